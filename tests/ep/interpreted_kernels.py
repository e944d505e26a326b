"""The dispatch's Triton kernels equal their torch versions, through Triton's interpreter.

Run by ``test_kernels.py`` in a child pytest with ``TRITON_INTERPRET=1``: the interpreter must be
chosen before Triton is imported. The kernels run on the GPU in the ep GPU tests; here every
branch (ids, weights, FP8 scales, a range of destinations, a shift, rows wider than one program's
chunk) runs on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ep._interpreter import CLOCK, numpy_scalars_in_the_interpreter, swap_ptx_helpers
from tests.ep._workers import scales_laid_out
from warmlink.ep.kernels import steps as _kernels
from warmlink.ep.kernels.call_block import scale_words
from warmlink.ep.kernels.layout import dispatch_layout

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels():
    import triton

    assert triton.knobs.runtime.interpret, "run with TRITON_INTERPRET=1 (test_kernels.py does)"
    numpy_scalars_in_the_interpreter()
    return _kernels._build()


def _routing(seed: int, tokens: int, num_ranks: int, num_experts: int, k: int):
    gen = torch.Generator().manual_seed(seed)
    topk = torch.rand(tokens, num_experts, generator=gen).argsort(1)[:, :k]
    topk[torch.rand(tokens, k, generator=gen) < 0.2] = -1  # masked entries
    return topk


@pytest.mark.parametrize("seed,tokens,num_ranks,num_experts,k", [(0, 37, 4, 16, 3), (1, 1100, 2, 8, 2), (2, 0, 3, 6, 2)])
def test_plan_kernel_equals_torch(kernels, seed, tokens, num_ranks, num_experts, k):
    topk = _routing(seed, tokens, num_ranks, num_experts, k)
    lay = dispatch_layout(topk, num_experts, num_ranks)
    want_rows, want_words = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, 50)
    rows, words = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, 50,
                                kernels=kernels)
    assert torch.equal(rows, want_rows)
    assert torch.equal(words, want_words)
    parts = _kernels.words_layout(num_ranks, num_experts)
    assert words[parts["sent"]].tolist() == lay.num_tokens_per_rank.tolist()
    if tokens:
        assert words[parts["lo"]].min().item() == topk.min().item() and words[parts["hi"]].max().item() == topk.max().item()


@pytest.mark.parametrize("seed,tokens,num_ranks,num_experts,k,dtype,bad", [
    (0, 37, 4, 16, 3, torch.int64, False), (1, 130, 2, 8, 2, torch.int32, True), (2, 0, 3, 6, 2, torch.int64, False),
    (3, 600, 8, 64, 8, torch.int64, True), (4, 9, 3, 9, 1, torch.int32, False)])  # 600: three programs
def test_layout_kernel_equals_torch(kernels, seed, tokens, num_ranks, num_experts, k, dtype, bad):
    """Every output of ``dispatch_layout`` in one launch equals the torch version's: masked ids,
    ids out of range on both sides (counted, routed nowhere), several programs, int32 ids."""
    topk = _routing(seed, tokens, num_ranks, num_experts, k)
    if bad and tokens:
        topk[::5, 0] = num_experts + 3
        topk[1::7, -1] = -4
    topk = topk.to(dtype)
    want = dispatch_layout(topk, num_experts, num_ranks)
    got = dispatch_layout(topk, num_experts, num_ranks, kernels=kernels)
    for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "num_bad_ids"):
        w, g = getattr(want, name), getattr(got, name)
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert (int(got.num_bad_ids) > 0) == (bad and tokens > 0)


def _sources(seed: int, tokens: int, words: int, topk, meta: str, layout: str = "row") -> _kernels.Sources:
    """Random rows and the meta parts ``meta`` names ("ids", "ids+weights", "scales", "all", "none"),
    the scales laid out as ``layout`` says (tests.ep._workers.scales_laid_out)."""
    gen = torch.Generator().manual_seed(seed)
    return _kernels.Sources(
        x=torch.randint(-2**62, 2**62, (tokens, words), generator=gen),
        topk=topk if "ids" in meta or meta == "all" else None,
        weights=torch.rand(tokens, 2, generator=gen) if "weights" in meta or meta == "all" else None,
        scales=scales_laid_out(torch.rand(tokens, 5, generator=gen), layout) if meta in ("scales", "all") else None)


class _Spy:
    """An interpreted kernel that records the arguments of each launch by name, then runs."""

    def __init__(self, jit) -> None:
        self.jit, self.calls = jit, []

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.calls.append(dict(zip(self.jit.arg_names, args)))
            return self.jit[grid](*args, **constexprs)

        return run


def _random_scales(seed: int, tokens: int, columns: int) -> torch.Tensor:
    """Scales as random float32 bit patterns (NaNs included): what arrives must be every bit sent."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), 1 << 31, (tokens, columns), generator=gen).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("layout", ["column", "wider"])
