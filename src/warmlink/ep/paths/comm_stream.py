"""``CommStream``: the stream a call made with ``async_finish=True`` runs on, as DeepEP's calls do.

# Note [Communication stream]
A call made without ``async_finish`` runs on the caller's current stream (after ``previous_event``,
if given), so that stream is ordered after the outputs: what DeepEP reaches with a stream wait,
without the wait. A call made with ``async_finish=True`` runs on the Buffer's communication
stream instead, so that the caller's stream is *not* ordered after it and the caller's next work
overlaps the call's: the communication stream first waits, runs the call's work, and the returned
event marks its end; the caller waits for that event (``event.current_stream_wait()``) before it
reads the outputs. The host returns as it does without ``async_finish`` (at launch, but for an
unpadded fresh dispatch, whose outputs are sized by counts the host must read: ep.protocol.normal, Note
[Padded dispatch returns at launch]). A call with a receive hook
runs on the caller's stream whatever ``async_finish`` says: it overlaps by returning before its
receive (DeepEP's low-latency calls take not both).

What the stream first waits for: ``deep_ep.Buffer``'s, as DeepEP's, for ``previous_event`` alone
(for the caller's stream without one); ``ep.Buffer``'s for the caller's stream and
``previous_event``, because its ``recv_x`` is a view of the receive area: a dispatch lets the peers
overwrite the area of the dispatch before last once its stream reaches it (ep.wire.flags, Note
[Arrival flags]), and the caller's reads of that area must come first. (``deep_ep.Buffer`` copies
``recv_x`` out on the communication stream.)

Tensors cross the two streams, and the caching allocator reuses memory per stream, so:
- the call's inputs (from the caller's stream) are marked used by the communication stream
  (``record_stream``): freed right after the call, their memory is not handed out before the call
  has read them;
- the outputs are allocated on the communication stream, whatever ``allocate_on_comm_stream``
  says, and marked used by the caller's stream. With ``previous_event`` the communication stream
  may run ahead of work the caller queued after that event, and a block of the caller's pool may
  still be read by that work when the call would write it: only the communication stream's own
  pool is safe to write without waiting.
A call that raises leaves the caller's stream ordered after whatever it issued.

The stream has the device's greatest priority, as DeepEP's: the point of ``async_finish`` is that
the caller's next kernels run beside the call, and at equal priority a long GEMM's waiting blocks
take every SM that frees up before the call's kernels get one.

The calls of one Buffer keep their issue order on the device, whichever stream each runs on: a
call on another stream than the last call's send phase first waits for that send's end
(``CudaMover.start_round``), and a call on the caller's stream after calls on this one waits for
all of this stream's work (``Buffer._call``, for the low-latency calls, which have no mover).
They share device words that each call's kernels read when they run, not when they are
launched: a fresh SM send's call block, the push bases its exchange writes, the plan's words,
the low-latency sequence numbers and output views. Without the wait, an async call whose push is
still queued on the communication stream behind other work would push with the next call's
block, if that call ran on the caller's stream first: another call's rows, with no error. A call
on the same stream as the last waits for nothing.
"""

from __future__ import annotations

import torch

from warmlink.ep.kernels.launch import on_stream

__all__ = ["CommStream", "INLINE"]


class _Inline:
    """A call on the caller's stream: nothing to switch, hold or give."""

    __slots__ = ()

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def hold(self, *tensors) -> None:
        return None

    def give(self, *tensors) -> None:
        return None


INLINE = _Inline()


def _flat(tensors):
    for t in tensors:
        if hasattr(t, "tensors"):  # a handle (deep_ep's): its list is made only here, for a call on the stream
            yield from _flat(t.tensors())
        elif isinstance(t, (tuple, list)):
            yield from _flat(t)
        elif isinstance(t, torch.Tensor):
            yield t


