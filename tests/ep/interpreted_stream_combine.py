"""The streamed combine's kernel (ep.kernels.stream_combine, Note [Streamed combine]) after the streamed
dispatch, through one space per rank, against its torch twin and the oracle, in Triton's interpreter.

Run by ``test_stream_combine.py`` in a child pytest with ``TRITON_INTERPRET=1``. As in
interpreted_stream.py the ranks share this process and the interpreter runs programs one after
another: every rank's senders, then every rank's receivers, with rings that hold a call's rows.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.ep._interpreter import CLOCK, numpy_scalars_in_the_interpreter, swap_ptx_helpers
from tests.ep._reference import reference_combine, reference_dispatch
from tests.ep._stream_workers import expert_output, group_inputs, same_bits
from warmlink.ep.kernels.stream import FIN, StreamSpace, failures, outputs, recv_offsets, row_words, stream_dispatch
from warmlink.ep.kernels.stream import stream_dispatch_torch
from warmlink.ep.kernels.stream_combine import combine_row_words, stream_combine, stream_combine_torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreter():
    assert triton.knobs.runtime.interpret, "run with TRITON_INTERPRET=1 (test_stream_combine.py does)"
    numpy_scalars_in_the_interpreter()


@pytest.fixture
def kernels(interpreter, monkeypatch):
    """The interpreter's dispatch and combine kernels, with Python clocks and fences in both modules."""
    from warmlink.ep.kernels import stream_combine_programs, stream_programs

    swap_ptx_helpers(monkeypatch, stream_programs)
    swap_ptx_helpers(monkeypatch, stream_combine_programs)
    return stream_programs.stream_dispatch_kernel, stream_combine_programs.stream_combine_kernel