def test_gather_and_push_read_the_callers_scales_through_their_strides(kernels, layout):
    """ep.kernels.steps, Note [Scales in place]: scales laid out column-major (DeepEP's tests) or as a
    view into a wider tensor give meta rows bit-identical to row-major ones, through the torch
    versions and the kernels; each kernel is given the caller's own tensor and its strides."""
    num_ranks, tokens, max_tokens, words, meta_k, meta_bytes = 4, 29, 32, 600, 3, 128
    topk = _routing(12, tokens, num_ranks, 16, 2)
    lay = dispatch_layout(topk, 16, num_ranks)
    rows, _ = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
    x, scales = torch.randint(-2**62, 2**62, (tokens, words)), _random_scales(5, tokens, 23)  # 23: hidden 2880
    row_major = _kernels.Sources(x, topk, scales=scales)
    src = _kernels.Sources(x, topk, scales=scales_laid_out(scales, layout))
    assert not src.scales.is_contiguous() and torch.equal(src.scales.view(torch.int32), scales.view(torch.int32))
    spied = kernels._replace(gather=_Spy(kernels.gather), push=_Spy(kernels.push))
    n = num_ranks * max_tokens
    metas = []
    for source, k in ((row_major, None), (src, None), (src, spied)):
        meta = torch.full((n, meta_bytes), 0xAB, dtype=torch.uint8)
        _kernels.gather(rows, source, torch.zeros(n, words, dtype=torch.int64), meta, meta_k, range(num_ranks),
                        kernels=k)
        metas.append(meta)
    assert torch.equal(metas[1], metas[0]) and torch.equal(metas[2], metas[0])
    shifts = [3, 0, 7, 1]
    pushed = []
    for source in (row_major, src):
        areas = [torch.full((max_tokens + 8, meta_bytes), 0xAB, dtype=torch.uint8) for _ in range(num_ranks)]
        bases = torch.tensor([a.data_ptr() + (shifts[d] - d * max_tokens) * meta_bytes for d, a in enumerate(areas)])
        x_areas = [torch.zeros(max_tokens + 8, words, dtype=torch.int64) for _ in range(num_ranks)]
        x_bases = torch.tensor([a.data_ptr() + (shifts[d] - d * max_tokens) * words * 8 for d, a in enumerate(x_areas)])
        _kernels.push(rows, source, x_bases, bases, meta_k, meta_bytes, kernels=spied)
        pushed.append(areas)
    assert all(torch.equal(a, b) for a, b in zip(*pushed))
    for launch in (spied.gather.calls[0], spied.push.calls[1]):  # no copy: the caller's tensor, read in place
        assert launch["s_ptr"] is src.scales, launch["s_ptr"].stride()
        assert (launch["s_token_stride"], launch["s_col_stride"]) == src.scales.stride()
    assert spied.push.calls[0]["s_ptr"] is scales and (spied.push.calls[0]["s_col_stride"] == 1)


@pytest.mark.parametrize("meta", ["ids+weights", "ids", "scales", "all", "none"])
@pytest.mark.parametrize("dests,shift,skip", [(range(0, 4), 0, -1), (range(2, 3), -5, -1), (range(1, 3), 3, -1),
                                              (range(0, 4), 0, 1)])
def test_gather_kernel_equals_torch(kernels, meta, dests, shift, skip):
    num_ranks, tokens, max_tokens, words, meta_k = 4, 29, 32, 600, 3  # 600 words: two programs per row
    topk = _routing(7, tokens, num_ranks, 16, 2)
    lay = dispatch_layout(topk, 16, num_ranks)
    rows, _ = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
    src = _sources(3, tokens, words, topk, meta)
    meta_bytes = 64
    n = num_ranks * max_tokens + 8  # rows + shift stay in [0, n) for these ranges
    outs = []
    for k in (None, kernels):
        x_out = torch.full((n, words), -7, dtype=torch.int64)
        meta_out = torch.full((n, meta_bytes), 0xAB, dtype=torch.uint8) if src.has_meta else None
        _kernels.gather(rows, src, x_out, meta_out, meta_k, dests, shift=shift, skip=skip, kernels=k)
        outs.append((x_out, meta_out))
    (want_x, want_meta), (x_out, meta_out) = outs
    assert torch.equal(x_out, want_x)
    if src.has_meta:
        assert torch.equal(meta_out, want_meta)
    # and the torch version itself places what it should
    d = dests.start
    t = int(torch.nonzero(rows[:, d] >= 0)[0, 0]) if (rows[:, d] >= 0).any() else None
    if t is not None:
        assert torch.equal(want_x[rows[t, d] + shift], src.x[t])
    untouched = torch.ones(n, dtype=torch.bool)
    for d in (d for d in dests if d != skip):
        untouched[rows[:, d][rows[:, d] >= 0] + shift] = False
    assert (want_x[untouched] == -7).all()


