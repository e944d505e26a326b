"""``EventOverlap``: what ``dispatch`` and ``combine`` return where DeepEP returns its event.

As DeepEP's, a call made with ``async_finish=True`` runs on the Buffer's communication stream and
returns an event the caller's stream must wait on (``event.current_stream_wait()``) before it
reads the outputs (ep.paths.comm_stream, Note [Communication stream]); ``previous_event`` takes it back.
"""

from __future__ import annotations

import torch

from warmlink.errors import ConfigError

__all__ = ["EventOverlap", "record_done"]


class EventOverlap:
    """A point on a CUDA stream after which an ep call's outputs are complete.

    Args:
        event: a raw CUDA event handle recorded at that point, from the Buffer's pool (the Buffer
            owns it: two calls later it is recorded again, at a later point, so an old
            ``EventOverlap`` then waits a little longer, never too little); None when the call
            was made without ``async_finish=True``.
        device: its CUDA device; -1 for a host-memory Buffer, whose outputs are complete on
            return (waiting is then a no-op).
    """

    __slots__ = ("_event", "_device")

    def __init__(self, event: int | None = None, device: int = -1) -> None:
        self._event = event
        self._device = device

    @property
    def event(self) -> int | None:
        """The raw CUDA event handle, or None."""
        return self._event

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait (on the GPU) for the point this event marks.

        Raises:
            ConfigError: on CUDA, for the event of a call made without ``async_finish=True`` (as
                DeepEP refuses it): there is no point to wait for.
        """
        if self._device < 0:
            return
        if self._event is None:
            raise ConfigError("ep.EventOverlap.current_stream_wait: this call was made without async_finish=True, so it "
                              "recorded no event; its outputs are ordered on the stream that was current during the call")
        from warmlink import _cuda
        from warmlink.ep.kernels.launch import current_stream

        _cuda.stream_wait_event(current_stream(self._device), self._event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        if self._event is not None:  # DeepEP's semantics: the block's work overlaps, then the stream waits
            self.current_stream_wait()

    def __repr__(self) -> str:
        where = "host" if self._device < 0 else f"cuda:{self._device}"
        event = f"{self._event:#x}" if self._event is not None else None
        return f"ep.EventOverlap({where}, event={event})"


def wait_for(previous_event, func: str) -> None:
    """Order the current stream after ``previous_event`` (DeepEP's ``previous_event`` argument): an
    ``EventOverlap``, a ``torch.cuda.Event`` or None."""
    if previous_event is None:
        return
    if isinstance(previous_event, EventOverlap):
        if previous_event.event is not None:
            previous_event.current_stream_wait()
        return
    if isinstance(previous_event, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(previous_event)
        return
    raise ConfigError(f"ep.Buffer.{func}: previous_event is a {type(previous_event).__name__}; expected an "
                      "EventOverlap (from an earlier call), a torch.cuda.Event or None")


def record_done(done_events: list[int], slot: int, device: int, async_finish: bool) -> EventOverlap:
    """DeepEP's event of a call: with ``async_finish`` on CUDA, pooled event ``slot`` recorded on
    the current stream now; else one that waits for nothing."""
    if device < 0 or not async_finish:
        return EventOverlap(None, device)
    from warmlink import _cuda
    from warmlink.ep.kernels.launch import current_stream

    event = done_events[slot]
    _cuda.event_record(event, current_stream(device))
    return EventOverlap(event, device)
