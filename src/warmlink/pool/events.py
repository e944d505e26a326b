"""Pooled CUDA events, keyed ``(device, timing, interprocess)``.

A released event is checked before reuse (see Note [Reset before reuse] in ``pool.core``): the
work it captured must complete within ``DRAIN_TIMEOUT_S`` without error, else it is destroyed.
Events made with ``timing=False`` carry ``cudaEventDisableTiming`` (cheaper record and query).

Fault injection: the pool calls ``warmlink._cuda.event_create / event_query / event_destroy``
through the module at call time, so CPU tests monkeypatch them with fakes.
"""

from __future__ import annotations

import logging

from warmlink import _cuda
from warmlink.errors import ConfigError
from warmlink.pool import streams
from warmlink.pool.core import FreeList, Lease

__all__ = ["Event", "lease_event", "clear_idle"]

log = logging.getLogger("warmlink.pool")


class Event:
    """One CUDA event owned by the pool; users hold a ``Lease[Event]``.

    Attributes:
        handle: the ``cudaEvent_t`` as an int.
        device: CUDA device index; record it only on streams of this device.
        timing: whether ``cudaEventElapsedTime`` works on it.
    """

    __slots__ = ("handle", "device", "timing", "interprocess")

    def __init__(self, handle: int, device: int, timing: bool, interprocess: bool = False) -> None:
        self.handle = handle
        self.device = device
        self.timing = timing
        self.interprocess = interprocess

    def __repr__(self) -> str:
        return f"Event({self.handle:#x}, device={self.device}, timing={self.timing}, interprocess={self.interprocess})"


def _create(key: tuple[int, bool, bool]) -> Event:
    device, timing, interprocess = key
    if interprocess:  # only exportable events pass the flag: fakes in tests take two arguments
        return Event(_cuda.event_create(device, timing, interprocess=True), device, timing, True)
    return Event(_cuda.event_create(device, timing), device, timing)


def _reset(event: Event) -> bool:
    # The timeout is read at call time so tests can patch streams.DRAIN_TIMEOUT_S.
    if streams.wait_until(lambda: _cuda.event_query(event.handle), streams.DRAIN_TIMEOUT_S):
        return True
    log.warning("event did not complete; destroying it", extra={"event": repr(event)})
    return False


def _destroy(event: Event) -> None:
    _cuda.event_destroy(event.handle)


_events: FreeList[tuple[int, bool, bool], Event] = FreeList("event", _create, _reset, _destroy, max_idle_per_key=256)


def lease_event(device: int, timing: bool = False, interprocess: bool = False) -> Lease[Event]:
    """Lease an event on ``device``; complete (not pending) when handed out.

    Args:
        device: CUDA device index >= 0.
        timing: True for an event usable with ``cudaEventElapsedTime``.
        interprocess: True for an event peers open with ``cudaIpcOpenEventHandle`` (no timing).

    Returns:
        A ``Lease`` whose ``resource`` is an ``Event``. ``release()`` waits (bounded) for its last
        record to complete; release only events known to be done to stay non-blocking.

    Raises:
        ConfigError: bad ``device``. PoolError: the event could not be created.

    Warm path? Reuses an idle event; creates one on a miss.
    """
    if not isinstance(device, int) or device < 0:
        raise ConfigError(f"lease_event: device={device!r}; expected a CUDA device index >= 0")
    if interprocess and timing:
        raise ConfigError("lease_event: interprocess=True needs timing=False (CUDA cannot export timing events)")
    return _events.lease((device, bool(timing), bool(interprocess)))


def clear_idle() -> None:
    """Destroy every idle event (tests and teardown)."""
    _events.clear()