@pytest.mark.parametrize("parts", ["ids+weights", "ids", "scales", "all"])
def test_unpack_kernel_equals_torch(kernels, parts):
    gen = torch.Generator().manual_seed(11)
    total, meta_k, k, num_scales = 45, 4, 3, 6
    meta = torch.randint(0, 256, (total, 80), dtype=torch.uint8, generator=gen)
    ids = meta.view(torch.int64)
    ids[:, :k] = torch.randint(-1, 16, (total, k), generator=gen)
    outs = []
    for kern in (None, kernels):
        idx = torch.full((total, k), 99, dtype=torch.int64) if parts != "scales" else None
        w = torch.full((total, k), 9.0) if "weights" in parts or parts == "all" else None
        scales = torch.full((total, num_scales), 9.0) if parts in ("scales", "all") else None
        _kernels.unpack(meta, meta_k, idx, w, scales, base=4, experts_per_rank=4, kernels=kern)
        outs.append((idx, w, scales))
    for want, got in zip(*outs):
        assert (want is None) == (got is None)
        if want is not None:  # bit-exact: random meta bytes include NaNs
            assert torch.equal(want.view(torch.int32) if want.is_floating_point() else want,
                               got.view(torch.int32) if got.is_floating_point() else got)
    idx = outs[0][0]
    if idx is not None:  # local ids of experts 4..7, -1 for the rest
        raw = ids[:, :k]
        assert torch.equal(idx, torch.where((raw >= 4) & (raw < 8), raw - 4, -1))


def _board(counts: list[list[int]], round_: int, row: int = 9) -> torch.Tensor:
    """A count board of ``round_``: row ``s`` holds the tag, a valid flag and ``counts[s]`` (rows ``s`` sends each rank)."""
    board = torch.full((len(counts), row), 5, dtype=torch.int64)  # stale words past the counts
    board[:, 0], board[:, 1] = round_, 1
    board[:, 2:2 + len(counts)] = torch.tensor(counts)
    return board


@pytest.mark.parametrize("case", ["received", "exactly full", "late source", "refused input",
                                  "a rank over the bound", "nothing received"])
def test_a_padded_unpack_reads_its_rows_received_from_the_board(kernels, case):
    """ep.protocol.normal, Note [Padded dispatch returns at launch]: the unpack learns the rows received on
    the device; rows past them, and every row of a round some rank refused or missed, get id -1
    and weight 0 (their scales are not written)."""
    gen = torch.Generator().manual_seed(13)
    padded_rows, meta_k, k, me, round_ = 40, 4, 3, 1, 7
    counts = {"received": [[3, 9, 2], [1, 4, 0], [0, 12, 5]], "exactly full": [[0, 20, 0], [0, 10, 0], [0, 10, 0]],
              "a rank over the bound": [[41, 1, 0], [0, 1, 0], [0, 1, 0]],
              "nothing received": [[3, 0, 2], [1, 0, 0], [0, 0, 5]]}.get(case, [[3, 9, 2], [1, 4, 0], [0, 12, 5]])
    board = _board(counts, round_)
    if case == "late source":
        board[2, 0] = round_ - 2
    if case == "refused input":
        board[0, 1] = 0
    want_rows = {"received": 25, "exactly full": 40, "nothing received": 0}.get(case, 0)
    meta = torch.randint(0, 256, (padded_rows, 80), dtype=torch.uint8, generator=gen)
    ids = meta.view(torch.int64)
    ids[:, :k] = torch.randint(4, 8, (padded_rows, k), generator=gen)  # every id is this rank's
    meta.view(torch.float32)[:, 2 * meta_k:2 * meta_k + k] = 0.5
    padded = _kernels.Padded(board, round_, me)
    assert padded.received(padded_rows) == want_rows
    outs = []
    for kern in (None, kernels):
        idx, w, scales = torch.full((padded_rows, k), 99), torch.full((padded_rows, k), 9.0), torch.full((padded_rows, 6), 9.0)
        _kernels.unpack(meta, meta_k, idx, w, scales, base=4, experts_per_rank=4, kernels=kern, padded=padded)
        outs.append((idx, w, scales))
    for want, got in zip(*outs):
        assert torch.equal(want, got)
    idx, w, scales = outs[1]
    assert torch.equal(idx[:want_rows], ids[:want_rows, :k] - 4) and (w[:want_rows] == 0.5).all()
    assert (idx[want_rows:] == -1).all() and (w[want_rows:] == 0).all() and (scales[want_rows:] == 9.0).all()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_padded_unpack_of_any_board_equals_its_torch_version_and_pads_a_refused_round_whole(kernels, data):
    """Fuzzed boards (late tags, refused inputs, counts around the bound): the kernel and the torch
    version agree bit for bit, and a round with any late or refused source gives only padding."""
    num_ranks = data.draw(st.integers(1, 5), label="ranks")
    me = data.draw(st.integers(0, num_ranks - 1), label="rank")
    rows, k, round_ = data.draw(st.integers(1, 70), label="padded rows"), 2, 11
    counts = data.draw(st.lists(st.lists(st.integers(0, 30), min_size=num_ranks, max_size=num_ranks),
                                min_size=num_ranks, max_size=num_ranks), label="counts")
    board = _board(counts, round_)
    late = data.draw(st.lists(st.booleans(), min_size=num_ranks, max_size=num_ranks), label="late")
    refused = data.draw(st.lists(st.booleans(), min_size=num_ranks, max_size=num_ranks), label="refused")
    for s, (is_late, is_refused) in enumerate(zip(late, refused)):
        board[s, 0] = round_ - 2 if is_late else round_
        board[s, 1] = 0 if is_refused else 1
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99), label="seed"))
    meta = torch.randint(0, 256, (rows, 48), dtype=torch.uint8, generator=gen)
    meta.view(torch.int64)[:, :k] = torch.randint(-1, 8, (rows, k), generator=gen)
    padded = _kernels.Padded(board, round_, me)
    outs = []
    for kern in (None, kernels):
        idx, w = torch.full((rows, k), 99), torch.full((rows, k), 9.0)
        _kernels.unpack(meta, 2, idx, w, None, base=4, experts_per_rank=4, kernels=kern, padded=padded)
        outs.append((idx, w))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
    if any(late) or any(refused):
        assert padded.received(rows) == 0 and (outs[1][0] == -1).all() and (outs[1][1] == 0).all()


