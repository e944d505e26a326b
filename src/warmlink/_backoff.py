"""Waiting with a deadline: the one poll loop of warmlink, so every wait backs off and times out alike.

Sleeps start short (a warm refit waits microseconds) and double to a cap. An optional liveness
probe runs every few milliseconds, so a dead peer ends a wait at once instead of at its deadline.
Every host-side wait of the library goes through ``wait_until`` (it raises) or ``poll`` (it
returns whether the condition came true), or, for a loop whose body is not one condition,
``Backoff``.
"""

from __future__ import annotations

import time
from typing import Callable

from warmlink.errors import PeerLostError, TransferTimeout

__all__ = ["Backoff", "poll", "wait_until"]


class Backoff:
    """``while not ready(): if b.expired(): raise ...; b.sleep()``.

    Args:
        timeout_s: seconds until ``expired()`` turns True.
        first_s: first sleep, seconds.
        cap_s: longest sleep, seconds.
    """

    __slots__ = ("deadline", "_sleep_s", "_cap_s")

    def __init__(self, timeout_s: float, first_s: float = 50e-6, cap_s: float = 5e-3) -> None:
        self.deadline = time.perf_counter() + timeout_s
        self._sleep_s = first_s
        self._cap_s = cap_s

    def expired(self) -> bool:
        return time.perf_counter() > self.deadline

    def sleep(self) -> None:
        """Sleep the current step, never past the deadline, then double the step up to the cap."""
        time.sleep(max(min(self._sleep_s, self.deadline - time.perf_counter()), 0.0))
        self._sleep_s = min(2 * self._sleep_s, self._cap_s)


def poll(
    ready: Callable[[], bool],
    timeout_s: float,
    *,
    lost: Callable[[], str | None] | None = None,
    first_s: float = 50e-6,
    cap_s: float = 5e-3,
    spin_s: float = 0.0,
    every_s: float = 0.005,
    first_probe_s: float | None = None,
) -> bool:
    """Call ``ready()`` until it returns True (then True) or ``timeout_s`` passes (then False).

    Args:
        ready: polled on this thread, once before any clock is read; its exceptions propagate.
        timeout_s: seconds; ``ready()`` is called at least once however small.
        lost: liveness probe, called ``first_probe_s`` after the first poll, then every ``every_s``
            seconds and once more before giving up: None while every peer awaited lives, else a
            message naming the one that is gone (it may also raise, to give up for a reason of
            its own).
        first_s: first sleep between polls, seconds; each sleep doubles up to ``cap_s``.
        cap_s: longest sleep between polls, seconds.
        spin_s: poll without sleeping for this long first, seconds (``math.inf``: never sleep):
            for waits that usually end within microseconds, where a sleep would add itself.
        every_s: seconds between liveness probes.
        first_probe_s: seconds before the first probe (default ``every_s``; 0: right after the
            first poll that finds the condition false).

    Raises:
        PeerLostError: ``lost()`` returned a message.

    Blocking? Up to ``timeout_s`` plus one call of ``ready`` and ``lost``.
    """
    if ready():
        return True
    now = start = time.perf_counter()
    deadline = start + timeout_s
    probe_at = start + (every_s if first_probe_s is None else first_probe_s)
    sleep_s = first_s
    while True:
        if lost is not None and (now >= probe_at or now >= deadline):
            probe_at = now + every_s
            why = lost()
            if why is not None:
                raise PeerLostError(why)
        if now >= deadline:
            return False
        if now - start >= spin_s:
            time.sleep(min(sleep_s, deadline - now))
            sleep_s = min(2 * sleep_s, cap_s)
        if ready():
            return True
        now = time.perf_counter()


def wait_until(
    ready: Callable[[], bool],
    *,
    timeout_s: float,
    what: str | Callable[[], str],
    lost: Callable[[], str | None] | None = None,
    first_s: float = 50e-6,
    cap_s: float = 5e-3,
    spin_s: float = 0.0,
    every_s: float = 0.005,
    first_probe_s: float | None = None,
) -> None:
    """``poll``, raising when the time runs out.

    Args:
        what: the TransferTimeout's message: what was awaited, by whom, for how long. A callable
            is called only on timeout, to report the state at that moment (ranks still behind).
        ready, timeout_s, lost, first_s, cap_s, spin_s, every_s, first_probe_s: as for ``poll``.

    Raises:
        TransferTimeout: ``ready()`` did not come true within ``timeout_s``.
        PeerLostError: ``lost()`` returned a message (checked before a timeout is reported).
    """
    if not poll(ready, timeout_s, lost=lost, first_s=first_s, cap_s=cap_s, spin_s=spin_s, every_s=every_s,
                first_probe_s=first_probe_s):
        raise TransferTimeout(what() if callable(what) else what)
