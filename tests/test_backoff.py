"""The one wait helper (warmlink._backoff), on a virtual clock: no test here depends on how fast
the machine is."""

from __future__ import annotations

import math

import pytest

from warmlink import _backoff
from warmlink.errors import PeerLostError, TransferTimeout
from warmlink.transport import base


class Clock:
    """``time`` for _backoff: ``sleep`` advances ``perf_counter`` exactly, and is recorded."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_backoff, "time", c)
    return c


def test_ready_at_once_reads_no_clock_and_sleeps_never(clock: Clock, monkeypatch) -> None:
    monkeypatch.setattr(clock, "perf_counter", lambda: pytest.fail("read the clock"))
    assert _backoff.poll(lambda: True, 1.0) is True
    _backoff.wait_until(lambda: True, timeout_s=1.0, what="nothing")
    assert clock.sleeps == []


def test_sleeps_double_to_the_cap_and_never_pass_the_deadline(clock: Clock) -> None:
    assert _backoff.poll(lambda: False, 0.01, first_s=1e-3, cap_s=4e-3) is False
    assert clock.sleeps[:3] == [1e-3, 2e-3, 4e-3] and max(clock.sleeps) == 4e-3
    assert sum(clock.sleeps) == pytest.approx(0.01)  # the last sleep is cut to the deadline


def test_zero_timeout_still_polls_once(clock: Clock) -> None:
    calls = []
    assert _backoff.poll(lambda: calls.append(1) or False, 0.0) is False
    assert calls == [1] and clock.sleeps == []


def test_becomes_ready_after_some_polls(clock: Clock) -> None:
    calls = []
    assert _backoff.poll(lambda: calls.append(1) or len(calls) == 5, 1.0) is True
    assert len(calls) == 5 and len(clock.sleeps) == 4


def test_spin_polls_without_sleeping_first(clock: Clock) -> None:
    calls = []

    def ready() -> bool:
        calls.append(1)
        clock.now += 1e-4  # each poll takes 100 us
        return False

    assert _backoff.poll(ready, 0.01, spin_s=2e-3, first_s=1e-3, cap_s=1e-3) is False
    assert len(calls) > 20 and len(clock.sleeps) < len(calls) - 15


def test_infinite_spin_never_sleeps(clock: Clock) -> None:
    def ready() -> bool:
        clock.now += 1e-3
        return False

    assert _backoff.poll(ready, 0.05, spin_s=math.inf) is False
    assert clock.sleeps == []


def test_timeout_message_is_built_only_on_timeout(clock: Clock) -> None:
    built = []

    def what() -> str:
        built.append(1)
        return "ranks [1] did not reach round 3 within 0.01 s"

    _backoff.wait_until(lambda: True, timeout_s=0.01, what=what)
    assert built == []
    with pytest.raises(TransferTimeout, match=r"ranks \[1\] did not reach round 3"):
        _backoff.wait_until(lambda: False, timeout_s=0.01, what=what)
    with pytest.raises(TransferTimeout, match="^the moon$"):
        _backoff.wait_until(lambda: False, timeout_s=0.01, what="the moon")


def test_lost_peer_ends_the_wait_before_its_deadline(clock: Clock) -> None:
    probes = []

    def lost() -> str | None:
        probes.append(clock.now)
        return "rank 1 (pid 42) died" if clock.now >= 100.02 else None

    with pytest.raises(PeerLostError, match=r"rank 1 \(pid 42\) died"):
        _backoff.wait_until(lambda: False, timeout_s=10.0, what="never", lost=lost, every_s=0.005, cap_s=1e-3)
    assert clock.now < 100.03  # found within one period of its death, not at the deadline
    assert probes[0] >= 100.005  # the first probe waits one period by default
    assert all(b - a >= 0.005 for a, b in zip(probes, probes[1:]))


def test_first_probe_at_once_and_a_last_one_before_a_timeout(clock: Clock) -> None:
    probes = []
    with pytest.raises(TransferTimeout):
        _backoff.wait_until(lambda: False, timeout_s=0.0021, what="never", lost=lambda: probes.append(clock.now),
                            every_s=1.0, first_probe_s=0.0)
    assert probes[0] == 100.0 and len(probes) == 2 and probes[1] >= 100.0021
    with pytest.raises(PeerLostError):  # dead at the deadline: the peer's loss is what is reported
        _backoff.wait_until(lambda: False, timeout_s=0.001, what="never", every_s=1.0,
                            lost=lambda: "gone" if clock.now > 100.0025 else None)


def test_a_probe_may_raise_to_give_up(clock: Clock) -> None:
    def check() -> None:
        raise ValueError("config changed")

    with pytest.raises(ValueError, match="config changed"):
        _backoff.poll(lambda: False, 1.0, lost=check)


def test_backoff_sleeps_never_pass_its_deadline(clock: Clock) -> None:
    b = _backoff.Backoff(0.0025, first_s=1e-3, cap_s=1e-3)
    for _ in range(5):
        b.sleep()
    assert clock.sleeps[:3] == pytest.approx([1e-3, 1e-3, 0.5e-3]) and clock.sleeps[3:] == [0.0, 0.0]
    clock.now += 1e-9
    assert b.expired()


class _Landing(base.Transfer):
    """A transfer that lands at a given time of the virtual clock."""

    def __init__(self, batch, clock: Clock, takes_s: float | None) -> None:
        super().__init__(batch, timeout_s=1.0)
        self.clock, self.lands_at = clock, None if takes_s is None else clock.now + takes_s

    def done(self) -> bool:
        return self.lands_at is not None and self.clock.now >= self.lands_at

    def _poll_error(self):
        return None


def _batch():
    return base.Batch([], [], 0)


class Ticking(Clock):
    """A clock that also moves 1 us per reading, as a real one does while a loop spins."""

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now


@pytest.fixture
def ticking(monkeypatch) -> Ticking:
    c = Ticking()
    monkeypatch.setattr(_backoff, "time", c)
    monkeypatch.setattr(base, "time", c)
    return c


def test_a_replayed_batch_dozes_through_most_of_its_last_time_then_polls_closely(ticking: Ticking) -> None:
    """Note [Waiting for a replay]: one long sleep, then polls without sleeping, landing on time."""
    clock = ticking
    batch = _batch()
    _Landing(batch, clock, 0.004).wait()
    assert batch.last_s == pytest.approx(0.004, abs=1e-4)  # the first wait sleeps in steps of <= 100 us
    clock.sleeps.clear()
    started = clock.now
    _Landing(batch, clock, 0.004).wait()
    assert clock.sleeps[0] == pytest.approx(0.85 * batch.last_s, rel=0.1) and len(clock.sleeps) == 1
    assert clock.now - started == pytest.approx(0.004, abs=2e-5)  # spinning: no sleep past the landing


class _Polled(_Landing):
    """A transfer whose bytes move only while ``done`` is called (NIXL over UCX without UCX
    threads): it lands ``takes_s`` of polling after its start, however long the waiter slept."""

    moves_alone = False

    def __init__(self, batch, clock: Clock, takes_s: float) -> None:
        super().__init__(batch, clock, None)
        self.left_s, self.polled_at = takes_s, None

    def done(self) -> bool:
        now = self.clock.now
        if self.polled_at is not None and now - self.polled_at <= 200e-6:  # a sleep moves nothing
            self.left_s -= now - self.polled_at
        self.polled_at = now
        return self.left_s <= 0


def test_a_transfer_that_moves_only_while_polled_never_dozes_so_its_waits_do_not_grow(ticking: Ticking) -> None:
    """A doze would add to such a transfer's time, and the next doze would be longer: repeated, a
    0.5 ms read would settle near 6.7x (Note [Waiting for a replay])."""
    clock = ticking
    batch = _batch()
    times = []
    for _ in range(20):
        started = clock.now
        _Polled(batch, clock, 0.0005).wait()
        times.append(clock.now - started)
    assert max(times) < 0.0008 and all(s <= 100e-6 for s in clock.sleeps)


def test_a_replay_that_never_lands_still_times_out_at_its_limit(ticking: Ticking) -> None:
    clock = ticking
    batch = _batch()
    batch.last_s = 0.05
    started = clock.now
    with pytest.raises(TransferTimeout, match="not done after 0.200 s"):
        _Landing(batch, clock, None).wait(0.2)
    assert clock.now - started <= 0.2 + 1e-4
    assert batch.last_s == 0.05  # a failed transfer teaches nothing