@pytest.mark.parametrize("meta", ["ids+weights", "scales", "all", "none"])
@pytest.mark.parametrize("skip,unsent", [(-1, None), (1, None), (-1, 2)])
def test_push_kernel_stores_what_gather_places_in_each_destination(kernels, meta, skip, unsent):
    """push's per-destination bases (ep.paths.sm_pushes, Note [SM sends]) land every row where a gather
    into that destination's own area, shifted, puts it; a 0 base and ``skip`` leave it untouched."""
    num_ranks, tokens, max_tokens, words, meta_k, meta_bytes = 4, 29, 32, 600, 3, 64
    topk = _routing(5, tokens, num_ranks, 16, 2)
    lay = dispatch_layout(topk, 16, num_ranks)
    rows, _ = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
    src = _sources(4, tokens, words, topk, meta)
    shifts = [3, 0, 7, 1]  # where this rank's rows start in each destination's area
    n = max_tokens + 8
    areas = [(torch.full((n, words), -7, dtype=torch.int64), torch.full((n, meta_bytes), 0xAB, dtype=torch.uint8))
             for _ in range(num_ranks)]
    x_bases = torch.tensor([0 if d == unsent else areas[d][0].data_ptr() + (shifts[d] - d * max_tokens) * words * 8
                            for d in range(num_ranks)], dtype=torch.int64)
    meta_bases = torch.tensor([0 if d == unsent else areas[d][1].data_ptr() + (shifts[d] - d * max_tokens) * meta_bytes
                               for d in range(num_ranks)], dtype=torch.int64)
    _kernels.push(rows, src, x_bases, meta_bases, meta_k, meta_bytes, skip=skip, kernels=kernels)
    for d in range(num_ranks):
        want_x = torch.full((n, words), -7, dtype=torch.int64)
        want_meta = torch.full((n, meta_bytes), 0xAB, dtype=torch.uint8)
        if d not in (skip, unsent):
            _kernels.gather(rows, src, want_x, want_meta if src.has_meta else None, meta_k, range(d, d + 1),
                            shift=shifts[d] - d * max_tokens)
        assert torch.equal(areas[d][0], want_x), d
        assert torch.equal(areas[d][1], want_meta), d


# -- the count exchange (ep.paths.sm_pushes, Note [SM sends]) ---------------------------------------------
@pytest.fixture
def exchange_kernels(kernels, monkeypatch):
    """The kernels with the exchange's PTX helpers (clock, system fence) swapped for Python ones."""
    from warmlink.ep.kernels import programs as _triton

    swap_ptx_helpers(monkeypatch, _triton)
    return kernels


CONFIG = 0x5A11  # the config word of the exchange tests' calls (any fresh call's word is not 0)


