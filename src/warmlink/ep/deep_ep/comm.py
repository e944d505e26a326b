"""The communication stream of ``deep_ep.Buffer``: where its calls made with ``async_finish=True``
run, as DeepEP's do (ep.paths.comm_stream, Note [Communication stream]), leased on first use.
"""

from __future__ import annotations

import torch

from warmlink.ep.paths.comm_stream import INLINE, CommStream
from warmlink.errors import ConfigError

__all__ = ["CommCalls"]


class _Failing:
    """A call's stay on the communication stream that marks the stream failed when it raises."""

    __slots__ = ("_owner", "_call")

    def __init__(self, owner: "CommCalls", call) -> None:
        self._owner, self._call = owner, call

    def __enter__(self):
        try:
            return self._call.__enter__()
        except BaseException:
            self._owner._comm_failed = True
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._owner._comm_failed = True
        try:
            self._call.__exit__(exc_type, exc, tb)
        except BaseException:
            self._owner._comm_failed = True
            raise


class CommCalls:
    """``deep_ep.Buffer``'s communication stream (mixed into it): ``get_comm_stream``, and the
    context each call runs in."""

    _comm: CommStream | None = None
    _comm_failed = False  # a call raised on the stream: close does not wait for it (it may wait on a lost peer)

    def _call(self, async_finish: bool, previous_event, like):
        """Where a call runs: with ``async_finish`` on CUDA, this Buffer's communication stream on
        ``like``'s device (ep.paths.comm_stream, Note [Communication stream]); else the caller's stream,
        after the stream's work when calls ran there since (the calls keep their issue order: the
        inner Buffer's low-latency kernels read device words a queued call has yet to advance).
        A context whose value marks the tensors that cross the two streams (``INLINE``: none)."""
        if not async_finish or not isinstance(like, torch.Tensor) or not like.is_cuda:
            if self._comm is not None:
                self._comm.join_caller()
            return INLINE
        device = like.device.index
        if self._comm is None:
            self._comm = CommStream.lease(device)
        elif self._comm.device != device:
            raise ConfigError(f"deep_ep.Buffer: a call on cuda:{device}; this Buffer's calls run on cuda:{self._comm.device}")
        # as DeepEP's: after previous_event alone when there is one (ep.paths.comm_stream, Note [Communication stream])
        return _Failing(self, self._comm.call(after_caller=previous_event is None))

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream calls made with ``async_finish=True`` run on (DeepEP's; ep.paths.comm_stream, Note
        [Communication stream]), on the current CUDA device unless a call chose it already.

        Raises:
            ConfigError: CUDA is not available (calls then run on the host, over shared memory).
        """
        if self._comm is None:
            if not torch.cuda.is_available():
                raise ConfigError("deep_ep.Buffer.get_comm_stream: CUDA is not available; this Buffer's calls run on "
                                  "the host, over shared memory, and finish on return")
            self._comm = CommStream.lease(torch.cuda.current_device())
        return self._comm.stream

    def _close_comm(self) -> None:
        """Give the stream back; the current stream waits for its work first, unless a call failed on it."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close(drain=not self._comm_failed)
