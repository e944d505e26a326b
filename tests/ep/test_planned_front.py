"""A planned fresh dispatch's compiled front (``host.cpp``'s ``planned_front``, ep.paths.planned) on CPU
tensors, its driver calls caught by ctypes functions standing in for ``cuGraphLaunch`` and
``cuEventRecord``: for any call of a kind, the streamed kernel's struct it patches from the struct
of another call of that kind is the struct the Python steps pack for this call
(``stream_cuda.pack_dispatch``), its call block holds ``call_words``, the exchange's abort word is
lifted before the graph's launch, and a driver error stops it at the step that failed. Built here
by the machine's C++ compiler (skipped only where there is none)."""

from __future__ import annotations

import ctypes
import types
from importlib import resources

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink import _cpp
from warmlink.ep.kernels import host, stream_cuda
from warmlink.ep.kernels.call_block import CALL_SLOTS, Sources, call_words
from warmlink.ep.paths.host_mover import as_words

HIDDEN, CHANNELS, TIMEOUT_NS = 256, 3, 7 * 10 ** 9
_STEP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)  # cuGraphLaunch's and cuEventRecord's
GRAPH, EVENT, STREAM = 0xAB, 0xE7, 0x5EA


@pytest.fixture(scope="module")
def compiled():
    if _cpp.compiler() is None:
        pytest.skip("no C++ compiler on this machine ($CXX, or c++)")
    return _cpp.load(resources.files("warmlink.ep.kernels").joinpath("host.cpp").read_text(), host.NAME)


class _Path:
    """What a StreamPath gives every struct: its space, bases, seq, valid and abort words."""

    def __init__(self, num_ranks: int) -> None:
        self.space = types.SimpleNamespace(num_ranks=num_ranks, channels=CHANNELS, row_words=40, ring_rows=128)
        self.bases = torch.arange(num_ranks, dtype=torch.int64)
        self.seq, self.valid, self.abort = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0xAB0

    def pack(self, call: dict, rows, taken, recv_offset, status) -> bytes:
        src = call["src"]
        return stream_cuda.pack_dispatch(
            self.space, rows, src.x, src.topk, src.weights, src.scales, self.bases, recv_offset, status, self.abort,
            self.valid, 1, self.seq, 64, 9, 4, TIMEOUT_NS, taken, starts_given=True, **stream_cuda.STEPS)


def _call(num_ranks: int, tokens: int, num_k: int, fp8: bool, weights: bool, column_major: bool) -> dict:
    if fp8:
        x = torch.randn(tokens, HIDDEN).to(torch.float8_e4m3fn)
        scales = torch.rand(tokens, HIDDEN // 128)
        scales = scales.T.contiguous().T if column_major else scales
    else:
        x, scales = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16), None
    src = Sources(as_words(x), torch.zeros(tokens, num_k, dtype=torch.int64), torch.rand(tokens, num_k) if weights else None,
                  scales)
    return {"src": src, "in_rank": torch.zeros(tokens, num_ranks, dtype=torch.bool),
            "per_rank": torch.zeros(num_ranks, dtype=torch.int32), "per_expert": torch.zeros(8, dtype=torch.int32),
            "config": 0x5C0FE}


class Driver:
    """The two driver calls, recorded with the call block and abort word as they were then."""

    def __init__(self, block, abort, failing: int = 0, error: int = 0) -> None:
        self.seen: list[tuple] = []

        def step(name, number, handle, stream):
            self.seen.append((name, handle, stream, list(block), abort.value))
            return error if failing == number else 0

        self._fns = (_STEP(lambda g, s: step("graph", 1, g, s)), _STEP(lambda e, s: step("event", 3, e, s)))
        self.addresses = [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]


def _front(compiled, path: _Path, call: dict, template: bytes, driver: Driver, block, abort, status):
    """``planned_front``'s value and the struct it packed, from ``template``."""
    kept, args = ctypes.create_string_buffer(template, len(template)), ctypes.create_string_buffer(len(template))
    src = call["src"]
    got = compiled.planned_front(
        src.x, src.scales, src.topk, src.weights, call["in_rank"], call["per_rank"], call["per_expert"], call["config"],
        path.space.num_ranks, CHANNELS, -1, ctypes.addressof(block), ctypes.addressof(abort), GRAPH, EVENT, STREAM,
        *driver.addresses, ctypes.addressof(kept), ctypes.addressof(args), len(template), status.data_ptr())
    return got, args


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_planned_call_packs_what_the_python_steps_pack_for_it_from_another_calls_struct(compiled, data):
    num_ranks = data.draw(st.sampled_from([2, 4, 8]))
    kind = {"num_k": data.draw(st.integers(1, 8)), "fp8": data.draw(st.booleans()), "weights": data.draw(st.booleans())}
    first = _call(num_ranks, data.draw(st.integers(0, 9)), column_major=data.draw(st.booleans()), **kind)
    call = _call(num_ranks, data.draw(st.integers(0, 9)), column_major=data.draw(st.booleans()), **kind)
    path = _Path(num_ranks)
    status = torch.zeros(2, 2 * CHANNELS, dtype=torch.int64)
    template = path.pack(first, torch.empty(9, num_ranks, dtype=torch.int64), torch.empty(num_ranks, CHANNELS,
                         dtype=torch.int64), torch.empty(num_ranks, dtype=torch.int64), status[0])
    block, abort = (ctypes.c_int64 * len(CALL_SLOTS))(), ctypes.c_int64(99)
    driver = Driver(block, abort)
    (rows, taken, recv_offset, error, step), args = _front(compiled, path, call, template, driver, block, abort,
                                                           status[1])
    assert (error, step) == (0, 0)
    tokens = call["src"].x.shape[0]
    assert [(t.shape, t.dtype) for t in (rows, taken, recv_offset)] == [
        ((tokens, num_ranks), torch.int64), ((num_ranks, CHANNELS), torch.int64), ((num_ranks,), torch.int64)]
    assert args.raw == path.pack(call, rows, taken, recv_offset, status[1])
    words = call_words(call["in_rank"], call["src"].topk, call["per_rank"], call["per_expert"], rows, call["src"], 0,
                       call["config"])
    assert [seen[:3] for seen in driver.seen] == [("graph", GRAPH, STREAM), ("event", EVENT, STREAM)]
    assert driver.seen[0][3] == list(words) and driver.seen[0][4] == 0  # written, and the abort lifted, first


@pytest.mark.parametrize("failing", [1, 3], ids=["graph", "event"])
def test_a_driver_error_stops_the_front_at_its_step(compiled, failing):
    path, call = _Path(2), _call(2, 4, 2, fp8=False, weights=True, column_major=False)
    status = torch.zeros(1, 2 * CHANNELS, dtype=torch.int64)
    template = path.pack(call, torch.empty(4, 2, dtype=torch.int64), torch.empty(2, CHANNELS, dtype=torch.int64),
                         torch.empty(2, dtype=torch.int64), status[0])
    block, abort = (ctypes.c_int64 * len(CALL_SLOTS))(), ctypes.c_int64(99)
    driver = Driver(block, abort, failing, error=801)
    (*_, error, step), args = _front(compiled, path, call, template, driver, block, abort, status[0])
    assert (error, step) == (801, failing)
    assert [seen[0] for seen in driver.seen] == ["graph", "event"][:1 if failing == 1 else 2]
    assert args.raw == bytes(len(template))  # the struct is packed only after both launched