def _exchange(kernels, peers: dict, own_valid: bool = True, abort_round: int = 0, timeout_s: float = 0.05):
    """Rank 2 of 4 runs its exchange for round 7 after ``peers`` (rank -> (tag, word, counts):
    word 1 of its row, its config word or 0 for a refused input) posted their rows in its board.
    Returns (boards, x bases, meta bases, the expected own row, the areas, (landing, board copy,
    plan words)): where it landed the round for the host, and the copy its call block named."""
    from warmlink.ep.wire.regions import board_words

    num_ranks, me, round_, num_experts, cap, x_row, meta_row = 4, 2, 7, 16, 50, 256, 64
    row = board_words(num_ranks)
    epr = num_experts // num_ranks
    sent = [3, 5, 0, 4]
    per_expert = list(range(10, 10 + num_experts))
    hi = num_experts - 1 if own_valid else num_experts + 2  # an expert id out of range refuses the input
    words = torch.tensor(sent + sent + per_expert + [-1] * 8 + [hi] * 8, dtype=torch.int64)
    boards = [torch.zeros(num_ranks, row, dtype=torch.int64) for _ in range(num_ranks)]
    recv_x = [1 << 40 | d << 32 for d in range(num_ranks)]  # only their arithmetic matters
    recv_meta = [1 << 41 | d << 32 for d in range(num_ranks)]
    tables = torch.tensor([[b.data_ptr() for b in boards], recv_x, recv_meta, [0] * num_ranks, [0] * num_ranks],
                          dtype=torch.int64)
    for s, (tag, valid, counts) in peers.items():
        boards[me][s, :2 + num_ranks] = torch.tensor([tag, valid] + counts)
    # the programs run one after another here: this rank's own row is in its board before any waits
    own = [round_, CONFIG if own_valid else 0] + sent
    boards[me][me, :2 + num_ranks] = torch.tensor(own)
    abort = torch.tensor([abort_round], dtype=torch.int64)
    shape = _kernels.FreshShape(num_ranks, num_experts, 2, x_row // 8, 0, cap, 2, meta_row, torch.int64, torch.int64,
                                torch.int64, None)
    call = torch.zeros(len(_kernels.CALL_SLOTS), dtype=torch.int64)
    call[_kernels.CALL_SLOTS.index("round")] = round_
    call[_kernels.CALL_SLOTS.index("config")] = CONFIG
    landing = torch.full((_kernels.landing_size(num_ranks, row, num_experts),), -5, dtype=torch.int64)
    landing[:num_ranks] = 0  # (the host zeroes the landed words before the launch)
    board_copy = torch.full((num_ranks, row), -5, dtype=torch.int64)
    call[_kernels.CALL_SLOTS.index("board_copy")] = board_copy.data_ptr()
    _kernels.exchange(shape, call, words, tables, abort.data_ptr(), me, timeout_s, row, landing.data_ptr(),
                      kernels=kernels)
    own_rows = [own + per_expert[d * epr:(d + 1) * epr] for d in range(num_ranks)]
    return (boards, tables[3].tolist(), tables[4].tolist(), own_rows, (recv_x, recv_meta, cap, x_row, meta_row),
            (landing, board_copy, words))


def _assert_landed(boards, landed, me: int = 2, num_ranks: int = 4, num_experts: int = 16) -> None:
    """The exchange landed its board as its wait left it (each row's used words: tag, word 1, the
    counts), in pinned memory and in the call's copy, the plan's words, and every landed word."""
    from warmlink.ep.wire.regions import board_words

    landing, board_copy, words = landed
    row, used = board_words(num_ranks), 2 + num_ranks + num_experts // num_ranks
    host_board = landing[num_ranks:num_ranks + num_ranks * row].view(num_ranks, row)
    assert landing[:num_ranks].tolist() == [1] * num_ranks
    for got in (host_board, board_copy):
        assert torch.equal(got[:, :used], boards[me][:, :used])
        assert (got[:, used:] == -5).all()  # (past the used words: nothing written)
    assert torch.equal(landing[num_ranks + num_ranks * row:], words)


def test_exchange_posts_this_ranks_row_everywhere_and_starts_its_rows_after_the_ranks_below(exchange_kernels):
    peers = {0: (7, CONFIG, [2, 1, 6, 0]), 1: (7, CONFIG, [1, 0, 3, 2]), 3: (7, CONFIG, [4, 4, 4, 4])}
    boards, x_bases, meta_bases, own_rows, (recv_x, recv_meta, cap, x_row, meta_row), landed = _exchange(
        exchange_kernels, peers)
    _assert_landed(boards, landed)
    for d, board in enumerate(boards):  # program d wrote this rank's row into d's board
        assert board[2, :len(own_rows[d])].tolist() == own_rows[d], d
    for d in range(4):  # after the rows of ranks 0 and 1 in d, counted from d's slot (rows[t, d] >= d * cap)
        below = peers[0][2][d] + peers[1][2][d]
        assert x_bases[d] == recv_x[d] + (below - d * cap) * x_row, d
        assert meta_bases[d] == recv_meta[d] + (below - d * cap) * meta_row, d


@pytest.mark.parametrize("fault", ["a peer refused", "a peer called with another config", "this rank refused",
                                   "a peer never posted", "the host aborted"])
def test_exchange_sends_nothing_when_any_rank_refused_or_the_wait_ended(exchange_kernels, fault):
    word = {"a peer refused": 0, "a peer called with another config": CONFIG + 1}.get(fault, CONFIG)
    peers = {0: (7, CONFIG, [2, 1, 6, 0]), 1: (7, word, [1, 0, 3, 2]), 3: (7, CONFIG, [4, 4, 4, 4])}
    if fault in ("a peer never posted", "the host aborted"):
        peers[3] = (5, CONFIG, [9, 9, 9, 9])  # its row of round 5: stale
    aborted = fault == "the host aborted"
    start = CLOCK[0]
    boards, x_bases, meta_bases, own_rows, _, landed = _exchange(
        exchange_kernels, peers, own_valid=fault != "this rank refused", abort_round=7 if aborted else 3,
        timeout_s=10.0 if aborted else 0.05)
    assert x_bases == [0] * 4 and meta_bases == [0] * 4
    _assert_landed(boards, landed)  # (a stale tag or a refusal lands too: the host reads what went wrong)
    if aborted:  # the abort word ended every program's wait at once, long before its 10 s deadline
        assert CLOCK[0] - start < 0.1e9, (CLOCK[0] - start) / 1e9
    for d, board in enumerate(boards):  # its own row still went out, flagged as it was
        assert board[2, :len(own_rows[d])].tolist() == own_rows[d], d
    # a peer's row of the round whose word is not this rank's config reads as refused from now on
    # (the padded unpack and the host read word 1); a stale row of an older round is left as it was
    assert boards[2][1, 1] == (0 if word != CONFIG else CONFIG) and boards[2][3, 1] == CONFIG


