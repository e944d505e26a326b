"""ep.paths.comm_stream on the CPU: the joins a call on the communication stream makes between the
caller's stream and its own, and which stream each tensor is marked used by, through fakes of the
CUDA calls (the GPU test ``test_gpu_async_finish_calls_run_on_the_communication_stream`` runs
the real thing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from warmlink import _cuda
from warmlink.ep.paths import comm_stream as _comm_stream
from warmlink.ep.paths.comm_stream import INLINE, CommStream

CALLER, COMM, ENTRY, EXIT = 0xC0, 0x50, 0xE1, 0xE2


class _Lease:
    def __init__(self, resource, log: list, name: str) -> None:
        self.resource, self._log, self._name = resource, log, name

    def release(self) -> None:
        self._log.append(("release", self._name))


@pytest.fixture
def comm(monkeypatch):
    """A ``CommStream`` over fakes, and the log of every CUDA call and stream mark it makes."""
    log: list = []
    caller = SimpleNamespace(cuda_stream=CALLER, wait_stream=lambda other: log.append(("caller waits for", other.cuda_stream)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(_cuda, "event_record", lambda event, stream: log.append(("record", event, stream)))
    monkeypatch.setattr(_cuda, "stream_wait_event", lambda stream, event: log.append(("wait", stream, event)))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(("used by", s.cuda_stream, t.numel())))
    switched = []

    class _OnStream:  # what on_stream does on CUDA: make the stream current, then restore
        def __init__(self, stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            switched.append(self.stream.cuda_stream)

        def __exit__(self, *exc) -> None:
            switched.append(None)

    monkeypatch.setattr(_comm_stream, "on_stream", _OnStream)
    stream = _Lease(SimpleNamespace(torch_stream=lambda: SimpleNamespace(cuda_stream=COMM)), log, "stream")
    events = [_Lease(SimpleNamespace(handle=h), log, f"event {h:#x}") for h in (ENTRY, EXIT)]
    return CommStream(0, stream, events), log, switched


def test_a_call_after_the_caller_joins_it_once_then_runs_on_the_stream(comm):
    stream, log, switched = comm
    with stream.call(after_caller=True) as call:
        assert switched == [COMM]  # the call's work is queued on the communication stream
        assert log == [("record", ENTRY, CALLER), ("wait", COMM, ENTRY)]
        call.hold(torch.zeros(3), (torch.zeros(5), None), [torch.zeros(7)])
        call.give(torch.zeros(2), None)
    assert switched == [COMM, None]  # and the caller's stream is current again
    # inputs marked used by the communication stream, outputs by the caller's; no join at the end:
    # the caller's stream is not ordered after the call (it waits for the returned event)
    assert log[2:] == [("used by", COMM, 3), ("used by", COMM, 5), ("used by", COMM, 7), ("used by", CALLER, 2)]


def test_a_call_with_a_previous_event_waits_for_that_alone(comm):
    stream, log, _ = comm
    with stream.call(after_caller=False):
        pass
    assert log == []  # deep_ep.Buffer's caller waits for previous_event inside the call, as DeepEP's


def test_a_call_that_raises_leaves_the_caller_ordered_after_what_it_issued(comm):
    stream, log, switched = comm
    with pytest.raises(ValueError, match="refused"):
        with stream.call(after_caller=True):
            raise ValueError("refused")
    assert switched == [COMM, None]
    assert log[2:] == [("record", EXIT, COMM), ("wait", CALLER, EXIT)]


@pytest.mark.parametrize("drain", [True, False])
def test_close_gives_everything_back_once_and_drains_unless_told_not_to(comm, drain):
    stream, log, _ = comm
    stream.close(drain=drain)
    stream.close(drain=drain)  # idempotent
    waits = [("caller waits for", COMM)] if drain else []
    assert log == [*waits, ("release", f"event {ENTRY:#x}"), ("release", f"event {EXIT:#x}"), ("release", "stream")]


def test_inline_calls_mark_nothing():
    with INLINE as call:
        call.hold(torch.zeros(1))
        call.give(torch.zeros(1))
    assert INLINE.__exit__(None, None, None) is None  # never swallows an exception


def test_host_memory_buffers_run_every_call_inline_and_have_no_stream():
    from warmlink.ep import Buffer
    from warmlink.errors import ConfigError
    from warmlink.rendezvous import Store

    store = Store(is_server=True, prefix="ep-comm", timeout_s=10)
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=4, hidden=128, num_topk=2, backend="shm", timeout_s=10) as buf:
            assert buf._call(True) is INLINE and buf._call(False) is INLINE
            with pytest.raises(ConfigError, match="host-memory Buffer has no stream"):
                buf.get_comm_stream()
        with pytest.raises(ConfigError, match="closed"):
            buf.get_comm_stream()
    finally:
        store.close()


def test_a_call_on_the_callers_stream_after_async_calls_waits_for_them_once(comm):
    """Calls of one Buffer keep their issue order (Note [Communication stream]): a low-latency call
    on the caller's stream reads device words an async call still queued on the communication
    stream would advance, so it first waits for that stream's work; the next one waits for nothing."""
    from warmlink.ep.api.buffer import Buffer

    stream, log, _ = comm
    buf = Buffer.__new__(Buffer)
    buf.device, buf._res = 0, SimpleNamespace(comm_stream=lambda: stream, comm=stream)
    assert buf._call(False) is INLINE and log == []  # nothing ran on the communication stream yet
    with buf._call(True):
        pass
    log.clear()
    assert buf._call(False) is INLINE
    assert log == [("record", EXIT, COMM), ("wait", CALLER, EXIT)]
    log.clear()
    assert buf._call(False) is INLINE and log == []


def test_a_deep_ep_call_on_the_callers_stream_after_async_ones_waits_for_them_once(comm):
    """``deep_ep.Buffer`` runs its async calls on a stream of its own (the inner Buffer sees them
    as calls on its caller's stream): the same join, once, when a call leaves that stream."""
    from warmlink.ep.deep_ep.comm import CommCalls

    stream, log, _ = comm
    calls = CommCalls()
    calls._comm = stream
    with stream.call(after_caller=False):  # an async call ran on the stream (deep_ep's _call makes it for CUDA tensors)
        pass
    with calls._call(False, None, None) as call:
        assert call is INLINE
    assert log == [("record", EXIT, COMM), ("wait", CALLER, EXIT)]
    log.clear()
    with calls._call(False, None, None):
        pass
    assert log == []