class _Group:
    """R ranks' stream spaces in this process."""

    def __init__(self, num_ranks: int, channels: int, ring_rows: int, words: int) -> None:
        self.space = StreamSpace(num_ranks, channels, ring_rows, words)
        self.mem = [torch.zeros(self.space.nbytes // 8, dtype=torch.int64) for _ in range(num_ranks)]
        self.bases = torch.tensor([m.data_ptr() for m in self.mem], dtype=torch.int64)

    def status(self) -> torch.Tensor:
        return torch.zeros(2 * self.space.channels, dtype=torch.int64)

    def words(self, me: int, seq: int, sends: list, recvs: list) -> torch.Tensor:
        c = self.space.channels
        return torch.cat([sends[me][:c], recvs[me][c:]])


def _dispatch(kernel, group: _Group, call: dict, seq: int):
    """Every rank's dispatch senders, then receivers; returns the inputs, each rank's (outputs,
    offsets, taken) and the status words."""
    num_ranks, channels = group.space.num_ranks, group.space.channels
    rows_of, sources_of, raw = group_inputs(call, num_ranks)
    epr, max_tokens = call["experts"] // num_ranks, max(call["tokens"]) or 1
    got = []
    for me in range(num_ranks):
        offsets, total = recv_offsets([int((r[:, me] >= 0).sum()) for r in rows_of])
        got.append((outputs(total, sources_of[me]), offsets, torch.full((num_ranks, channels), -7)))
    sends, recvs = [], []
    for role, statuses in (("send", sends), ("recv", recvs)):
        for me, (out, offsets, taken) in enumerate(got):
            statuses.append(group.status())
            stream_dispatch(group.space, rows_of[me], sources_of[me], out, offsets, group.bases, statuses[-1], me=me,
                            seq=seq, max_tokens=max_tokens, experts_per_rank=epr, timeout_s=5.0, role=role,
                            kernel=kernel, taken=taken)
    for me in range(num_ranks):
        assert not failures(group.words(me, seq, sends, recvs), seq, channels), (seq, me)
        want_taken = torch.zeros(num_ranks, channels, dtype=torch.int64)
        want = stream_dispatch_torch(me, rows_of, sources_of, max_tokens, epr, taken=want_taken)
        assert same_bits(got[me][0].x, want.x) and torch.equal(got[me][2], want_taken), (seq, me)
    return rows_of, raw, got


def _combine(kernel, group: _Group, seq: int, rows_of, ys, ws, got, roles=("send", "recv"), ranks=None, **kw):
    """Rank by rank, the combine's programs of each role; returns each rank's (out, out_w) and status words."""
    ranks = range(group.space.num_ranks) if ranks is None else ranks
    outs = {me: (torch.full((rows_of[me].shape[0], ys[0].shape[1]), 7.0, dtype=ys[0].dtype),
                 torch.full((rows_of[me].shape[0], ws[0].shape[1]), 7.0) if ws is not None else None) for me in ranks}
    statuses = {role: {} for role in roles}
    for role in roles:
        for me in ranks:
            status = statuses[role][me] = group.status()
            stream_combine(group.space, rows_of[me], ys[me], outs[me][0], got[me][2], got[me][1], group.bases, status,
                           me=me, seq=seq, weights=ws[me] if ws is not None else None, out_weights=outs[me][1],
                           role=role, kernel=kernel, **{"timeout_s": 5.0, **kw})
    return outs, statuses


CASES = {
    "2 ranks, hidden 2880, weights": {"tokens": [[70, 1], [0, 61]], "hidden": 2880, "experts": 8, "topk": 4,
                                      "channels": 3},
    "3 ranks, hidden 7168, no weights": {"tokens": [[1, 50, 0], [37, 0, 33]], "hidden": 7168, "experts": 12,
                                         "topk": 3, "channels": 2, "weights": False},
    "2 ranks, hidden 2880, fp16 expert outputs": {"tokens": [[64, 70]], "hidden": 2880, "experts": 8, "topk": 3,
                                                  "channels": 2, "out_dtype": torch.float16},
}


def _as_interpreted(sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 sums cast as Triton's interpreter casts them: BF16 toward zero (its float32 word's high
    half; CUDA rounds to nearest, as torch), FP16 to nearest (NumPy's cast)."""
    if dtype == torch.float16:
        return sums.to(dtype)
    return torch.from_numpy((sums.numpy().view(np.uint32) >> 16).astype(np.uint16)).view(torch.bfloat16)


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_then_combine_twice_through_one_space_equal_the_twins_and_the_oracle(kernels, name):
    """Dispatch (seq 1), combine (2), dispatch (3), combine (4) through one space per rank, the
    expert output a function of the rows received: every program finished; each source's sums equal
    the torch twin's, and the twin the oracle's (tests.ep._reference.reference_combine), bit for bit
    (BF16 sums cast as the interpreter casts, toward zero: ``_as_interpreted``); and the words left
    are the combine's: every tail and head ``seq << 32 | FIN | rows``."""
    dispatch_kernel, combine_kernel = kernels
    case = CASES[name]
    num_ranks, channels, hidden, k = len(case["tokens"][0]), case["channels"], case["hidden"], case["topk"]
    weighted = case.get("weights", True)
    ring_rows = max(-(-max(tokens) // channels) for tokens in case["tokens"])  # a call's rows fit
    words = max(row_words(hidden // 4, k, 0), combine_row_words(hidden // 4, k))
    group = _Group(num_ranks, channels, ring_rows, words)
    for call_no, tokens in enumerate(case["tokens"]):
        seq = 2 * call_no + 1
        rows_of, raw, got = _dispatch(dispatch_kernel, group, dict(case, tokens=tokens, seed=seq), seq)
        dtype = case.get("out_dtype", torch.bfloat16)
        ys = [expert_output(out.x, hidden, d).to(dtype) for d, (out, _, _) in enumerate(got)]
        ws = [out.weights for out, _, _ in got] if weighted else None
        outs, statuses = _combine(combine_kernel, group, seq + 1, rows_of, ys, ws, got)
        oracle = reference_dispatch([r["x"] for r in raw], [r["topk_idx"] for r in raw],
                                    [r["topk_weights"] for r in raw] if weighted else None, case["experts"])
        ref = reference_combine(ys, [o["recv_src"] for o in oracle], tokens, ws)
        for me in range(num_ranks):
            words_ = group.words(me, seq + 1, statuses["send"], statuses["recv"])
            assert not failures(words_, seq + 1, channels), (seq + 1, me, words_.tolist())
            taken, offsets = [g[2] for g in got], [g[1] for g in got]
            want, want_w = stream_combine_torch(me, rows_of[me], ys, taken, offsets, ws)
            sums, _ = stream_combine_torch(me, rows_of[me], [y.float() for y in ys], taken, offsets)
            assert same_bits(outs[me][0], _as_interpreted(sums, dtype)), (seq + 1, me)
            assert same_bits(outs[me][1], want_w), (seq + 1, me)
            assert same_bits(want, ref[me]["out"]) and same_bits(want_w, ref[me]["combined_weights"]), (seq + 1, me)
            assert same_bits(want, sums.to(dtype))
        for d in range(num_ranks):  # d: the expert rank, sending its rows back to source s
            for s in range(num_ranks):
                for c in range(channels):
                    word = (seq + 1) << 32 | FIN | int(got[d][2][s, c])
                    assert int(group.mem[s][group.space.tail(d, c)]) == word, (seq + 1, s, d, c)
                    assert int(group.mem[d][group.space.head(s, c)]) == word, (seq + 1, s, d, c)


_SMALL = {"tokens": [40, 25], "hidden": 256, "experts": 8, "topk": 2, "seed": 5}


@pytest.mark.parametrize("aborted", [False, True], ids=["deadline", "abort word"])
def test_a_source_whose_expert_rank_never_sends_ends_with_its_failure_word(kernels, aborted):
    """After a whole dispatch, rank 1 never runs its combine: rank 0's receivers sum what they can
    wait for, then end at the deadline (or at once, on the abort word) with ``rows`` from peer 1."""
    dispatch_kernel, combine_kernel = kernels
    group = _Group(2, 2, 32, row_words(64, 2, 0))
    rows_of, _, got = _dispatch(dispatch_kernel, group, _SMALL, 1)
    ys = [expert_output(out.x, 256, d) for d, (out, _, _) in enumerate(got)]
    ws = [out.weights for out, _, _ in got]
    _, sent = _combine(combine_kernel, group, 2, rows_of, ys, ws, got, roles=("send",), ranks=[0])
    assert sent["send"][0][:2].tolist() == [2 << 32] * 2  # its senders finished
    abort = torch.tensor([2 if aborted else 0], dtype=torch.int64)
    start = CLOCK[0]
    _, status = _combine(combine_kernel, group, 2, rows_of, ys, ws, got, roles=("recv",), ranks=[0],
                         timeout_s=10.0 if aborted else 0.05, abort=abort.data_ptr())
    took = (CLOCK[0] - start) / 1e9
    assert (took < 0.1) if aborted else (0.05 < took < 0.5), took
    fails = [f for f in failures(status["recv"][0], 2, 2) if f.role == "recv"]
    assert [(f.wait, f.peer, f.aborted) for f in fails] == [("rows", 1, aborted)] * 2, fails


def test_a_sender_whose_ring_stays_full_ends_with_its_failure_word_having_published_what_it_wrote(kernels):
    """A ring of 2 rows, 20 rows for rank 1 and no receiver: the sender writes and publishes 2 rows,
    waits for a credit and ends at the deadline with status ``credit`` from peer 1; no FIN."""
    _, combine_kernel = kernels
    group = _Group(2, 1, 2, combine_row_words(8, 3))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(23, 32, generator=gen).to(torch.bfloat16)
    w = torch.rand(23, 3, generator=gen)
    taken, offsets = torch.tensor([[0], [20]]), torch.tensor([0, 3])
    rows = torch.zeros(0, 2, dtype=torch.int64)
    status = group.status()
    stream_combine(group.space, rows, x, torch.zeros(0, 32, dtype=torch.bfloat16), taken, offsets, group.bases,
                   status, me=0, seq=1, weights=w, out_weights=torch.zeros(0, 3), timeout_s=0.05, role="send",
                   kernel=combine_kernel)
    assert [(f.role, f.wait, f.peer) for f in failures(status[:1], 1, 1)] == [("send", "credit", 1)]
    assert int(group.mem[1][group.space.tail(0, 0)]) == 1 << 32 | 2
    ring = group.mem[1][group.space.ring(0, 0):].view(-1)[:2 * group.space.row_words].view(2, -1)
    assert torch.equal(ring[:, :8], x[3:5].view(torch.int64))  # rows 3, 4 of x: source 1's start at offset 3
    assert torch.equal(ring[:, 8:].view(torch.float32)[:, :3], w[3:5])


def test_a_rank_that_sends_fewer_rows_than_the_tokens_need_is_a_bad_row(kernels):
    """One rank, 10 tokens, but a ``taken`` of 9: the receiver sums 8, finds FIN at 9 rows where the
    last tile needs 2 and reports ``bad row`` from peer 0 at once, its last tokens untouched."""
    _, combine_kernel = kernels
    group = _Group(1, 1, 16, combine_row_words(8, 0))
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = torch.full((10, 32), 7.0, dtype=torch.bfloat16)
    for role in ("send", "recv"):
        status = group.status()
        stream_combine(group.space, torch.zeros(10, 1, dtype=torch.int64), x, out, torch.tensor([[9]]),
                       torch.tensor([0]), group.bases, status, me=0, seq=1, timeout_s=10.0, role=role,
                       kernel=combine_kernel, batch=8)  # tiles of 8 tokens: the first is whole
    assert [(f.role, f.wait, f.peer) for f in failures(status, 1, 1) if f.role == "recv"] == [("recv", "bad row", 0)]
    assert torch.equal(out[:8], x[:8]) and (out[8:] == 7).all()


@pytest.mark.parametrize("ring_rows,publish,batch", [(1, 2, 4), (3, 4, 8), (5, 8, 2)])
def test_rings_that_wrap_with_senders_and_receivers_at_once_equal_the_twin(kernels, ring_rows, publish, batch):
    """Rings of 1-5 rows, far fewer than a call's: each rank's senders and receivers run at once, in
    threads, so every row waits on credits. One channel: the interpreter keeps one program id for
    all threads, and its patch of triton.language is held for the whole test (a launch that ends
    restores what it found). FP16 (the interpreter rounds it as CUDA does): equal to the twin."""
    from triton.runtime import interpreter

    _, combine_kernel = kernels
    tokens, gen = [37, 23], torch.Generator().manual_seed(ring_rows)
    group = _Group(2, 1, ring_rows, combine_row_words(16, 3))
    rows = [torch.where(torch.rand(t, 2, generator=gen) < 0.7, 0, -1) for t in tokens]
    taken = [torch.tensor([[int((r[:, d] >= 0).sum())] for r in rows]) for d in range(2)]
    offsets = [torch.cumsum(t.view(-1), 0) - t.view(-1) for t in taken]
    xs = [torch.randn(int(t.sum()), 64, generator=gen).to(torch.float16) for t in taken]
    ws = [torch.rand(int(t.sum()), 3, generator=gen) for t in taken]
    outs = [(torch.full((t, 64), 7.0, dtype=torch.float16), torch.full((t, 3), 7.0)) for t in tokens]
    abort, statuses, errors = torch.zeros(1, dtype=torch.int64), {}, []

    def run(me: int, role: str) -> None:
        try:
            status = statuses[me, role] = group.status()
            stream_combine(group.space, rows[me], xs[me], outs[me][0], taken[me], offsets[me], group.bases, status,
                           me=me, seq=1, weights=ws[me], out_weights=outs[me][1], timeout_s=1e4,
                           abort=abort.data_ptr(), role=role, publish=publish, batch=batch, kernel=combine_kernel)
        except Exception as e:  # noqa: BLE001 - raised in the test's thread below
            errors.append(e)

    held = interpreter._patch_lang(combine_kernel.fn)
    try:
        threads = [threading.Thread(target=run, args=(me, role)) for me in range(2) for role in ("send", "recv")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        if any(thread.is_alive() for thread in threads):
            abort[0] = 1  # ends every wait at once
            for thread in threads:
                thread.join()
    finally:
        held.restore()
    assert not errors and not abort[0], (errors, abort)
    for me in range(2):
        words = torch.cat([statuses[me, "send"][:1], statuses[me, "recv"][1:]])
        assert not failures(words, 1, 1), (me, words.tolist())
        want, want_w = stream_combine_torch(me, rows[me], xs, taken, offsets, ws)
        assert same_bits(outs[me][0], want) and same_bits(outs[me][1], want_w), me