# -- the fresh send's call-block kernels (ep.paths.sm_pushes, Note [Fresh send graph]) -----------------------
@pytest.mark.parametrize("meta,dtypes", [("ids+weights", (torch.int64, torch.int64, torch.float32)),
                                         ("all", (torch.int32, torch.int32, torch.bfloat16))])
def test_fresh_send_from_a_call_block_plans_and_pushes_what_the_direct_kernels_do(exchange_kernels, meta, dtypes):
    """``fresh_front`` + ``fresh_push`` read every per-call value from the call block, the way a
    replayed graph does: the same rows, words and landed rows as ``plan`` + ``push`` with the same
    bases. Rank 1 of 3, the peers' counts already posted; a second call with other inputs and a
    later round, through the same block, lands its own rows; its scales are column-major, read
    through the strides in the block (ep.kernels.steps, Note [Scales in place]): the rows they land in
    equal a row-major call's."""
    from warmlink.ep.wire.regions import board_words

    num_ranks, me, num_experts, k, max_tokens, words_per_row, meta_k, meta_bytes = 3, 1, 12, 2, 40, 600, 2, 64
    topk_t, count_t, w_t = dtypes
    row = board_words(num_ranks)
    boards = [torch.zeros(num_ranks, row, dtype=torch.int64) for _ in range(num_ranks)]
    n = max_tokens + 4
    areas = [(torch.zeros(n, words_per_row, dtype=torch.int64), torch.zeros(n, meta_bytes, dtype=torch.uint8))
             for _ in range(num_ranks)]
    tables = torch.tensor([[b.data_ptr() for b in boards], [a[0].data_ptr() for a in areas],
                           [a[1].data_ptr() for a in areas], [0] * num_ranks, [0] * num_ranks], dtype=torch.int64)
    call = torch.zeros(len(_kernels.CALL_SLOTS), dtype=torch.int64)
    plan_words = torch.zeros(_kernels.words_size(num_ranks, num_experts), dtype=torch.int64)
    below = [[3, 0, 5], [2, 4, 1]]  # per call: what ranks 0 (below this one) sends to each destination

    for call_no, (seed, tokens, round_) in enumerate([(11, 23, 5), (12, 17, 6)]):
        topk = _routing(seed, tokens, num_ranks, num_experts, k).to(topk_t).contiguous()
        lay = dispatch_layout(topk.long(), num_experts, num_ranks)
        src = _sources(seed, tokens, words_per_row, topk, meta, layout=("row", "column")[call_no])
        src = _kernels.Sources(src.x, src.topk, src.weights.to(w_t) if src.weights is not None else None, src.scales)
        per_rank, per_expert = lay.num_tokens_per_rank.to(count_t), lay.num_tokens_per_expert.to(count_t)
        for s, counts in ((0, below[call_no]), (2, [0, 0, 0])):
            boards[me][s, :2 + num_ranks] = torch.tensor([round_, CONFIG] + counts)
        boards[me][me, :2] = torch.tensor([round_, CONFIG])  # its own post: the programs run one after another here
        rows = torch.empty(tokens, num_ranks, dtype=torch.int64)
        call[:] = torch.tensor(_kernels.call_words(lay.is_token_in_rank, topk, per_rank, per_expert, rows, src, round_,
                                                   CONFIG))
        if src.scales is not None:  # the caller's own scales, not a copy
            at = _kernels.CALL_SLOTS.index("scales")
            assert call[at:at + 3].tolist() == [src.scales.data_ptr(), *src.scales.stride()]
        shape = _kernels.FreshShape(num_ranks, num_experts, k, words_per_row,
                                    src.scales.shape[1] if src.scales is not None else 0, max_tokens, meta_k, meta_bytes,
                                    topk_t, count_t, count_t, w_t)
        for area in areas:
            area[0].zero_()
            area[1].zero_()
        landing = torch.zeros(_kernels.landing_size(num_ranks, row, num_experts), dtype=torch.int64)
        _kernels.fresh_front(shape, call, plan_words, tables, torch.zeros(1, dtype=torch.int64).data_ptr(), me, 5.0, row,
                             landing.data_ptr(), kernels=exchange_kernels)
        assert landing[:num_ranks].tolist() == [1] * num_ranks
        _kernels.fresh_push(shape, call, tables, kernels=exchange_kernels)

        want_rows, want_words = _kernels.plan(lay.is_token_in_rank, topk.long(), per_rank, per_expert, max_tokens)
        assert torch.equal(rows, want_rows), call_no
        assert torch.equal(plan_words, want_words), call_no
        row_major = _kernels.Sources(src.x, src.topk, src.weights,
                                     src.scales.contiguous() if src.scales is not None else None)
        for d in range(num_ranks):
            want_x = torch.zeros(n, words_per_row, dtype=torch.int64)
            want_meta = torch.zeros(n, meta_bytes, dtype=torch.uint8)
            _kernels.gather(rows, row_major, want_x, want_meta, meta_k, range(d, d + 1),
                            shift=below[call_no][d] - d * max_tokens)
            assert torch.equal(areas[d][0], want_x), (call_no, d)
            assert torch.equal(areas[d][1], want_meta), (call_no, d)


