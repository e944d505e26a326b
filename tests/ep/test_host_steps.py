"""The compiled host steps of a fresh dispatch (ep.kernels.host, ``host.cpp``) on CPU tensors, their
launches caught by a ctypes function standing in for ``cuLaunchKernel``: the starts and outputs
agree with the Python steps' (``recv_starts``, ``stream.outputs``) on any board, the kernel's
struct is patched where ``stream_cuda`` packs it, a board the Python steps would raise on launches
nothing; a planned call's posted outputs (``post_outputs``) agree with them too, a bad board or a
failed allocation posted void; ``status_clean`` reads status words as ep.paths.launch_status does.
Built here by the machine's C++ compiler (skipped only where there is none)."""

from __future__ import annotations

import ctypes
import time
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.ep.kernels import host, layout_cuda, stream_cuda
from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.kernels.stream import outputs as stream_outputs
from warmlink.ep.paths.planned import POSTED_WORDS
from warmlink.ep.wire.handle import Handle, plan_from_board, recv_starts
from warmlink.errors import MetadataError, TransferTimeout

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
ROW = 2 + 8 + 4  # a board row: round, valid, counts to each rank (8 ranks at most here), then this rank's experts
FUNCTION, STREAM = 0xF00D, 0x5EA


class Driver:
    """A ``cuLaunchKernel`` that records each launch: its function, grid, block, stream and the bytes
    of its one argument struct; it returns ``error``."""

    def __init__(self, nbytes: int, error: int = 0) -> None:
        self.launches: list[tuple] = []
        self.error = error

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            self.launches.append((function, (gx, gy, gz), (bx, by, bz), stream, ctypes.string_at(params[0], nbytes)))
            return self.error

        self._fn = _LAUNCH(launch)  # (kept alive while the module may call it)
        self.address = ctypes.cast(self._fn, ctypes.c_void_p).value


def _board(counts: list[list[int]], round_: int = 7, valid=None) -> np.ndarray:
    r = len(counts)
    board = np.zeros((r, ROW), dtype=np.int64)
    for s, row in enumerate(counts):
        board[s, :2] = (round_, 1 if valid is None else valid[s])
        board[s, 2:2 + r] = row
    return board


def _fresh(compiled, board: np.ndarray, rank: int, src: Sources, driver: Driver, max_tokens: int = 64):
    args = ctypes.create_string_buffer(stream_cuda._DISPATCH.size)
    k = src.topk.shape[1] if src.topk is not None else -1
    done = compiled.fresh_launch(
        board.ctypes.data, board.shape[0], ROW, rank, max_tokens, src.x.shape[1], k, src.weights is not None,
        src.scales.shape[1] if src.scales is not None else 0, -1, ctypes.addressof(args), stream_cuda._OUT_AT,
        stream_cuda._OUT_ROWS_AT, stream_cuda._STARTS_AT, stream_cuda.MAX_RANKS, driver.address, FUNCTION, 40, 768,
        STREAM)
    return done, args


def _src(k: int | None = 3, weights: bool = True, scales: int = 0) -> Sources:
    return Sources(torch.zeros(5, 4, dtype=torch.int64), torch.zeros(5, k, dtype=torch.int64) if k is not None else None,
                   torch.zeros(5, k) if weights and k is not None else None,
                   torch.zeros(5, scales) if scales else None)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_starts_and_outputs_agree_with_the_python_steps_and_the_struct_is_patched(compiled, data):
    r = data.draw(st.integers(1, 8))
    counts = data.draw(st.lists(st.lists(st.integers(0, 64), min_size=r, max_size=r), min_size=r, max_size=r))
    rank = data.draw(st.integers(0, r - 1))
    src = _src(k=data.draw(st.sampled_from([None, 1, 8])), weights=data.draw(st.booleans()),
               scales=data.draw(st.sampled_from([0, 56])))
    board = _board(counts)
    driver = Driver(stream_cuda._DISPATCH.size)
    done, args = _fresh(compiled, board, rank, src, driver)
    status, starts, x, idx, weights, scales, error = done
    assert (status, error) == (host.LAUNCHED, 0)
    assert starts == recv_starts(board, rank, 64)
    want = stream_outputs(starts[-1], src, device="cpu")
    for got, ref in zip((x, idx, weights, scales), want):
        assert (got is None) == (ref is None)
        if got is not None:
            assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
    (function, grid, block, stream, packed), = driver.launches
    assert (function, grid, block, stream) == (FUNCTION, (40, 1, 1), (768, 1, 1), STREAM)
    assert packed == args.raw  # the struct it launched is the buffer it patched
    fields = stream_cuda._DISPATCH.unpack(packed)
    assert fields[7:11] == tuple(t.data_ptr() if t is not None else 0 for t in (x, idx, weights, scales))
    assert fields[18 + 10] == starts[-1]
    assert list(fields[18 + 13:18 + 13 + stream_cuda.MAX_RANKS]) == starts[:-1] + [0] * (stream_cuda.MAX_RANKS - r)


