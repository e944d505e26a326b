"""``bench._proc.Group``: a child that stalls makes the parent raise in time, and says where it is;
a child killed in the middle of a message leaves the others' messages flowing."""

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


def _blocks_in_a_big_message(*, control, results) -> None:
    results.put({"tag": "big", "event": "started"})
    results.put({"tag": "big", "event": "big", "blob": b"x" * (8 << 20)})  # the parent is not reading: blocks
    time.sleep(60)


def _answers(*, control, results) -> None:
    control.get(timeout=30)
    results.put({"tag": "small", "event": "hello"})


def test_a_child_killed_mid_message_does_not_silence_the_others() -> None:
    """With one queue shared by all children, the killed child's feeder thread held the queue's
    write lock for good and 'hello' never came (bench reconfigure kills replaced processes)."""
    with Group(20.0) as group:
        group.start("big", _blocks_in_a_big_message)
        group.start("small", _answers)
        group.expect("started", 1)
        time.sleep(0.5)  # the 8 MiB message is half written into a full pipe
        big = group.procs.pop("big")
        big.kill()
        big.join(timeout=10)
        group.send("small", "go")
        assert group.expect("hello", 1, timeout_s=10)[0]["tag"] == "small"