@pytest.mark.parametrize("advance", [False, True], ids=["sm", "streamed"])
def test_take_call_copies_the_block_and_gives_a_streamed_call_its_round(kernels, advance):
    """``take_call``, a fresh send's first step: the call block as the host wrote it into the device
    copy the later steps read; the streamed path's also advances the seq and the round on the
    device and puts the round in the copy (the host's round word is not used)."""
    host_block = torch.arange(100, 100 + len(_kernels.CALL_SLOTS), dtype=torch.int64)
    block = torch.full_like(host_block, -1)
    counters = torch.tensor([6, 40, 0], dtype=torch.int64)
    _kernels.take_call(host_block.data_ptr(), block, counters if advance else None, kernels=kernels)
    want = host_block.clone()
    if advance:
        want[_kernels.CALL_SLOTS.index("round")] = 7
    assert block.tolist() == want.tolist()
    assert counters.tolist() == ([7, 41, 0] if advance else [6, 40, 0])


@pytest.mark.parametrize("meta,layout", [("scales", "row"), ("scales", "column"), ("none", "row")])
def test_a_cached_push_from_a_call_block_with_its_bases_equals_push(kernels, meta, layout):
    """A cached dispatch's graph (ep.paths.sm_pushes, SmPushes.send_sm_cached) reads its rows, x, scales
    (address and strides: row- or column-major), token count and per-destination bases from one
    call block: the same stores as ``push`` of row-major scales with those bases."""
    num_ranks, tokens, max_tokens, words, meta_k, meta_bytes = 3, 21, 30, 600, 3, 64
    topk = _routing(8, tokens, num_ranks, 9, 2)
    lay = dispatch_layout(topk, 9, num_ranks)
    rows, _ = _kernels.plan(lay.is_token_in_rank, topk, lay.num_tokens_per_rank, lay.num_tokens_per_expert, max_tokens)
    src = _sources(9, tokens, words, None, meta, layout)
    n = max_tokens + 6
    shifts = [2, 0, 5]

    def areas_and_bases():
        areas = [(torch.zeros(n, words, dtype=torch.int64), torch.zeros(n, meta_bytes, dtype=torch.uint8))
                 for _ in range(num_ranks)]
        bases = [areas[d][k].data_ptr() + (shifts[d] - d * max_tokens) * size for k, size in ((0, words * 8), (1, meta_bytes))
                 for d in range(num_ranks)]
        return areas, torch.tensor(bases, dtype=torch.int64)

    want, bases = areas_and_bases()
    row_major = _kernels.Sources(src.x, scales=src.scales.contiguous() if src.scales is not None else None)
    _kernels.push(rows, row_major, bases[:num_ranks], bases[num_ranks:], meta_k, meta_bytes, kernels=kernels)
    got, bases = areas_and_bases()
    slots = len(_kernels.CALL_SLOTS)
    call = torch.zeros(slots + 2 * num_ranks, dtype=torch.int64)
    words_of = dict(zip(("scales", "scales_token_stride", "scales_col_stride"), scale_words(src)))
    for name, value in (("rows", rows.data_ptr()), ("x", src.x.data_ptr()), ("tokens", tokens), *words_of.items()):
        call[_kernels.CALL_SLOTS.index(name)] = value
    call[slots:] = bases
    num_scales = src.scales.shape[1] if src.scales is not None else 0
    _kernels.push_from_call(call, call[slots:slots + num_ranks], call[slots + num_ranks:], words, num_ranks, 0, num_scales,
                            meta_k, meta_bytes, None, None, kernels=kernels)
    for d in range(num_ranks):
        assert torch.equal(got[d][0], want[d][0]) and torch.equal(got[d][1], want[d][1]), d
    assert any(bool(a[0].any()) for a in got)  # rows landed