def test_a_refused_round_launches_with_no_rows_and_every_start_zero(compiled):
    board = _board([[3, 4], [5, 6]], valid=[1, 0])
    driver = Driver(stream_cuda._DISPATCH.size)
    status, starts, x, *_ = _fresh(compiled, board, 1, _src(), driver)[0]
    assert status == host.LAUNCHED and starts == [0, 0, 0] and x.shape == (0, 4)
    assert recv_starts(board, 1, 64) is None and len(driver.launches) == 1


FAULTS = [("late", host.LATE, TransferTimeout), ("negative", host.OUT_OF_RANGE, MetadataError),
          ("too many", host.OUT_OF_RANGE, MetadataError)]


def _faulty_board(fault: str) -> np.ndarray:
    board = _board([[3, 4], [5, 6]])
    if fault == "late":
        board[0, 0] = 6  # rank 0's counts are of the round before
    else:
        board[0, 3] = -1 if fault == "negative" else 65
    return board


@pytest.mark.parametrize("fault, status, error", FAULTS)
def test_a_board_the_python_steps_raise_on_launches_nothing(compiled, fault, status, error):
    board = _faulty_board(fault)
    driver = Driver(stream_cuda._DISPATCH.size)
    assert _fresh(compiled, board, 1, _src(), driver)[0][0] == status
    assert driver.launches == []
    with pytest.raises(error):
        recv_starts(board, 1, 64)


def test_a_driver_error_comes_back_with_the_outputs_and_raises_named(compiled):
    driver = Driver(stream_cuda._DISPATCH.size, error=700)
    status, *_, error = _fresh(compiled, _board([[1, 2], [3, 4]]), 0, _src(), driver)[0]
    assert (status, error) == (host.DRIVER_ERROR, 700)


def test_the_layout_launch_packs_layout_cus_struct_into_fresh_outputs(compiled):
    topk = torch.tensor([[0, 5, -1], [3, 2, 7]], dtype=torch.int64)
    driver = Driver(layout_cuda._ARGS.size)
    error, per_rank, per_expert, in_rank, bad = compiled.layout(topk, 8, 2, -1, driver.address, FUNCTION, 1024, STREAM)
    assert error == 0
    assert (per_rank.shape, per_expert.shape, in_rank.shape, bad.shape) == ((2,), (8,), (2, 2), (1,))
    assert per_rank.dtype == per_expert.dtype == bad.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert per_expert.data_ptr() == per_rank.data_ptr() + 2 * 4 and bad.data_ptr() == per_rank.data_ptr() + 10 * 4
    assert in_rank.is_contiguous() and in_rank.data_ptr() >= bad.data_ptr() + 4  # (its own bytes, same allocation)
    (function, grid, block, stream, packed), = driver.launches
    assert (function, grid, block, stream) == (FUNCTION, (1, 1, 1), (1024, 1, 1), STREAM)
    assert layout_cuda._ARGS.unpack(packed) == (topk.data_ptr(), in_rank.data_ptr(), per_rank.data_ptr(), 2, 8, 3, 8,
                                                4, 2, 0)


