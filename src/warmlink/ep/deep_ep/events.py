"""DeepEP's ``EventHandle`` and ``EventOverlap``: a point on the current CUDA stream, and the
wrapper every ``deep_ep.Buffer`` call returns and takes back as ``previous_event``.

As DeepEP's, a call made with ``async_finish=True`` runs on the Buffer's communication stream and
returns an event recorded there after its last work: the caller's stream waits for it before it
reads the outputs (ep.paths.comm_stream, Note [Communication stream]). Where no CUDA work was ever issued in this process (shared-memory ranks on the CPU), every call has
finished on return and an event marks nothing: it records nothing and waiting returns at once.
"""

from __future__ import annotations

from typing import Callable

import torch

from warmlink.ep.paths.event import wait_for
from warmlink.errors import ConfigError

__all__ = ["EventHandle", "EventOverlap", "returned_event", "wait_previous"]


class EventHandle:
    """A CUDA event recorded on the current stream when made (DeepEP's ``EventHandle()``).

    Nothing is recorded while CUDA is not initialized in this process: no GPU work exists that a
    stream could wait for.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait (on the GPU, the host does not block) for this point."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def __repr__(self) -> str:
        return f"deep_ep.EventHandle({'cuda' if self._event is not None else 'host, nothing recorded'})"


class EventOverlap:
    """DeepEP's event wrapper: ``event`` (an ``EventHandle``, or None for a call made without
    ``async_finish=True``), ``extra_tensors`` kept alive with it, and ``with event:`` blocks whose
    work overlaps the call before the current stream waits for it on exit."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors  # kept alive with the event, as DeepEP does for graph capture
        self._release_on_exit = False
        self.hook_after_wait: Callable[[], None] | None = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event, then the hook registered with
        ``register_hook_after_wait`` runs once; ``release_handle`` drops the event.

        Raises:
            ConfigError: the call was made without ``async_finish=True`` (it recorded no event), as
                DeepEP refuses it.
        """
        if self.event is None:
            raise ConfigError("deep_ep.EventOverlap.current_stream_wait: event=None; the call was made without "
                              "async_finish=True, so there is nothing to wait for (its outputs are ordered on the "
                              "stream that was current during the call)")
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` after the next ``current_stream_wait``.

        Raises:
            ConfigError: a hook is registered already.
        """
        if self.hook_after_wait is not None:
            raise ConfigError("deep_ep.EventOverlap.register_hook_after_wait: a hook is registered already; "
                              "expected one hook per wait")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):`` drops the event after the wait on exit."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False

    def __repr__(self) -> str:
        return f"deep_ep.EventOverlap(event={self.event!r})"


def returned_event(async_finish: bool) -> EventOverlap:
    """DeepEP's returned event: recorded after the call's work with ``async_finish``, else empty."""
    return EventOverlap(EventHandle() if async_finish else None)


def wait_previous(previous_event, func: str) -> None:
    """Order the current stream after DeepEP's ``previous_event``: an ``EventOverlap`` (its event,
    if any), or what ``warmlink.ep.Buffer`` takes (None, a ``torch.cuda.Event``, ``ep.EventOverlap``).

    Raises:
        ConfigError: any other type, before any byte moves.
    """
    if isinstance(previous_event, EventOverlap):
        if previous_event.event is not None:
            previous_event.event.current_stream_wait()
        return
    wait_for(previous_event, func)
