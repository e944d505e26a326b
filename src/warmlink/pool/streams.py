"""Pooled CUDA streams, keyed ``(device, priority)``.

A released stream is drained before reuse (see Note [Reset before reuse] in ``pool.core``): its
queue is polled with ``cudaStreamQuery`` until idle, for at most ``DRAIN_TIMEOUT_S``. A stream that
stays busy past the deadline or reports an error is destroyed, never handed out again.

``cudaStreamQuery`` returning success means every operation queued on the stream has finished,
host functions launched with ``cudaLaunchHostFunc`` (and stream callbacks) included, so no callback
of the previous holder can run once the next holder has the stream.

Fault injection: the pool calls ``warmlink._cuda.stream_create / stream_query / stream_destroy``
through the module at call time, so CPU tests monkeypatch those three functions with fakes;
``DRAIN_TIMEOUT_S`` may be patched to make a stuck stream fail fast.

# Note [Leaked streams at exit]
Idle streams are not destroyed at interpreter exit: the CUDA runtime may already be torn down
when module globals are collected (c10's stream pool makes the same choice). The driver frees
them with the process. Call ``clear_idle()`` to destroy them earlier.
"""

from __future__ import annotations

import logging
from typing import Callable

from warmlink import _backoff, _cuda
from warmlink.errors import ConfigError
from warmlink.pool.core import FreeList, Lease

__all__ = ["Stream", "lease_stream", "lease_urgent_stream", "clear_idle", "wait_until", "DRAIN_TIMEOUT_S"]

log = logging.getLogger("warmlink.pool")

DRAIN_TIMEOUT_S = 5.0  # how long a released stream may take to drain before it is destroyed


class Stream:
    """One CUDA stream (non-blocking flag) owned by the pool; users hold a ``Lease[Stream]``.

    Attributes:
        handle: the ``cudaStream_t`` as an int.
        device: CUDA device index the stream belongs to.
        priority: stream priority (lower is higher priority; 0 is the default).
    """

    __slots__ = ("handle", "device", "priority", "_torch")

    def __init__(self, handle: int, device: int, priority: int) -> None:
        self.handle = handle
        self.device = device
        self.priority = priority
        self._torch = None

    def torch_stream(self):
        """This stream as a ``torch.cuda.ExternalStream`` (made on first call, then cached).

        Returns:
            A torch stream object that does not own the handle; valid while the lease is held.
        """
        if self._torch is None:
            import torch

            self._torch = torch.cuda.ExternalStream(self.handle, device=torch.device("cuda", self.device))
        return self._torch

    def __repr__(self) -> str:
        return f"Stream({self.handle:#x}, device={self.device}, priority={self.priority})"


def wait_until(query: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``query`` until it returns True (True) or ``timeout_s`` seconds pass (False).

    Exceptions from ``query`` propagate. Sleeps back off from 20 us to 1 ms (``_backoff.poll``).
    """
    return _backoff.poll(query, timeout_s, first_s=20e-6, cap_s=1e-3)


def _create(key: tuple[int, int]) -> Stream:
    device, priority = key
    return Stream(_cuda.stream_create(device, priority), device, priority)


def _reset(stream: Stream) -> bool:
    # A stream whose queue errors (sticky error) raises here; FreeList counts it as failed.
    if wait_until(lambda: _cuda.stream_query(stream.handle), DRAIN_TIMEOUT_S):
        return True
    log.warning("stream did not drain; destroying it", extra={"stream": repr(stream), "timeout_s": DRAIN_TIMEOUT_S})
    return False


def _destroy(stream: Stream) -> None:
    stream._torch = None
    _cuda.stream_destroy(stream.handle, stream.device)


_streams: FreeList[tuple[int, int], Stream] = FreeList("stream", _create, _reset, _destroy, max_idle_per_key=32)


def lease_stream(device: int, priority: int = 0) -> Lease[Stream]:
    """Lease a stream on ``device`` with ``priority``, idle and drained.

    Args:
        device: CUDA device index >= 0.
        priority: between the device's least (0) and greatest (e.g. -5) priority, inclusive.

    Returns:
        A ``Lease`` whose ``resource`` is a ``Stream``; ``release()`` (or leaving the ``with``)
        drains it (host-blocking, bounded by ``DRAIN_TIMEOUT_S``) and keeps it for the next lease.

    Raises:
        ConfigError: ``device`` or ``priority`` out of range.
        PoolError: the stream could not be created.

    Blocking? Only ``release`` (drain). Warm path? Reuses an idle stream; creates one on a miss.
    """
    if not isinstance(device, int) or device < 0:
        raise ConfigError(f"lease_stream: device={device!r}; expected a CUDA device index >= 0")
    least, greatest = _cuda.stream_priority_range(device)
    if not isinstance(priority, int) or not greatest <= priority <= least:
        raise ConfigError(
            f"lease_stream: priority={priority!r} out of range; expected {greatest} <= priority <= {least} on cuda:{device}"
        )
    return _streams.lease((device, priority))


def lease_urgent_stream(device: int) -> Lease[Stream]:
    """``lease_stream`` at ``device``'s greatest priority: for short work that another stream's
    long kernels would otherwise hold up (the block scheduler hands free SMs to waiting blocks of
    higher-priority streams first; DeepEP's communication stream is one such)."""
    return lease_stream(device, _cuda.stream_priority_range(device)[1])


def clear_idle() -> None:
    """Destroy every idle stream (tests and teardown). See Note [Leaked streams at exit]."""
    _streams.clear()
