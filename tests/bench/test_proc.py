"""``bench._proc.Group``: a child that stalls makes the parent raise in time, and says where it is."""

from __future__ import annotations

import signal
import time

import pytest

from warmlink.bench._proc import Group


def _stalls_in_a_named_place(*, control, results) -> None:
    results.put({"tag": "stall", "event": "started"})
    time.sleep(60)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
def test_a_timeout_writes_the_stalled_childs_stack(capfd) -> None:
    t = time.perf_counter()
    with Group(20.0) as group:
        group.start("stall", _stalls_in_a_named_place)
        group.expect("started", 1)
        with pytest.raises(RuntimeError, match=r"timed out waiting for 1 x 'done' \(got 0\); stacks of \['stall'\]"):
            group.expect("done", 1, timeout_s=1.0)
        group.procs["stall"].terminate()
    assert time.perf_counter() - t < 20
    assert "_stalls_in_a_named_place" in capfd.readouterr().err
