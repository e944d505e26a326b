"""Polling with a deadline: sleeps start short (a warm refit waits microseconds) and double to a cap."""

from __future__ import annotations

import time

__all__ = ["Backoff"]


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
        time.sleep(self._sleep_s)
        self._sleep_s = min(2 * self._sleep_s, self._cap_s)
