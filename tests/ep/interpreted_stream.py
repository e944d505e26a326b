"""The streamed dispatch's kernel (ep.kernels.stream, Note [Streamed dispatch]) against its torch twin
and the oracle, through Triton's interpreter.

Run by ``test_stream.py`` in a child pytest with ``TRITON_INTERPRET=1``. The ranks share this
process: each rank's stream space is a CPU tensor, its peers' bases the other tensors' addresses.
The interpreter runs programs one after another, so every rank's senders run first, then every
rank's receivers, with rings that hold a call's rows; rings that fill and wrap (the credits) run
on GPUs (test_stream_gpu.py), and here only the deadline of a sender whose ring stays full.
"""

from __future__ import annotations

import pytest
import torch

from tests.ep._interpreter import CLOCK, numpy_scalars_in_the_interpreter, swap_ptx_helpers
from tests.ep._reference import reference_dispatch
from tests.ep._stream_workers import group_inputs, same_bits
from warmlink.ep.kernels.stream import (FIN, Sources, StreamSpace, failures, meta_words, outputs, recv_offsets,
                                        row_words, stream_dispatch, stream_dispatch_torch)
from warmlink.ep.wire.fp8 import num_scales

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreter():
    assert triton.knobs.runtime.interpret, "run with TRITON_INTERPRET=1 (test_stream.py does)"
    numpy_scalars_in_the_interpreter()


@pytest.fixture
def kernel(interpreter, monkeypatch):
    """The interpreter's kernel, with its clock and system fence (PTX) swapped for Python ones."""
    from warmlink.ep.kernels import stream_programs

    swap_ptx_helpers(monkeypatch, stream_programs)
    return stream_programs.stream_dispatch_kernel


