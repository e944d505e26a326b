"""A planned fresh dispatch's compiled steps (``host.cpp``'s ``planned_front`` and ``planned_padded``,
ep.paths.planned) on CPU tensors, their driver calls caught by ctypes functions
standing in for ``cuGraphLaunch``, ``cuEventRecord`` and ``cuLaunchKernel``: for any call of a
kind, the streamed kernel's struct they launch, patched from the struct of another call of that
kind, is the struct the Python steps pack for this call (``stream_cuda.pack_dispatch``; an
unpadded call's with the next tag of the posted outputs block: its posts, test_host_steps.py), the
call block holds ``call_words``, the exchange's abort word is lifted and its landed words zeroed
before the graph's launch, a padded call's block names its board copy for the exchange to write and
its outputs are the Python steps' shapes, and a driver error stops them at the step that failed.
Built here by the machine's C++ compiler (skipped only where there is none)."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.ep.kernels import stream_cuda
from warmlink.ep.kernels.call_block import CALL_SLOTS, Sources, call_words
from warmlink.ep.kernels.stream import outputs
from warmlink.ep.paths.host_mover import as_words
from warmlink.ep.paths.planned import POSTED_WORDS

HIDDEN, CHANNELS, TIMEOUT_NS = 256, 3, 7 * 10 ** 9
_STEP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)  # cuGraphLaunch's and cuEventRecord's
GRAPH, EVENT, STREAM = 0xAB, 0xE7, 0x5EA


class _Path:
    """What a StreamPath gives every struct: its space, bases, seq, valid and abort words."""

    def __init__(self, num_ranks: int) -> None:
        self.space = types.SimpleNamespace(num_ranks=num_ranks, channels=CHANNELS, row_words=40, ring_rows=128)
        self.bases = torch.arange(num_ranks, dtype=torch.int64)
        self.seq, self.valid, self.abort = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0xAB0

    def pack(self, call: dict, rows, taken, recv_offset, status, posted=None) -> bytes:
        src = call["src"]
        return stream_cuda.pack_dispatch(
            self.space, rows, src.x, src.topk, src.weights, src.scales, self.bases, recv_offset, status, self.abort,
            self.valid, 1, self.seq, 64, 9, 4, TIMEOUT_NS, taken, starts_given=True, posted=posted,
            **stream_cuda.STEPS)


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
    """The two driver calls, recorded with the call block, abort word and landed words as they were
    then (the landed words start set: the last exchange's)."""

    def __init__(self, block, abort, num_ranks: int, failing: int = 0, error: int = 0) -> None:
        self.seen: list[tuple] = []
        self.landed = (ctypes.c_int64 * num_ranks)(*[1] * num_ranks)

        def step(name, number, handle, stream):
            self.seen.append((name, handle, stream, list(block), abort.value, list(self.landed)))
            return error if failing == number else 0

        self._fns = (_STEP(lambda g, s: step("graph", 1, g, s)), _STEP(lambda e, s: step("event", 2, e, s)))
        self.addresses = [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]


_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
BOARD_ROW, FUNCTION = 12, 0xF00D


class Launcher:
    """A ``cuLaunchKernel`` that records each launch (function, grid, block, stream, its struct's
    bytes) and the driver steps recorded before it, returning ``error``."""

    def __init__(self, nbytes: int, driver: "Driver | None" = None, error: int = 0) -> None:
        self.launches: list[tuple] = []

        def launched(function, gx, gy, gz, bx, by, bz, shared, on, params, extra):
            steps = [seen[0] for seen in driver.seen] if driver is not None else []
            self.launches.append((function, gx, bx, on, ctypes.string_at(params[0], nbytes), steps))
            return error

        self._fn = _LAUNCH(launched)  # (kept alive while the module may call it)
        self.address = ctypes.cast(self._fn, ctypes.c_void_p).value


def _front(compiled, path: _Path, call: dict, template: bytes, driver: Driver, block, abort, status, posted,
           launcher: Launcher):
    """``planned_front``'s value and the struct it packed, from ``template``."""
    kept, args = ctypes.create_string_buffer(template, len(template)), ctypes.create_string_buffer(len(template))
    src = call["src"]
    got = compiled.planned_front(
        src.x, src.scales, src.topk, src.weights, call["in_rank"], call["per_rank"], call["per_expert"], call["config"],
        path.space.num_ranks, CHANNELS, -1, ctypes.addressof(block), ctypes.addressof(abort),
        ctypes.addressof(driver.landed), GRAPH, EVENT, STREAM, *driver.addresses, ctypes.addressof(kept),
        ctypes.addressof(args), len(template), status.data_ptr(), posted.data_ptr(), launcher.address, FUNCTION, 6,
        768)
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
    driver = Driver(block, abort, num_ranks)
    launcher = Launcher(len(template), driver)
    posted = torch.zeros(POSTED_WORDS, dtype=torch.int64)
    posted[:2] = launched = data.draw(st.integers(0, 1 << 40))  # (the tags of the calls before)
    (rows, taken, recv_offset, error, step), args = _front(compiled, path, call, template, driver, block, abort,
                                                           status[1], posted, launcher)
    assert (error, step) == (0, 0)
    tokens = call["src"].x.shape[0]
    assert [(t.shape, t.dtype) for t in (rows, taken, recv_offset)] == [
        ((tokens, num_ranks), torch.int64), ((num_ranks, CHANNELS), torch.int64), ((num_ranks,), torch.int64)]
    want = path.pack(call, rows, taken, recv_offset, status[1], posted=(launched + 1, posted.data_ptr()))
    assert args.raw == want
    # the next tag counted, not yet posted: the launch's receivers wait for it
    assert posted[:2].tolist() == [launched, launched + 1]
    _assert_apart(rows, taken, recv_offset)
    words = call_words(call["in_rank"], call["src"].topk, call["per_rank"], call["per_expert"], rows, call["src"], 0,
                       call["config"])
    assert [seen[:3] for seen in driver.seen] == [("graph", GRAPH, STREAM), ("event", EVENT, STREAM)]
    # written, the abort lifted and the landed words zeroed, first
    assert driver.seen[0][3:] == (list(words), 0, [0] * num_ranks)
    # the stream launched behind the exchange, with that struct
    assert launcher.launches == [(FUNCTION, 6, 768, STREAM, want, ["graph", "event"])]


def _assert_apart(*parts: torch.Tensor) -> None:
    """Tensors carved from one allocation (host.cpp's ``Carved``): contiguous, each on its own
    bytes, so that filling each leaves the others as they were."""
    for i, t in enumerate(parts):
        assert t.is_contiguous()
        t.view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(parts):
        assert (t.view(torch.uint8) == i + 1).all()


@pytest.mark.parametrize("failing", [1, 2, 3], ids=["graph", "event", "kernel"])
def test_a_driver_error_stops_the_front_at_its_step(compiled, failing):
    path, call = _Path(2), _call(2, 4, 2, fp8=False, weights=True, column_major=False)
    status = torch.zeros(1, 2 * CHANNELS, dtype=torch.int64)
    template = path.pack(call, torch.empty(4, 2, dtype=torch.int64), torch.empty(2, CHANNELS, dtype=torch.int64),
                         torch.empty(2, dtype=torch.int64), status[0])
    block, abort = (ctypes.c_int64 * len(CALL_SLOTS))(), ctypes.c_int64(99)
    driver = Driver(block, abort, 2, failing, error=801)
    launcher = Launcher(len(template), driver, error=801 if failing == 3 else 0)
    posted = torch.zeros(POSTED_WORDS, dtype=torch.int64)
    (*_, error, step), args = _front(compiled, path, call, template, driver, block, abort, status[0], posted, launcher)
    assert (error, step) == (801, failing)
    assert [seen[0] for seen in driver.seen] == ["graph", "event"][:1 if failing == 1 else 2]
    assert len(launcher.launches) == (failing == 3)
    if failing < 3:
        assert args.raw == bytes(len(template))  # the struct is packed only after both launched


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_planned_padded_call_launches_what_the_python_steps_launch_for_it(compiled, data):
    """``planned_padded``: a fresh board copy named in the call block (the exchange writes it), the
    graph, the event, then the streamed kernel launched with the struct the Python steps pack for
    this call (its outputs of num_worst_tokens rows, the board copy as its padded plan's), from
    another call's struct."""
    num_ranks = data.draw(st.sampled_from([2, 4]))
    kind = {"num_k": data.draw(st.integers(1, 8)), "fp8": data.draw(st.booleans()), "weights": data.draw(st.booleans())}
    first = _call(num_ranks, data.draw(st.integers(0, 9)), column_major=data.draw(st.booleans()), **kind)
    call = _call(num_ranks, data.draw(st.integers(0, 9)), column_major=data.draw(st.booleans()), **kind)
    worst = data.draw(st.integers(0, 20))
    path, status = _Path(num_ranks), torch.zeros(2, 2 * CHANNELS, dtype=torch.int64)

    def pack(c, rows, taken, recv_offset, status_row, board, out) -> bytes:
        src = c["src"]
        packed = ctypes.create_string_buffer(stream_cuda.pack_dispatch(
            path.space, rows, src.x, src.topk, src.weights, src.scales, path.bases, recv_offset, status_row, path.abort,
            path.valid, 1, path.seq, 64, 9, 4, TIMEOUT_NS, taken, padded=(board, worst), **stream_cuda.STEPS))
        stream_cuda._OUTPUTS.pack_into(packed, stream_cuda._OUT_AT, *(t.data_ptr() if t is not None else 0 for t in out))
        stream_cuda._WORD.pack_into(packed, stream_cuda._OUT_ROWS_AT, worst)
        return packed.raw[:stream_cuda._DISPATCH.size]

    some = torch.empty(3, dtype=torch.int64)
    template = pack(first, some, some, some, status[0], torch.empty(num_ranks, BOARD_ROW, dtype=torch.int64),
                    (some, None, None, None))
    block, abort = (ctypes.c_int64 * len(CALL_SLOTS))(), ctypes.c_int64(99)
    driver = Driver(block, abort, num_ranks)
    seen = driver.seen
    launcher = Launcher(len(template))
    kept, args = ctypes.create_string_buffer(template, len(template)), ctypes.create_string_buffer(len(template))
    src = call["src"]
    num_k = src.topk.shape[1]
    got = compiled.planned_padded(
        src.x, src.scales, src.topk, src.weights, call["in_rank"], call["per_rank"], call["per_expert"], call["config"],
        num_ranks, CHANNELS, -1, ctypes.addressof(block), ctypes.addressof(abort), ctypes.addressof(driver.landed),
        GRAPH, EVENT, STREAM, *driver.addresses, ctypes.addressof(kept), ctypes.addressof(args), len(template),
        status[1].data_ptr(), BOARD_ROW, worst, src.x.shape[1], num_k, src.weights is not None,
        src.scales.shape[1] if src.scales is not None else 0, launcher.address, FUNCTION, 6,
        768)
    rows, taken, recv_offset, board, x, idx, weights, scales, error, step = got
    assert (error, step) == (0, 0)
    want = outputs(worst, src, device="cpu")  # (the outputs' shapes: as the Python steps make them)
    for t, ref in zip((x, idx, weights, scales), want, strict=True):
        assert (t is None) == (ref is None) and (t is None or (t.shape, t.dtype) == (ref.shape, ref.dtype))
    assert board.shape == (num_ranks, BOARD_ROW)
    _assert_apart(*(t for t in (idx, weights, scales) if t is not None))
    assert [step[0] for step in seen] == ["graph", "event"]
    words = call_words(call["in_rank"], src.topk, call["per_rank"], call["per_expert"], rows, src, 0, call["config"],
                       board)
    assert seen[0][3:] == (list(words), 0, [0] * num_ranks)
    (function, grid, threads, stream, packed, _), = launcher.launches
    assert (function, grid, threads, stream) == (FUNCTION, 6, 768, STREAM)
    assert packed == args.raw == pack(call, rows, taken, recv_offset, status[1], board, (x, idx, weights, scales))
