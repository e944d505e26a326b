"""Ranks whose calls do not line up, over shm (ep.protocol.normal, Note [Refused dispatch] and Note
[Broken rounds]): cached dispatches of different handles, a cached dispatch or a combine one rank
refuses, a handle of another Buffer, a peer stalled past the timeout. Every call either raises a typed
error on every rank it concerns or returns its own step's rows; none returns another step's."""

from __future__ import annotations

from tests.ep._group import run_ranks
from tests.ep._out_of_step import out_of_step


def _run(scenario: str, timeout_s: float = 10.0, ranks: int = 2) -> list[list[str]]:
    return run_ranks(out_of_step, ranks, case={"scenario": scenario, "timeout_s": timeout_s}, timeout_s=120)


def test_cached_dispatches_of_different_handles_are_refused_on_every_rank_and_the_next_works():
    for log in _run("other_handles"):
        assert log[0].startswith("ConfigError") and "handle of dispatch round" in log[0], log
        assert log[1:] == ["ok", "ok"], log


def test_a_cached_dispatch_one_rank_refuses_is_refused_on_every_rank_and_the_next_works():
    logs = _run("refused_cached", ranks=3)
    assert logs[1][0] == "ConfigError: ep.Buffer.dispatch: handle is for 4 tokens; x has 3", logs[1]
    for log in (logs[0], logs[2]):
        assert log[0].startswith("RefusedRound") and "ranks [1] refused" in log[0], log
    assert all(log[1:] == ["ok", "ok"] for log in logs), logs


def test_a_combine_one_rank_refuses_is_refused_on_every_rank_and_the_next_works():
    logs = _run("refused_combine", ranks=3)
    assert logs[1][0] == "ConfigError: ep: x has 3 rows; expected 4", logs[1]
    for log in (logs[0], logs[2]):
        assert log[0].startswith("RefusedRound: ep.Buffer.combine: ranks [1] refused"), log
    assert all(log[1:] == ["ok", "ok"] for log in logs), logs


def test_a_handle_of_another_buffer_is_refused_before_anything_moves():
    for log in _run("foreign_handle"):
        assert log[0] == ("ConfigError: ep.Buffer.dispatch: handle is not one this Buffer's dispatch returned; pass "
                          "the handle of an earlier dispatch on this Buffer"), log
        assert log[1] == "ConfigError: ep.Buffer.combine: handle (a Handle) is not from this Buffer's dispatch", log
        assert log[2] == "ok", log


def test_a_peer_stalled_past_the_timeout_breaks_the_buffer_and_no_call_returns_another_steps_rows():
    logs = _run("stall", timeout_s=1.5)
    assert all(outcome != "WRONG" for log in logs for outcome in log), logs
    first, *later = logs[0][1:]
    assert logs[0][0] == "ok" and first.startswith("TransferTimeout") and "rank" in first, logs[0]
    for outcome in later:  # every later call raises what broke the rounds, at once
        assert outcome.startswith("TransferTimeout: ep.Buffer.dispatch: an earlier call failed"), logs[0]
    assert any(o.startswith(("TransferTimeout", "PeerLostError")) for o in logs[1][1:]), logs[1]