class _Group:
    """R ranks' stream spaces in this process."""

    def __init__(self, num_ranks: int, channels: int, ring_rows: int, words: int) -> None:
        self.space = StreamSpace(num_ranks, channels, ring_rows, words)
        self.mem = [torch.zeros(self.space.nbytes // 8, dtype=torch.int64) for _ in range(num_ranks)]
        self.bases = torch.tensor([m.data_ptr() for m in self.mem], dtype=torch.int64)

    def launch(self, kernel, me: int, seq: int, rows, src, max_tokens: int, experts_per_rank: int, role: str,
               out=None, offsets=None, timeout_s: float = 5.0, abort: int = 0, **steps):
        """Rank ``me``'s programs of ``role``; returns (outputs, status words). steps: tokens, batch, publish."""
        if out is None:
            offsets, total = recv_offsets([0] * self.space.num_ranks)
            out = outputs(total, src)
        status = torch.zeros(2 * self.space.channels, dtype=torch.int64)
        stream_dispatch(self.space, rows, src, out, offsets, self.bases, status, me=me, seq=seq, max_tokens=max_tokens,
                        experts_per_rank=experts_per_rank, timeout_s=timeout_s, abort=abort, role=role, kernel=kernel,
                        **steps)
        return out, status


def _received(rows_of, me: int, src):
    """Outputs for what rank ``me`` receives (every part filled with -7), and its offsets."""
    offsets, total = recv_offsets([int((r[:, me] >= 0).sum()) for r in rows_of])
    out = outputs(total, src)
    for part in out:
        if part is not None:
            part.fill_(-7)
    return out, offsets


def _call(kernel, group: _Group, call: dict, seq: int):
    """Every rank's senders, then every rank's receivers, of one call; returns its inputs and outputs."""
    rows_of, sources_of, raw = group_inputs(call, group.space.num_ranks)
    epr, max_tokens = call["experts"] // group.space.num_ranks, call.get("max_tokens", max(call["tokens"]) or 1)
    got = [_received(rows_of, me, sources_of[me]) for me in range(len(rows_of))]
    statuses = []
    for role in ("send", "recv"):
        for me, (out, offsets) in enumerate(got):
            _, status = group.launch(kernel, me, seq, rows_of[me], sources_of[me], max_tokens, epr, role, out, offsets,
                                     **call.get("steps", {}))
            statuses.append(status)
    return rows_of, sources_of, raw, [out for out, _ in got], statuses


CASES = {
    "2 ranks, bf16, hidden 2880": {"tokens": [[130, 1], [0, 111]], "hidden": 2880, "experts": 8, "topk": 4,
                                   "channels": 3},
    "3 ranks, fp8, hidden 7168, column-major scales": {
        "tokens": [[1, 90, 0], [70, 0, 33]], "hidden": 7168, "experts": 12, "topk": 3, "channels": 2,
        "dtype": torch.float8_e4m3fn, "layout": "column"},
    "2 ranks, fp8, hidden 2880, no weights": {"tokens": [[0, 0], [40, 7]], "hidden": 2880, "experts": 6, "topk": 2,
                                              "channels": 4, "dtype": torch.float8_e4m3fn, "weights": False},
    "3 ranks, bf16, hidden 7168": {"tokens": [[40, 9, 70], [1, 0, 0]], "hidden": 7168, "experts": 24, "topk": 8,
                                   "channels": 2},
    # tiles of 4 tokens, visits of 3 rows, tails every 5 rows, over 61 and 23 tokens a channel: no count is
    # a multiple of another, so tiles and visits end part-way
    "2 ranks, bf16, hidden 2880, tiles of 4": {"tokens": [[122, 45], [7, 90]], "hidden": 2880, "experts": 8,
                                               "topk": 2, "channels": 2, "steps": {"tokens": 4, "batch": 3,
                                                                                   "publish": 5}},
}


def _channel_counts(rows: torch.Tensor, dest: int, channels: int) -> list[int]:
    """Rows a source sends ``dest`` on each channel (channel c: tokens [c * ceil(T/C), ...))."""
    per = -(-rows.shape[0] // channels)
    return [int((rows[c * per:(c + 1) * per, dest] >= 0).sum()) for c in range(channels)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_calls_through_the_same_rings_equal_the_torch_twin_and_the_oracle(kernel, name):
    """Two calls (seq 1, then 2, other tokens and counts) through the same spaces: every rank's
    outputs equal the torch twin's bit for bit and the oracle's (tests.ep._reference), every
    program finished, and the words left are the last call's: each tail and head ``seq << 32 |
    FIN | rows`` of its source, destination and channel."""
    case = CASES[name]
    num_ranks, channels = len(case["tokens"][0]), case["channels"]
    hidden, k = case["hidden"], case["topk"]
    fp8 = case.get("dtype") == torch.float8_e4m3fn
    x_words = hidden * (1 if fp8 else 2) // 8
    ring_rows = max(-(-max(tokens) // channels) for tokens in case["tokens"])  # a call's rows fit
    group = _Group(num_ranks, channels, ring_rows, row_words(x_words, k, num_scales(hidden) if fp8 else 0))
    for seq, tokens in enumerate(case["tokens"], start=1):
        call = dict(case, tokens=tokens, seed=seq)
        rows_of, sources_of, raw, got, statuses = _call(kernel, group, call, seq)
        for me in range(num_ranks):  # its senders' words from the first launch, its receivers' from the second
            words = torch.cat([statuses[me][:channels], statuses[num_ranks + me][channels:]])
            assert not failures(words, seq, channels), (seq, me, words.tolist())
        oracle = reference_dispatch([r["x"] for r in raw], [r["topk_idx"] for r in raw],
                                    [r["topk_weights"] for r in raw] if case.get("weights", True) else None,
                                    case["experts"])
        for me in range(num_ranks):
            want = stream_dispatch_torch(me, rows_of, sources_of, max(tokens) or 1, case["experts"] // num_ranks)
            for field, g, w in zip(got[me]._fields, got[me], want):
                assert same_bits(g, w), (seq, me, field)
            ref = oracle[me]
            x = got[me].x.view(case.get("dtype", torch.bfloat16)).view(-1, hidden)
            assert same_bits(x.view(torch.uint8), (ref["recv_x"][0] if fp8 else ref["recv_x"]).view(torch.uint8))
            if fp8:
                assert same_bits(got[me].scales, ref["recv_x"][1].float())
            assert torch.equal(got[me].idx, ref["recv_topk_idx"])
            assert same_bits(got[me].weights, ref["recv_topk_weights"])
        for d in range(num_ranks):
            for s in range(num_ranks):
                for c, rows in enumerate(_channel_counts(rows_of[s], d, channels)):
                    word = seq << 32 | FIN | rows
                    assert int(group.mem[d][group.space.tail(s, c)]) == word, (seq, s, d, c)
                    assert int(group.mem[s][group.space.head(d, c)]) == word, (seq, s, d, c)


def _one_way(tokens: int, seed: int = 3):
    """Rank 0's tokens of a 2-rank group, every one to rank 1 only (experts 4-7 of 8); max_tokens = tokens."""
    gen = torch.Generator().manual_seed(seed)
    topk = torch.randint(4, 8, (tokens, 1), generator=gen)
    rows = torch.stack([torch.full((tokens,), -1), tokens + torch.arange(tokens)], 1)
    x = torch.randint(-2**62, 2**62, (tokens, 24), generator=gen)
    return rows, Sources(x, topk, torch.rand(tokens, 1, generator=gen))


@pytest.mark.parametrize("aborted", [False, True], ids=["deadline", "abort word"])
def test_a_receiver_whose_source_never_publishes_ends_with_its_failure_word(kernel, aborted):
    """Rank 1 never runs: rank 0's receivers take their own rows, then wait for rank 1's and end
    at the deadline (or at once, on the abort word) with status ``rows`` from peer 1."""
    call = {"tokens": [40, 25], "hidden": 256, "experts": 8, "topk": 2, "seed": 5}
    rows_of, sources_of, _ = group_inputs(call, 2)
    group = _Group(2, 2, 32, row_words(64, 2, 0))
    out, offsets = _received(rows_of, 0, sources_of[0])
    _, sent = group.launch(kernel, 0, 1, rows_of[0], sources_of[0], 40, 4, "send")
    assert sent[:2].tolist() == [1 << 32] * 2  # its senders finished
    abort = torch.tensor([1 if aborted else 0], dtype=torch.int64)
    start = CLOCK[0]
    _, status = group.launch(kernel, 0, 1, rows_of[0], sources_of[0], 40, 4, "recv", out, offsets,
                             timeout_s=10.0 if aborted else 0.05, abort=abort.data_ptr())
    took = (CLOCK[0] - start) / 1e9
    assert (took < 0.1) if aborted else (0.05 < took < 0.5), took
    fails = [f for f in failures(status, 1, 2) if f.role == "recv"]
    assert [(f.wait, f.peer, f.aborted) for f in fails] == [("rows", 1, aborted)] * 2, fails
    want = stream_dispatch_torch(0, rows_of, sources_of, 40, 4)
    own = int((rows_of[0][:, 0] >= 0).sum())  # source 0's rows came; source 1's are untouched
    assert torch.equal(out.x[:own], want.x[:own]) and (out.x[own:] == -7).all()


@pytest.mark.parametrize("ring_rows", [2, 11])
def test_a_sender_whose_ring_stays_full_ends_with_its_failure_word_having_published_what_it_wrote(kernel, ring_rows):
    """A ring of fewer rows than a tile (8 tokens), or of a tile and a part, and no receiver: the
    sender fills it, publishes its rows, waits for a credit and ends at the deadline with status
    ``credit`` from peer 1; no FIN."""
    rows, src = _one_way(20)
    group = _Group(2, 1, ring_rows, row_words(24, 1, 0))
    _, status = group.launch(kernel, 0, 1, rows, src, 20, 4, "send", timeout_s=0.05)
    assert [(f.role, f.wait, f.peer) for f in failures(status[:1], 1, 1)] == [("send", "credit", 1)]
    assert int(group.mem[1][group.space.tail(0, 0)]) == 1 << 32 | ring_rows
    ring = group.mem[1][group.space.ring(0, 0):].view(-1)[:ring_rows * group.space.row_words].view(ring_rows, -1)
    ordinals = ring[:, 24 + meta_words(1, 0)].tolist()
    assert torch.equal(ring[:, :24], src.x[:ring_rows]) and ordinals == list(range(ring_rows))  # rows, ordinals


def test_a_sender_waits_for_the_previous_calls_rows_to_be_taken_and_overwrites_none(kernel):
    """Call 1 completes but for rank 1's receivers; rank 0's sender of call 2 finds rank 1's head
    still at 0 (call 1 not taken), writes nothing and ends at the deadline with ``previous call``
    from peer 1. Rank 1's receivers, late, still take call 1's rows intact."""
    call = {"tokens": [30, 11], "hidden": 256, "experts": 8, "topk": 2, "seed": 7}
    rows_of, sources_of, _ = group_inputs(call, 2)
    group = _Group(2, 1, 32, row_words(64, 2, 0))
    got = [_received(rows_of, me, sources_of[me]) for me in range(2)]
    for me in range(2):
        group.launch(kernel, me, 1, rows_of[me], sources_of[me], 30, 4, "send")
    _, status = group.launch(kernel, 0, 1, rows_of[0], sources_of[0], 30, 4, "recv", *got[0])
    assert status[1] == 1 << 32  # rank 0's receiver took both sources' rows
    again = group_inputs(dict(call, seed=8), 2)
    _, status = group.launch(kernel, 0, 2, again[0][0], again[1][0], 30, 4, "send", timeout_s=0.05)
    assert [(f.wait, f.peer) for f in failures(status[:1], 2, 1)] == [("previous call", 1)]
    _, status = group.launch(kernel, 1, 1, rows_of[1], sources_of[1], 30, 4, "recv", *got[1])
    assert status[1] == 1 << 32
    want = stream_dispatch_torch(1, rows_of, sources_of, 30, 4)
    assert all(same_bits(g, w) for g, w in zip(got[1][0], want))


def test_a_row_outside_its_sources_outputs_is_not_written_and_reported(kernel):
    """One rank, 10 rows sent, outputs of 6 (a view with guard rows after it): rows 0-5 land, the
    others are dropped, the guard rows are untouched and the receiver reports ``bad row``."""
    rows = torch.arange(10).view(10, 1)
    gen = torch.Generator().manual_seed(2)
    src = Sources(torch.randint(-2**62, 2**62, (10, 16), generator=gen), torch.zeros(10, 1, dtype=torch.int64))
    group = _Group(1, 1, 16, row_words(16, 1, 0))
    x = torch.full((9, 16), -7, dtype=torch.int64)
    idx = torch.full((9, 1), -7, dtype=torch.int64)
    out = outputs(0, src)._replace(x=x[:6], idx=idx[:6])
    group.launch(kernel, 0, 1, rows, src, 10, 1, "send", out, torch.zeros(1, dtype=torch.int64))
    _, status = group.launch(kernel, 0, 1, rows, src, 10, 1, "recv", out, torch.zeros(1, dtype=torch.int64))
    assert [(f.wait, f.peer) for f in failures(status, 1, 1) if f.role == "recv"] == [("bad row", 0)]
    assert torch.equal(x[:6], src.x[:6]) and (x[6:] == -7).all() and (idx[:6] == 0).all() and (idx[6:] == -7).all()


def test_a_receiver_takes_nothing_from_the_previous_calls_tail(kernel):
    """One rank: call 1 runs whole; call 2's receiver, run before its sender, finds call 1's tail
    (FIN, 12 rows) in place, takes none of it and ends with ``rows`` from peer 0, its outputs
    untouched; then call 2's sender and receiver run and the rows are call 2's."""
    rows = torch.arange(12).view(12, 1)
    group = _Group(1, 1, 16, row_words(16, 1, 0))
    for seq in (1, 2):
        gen = torch.Generator().manual_seed(seq)
        src = Sources(torch.randint(-2**62, 2**62, (12, 16), generator=gen), torch.zeros(12, 1, dtype=torch.int64))
        out, offsets = _received([rows], 0, src)
        if seq == 2:
            _, status = group.launch(kernel, 0, seq, rows, src, 12, 1, "recv", out, offsets, timeout_s=0.05)
            assert [(f.wait, f.peer) for f in failures(status, seq, 1) if f.role == "recv"] == [("rows", 0)]
            assert (out.x == -7).all() and int(group.mem[0][group.space.tail(0, 0)]) == 1 << 32 | FIN | 12
        group.launch(kernel, 0, seq, rows, src, 12, 1, "send", out, offsets)
        _, status = group.launch(kernel, 0, seq, rows, src, 12, 1, "recv", out, offsets)
        assert status[1] == seq << 32 and torch.equal(out.x, src.x), seq


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_the_padded_plan_kernel_equals_its_torch_twin(interpreter, num_ranks):
    """A padded streamed dispatch's offsets and verdict from its board (ep.protocol.streamed, Note
    [Streamed calls]): refused by the exchange, or by a rank receiving one row more than the
    worst case, or standing with exactly that many."""
    from warmlink.ep.kernels import stream_programs
    from warmlink.ep.kernels.stream_counts import padded_plan, padded_plan_torch
    from warmlink.ep.wire.regions import board_words

    gen = torch.Generator().manual_seed(num_ranks)
    verdicts = set()
    for trial in range(6):
        board = torch.randint(0, 50, (num_ranks, board_words(num_ranks)), generator=gen, dtype=torch.int64)
        exchange_valid = torch.tensor([trial % 3], dtype=torch.int64)  # 0: the exchange refused the round
        worst = int(board[:, 2:2 + num_ranks].sum(0).max()) - trial % 2  # exactly what the fullest rank gets, or one short
        for me in range(num_ranks):
            got = padded_plan(board, exchange_valid, me, worst, kernel=stream_programs.padded_plan_kernel)
            want = padded_plan_torch(board, exchange_valid, me, worst)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (trial, me, got, want)
            verdicts.add(int(got[1]))
    assert verdicts == {0, 1}
