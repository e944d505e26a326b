"""Tests for warmlink.refit.plan: every plan is executed by a dense byte-copy reference and compared bit-exactly."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmlink._dtypes import dtype_size
from warmlink._geometry import box_numel, intersect, pad_shape
from warmlink.errors import ConfigError, LayoutError
from warmlink.refit.manifest import Part, Shard, TensorLayout
from warmlink.refit.plan import (
    SCRATCH_ALIGN_BYTES,
    Plan,
    Run,
    StagedPull,
    TensorPlan,
    build_plan,
    gate_up_layout,
    layout_signature,
    qkv_layout,
)

F32, BF16 = "float32", "bfloat16"
TPS = (1, 2, 4)


# -- dense reference executor ----------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def make_globals(specs: dict[str, tuple[tuple[int, ...], str]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random global tensors (random bytes, so every misplaced byte shows) per logical name."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in sorted(specs.items()):
        numel = 1
        for d in shape:
            numel *= d
        raw = torch.randint(0, 256, (numel * dtype_size(dtype),), dtype=torch.uint8, generator=gen)
        out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
    return out


def physical(layout: TensorLayout, globals_: dict[str, torch.Tensor], name_map=None) -> torch.Tensor:
    """A physical tensor built from the globals per its layout (dtype of the globals)."""
    name_map = name_map or {}
    g0 = globals_[name_map.get(layout.parts[0].logical, layout.parts[0].logical)]
    out = torch.zeros(layout.shape, dtype=g0.dtype)
    for p in layout.parts:
        g = globals_[name_map.get(p.logical, p.logical)]
        target = out[tuple(slice(a, b) for a, b in p.local_box())]
        target.copy_(g[tuple(slice(a, b) for a, b in p.shard.bounds)].reshape(target.shape))
    return out


def _covered(layout: TensorLayout) -> torch.Tensor:
    """1 where a part of ``layout`` lies, 0 on padding, per byte."""
    mask = torch.zeros(layout.shape + (dtype_size(layout.dtype),), dtype=torch.int32)
    for p in layout.parts:
        mask[tuple(slice(a, b) for a, b in p.local_box())] = 1
    return mask.reshape(-1)


def execute(plan: Plan, src: dict[tuple[int, str], torch.Tensor], targets=None) -> dict[str, torch.Tensor]:
    """Run the plan with plain byte copies; check every receive byte of a part is written exactly
    once and padding never."""
    out = {}
    covered = {t.name: _covered(TensorLayout(t.name, tp.src_dtype, t.parts, t.shape))
               for t, tp in zip(targets, plan.tensors)} if targets is not None else {}
    for tp in plan.tensors:
        dtype = getattr(torch, tp.src_dtype)
        item = dtype_size(tp.src_dtype)
        recv = torch.zeros(tp.recv_nbytes, dtype=torch.uint8)
        hits = torch.zeros(tp.recv_nbytes, dtype=torch.int32)
        for r in tp.runs:
            sb = _bytes(src[(r.src_rank, r.src_tensor)])
            assert r.num_rows >= 1 and r.row_nbytes > 0 and r.row_nbytes % item == 0
            if r.num_rows == 1:
                assert r.src_pitch == 0 and r.dst_pitch == 0
            else:
                assert r.src_pitch >= r.row_nbytes and r.dst_pitch >= r.row_nbytes
            assert r.src_offset + (r.num_rows - 1) * r.src_pitch + r.row_nbytes <= sb.numel()
            assert r.dst_offset + (r.num_rows - 1) * r.dst_pitch + r.row_nbytes <= recv.numel()
            size = (r.num_rows, r.row_nbytes)
            rows = sb.as_strided(size, (r.src_pitch, 1), r.src_offset)
            recv.as_strided(size, (r.dst_pitch, 1), r.dst_offset).copy_(rows)
            hits.as_strided(size, (r.dst_pitch, 1), r.dst_offset).add_(1)
        scratch = torch.zeros(tp.scratch_nbytes, dtype=torch.uint8)
        recv_el = recv.view(dtype).reshape(tp.dst_shape)
        hits_el = hits.reshape(tuple(tp.dst_shape) + (item,))
        for s in tp.staged:
            sb = _bytes(src[(s.src_rank, s.src_tensor)])
            assert s.src_nbytes == sb.numel() and s.scratch_offset % SCRATCH_ALIGN_BYTES == 0
            assert s.scratch_offset + s.src_nbytes <= tp.scratch_nbytes
            scratch[s.scratch_offset:s.scratch_offset + s.src_nbytes] = sb
            sv = scratch[s.scratch_offset:s.scratch_offset + s.src_nbytes].view(dtype)
            for sbox, dbox in s.local_copies:
                si = tuple(slice(a, b) for a, b in sbox)
                di = tuple(slice(a, b) for a, b in dbox)
                recv_el.view(pad_shape(tp.dst_shape, len(dbox)))[di] = sv.view(pad_shape(s.src_local_shape, len(sbox)))[si]
                hits_el.view(pad_shape(tp.dst_shape, len(dbox)) + (item,))[di] += 1
        want = covered.get(tp.dst)
        if want is None:
            assert bool((hits == 1).all()), f"{tp.dst}: bytes written {hits.unique().tolist()} times"
        else:
            assert torch.equal(hits, want), f"{tp.dst}: bytes written {hits.unique().tolist()} times, padding {want.eq(0).sum()}"
        out[tp.dst] = recv_el
    return out


def check(sources, targets, *, max_runs_per_tensor=64, name_map=None, seed=0) -> Plan:
    """Build, execute and compare bit-exactly; also check the run cap. Returns the plan."""
    specs = {}
    for r, layouts in sources.items():
        for t in layouts:
            for p in t.parts:
                specs[p.logical] = (p.shard.global_shape, t.dtype)
    globals_ = make_globals(specs, seed)
    src = {(r, t.name): physical(t, globals_) for r, ts in sources.items() for t in ts}
    plan = build_plan(sources, targets, max_runs_per_tensor=max_runs_per_tensor, name_map=name_map)
    got = execute(plan, src, targets)
    assert [t.dst for t in plan.tensors] == [t.name for t in targets]
    for t in targets:
        want = physical(t, globals_, name_map)
        assert got[t.name].dtype == want.dtype and got[t.name].shape == want.shape
        assert torch.equal(_bytes(got[t.name]), _bytes(want)), t.name
    for tp in plan.tensors:
        num_srcs = len({(r.src_rank, r.src_tensor) for r in tp.runs} | {(s.src_rank, s.src_tensor) for s in tp.staged})
        assert len(tp.runs) + len(tp.staged) <= max(max_runs_per_tensor, num_srcs)
    return plan


# -- layout builders for the TP matrix -------------------------------------------------------------
def plain(name, shape, split, tp, rank, dtype=F32, logical=None):
    if split is None or tp == 1:
        return TensorLayout.plain(name, dtype, shape, logical=logical)
    return TensorLayout.plain(name, dtype, shape, split, tp, rank, logical=logical)


QKV = dict(num_q_heads=8, num_kv_heads=2, head_dim=2, hidden=6)


def unfused_qkv(tp, rank, dtype=F32):
    q = plain("q_proj", (QKV["num_q_heads"] * QKV["head_dim"], QKV["hidden"]), 0, tp, rank, dtype, "q")
    kv_shape = (QKV["num_kv_heads"] * QKV["head_dim"], QKV["hidden"])
    kvh = QKV["num_kv_heads"]
    kv = Shard.split(kv_shape, 0, kvh, rank * kvh // tp) if tp > kvh else (Shard.split(kv_shape, 0, tp, rank) if tp > 1 else Shard(kv_shape))
    rep = tp > kvh  # each KV head on tp / kvh ranks
    return [q, TensorLayout("k_proj", dtype, (Part("k", kv, replicated=rep),)),
            TensorLayout("v_proj", dtype, (Part("v", kv, replicated=rep),))]


def fused_qkv(tp, rank, dtype=F32):
    return [qkv_layout("qkv_proj", dtype, tp=tp, rank=rank, **QKV)]


def fused_gate_up(tp, rank, dtype=F32):
    return [gate_up_layout("gate_up_proj", dtype, intermediate=12, hidden=5, tp=tp, rank=rank)]


def split_gate_up(tp, rank, dtype=F32):
    return [plain("gate_proj", (12, 5), 0, tp, rank, dtype, "gate"),
            plain("up_proj", (12, 5), 0, tp, rank, dtype, "up")]


KINDS = {
    "column": lambda tp, r: [plain("w", (8, 6), 0, tp, r)],
    "row": lambda tp, r: [plain("w", (6, 8), 1, tp, r, BF16)],
    "replicated": lambda tp, r: [plain("w", (3, 5), None, tp, r)],
    "vocab_embedding": lambda tp, r: [plain("embed", (13, 4), 0, tp, r)],
    "bias_and_norm": lambda tp, r: [plain("bias", (10,), 0, tp, r), plain("norm", (7,), None, tp, r, BF16)],
    "qkv_fused": fused_qkv,
    "qkv_unfused": unfused_qkv,
    "gate_up_fused": fused_gate_up,
    "gate_up_split": split_gate_up,
    "3d_middle": lambda tp, r: [plain("experts", (3, 8, 5), 1, tp, r)],
}
PAIRS = [
    ("column", "column"), ("row", "row"), ("replicated", "replicated"), ("vocab_embedding", "vocab_embedding"),
    ("bias_and_norm", "bias_and_norm"), ("qkv_fused", "qkv_unfused"), ("qkv_unfused", "qkv_fused"),
    ("qkv_fused", "qkv_fused"), ("gate_up_fused", "gate_up_split"), ("gate_up_split", "gate_up_fused"),
    ("3d_middle", "3d_middle"),
]


@pytest.mark.parametrize("src_kind,dst_kind", PAIRS)
@pytest.mark.parametrize("src_tp", TPS)
@pytest.mark.parametrize("dst_tp", TPS)
def test_tp_matrix(src_kind, dst_kind, src_tp, dst_tp):
    sources = {r: KINDS[src_kind](src_tp, r) for r in range(src_tp)}
    for dst_rank in range(dst_tp):
        check(sources, KINDS[dst_kind](dst_tp, dst_rank), seed=dst_rank)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 4), (4, 2), (2, 1), (4, 4)])
@pytest.mark.parametrize("cap", [1, 2, 3])
def test_3d_staged_fallback(src_tp, dst_tp, cap):
    # Split on the middle dim on one side and the last dim on the other: outer rows multiply into runs.
    sources = {r: [plain("experts", (4, 8, 6), 1, src_tp, r)] for r in range(src_tp)}
    for dst_rank in range(dst_tp):
        targets = [plain("experts", (4, 8, 6), 2, dst_tp, dst_rank)]
        plan = check(sources, targets, max_runs_per_tensor=cap)
        if src_tp > 1 and dst_tp > 1:  # otherwise one 2-D run per source suffices
            assert plan.num_staged >= 1 and plan.scratch_nbytes > 0
            assert plan.link_nbytes == sum(t.link_nbytes for t in plan.tensors)
        assert plan.recv_nbytes == targets[0].nbytes  # 6 over 4 ranks is uneven: 2, 2, 1, 1


def test_staged_is_chosen_only_when_needed():
    sources = {r: [plain("x", (4, 8, 6), 1, 2, r)] for r in range(2)}
    targets = [plain("x", (4, 8, 6), 2, 2, 0)]
    direct = check(sources, targets)
    assert direct.num_staged == 0 and direct.num_runs == 8  # 4 outer rows x 2 sources
    staged = check(sources, targets, max_runs_per_tensor=4)
    (tp,) = staged.tensors
    assert len(tp.staged) == 2 and not tp.runs and tp.staged[1].scratch_offset % SCRATCH_ALIGN_BYTES == 0
    assert tp.link_nbytes == 2 * 4 * 4 * 6 * 4  # whole source shards
    partial = check(sources, targets, max_runs_per_tensor=5)
    assert len(partial.tensors[0].staged) == 1 and len(partial.tensors[0].runs) == 4


# -- run counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind", ["column", "row", "replicated", "vocab_embedding", "qkv_fused", "gate_up_fused", "3d_middle"]
)
@pytest.mark.parametrize("tp", TPS)
def test_matched_layout_one_run_per_tensor(kind, tp):
    sources = {r: KINDS[kind](tp, r) for r in range(tp)}
    for rank in range(tp):
        plan = check(sources, KINDS[kind](tp, rank))
        assert all(len(t.runs) == 1 and t.runs[0].num_rows == 1 and not t.staged for t in plan.tensors)
        if kind != "replicated":
            assert {r.src_rank for t in plan.tensors for r in t.runs} == {rank}


def test_fused_on_other_dim_coalesces():
    shard = Shard((4, 3))
    layout = TensorLayout.fused("ab", F32, [("a", shard), ("b", shard)], fuse_dim=1)
    plan = check({0: [layout]}, [layout])
    assert plan.num_runs == 1 and plan.tensors[0].runs[0].row_nbytes == 4 * 6 * 4


def test_column_two_to_one():
    sources = {r: [plain("w", (8, 6), 0, 2, r)] for r in range(2)}
    plan = check(sources, [plain("w", (8, 6), None, 1, 0)])
    runs = plan.tensors[0].runs
    assert [(r.src_rank, r.src_offset, r.dst_offset, r.row_nbytes, r.num_rows) for r in runs] == [
        (0, 0, 0, 96, 1), (1, 0, 96, 96, 1)]


def test_row_two_to_one():
    sources = {r: [plain("w", (6, 8), 1, 2, r)] for r in range(2)}
    plan = check(sources, [plain("w", (6, 8), None, 1, 0)])
    runs = plan.tensors[0].runs
    assert runs == (Run(0, "w", 0, 0, 16, 6, 16, 32), Run(1, "w", 0, 16, 16, 6, 16, 32))
    assert plan.num_runs == 2 and plan.link_nbytes == 6 * 8 * 4


def test_replicated_source_spreads_and_prefers_own_rank():
    sources = {r: [plain(f"n{i}", (5,), None, 1, 0) for i in range(4)] for r in range(4)}
    plan = check(sources, [plain(f"n{i}", (5,), None, 1, 0) for i in range(4)])
    assert [t.runs[0].src_rank for t in plan.tensors] == [0, 1, 2, 3]
    # GQA: receiver TP 4 rank 3 with kv replicated on ranks {2, 3} reads k and v from rank 3 (q's rank).
    sources = {r: fused_qkv(4, r) for r in range(4)}
    plan = check(sources, fused_qkv(4, 3))
    assert plan.num_runs == 1 and plan.tensors[0].runs[0].src_rank == 3


def test_cast_and_name_map():
    sources = {r: [plain("model.w", (8, 4), 0, 2, r, BF16)] for r in range(2)}
    targets = [plain("w_fp32", (8, 4), None, 1, 0, F32, "w")]
    plan = check(sources, targets, name_map={"w": "model.w"})
    (tp,) = plan.tensors
    assert tp.needs_cast and tp.src_dtype == BF16 and tp.dst_dtype == F32 and tp.recv_nbytes == 8 * 4 * 2
    assert not build_plan(sources, [plain("w", (8, 4), 0, 2, 0, BF16, "model.w")]).tensors[0].needs_cast


def test_uneven_split():
    sources = {r: [plain("w", (10, 3), 0, 4, r)] for r in range(4)}
    for dst_tp in (1, 3):
        for rank in range(dst_tp):
            check(sources, [plain("w", (10, 3), 0, dst_tp, rank)])
    sources = {r: [plain("w", (3, 10), 1, 4, r)] for r in range(4)}
    check(sources, [plain("w", (3, 10), 1, 3, 1)])


def test_overlapping_distinct_source_boxes():
    # Rank 0 holds half of w split 2 ways, rank 1 all of it, rank 2 a third of it, each a replica:
    # every element once.
    sources = {0: [plain("w", (6, 4), 0, 2, 1).with_replicated()], 1: [plain("w", (6, 4), None, 1, 0)],
               2: [plain("w", (6, 4), 0, 3, 1).with_replicated()]}
    for tp in (1, 2, 3):
        for rank in range(tp):
            check(sources, [plain("w", (6, 4), 0, tp, rank)])
    sources = {0: [plain("w", (6, 4), 0, 2, 0).with_replicated()],  # left half of the bottom missing
               1: [plain("w", (6, 4), 1, 2, 1).with_replicated()]}
    assert "box=((3, 6), (0, 2))" in _raises("uncovered", sources, [plain("w", (6, 4), None, 1, 0)])


# -- replicas and duplicated shards (Note [Replica choice]) ----------------------------------------
def test_duplicated_shards_are_refused_naming_both_holders():
    # Two ranks built with the same rank= (a launcher bug): one box, two holders, different bytes.
    sources = {r: [plain("w", (8, 6), 0, 2, 0)] for r in range(2)}
    msg = _raises("marked replicated", sources, [plain("w", (8, 6), 0, 2, 0)])
    for needle in ("logical='w'", "box=((0, 4), (0, 6)) is held by rank=0 tensor='w' and by rank=1 tensor='w'",
                   "neither part is marked replicated"):
        assert needle in msg, msg
    # Overlapping distinct boxes: rank 1 holds TP 4 shard 1, inside rank 0's TP 2 shard 0.
    sources = {0: [plain("w", (8, 6), 0, 2, 0)], 1: [plain("w", (8, 6), 0, 4, 1)], 2: [plain("w", (8, 6), 0, 2, 1)]}
    msg = _raises("overlaps", sources, [plain("w", (8, 6), None, 1, 0)])
    assert "box=((0, 4), (0, 6)) of rank=0 tensor='w' overlaps box=((2, 4), (0, 6)) of rank=1 tensor='w'" in msg, msg
    # A replica beside a part that does not say so is refused too, naming the one that does not.
    sources = {0: [plain("w", (8, 6), 0, 2, 0).with_replicated()], 1: [plain("w", (8, 6), 0, 2, 0)]}
    msg = _raises("marked replicated", sources, [plain("w", (8, 6), 0, 2, 0)])
    assert "the part of rank=1 tensor='w' is not marked replicated" in msg, msg
    # Two tensors of one rank, and a whole tensor beside a shard nobody marked.
    sources = {0: [plain("a", (8, 6), 0, 2, 1, logical="w"), plain("b", (8, 6), 0, 2, 1, logical="w")]}
    msg = _raises("marked replicated", sources, [plain("w", (8, 6), 0, 2, 1)])
    assert "rank=0 tensor='a' and by rank=0 tensor='b'" in msg, msg
    sources = {0: [plain("w", (8, 6), None, 1, 0)], 1: [plain("w", (8, 6), 0, 2, 1)]}
    msg = _raises("marked replicated", sources, [plain("w", (8, 6), None, 1, 0)])
    assert "the part of rank=1 tensor='w' is not" in msg, msg


def test_true_replicas_are_accepted():
    # GQA at TP 4 over 2 KV heads: qkv_layout marks k and v, each on two ranks; not at TP 2.
    sources = {r: fused_qkv(4, r) for r in range(4)}
    assert [p.replicated for p in sources[3][0].parts] == [False, True, True]
    assert not any(p.replicated for p in fused_qkv(2, 1)[0].parts)
    check(sources, fused_qkv(1, 0))
    for rank in range(2):
        check(sources, unfused_qkv(2, rank))
    # Whole tensors on every rank are replicas by nature (DDP, norms): no flag needed.
    check({r: [plain("norm", (7,), None, 1, 0)] for r in range(3)}, [plain("norm", (7,), None, 1, 0)])
    # Two data-parallel replicas of TP 2, every part marked: each receiver rank reads one holder.
    sources = {r: [plain("w", (8, 6), 0, 2, r % 2).with_replicated()] for r in range(4)}
    plan = check(sources, [plain("w", (8, 6), None, 1, 0)])
    assert plan.link_nbytes == 8 * 6 * 4


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_overlaps_are_refused_unless_every_holder_is_a_replica(data):
    """Shards that tile the tensor plus random extra boxes, on random ranks, each marked replicated
    or not: the plan is refused exactly when two non-empty boxes intersect and one of them is
    neither marked nor the whole tensor, and otherwise reproduces the tensor exactly."""
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))
    world = data.draw(st.integers(1, 4))
    dim, n = data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(1, 3))
    boxes = [(data.draw(st.integers(0, world - 1)), Shard.split(shape, dim, n, i)) for i in range(n)]
    for _ in range(data.draw(st.integers(0, 2))):
        bounds = []
        for d in shape:
            a = data.draw(st.integers(0, d))
            bounds.append((a, data.draw(st.integers(a, d))))
        boxes.append((data.draw(st.integers(0, world - 1)), Shard(shape, tuple(bounds))))
    sources: dict[int, list] = {r: [] for r in range(world)}
    held = []
    for i, (r, shard) in enumerate(boxes):
        flag = data.draw(st.booleans())
        sources[r].append(TensorLayout(f"t{i}", F32, (Part("w", shard, replicated=flag),)))
        held.append((shard.bounds, flag or shard.bounds == Shard(shape).bounds))
    refused = any(box_numel(a) and box_numel(b) and intersect(a, b) is not None and not (ra and rb)
                  for (a, ra), (b, rb) in itertools.combinations(held, 2))
    targets = [plain("w", shape, None, 1, 0)]
    if refused:
        _raises("marked replicated", sources, targets)
    else:
        check(sources, targets)


def test_scalar_and_empty_tensors():
    check({0: [TensorLayout.plain("s", F32, ())]}, [TensorLayout.plain("s", "float16", ())])
    plan = check({0: [TensorLayout.plain("e", F32, (0, 4))]}, [TensorLayout.plain("e", F32, (0, 4))])
    assert plan.num_runs == 0 and plan.tensors[0].recv_nbytes == 0


# -- rejections ------------------------------------------------------------------------------------
def _raises(match, sources, targets, **kw):
    with pytest.raises(LayoutError, match=match) as info:
        build_plan(sources, targets, **kw)
    assert str(info.value).startswith("build_plan: ")
    return str(info.value)


def test_empty_shards_plan_exactly():
    # torch.chunk gives 6 experts over 4 ranks as [2, 2, 2, 0]; tensor_split gives 3 rows as [1, 1, 1, 0].
    chunked = {r: [TensorLayout("e", F32, (Part("e", Shard.chunk((6, 4), 0, 4, r)),))] for r in range(4)}
    assert chunked[3][0].shape == (0, 4) and chunked[2][0].parts[0].shard.bounds == ((4, 6), (0, 4))
    check(chunked, [plain("e", (6, 4), None, 1, 0)])
    check(chunked, [plain("e", (6, 4), 0, 3, r) for r in range(3)][:1])
    split = {r: [plain("w", (3, 4), 0, 4, r)] for r in range(4)}
    assert split[3][0].shape == (0, 4)
    check(split, [plain("w", (3, 4), None, 1, 0)])
    # An empty destination shard plans to nothing.
    plan = check({0: [plain("w", (3, 4), None, 1, 0)]}, [plain("w", (3, 4), 0, 4, 3)])
    assert plan.tensors[0].runs == () and plan.tensors[0].recv_nbytes == 0
    gate_up_layout("gu", F32, intermediate=2, hidden=4, tp=4, rank=3)  # empty parts are valid


def test_rejects_missing_logical():
    msg = _raises("missing from every publisher", {0: [plain("a", (4,), None, 1, 0)]}, [plain("b", (4,), None, 1, 0)])
    assert "dst tensor='b'" in msg and "logical='b'" in msg and "'a'" in msg


def test_rejects_uncovered_region():
    sources = {0: [plain("w", (8, 6), 0, 4, 0)], 1: [plain("w", (8, 6), 0, 4, 1)], 3: [plain("w", (8, 6), 0, 4, 3)]}
    msg = _raises("uncovered", sources, [plain("w", (8, 6), None, 1, 0)])
    assert "box=((4, 6), (0, 6))" in msg and "dst tensor='w'" in msg and "logical='w'" in msg
    # The part that is covered plans fine.
    check(sources, [plain("w", (8, 6), 0, 2, 0)])


def test_rejects_shape_and_dtype_mismatch():
    sources = {0: [plain("w", (8, 6), 0, 2, 0)], 1: [plain("w", (8, 6), 0, 2, 1)]}
    msg = _raises("global_shape=", sources, [plain("w", (8, 7), None, 1, 0)])
    assert "dst tensor='w'" in msg and "(8, 6)" in msg
    _raises("differs across publishers", {0: [plain("w", (8, 6), 0, 2, 0)], 1: [plain("w", (8, 7), 0, 2, 1)]},
            [plain("w", (8, 6), None, 1, 0)])
    msg = _raises("dtype='bfloat16'", {0: [plain("w", (8, 6), 0, 2, 0)], 1: [plain("w", (8, 6), 0, 2, 1, BF16)]},
                  [plain("w", (8, 6), None, 1, 0)])
    assert "rank=1" in msg and "rank=0" in msg
    mixed = {0: [plain("a", (4, 2), None, 1, 0), plain("b", (4, 2), None, 1, 0, BF16)]}
    fused = TensorLayout.fused("ab", F32, [("a", Shard((4, 2))), ("b", Shard((4, 2)))])
    _raises("one source dtype per destination tensor", mixed, [fused])


def test_rejects_bad_inputs():
    ok = {0: [plain("w", (4,), None, 1, 0)]}
    _raises("rank=-1 out of range", {-1: ok[0]}, ok[0])
    _raises("rank=True out of range", {True: ok[0]}, ok[0])
    _raises("name='w' duplicate", ok, ok[0] * 2)
    _raises("name='w' duplicate", {0: ok[0] * 2}, ok[0])
    _raises("sources=", {}, ok[0])
    _raises("item=", ok, ["w"])
    _raises("name_map", ok, ok[0], name_map={"w": 3})
    with pytest.raises(ConfigError, match="max_runs_per_tensor=0"):
        build_plan(ok, ok[0], max_runs_per_tensor=0)


@pytest.mark.parametrize("kw,match", [
    (dict(num_q_heads=6, num_kv_heads=2, tp=4), "num_q_heads=6 not divisible by tp=4"),
    (dict(num_q_heads=8, num_kv_heads=6, tp=4), "num_kv_heads=6 not divisible by tp=4"),
    (dict(num_q_heads=12, num_kv_heads=3, tp=4), "tp=4 not a multiple of num_kv_heads=3"),
    (dict(num_q_heads=8, num_kv_heads=0, tp=4), "num_kv_heads=0 invalid"),
    (dict(num_q_heads=8, num_kv_heads=2, tp=4, rank=4), "rank=4 out of range"),
])
def test_qkv_layout_rejects_bad_heads(kw, match):
    args = dict(head_dim=2, hidden=4, rank=0) | kw
    with pytest.raises(LayoutError, match=match):
        qkv_layout("qkv", F32, **args)


def test_qkv_layout_shapes():
    t = qkv_layout("qkv", BF16, num_q_heads=8, num_kv_heads=2, head_dim=4, hidden=16, tp=4, rank=3)
    assert t.local_shape == (8 + 4 + 4, 16) and [p.logical for p in t.parts] == ["q", "k", "v"]
    assert t.parts[1].shard.box() == ((4, 8), (0, 16)) and t.parts[0].shard.box() == ((24, 32), (0, 16))
    t = qkv_layout("qkv", BF16, num_q_heads=8, num_kv_heads=8, head_dim=4, hidden=16, tp=2, rank=1,
                   logical=("wq", "wk", "wv"))
    assert t.parts[2].logical == "wv" and t.parts[2].shard.box() == ((16, 32), (0, 16))


# -- property tests --------------------------------------------------------------------------------
@st.composite
def _side(draw, shape, logicals, dtype, prefix):
    """One side: a world size, a sharding per logical, fused or separate physical tensors per rank."""
    world = draw(st.integers(1, 4))
    split = draw(st.sampled_from([None] + list(range(len(shape)))))
    n = 1 if split is None else draw(st.integers(1, min(world, shape[split])))
    fuse = len(logicals) > 1 and draw(st.booleans())
    fuse_dim = draw(st.integers(0, len(shape) - 1)) if fuse else 0
    sides = {}
    rep = n < world  # ranks r hold shard r * n // world: several ranks hold each, replicas
    for r in range(world):
        shard = Shard.split(shape, split, n, r * n // world) if split is not None else Shard(shape)
        if fuse:
            sides[r] = [TensorLayout.fused(f"{prefix}{r}", dtype, [(lg, shard, rep) for lg in logicals], fuse_dim)]
        else:
            sides[r] = [TensorLayout(f"{prefix}{r}.{lg}", dtype, (Part(lg, shard, replicated=rep),)) for lg in logicals]
    return sides


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_layouts_reproduce_exactly(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    logicals = data.draw(st.sampled_from([["a"], ["a", "b"], ["a", "b", "c"]]))
    src_dtype = data.draw(st.sampled_from([F32, BF16, "uint8"]))
    sources = data.draw(_side(shape, logicals, src_dtype, "s"))
    dst = data.draw(_side(shape, logicals, data.draw(st.sampled_from([src_dtype, F32])), "d"))
    targets = [t for r in sorted(dst) for t in dst[r]]  # every receiver shard in one plan
    cap = data.draw(st.sampled_from([1, 2, 3, 64]))
    plan = check(sources, targets, max_runs_per_tensor=cap, seed=data.draw(st.integers(0, 2**16)))
    assert plan.signature == layout_signature(sources, targets, max_runs_per_tensor=cap)


# Builds the same inputs in this process and in a fresh one (no torch needed there).
_SIG_CODE = """
from warmlink.refit.manifest import TensorLayout
from warmlink.refit.plan import layout_signature, qkv_layout
heads = dict(num_q_heads=8, num_kv_heads=2, head_dim=2, hidden=6)
sources = {r: [qkv_layout("qkv_proj", "float32", tp=2, rank=r, **heads),
               TensorLayout.plain("norm", "float32", (6,))] for r in range(2)}