@pytest.mark.parametrize("num_ranks,hidden,dtype", [(3, 1100, torch.bfloat16), (4, 256, torch.float16), (2, 8, torch.float32)])
def test_the_combine_sum_kernel_equals_the_torch_sum(num_ranks, hidden, dtype):
    """The combine's sum (ep.kernels.reduce), with this rank's own copy read where it lies and tokens that
    went nowhere, gives the torch sum (float32 in rank order): exactly, but for the last bit of a
    bfloat16 result."""
    from warmlink.ep.kernels import reduce as _reduce

    gen = torch.Generator().manual_seed(num_ranks * 100 + hidden)
    tokens, area_rows, me = 19, 40, 1
    area = torch.randn(area_rows, hidden, generator=gen).to(dtype)
    own = torch.randn(12, hidden, generator=gen).to(dtype)
    rows = torch.randint(0, area_rows, (tokens, num_ranks), generator=gen)
    rows[torch.rand(tokens, num_ranks, generator=gen) < 0.3] = -1
    rows[3] = -1  # a token that went nowhere
    rows[:, me] = torch.where(rows[:, me] >= 0, torch.randint(0, 10, (tokens,), generator=gen), -1)
    local = (own, me, 2)  # own copy of token t at own[rows[t, me] + 2]
    want, got = torch.empty(tokens, hidden, dtype=dtype), torch.full((tokens, hidden), 7, dtype=dtype)
    _reduce.combine_sum(area, rows, want, local=local, use_triton=False)
    _reduce.combine_sum(area, rows, got, local=local, kernels=_reduce._build())
    if dtype == torch.bfloat16:  # the interpreter rounds float32 to bfloat16 toward zero, CUDA to nearest
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)
    assert not got[3].any()


@pytest.mark.parametrize("num_ranks,parts", [(4, 4), (3, 2), (2, 3)])
def test_the_combine_sum_in_parts_writes_each_token_once_and_equals_the_whole_sum(num_ranks, parts):
    """Summed part by part (ep.kernels.reduce, Note [Pipelined combine]), the kernel writes each token in
    exactly the part that completes its copies, and the parts together give the whole sum."""
    from warmlink.ep.kernels import reduce as _reduce

    gen = torch.Generator().manual_seed(num_ranks * 10 + parts)
    tokens, slot, hidden, me = 23, 30, 256, num_ranks - 1
    goes = torch.rand(tokens, num_ranks, generator=gen) < 0.6
    goes[5] = False  # a token that went nowhere
    # rank d's copies come in source-token order from row d * slot of the area (this rank's own
    # copies are read from ``own``); a row is -1 where the token did not go
    pos = goes.long().cumsum(0) - 1
    counts = goes.sum(0)
    rows = torch.where(goes, pos + torch.arange(num_ranks) * slot, -1)
    area = torch.randn(num_ranks * slot, hidden, generator=gen).to(torch.float16)
    own = torch.randn(tokens + 3, hidden, generator=gen).to(torch.float16)
    local = (own, me, 3 - me * slot)  # own copy of token t at own[rows[t, me] - me * slot + 3]
    want = torch.empty(tokens, hidden, dtype=torch.float16)
    _reduce.combine_sum(area, rows, want, local=local, use_triton=False)
    expect_part = _reduce.token_parts(rows, counts, me, slot, parts)
    assert set(expect_part.tolist()) <= set(range(parts))
    for kernels in (None, _reduce._build()):
        got = torch.full((tokens, hidden), 7, dtype=torch.float16)
        for k in range(parts):
            _reduce.combine_sum(area, rows, got, local=local, counts=counts, slot_rows=slot, part=k, parts=parts,
                                use_triton=False, kernels=kernels)
            done = expect_part <= k
            assert torch.equal(got[done], want[done]), (kernels, k)
            assert (got[~done] == 7).all(), (kernels, k)  # later parts' tokens untouched
    for p in range(parts):  # a token's part is the last part among its peers' copies
        for t in (expect_part == p).nonzero().squeeze(1).tolist():
            peers = [d for d in range(num_ranks) if d != me and goes[t, d]]
            assert max((int(pos[t, d]) * parts // int(counts[d]) for d in peers), default=0) == p


@pytest.mark.parametrize("parts", [1, 3])
def test_a_nan_in_one_copy_stays_in_its_token_in_the_combine_sum_kernel(parts):
    """The kernel reads only the copies a token has (a branch on its row, not a product with a
    mask): NaN and inf in area row 0 and own row 0, where absent copies' indices would land, stay in
    token 0."""
    from warmlink.ep.kernels import reduce as _reduce

    gen = torch.Generator().manual_seed(parts)
    tokens, slot, hidden, num_ranks, me = 11, 12, 256, 3, 2
    goes = torch.rand(tokens, num_ranks, generator=gen) < 0.5
    goes[0] = True
    goes[1] = False
    pos = goes.long().cumsum(0) - 1
    rows = torch.where(goes, pos + torch.arange(num_ranks) * slot, -1)
    area = torch.randn(num_ranks * slot, hidden, generator=gen).to(torch.float16)
    own = torch.randn(tokens, hidden, generator=gen).to(torch.float16)
    local, counts = (own, me, -me * slot), goes.sum(0)
    want = torch.empty(tokens, hidden, dtype=torch.float16)
    _reduce.combine_sum(area, rows, want, local=local, use_triton=False)
    area[0, 3], own[0, 5], area[slot, 7] = float("nan"), float("inf"), float("nan")
    got = torch.full((tokens, hidden), 7, dtype=torch.float16)
    for k in range(parts):
        _reduce.combine_sum(area, rows, got, local=local, counts=counts, slot_rows=slot, part=k, parts=parts,
                            kernels=_reduce._build())
    assert torch.equal(got[1:], want[1:])
    assert not got[1].any()
    assert got[0, 3].isnan() and got[0, 5].isinf() and got[0, 7].isnan()