def test_launch_from_board_maps_the_statuses(compiled, monkeypatch):
    """``PreparedDispatch.launch_from_board``: outputs and starts when launched, None (nothing
    launched) for a board the Python steps raise on, the kernel's named error for a driver error."""
    failed = []

    class Kernel:
        address = FUNCTION

        def failed(self, err, grid, block):
            failed.append(err)
            raise RuntimeError(f"launch failed: {err}")

    prepared = object.__new__(stream_cuda.PreparedDispatch)
    prepared._args = ctypes.create_string_buffer(stream_cuda._DISPATCH.size)
    prepared._kernel, prepared._stream, prepared._grid, prepared._starts_given = Kernel(), STREAM, 40, True
    src = Sources(torch.zeros(5, 4, dtype=torch.int64), torch.zeros(5, 2, dtype=torch.int64), None, None)
    board = _board([[1, 2], [3, 4]])
    driver = Driver(stream_cuda._DISPATCH.size)
    monkeypatch.setattr(host, "launch_address", lambda: driver.address)  # (the real one is libcuda's)
    (x, idx, weights, scales), starts = prepared.launch_from_board(compiled, board.ctypes.data, 2, ROW, 1, 64, src)
    assert starts == [0, 2, 6] and x.shape == (6, 4) and idx.shape == (6, 2) and weights is None is scales
    board[0, 0] = 3
    assert prepared.launch_from_board(compiled, board.ctypes.data, 2, ROW, 1, 64, src) is None
    board[0, 0] = 7
    driver.error = 719
    with pytest.raises(RuntimeError, match="719"):
        prepared.launch_from_board(compiled, board.ctypes.data, 2, ROW, 1, 64, src)
    assert failed == [719] and len(driver.launches) == 2


def test_module_loads_the_same_build_the_steps_use(compiled):
    host.module.cache_clear()
    try:
        assert host.module() is compiled  # (one build per source: _cpp.load's cache)
    finally:
        host.module.cache_clear()


def test_the_python_switch_keeps_the_compiled_steps_off(monkeypatch):
    from warmlink import _env

    monkeypatch.setenv("WARMLINK_EP_HOST", "python")
    _env.clear_cache()
    host.module.cache_clear()
    try:
        assert host.module() is None
    finally:
        host.module.cache_clear()
        _env.clear_cache()


_GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_the_count_exchange_launch_writes_the_call_block_zeroes_the_landed_words_then_launches_and_records(
        compiled, failing):
    """``front_launch``: the call block's words into the pinned block and the landed words zeroed
    before the graph's launch (its first step reads the block; the exchange sets those words), then
    the event; a driver error stops there and names its step."""
    seen: list[tuple] = []
    block, landed = (ctypes.c_int64 * 14)(), (ctypes.c_int64 * 3)(5, 6, 7)
    error = 801

    def step(name, number, *args):
        seen.append((name, list(block)[:4], list(landed), *args))
        return error if failing == number else 0

    graph_launch = _GRAPH_LAUNCH(lambda graph, stream: step("graph", 1, graph, stream))
    record = _GRAPH_LAUNCH(lambda event, stream: step("event", 2, event, stream))
    addresses = [ctypes.cast(f, ctypes.c_void_p).value for f in (graph_launch, record)]
    words = (11, 12, 13, 14, 2 ** 40, -1)
    got = compiled.front_launch(words, ctypes.addressof(block), 0xAB, ctypes.addressof(landed), 3, 0xE7, STREAM,
                                *addresses)
    assert list(block)[:6] == list(words)
    want = [("graph", [11, 12, 13, 14], [0, 0, 0], 0xAB, STREAM), ("event", [11, 12, 13, 14], [0, 0, 0], 0xE7, STREAM)]
    assert seen == want[:{0: 2, 1: 1, 2: 2}[failing]]
    assert got == ((error, failing) if failing else (0, 0))


def test_waiting_for_the_landed_words_returns_once_every_one_is_set_and_gives_up_after_its_spin(compiled):
    """``wait_landed``: True as soon as every landed word is set (here by another thread, while the
    spin runs without the GIL), False once its spin passed with one still 0."""
    import threading

    landed = (ctypes.c_int64 * 3)(1, 0, 1)
    assert not compiled.wait_landed(ctypes.addressof(landed), 3, 1_000_000)

    def land() -> None:
        time.sleep(0.05)  # (past the spin's start, most likely: it must let this thread take the GIL)
        landed[1] = 1

    thread = threading.Thread(target=land)
    thread.start()
    assert compiled.wait_landed(ctypes.addressof(landed), 3, 60 * 10 ** 9)
    thread.join()
    assert compiled.wait_landed(ctypes.addressof(landed), 3, 0)


