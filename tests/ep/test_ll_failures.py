"""What the host raises for a low-latency kernel's failure report (ep.low_latency._failures): the
words a kernel writes (code, slot, sequence, rank) read once, a timeout kept, and each code's
exception naming the call, the phase, the rank and what to do."""

from __future__ import annotations

import types

import numpy as np
import pytest

from warmlink.ep.low_latency import _failures
from warmlink.ep.low_latency._failures import F_MISMATCH, F_REFUSED, F_TIMEOUT, F_UNMASKED
from warmlink.errors import ConfigError, PeerLostError, TransferTimeout


def test_a_report_is_read_once_but_a_timeout_stays_reported():
    words = np.array([F_MISMATCH, 3, 7, 1], dtype=np.int64)  # slot 3: a combine's parity 1
    assert _failures.read(words) == (F_MISMATCH, "combine", 7, 1)
    assert _failures.read(words) is None
    words[:] = [F_TIMEOUT, 1, 2, 0]
    assert _failures.read(words) == (F_TIMEOUT, "dispatch", 2, 0)
    assert _failures.read(words) == (F_TIMEOUT, "dispatch", 2, 0)


@pytest.mark.parametrize("code,alive,kind,words", [
    (F_TIMEOUT, True, TransferTimeout, "waited 2.5 s for rank 1; a peer is stalled"),
    (F_TIMEOUT, False, PeerLostError, "waited for rank 1 (pid 4242), which died"),
    (F_MISMATCH, True, ConfigError, "rank 1 called with other arguments"),
    (F_REFUSED, True, ConfigError, "rank 1's topk_idx held an expert id outside [-1, 64)"),
    (F_UNMASKED, True, ConfigError, "selected experts where the dispatch's topk_idx held -1")])
def test_each_code_raises_its_error_naming_the_call_the_phase_and_the_rank(code, alive, kind, words):
    refs = {1: types.SimpleNamespace(pid=4242, alive=lambda: alive)}
    exc = _failures.error((code, "dispatch", 5, 1), "ep.Buffer.low_latency_combine", 3, 2.5, 64, refs)
    assert type(exc) is kind
    assert str(exc).startswith("ep.Buffer.low_latency_combine: an earlier low-latency dispatch on cuda:3 (sequence 5")
    assert words in str(exc)
    assert _failures.error(None, "f", 0, 1.0, 64, refs) is None