class _OnComm:
    """One call's stay on the communication stream (Note [Communication stream])."""

    __slots__ = ("_comm", "_after_caller", "_caller", "_switch")

    def __init__(self, comm: "CommStream", after_caller: bool) -> None:
        self._comm, self._after_caller = comm, after_caller

    def __enter__(self) -> "_OnComm":
        comm = self._comm
        self._caller = torch.cuda.current_stream(comm.device)
        if self._after_caller:
            comm.cuda.event_record(comm.entry_event, self._caller.cuda_stream)
            comm.cuda.stream_wait_event(comm.raw, comm.entry_event)
        self._switch = on_stream(comm.stream)
        self._switch.__enter__()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._switch.__exit__(exc_type, *exc)
        if exc_type is not None:  # whatever the call issued comes before the caller's next work
            comm = self._comm
            comm.cuda.event_record(comm.exit_event, comm.raw)
            comm.cuda.stream_wait_event(self._caller.cuda_stream, comm.exit_event)

    def hold(self, *tensors) -> None:
        """Mark the caller's ``tensors`` (nested tuples, None and handles with a ``tensors()`` list
        allowed) used by the communication stream."""
        stream = self._comm.stream
        for t in _flat(tensors):
            t.record_stream(stream)

    def give(self, *tensors) -> None:
        """Mark the call's output ``tensors`` used by the caller's stream."""
        for t in _flat(tensors):
            t.record_stream(self._caller)


class CommStream:
    """A Buffer's communication stream and the two events that join it to callers' streams.

    Args:
        device: the CUDA device.
        stream: a pooled ``Stream`` lease (warmlink.pool.streams), released by ``close``.
        events: two pooled ``Event`` leases: a call's entry (the caller's point it waits for) and
            an exit (what the caller's stream waits for after a failed call, or ``join_caller``).
    """

    def __init__(self, device: int, stream, events) -> None:
        from warmlink import _cuda

        self.cuda = _cuda
        self.device = device
        self._stream_lease, self._event_leases = stream, list(events)
        self.stream = stream.resource.torch_stream()
        self.raw = self.stream.cuda_stream
        self.entry_event, self.exit_event = (e.resource.handle for e in self._event_leases)
        self._joined = True  # no call ran here since the caller's stream last joined it (join_caller)

    @classmethod
    def lease(cls, device: int) -> "CommStream":
        """A communication stream on ``device`` from the pool (made once per process and device)."""
        from warmlink.pool.events import lease_event
        from warmlink.pool.streams import lease_urgent_stream

        events = []
        stream = lease_urgent_stream(device)
        try:
            events = [lease_event(device) for _ in range(2)]
            return cls(device, stream, events)
        except BaseException:
            for lease in (*events, stream):
                lease.release()
            raise

    @property
    def joined(self) -> bool:
        """Whether the caller's stream is ordered after everything queued here so far (no call ran
        here since the last ``join_caller``): a call on the caller's stream then needs no join."""
        return self._joined

    def join_caller(self) -> None:
        """Order the caller's current stream after everything queued on this stream so far, when a
        call ran here since the last join (a call on the caller's stream makes it first: Note
        [Communication stream]); else nothing."""
        if self._joined:
            return
        self._joined = True
        self.cuda.event_record(self.exit_event, self.raw)
        self.cuda.stream_wait_event(torch.cuda.current_stream(self.device).cuda_stream, self.exit_event)

    def call(self, after_caller: bool = True) -> _OnComm:
        """The context of one call on this stream, which first waits for the caller's stream when
        ``after_caller`` (else the call waits for its ``previous_event`` only, inside the context)."""
        self._joined = False
        return _OnComm(self, after_caller)

    def close(self, drain: bool = True) -> None:
        """Give the stream and events back. With ``drain`` the current stream is first ordered after
        this stream's work (which reads the Buffer's region); without, as after a failed receive
        (ep.paths.cuda_mover, Note [Receive work on its own stream]), it is not."""
        stream, self._stream_lease = self._stream_lease, None
        if stream is None:
            return
        if drain:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for lease in self._event_leases:
            lease.release()
        self._event_leases = []
        stream.release()