def test_describe_says_which_steps_run_without_building_them(compiled, monkeypatch, tmp_path):
    from warmlink import _env

    assert host.describe().startswith("compiled, built in ")  # (the fixture built them)
    monkeypatch.setenv("WARMLINK_CACHE_DIR", str(tmp_path))
    _env.clear_cache()
    try:
        assert host.describe().startswith("compiled, built at first use by ")
        assert not any(tmp_path.iterdir())  # nothing built
        monkeypatch.setenv("CXX", "no-such-compiler")
        assert host.describe().startswith("Python (no C++ compiler")
        monkeypatch.setenv("WARMLINK_EP_HOST", "python")
        _env.clear_cache()
        assert host.describe() == "Python (WARMLINK_EP_HOST=python)"
    finally:
        _env.clear_cache()


def test_a_driver_status_from_compiled_code_is_raised_by_its_name(monkeypatch):
    """The compiled steps hand back the driver's status as a plain int; ``_cuda.check`` names it as
    the driver does (where the bindings load) and raises, for the kernels' ``failed`` too."""
    import enum

    from warmlink import _cuda
    from warmlink.errors import TransferError

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_ILLEGAL_ADDRESS = 700

    monkeypatch.setattr(_cuda, "_drv", types.SimpleNamespace(CUresult=CUresult))
    with pytest.raises(TransferError, match=r"cuGraphLaunch failed: CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"):
        _cuda.check(700, "cuGraphLaunch")
    with pytest.raises(TransferError, match=r"error 123456 \(123456\)"):  # not a driver status
        _cuda.check(123456, "cuEventRecord")
    _cuda.check(0, "cuEventRecord")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_padded_board_stands_exactly_where_the_python_steps_raise_nothing(compiled, data):
    """``padded_stands``: the checks a padded round's board gets at the next call (ep.protocol.streamed),
    compiled: True exactly where ``plan_from_board``'s checks (a late source, a count out of range,
    a refused input, a rank over ``num_worst_tokens``) would raise nothing."""
    from warmlink.ep.wire.handle import _board_matrix, check_worst_tokens
    from warmlink.errors import ConfigError

    r = data.draw(st.integers(1, 8))
    counts = data.draw(st.lists(st.lists(st.integers(-1, 65), min_size=r, max_size=r), min_size=r, max_size=r))
    valid = data.draw(st.lists(st.sampled_from([1, 1, 1, 0]), min_size=r, max_size=r))
    board = _board(counts, valid=valid)
    if data.draw(st.booleans()):
        board[data.draw(st.integers(0, r - 1)), 0] -= 1  # a source's counts of the round before
    rank, worst = data.draw(st.integers(0, r - 1)), data.draw(st.sampled_from([0, 64, 200, 520]))
    try:
        matrix = _board_matrix(board, int(board[rank, 0]), 64)
        stands = matrix is not None and bool(check_worst_tokens(matrix, worst, "test"))
    except (TransferTimeout, MetadataError, ConfigError):
        stands = False
    assert compiled.padded_stands(board.ctypes.data, r, ROW, rank, 64, worst) == stands


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_status_clean_counts_the_launches_that_ended_clean_in_order(compiled, data):
    """``status_clean`` (ep.paths.launch_status reads finished launches with it): the leading slots
    whose every program's word is set (a seq in the high bits) with no failure in the low bits, as
    ``LaunchStatus`` reads them in Python."""
    rows, width = 8, data.draw(st.integers(1, 12))
    words = torch.zeros(rows, width + 3, dtype=torch.int64)
    for r in range(rows):
        for p in range(width):
            words[r, p] = data.draw(st.sampled_from([0, 5 << 32, (5 << 32) | (2 << 16) | 1]))
    slots = data.draw(st.lists(st.integers(0, rows - 1), max_size=8))
    want = 0
    for slot in slots:
        row = words[slot, :width]
        if not bool(row.all()) or bool((row & 0xFFFFFFFF).any()):
            break
        want += 1
    assert compiled.status_clean(words.data_ptr(), words.shape[1], width, slots) == want