targets = [TensorLayout.plain(n + "_proj", "float32", (d, 6), logical=n) for n, d in (("q", 16), ("k", 4), ("v", 4))]
"""


def _sig_inputs():
    ns: dict = {}
    exec(_SIG_CODE, ns)
    return ns["sources"], ns["targets"]


def test_signature_stable():
    sources, targets = _sig_inputs()
    sig = layout_signature(sources, targets)
    assert len(sig) == 64 and int(sig, 16) >= 0
    assert layout_signature(*_sig_inputs()) == sig
    reordered = {r: list(reversed(sources[r])) for r in reversed(sorted(sources))}
    assert layout_signature(reordered, targets) == sig
    assert build_plan(reordered, targets).signature == sig
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), PYTHONHASHSEED="12345")
    code = _SIG_CODE + "print(layout_signature(sources, targets))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == sig


def test_signature_sensitive():
    sources, targets = _sig_inputs()
    base = layout_signature(sources, targets)
    changed = [
        layout_signature({**sources, 1: fused_qkv(2, 1, BF16) + sources[1][1:]}, targets),  # dtype
        layout_signature({0: sources[0]}, targets),  # rank set
        layout_signature({0: sources[0], 2: sources[1]}, targets),  # rank ids
        layout_signature(sources, targets[:2] + [plain("v_proj", (4, 6), 0, 2, 0, F32, "v")]),  # sharding
        layout_signature(sources, targets[:2] + [plain("v_projX", (4, 6), None, 1, 0, F32, "v")]),  # name
        layout_signature(sources, targets[::-1]),  # target order
        layout_signature({r: s[:1] + [plain("norm", (7,), None, 2, r)] for r, s in sources.items()}, targets),  # shape
        layout_signature(sources, targets, max_runs_per_tensor=8),
        layout_signature(sources, targets, name_map={"x": "y"}),
        layout_signature({r: [s[0].with_replicated()] + s[1:] for r, s in sources.items()}, targets),  # replicas
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_types_are_frozen_slots():
    for cls in (Run, StagedPull, TensorPlan, Plan):
        assert hasattr(cls, "__slots__")
    r = Run(0, "w", 0, 0, 4)
    with pytest.raises(AttributeError):
        r.src_rank = 1  # type: ignore[misc]


@st.composite
def _framework_side(draw, shape, logicals, dtype, prefix):
    """One side as frameworks lay weights out: per rank, boxes cut along ``dim`` with
    ``tensor_split`` or ``torch.chunk`` rows (possibly empty), one box per group when the dim is
    grouped (Megatron's QKV interleaved per query group), fused or one tensor per logical, padded
    past the parts or not. Every rank of a side together holds every element."""
    world = draw(st.integers(1, 4))
    dim = draw(st.integers(0, len(shape) - 1))
    rule = Shard.split if draw(st.booleans()) else Shard.chunk
    n = draw(st.integers(1, world))  # ranks r hold shard r * n // world: every shard held
    groups = draw(st.integers(1, min(3, shape[dim])))
    group_rows = [Shard.split(shape, dim, groups, g).bounds[dim] for g in range(groups)]
    fuse = len(logicals) > 1 and draw(st.booleans())
    pad = draw(st.sampled_from([0, 0, 1, 3]))
    sides = {}
    for r in range(world):
        idx = r * n // world
        boxes = []  # (logical, Shard) in placement order along dim
        for lg in logicals:
            for lo, hi in group_rows:
                inner = list(shape)
                inner[dim] = hi - lo
                a, b = rule(tuple(inner), dim, n, idx).bounds[dim]
                bounds = [(0, d) for d in shape]
                bounds[dim] = (lo + a, lo + b)
                boxes.append((lg, Shard(shape, tuple(bounds)), n < world))  # n < world: replicas

        def padded(parts):
            rows = sum(box[1].local_shape[dim] for box in parts)
            out = [d for d in shape]
            out[dim] = rows + pad
            return tuple(out)

        if fuse:
            sides[r] = [TensorLayout.fused(f"{prefix}{r}", dtype, boxes, dim, shape=padded(boxes))]
        else:
            sides[r] = [TensorLayout.fused(f"{prefix}{r}.{lg}", dtype, [b for b in boxes if b[0] == lg], dim,
                                           shape=padded([b for b in boxes if b[0] == lg]))
                        for lg in logicals]
    return sides


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_framework_layouts_reproduce_exactly(data):
    """Random chunk/split, empty, grouped, fused and padded layouts on both sides plan exactly:
    every element of every part arrives once, padding is never written."""
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    logicals = data.draw(st.sampled_from([["a"], ["a", "b"], ["a", "b", "c"]]))
    src_dtype = data.draw(st.sampled_from([F32, BF16, "uint8"]))
    sources = data.draw(_framework_side(shape, logicals, src_dtype, "s"))
    dst = data.draw(_framework_side(shape, logicals, data.draw(st.sampled_from([src_dtype, F32])), "d"))
    targets = [t for r in sorted(dst) for t in dst[r]]
    cap = data.draw(st.sampled_from([1, 2, 64]))
    check(sources, targets, max_runs_per_tensor=cap, seed=data.draw(st.integers(0, 2**16)))


def test_squeezed_expert_tensors_plan_exactly():
    """Megatron keeps one 2-D tensor per local expert of a 3-D logical ``[E, 2I, H]``: parts with a
    squeezed leading dim. Into vLLM-style stacked ``[E_local, 2I/tp, H]`` and back."""
    E, I2, H = 4, 6, 3
    shape = (E, I2, H)
    per_expert = {0: [TensorLayout(f"e{e}", F32, (Part("w", Shard(shape, ((e, e + 1), (0, I2), (0, H))), (0, 0)),))
                      for e in range(E)]}
    stacked = [TensorLayout.fused(f"w13.{r}", F32, [("w", Shard.split(shape, 1, 2, r))], 1) for r in range(2)]
    check(per_expert, stacked)
    check({r: [t] for r, t in enumerate(stacked)}, per_expert[0])
    assert per_expert[0][1].shape == (I2, H)