def _post(compiled, board: np.ndarray, rank: int, src: Sources, posted: torch.Tensor, x_words: int | None = None):
    k = src.topk.shape[1] if src.topk is not None else -1
    return compiled.post_outputs(board.ctypes.data, board.shape[0], ROW, rank, 64,
                                 src.x.shape[1] if x_words is None else x_words, k, src.weights is not None,
                                 src.scales.shape[1] if src.scales is not None else 0, -1, posted.data_ptr(),
                                 _experts(board))


def _experts(board: np.ndarray) -> int:
    return ROW - 2 - board.shape[0]  # (a board row's columns past the counts: this rank's experts)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_posted_outputs_and_starts_are_the_python_steps_and_the_tag_comes_last(compiled, data):
    """``post_outputs`` (Note [Posted outputs] in ep.paths.planned): the outputs the Python steps
    make for the board (``stream.outputs`` of ``recv_starts``' rows), their addresses and the starts
    in the block, and the launch's tag (the block's second word) posted, for any board, a refused
    round too (no rows, every start 0); the handle's plan as ``plan_from_board`` fills it, and the
    count matrix summed over the sources."""
    r = data.draw(st.integers(1, 8))
    counts = data.draw(st.lists(st.lists(st.integers(0, 64), min_size=r, max_size=r), min_size=r, max_size=r))
    valid = data.draw(st.lists(st.booleans(), min_size=r, max_size=r)) if data.draw(st.booleans()) else None
    rank = data.draw(st.integers(0, r - 1))
    src = _src(k=data.draw(st.sampled_from([None, 1, 8])), weights=data.draw(st.booleans()),
               scales=data.draw(st.sampled_from([0, 56])))
    board = _board(counts, valid=valid)
    experts = data.draw(st.lists(st.lists(st.integers(0, 64), min_size=_experts(board), max_size=_experts(board)),
                                 min_size=r, max_size=r))
    board[:, 2 + r:] = experts
    posted = torch.zeros(POSTED_WORDS, dtype=torch.int64)
    posted[:2] = torch.tensor([41, 42])
    status, starts, *outs, plan = _post(compiled, board, rank, src, posted)
    assert status == host.LAUNCHED
    assert starts == (recv_starts(board, rank, 64) or [0] * (r + 1))
    for got, ref in zip(outs, stream_outputs(starts[-1], src, device="cpu"), strict=True):
        assert (got is None) == (ref is None) and (got is None or (got.shape, got.dtype) == (ref.shape, ref.dtype))
    block = posted.tolist()
    assert block[:2] == [42, 42]
    assert block[2:6] == [t.data_ptr() if t is not None else 0 for t in outs]
    assert block[6:7 + r] == starts
    if valid is not None and not all(valid):
        assert plan is None  # (the Python steps raise the refusal)
        return
    handle = Handle(_experts(board) * r, 5, None, None, None)
    plan_from_board(handle, board, 7, rank, 64)
    round_, matrix, per_expert, prefix = plan
    assert (round_, matrix, per_expert) == (7, handle.count_matrix, handle.num_recv_tokens_per_expert_list)
    assert prefix.dtype == torch.int32 and prefix.tolist() == np.cumsum(counts, axis=0).tolist()


@pytest.mark.parametrize("fault, status, error", FAULTS)
def test_a_board_the_python_steps_raise_on_is_posted_void(compiled, fault, status, error):
    """The launch's receivers then take their rows and store none; the Python steps raise."""
    board = _faulty_board(fault)
    posted = torch.full((POSTED_WORDS,), 77, dtype=torch.int64)
    posted[:2] = torch.tensor([4, 5])
    assert _post(compiled, board, 1, _src(), posted)[0] == status
    assert posted[:6].tolist() == [5, 5, 0, 0, 0, 0]
    with pytest.raises(error):
        recv_starts(board, 1, 64)


def test_an_allocation_that_fails_is_posted_void_and_raises(compiled):
    posted = torch.full((POSTED_WORDS,), 77, dtype=torch.int64)
    posted[:2] = torch.tensor([8, 9])
    with pytest.raises(RuntimeError):
        _post(compiled, _board([[3, 4], [5, 6]]), 0, _src(), posted, x_words=1 << 60)  # (8 rows of 2^63 bytes)
    assert posted[:6].tolist() == [9, 9, 0, 0, 0, 0]
