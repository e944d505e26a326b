"""Transposed parts (Note [Transposed parts] in warmlink.refit.manifest): their rules, plans that pull
through scratch and permute in the translate step, and vLLM's GPT-OSS layout received bit-exactly
over shm from a TP-2 trainer (Note [vLLM GPT-OSS]).

Plans are executed here by byte copies for the runs and the real ``translate.unstage`` for the
local step; expectations are built with plain torch (``permute``), never from the plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmlink._dtypes import dtype_size
from warmlink.errors import LayoutError
from warmlink.refit import Publisher, Receiver, translate
from warmlink.refit.manifest import Part, Shard, TensorLayout
from warmlink.refit.plan import build_plan, layout_signature

transformers = pytest.importorskip("transformers")

from _harness import TIMEOUT_S, new_store, refit_layouts, zeros_like_layout  # noqa: E402
from _references import ref_hf, ref_vllm  # noqa: E402
from test_families import check, config, model, state, world  # noqa: E402

from warmlink.refit.families import layouts  # noqa: E402

F32, BF16 = "float32", "bfloat16"


def _slices(box):
    return tuple(slice(a, b) for a, b in box)


def expected(layout: TensorLayout, globals_: dict) -> torch.Tensor:
    """The physical tensor ``layout`` describes, with plain torch: each box, squeezed, permuted."""
    out = torch.zeros(layout.shape, dtype=next(iter(globals_.values())).dtype)
    for p in layout.parts:
        box = globals_[p.logical][_slices(p.shard.bounds)]
        box = box.reshape(box.shape[len(box.shape) - len(p.offset):])
        out[_slices(p.local_box())] = box.permute(p.perm) if p.perm else box
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copy_run(dst: torch.Tensor, dst_base: int, src: torch.Tensor, r) -> None:
    size = (r.num_rows, r.row_nbytes)
    rows = src.as_strided(size, (r.src_pitch or r.row_nbytes, 1), r.src_offset)
    dst.as_strided(size, (r.dst_pitch or r.row_nbytes, 1), dst_base + r.dst_offset).copy_(rows)


def execute(plan, src: dict) -> dict[str, torch.Tensor]:
    """Run ``plan``: runs and staged pulls as byte copies, then the real ``translate.unstage``."""
    out = {}
    for tp in plan.tensors:
        recv = torch.zeros(tp.recv_nbytes, dtype=torch.uint8)
        for r in tp.runs:
            _copy_run(recv, 0, _bytes(src[(r.src_rank, r.src_tensor)]), r)
        scratch = torch.zeros(max(tp.scratch_nbytes, 1), dtype=torch.uint8)
        for s in tp.staged:
            sb = _bytes(src[(s.src_rank, s.src_tensor)])
            if s.runs:
                assert sum(r.nbytes for r in s.runs) == s.src_nbytes
                for r in s.runs:
                    _copy_run(scratch, s.scratch_offset, sb, r)
            else:
                assert s.src_nbytes == sb.numel()
                scratch[s.scratch_offset:s.scratch_offset + s.src_nbytes] = sb
        view = recv.view(getattr(torch, tp.src_dtype)).reshape(tp.dst_shape)
        translate.unstage(tp, view, scratch)
        out[tp.dst] = view
    return out


def _globals(specs: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen).to(getattr(torch, dt)) for n, (shape, dt) in sorted(specs.items())}


def _run(sources: dict, targets: list, **kw):
    specs = {p.logical: (p.shard.global_shape, t.dtype) for ts in sources.values() for t in ts for p in t.parts}
    g = _globals(specs)
    src = {(r, t.name): expected(t, g) for r, ts in sources.items() for t in ts}
    plan = build_plan(sources, targets, **kw)
    got = execute(plan, src)
    for t in targets:
        assert torch.equal(got[t.name], expected(t, g)), t.name
    return plan


# -- the layout rules --------------------------------------------------------------------------------
def test_a_transposed_part_places_its_box_permuted():
    g = (4, 6, 10)
    lay = TensorLayout("w", F32, (Part("x", Shard(g, ((0, 4), (0, 6), (2, 6))), None, (0, 2, 1)),))
    assert lay.shape == (4, 4, 6) and lay.transposed
    assert lay.parts[0].local_box() == ((0, 4), (0, 4), (0, 6))
    # the identity is no transposition: one layout, one value
    same = TensorLayout("w", F32, (Part("x", Shard(g), (0, 0, 0), (0, 1, 2)),))
    assert same == TensorLayout.plain("w", F32, g, logical="x") and not same.transposed
    with pytest.raises(LayoutError, match=r"'w': perm=\(0, 2\) invalid; expected a permutation of range\(3\)"):
        TensorLayout("w", F32, (Part("x", Shard(g), None, (0, 2)),))
    with pytest.raises(LayoutError, match=r"offset\[2\]=0 \+ extent 6 exceeds shape\[2\]=4"):
        TensorLayout("w", F32, (Part("x", Shard(g, ((0, 4), (0, 6), (2, 6))), (0, 0, 0), (0, 2, 1)),), (4, 6, 4))
    with pytest.raises(LayoutError, match=r"overlap in the physical tensor"):  # extents checked in perm order
        TensorLayout("w", F32, (Part("x", Shard((4, 1)), (0, 0), (1, 0)), Part("y", Shard((1, 3)), (0, 1))), (4, 4))


def test_transposed_parts_are_receiver_only():
    g = (4, 6, 10)
    lay = TensorLayout("w", F32, (Part("x", Shard(g), None, (0, 2, 1)),))
    with pytest.raises(LayoutError, match=r"'w': part of logical='x' has perm=\(0, 2, 1\); expected no transposed part"):
        lay.to_json()
    with pytest.raises(LayoutError, match=r"logical='x' in rank=0 tensor='w' is transposed"):
        build_plan({0: [lay]}, [TensorLayout.plain("x", F32, g)])
    with new_store() as store:
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
        try:
            with pytest.raises(LayoutError, match=r"Publisher.add: layout 'w' holds logical='x' transposed"):
                pub.add("w", torch.zeros(4, 10, 6), lay)
            m = model("gpt_oss")
            with pytest.raises(LayoutError, match=r"Publisher.add_module: layout '.*w13_weight' holds .* transposed"):
                pub.add_module(m, layouts(m, convention="vllm"))
            assert not pub.layouts()  # refused before anything was declared
        finally:
            pub.close()


def test_the_signature_sees_perm():
    g = (3, 5)
    src = {0: [TensorLayout.plain("x", F32, g)]}
    plain = TensorLayout("t", F32, (Part("x", Shard(g), (0, 0)),), (5, 5))
    moved = TensorLayout("t", F32, (Part("x", Shard(g), (0, 0), (1, 0)),), (5, 5))
    assert layout_signature(src, [plain]) != layout_signature(src, [moved])


# -- plans -------------------------------------------------------------------------------------------
def test_a_transposed_box_is_pulled_compactly_and_permuted_into_place():
    """GPT-OSS's w13 at TP 2: columns 2a:2b of [E, H, 2I], held as [E, 2I/2, H]. The box is one
    strided run of the source; nothing else moves."""
    g = (4, 8, 12)
    src = {0: [TensorLayout.plain("gate_up", BF16, g)]}
    for r in range(2):
        dst = TensorLayout("w13", BF16, (Part("gate_up", Shard(g, ((0, 4), (0, 8), (6 * r, 6 * r + 6))), None, (0, 2, 1)),))
        tp = _run(src, [dst]).tensors[0]
        assert not tp.runs and len(tp.staged) == 1
        sp = tp.staged[0]
        assert sp.dst_perm == (0, 2, 1) and len(sp.runs) == 1 and sp.runs[0].num_rows == 32
        assert tp.link_nbytes == dst.nbytes == 4 * 8 * 6 * dtype_size(BF16)


def test_a_transposed_box_from_several_sources():
    """Sources split along the hidden dim (as a TP trainer might): each source's piece of the box is
    gathered on its own and permuted into its place."""
    g = (4, 8, 12)
    src = {r: [TensorLayout.plain("gate_up", F32, g, 1, 2, r)] for r in range(2)}
    dst = TensorLayout("w13", F32, (Part("gate_up", Shard(g, ((0, 4), (0, 8), (3, 9))), None, (0, 2, 1)),))
    tp = _run(src, [dst]).tensors[0]
    assert sorted(s.src_rank for s in tp.staged) == [0, 1] and tp.link_nbytes == dst.nbytes


def test_a_tensor_with_plain_and_transposed_parts():
    """``[a | b^T]``: the plain part by runs, the transposed one through scratch."""
    a, b = (6, 4), (3, 6)
    dst = TensorLayout("t", F32, (Part("a", Shard(a), (0, 0)), Part("b", Shard(b), (0, 4), (1, 0))), (6, 8))
    plan = _run({0: [TensorLayout.plain("a", F32, a), TensorLayout.plain("b", F32, b)]}, [dst])
    tp = plan.tensors[0]
    assert tp.runs and [s.dst_perm for s in tp.staged] == [(1, 0)]


def test_a_transposed_part_with_squeezed_dims_and_padding():
    """One expert of [E, I, H] held as a padded [H + 2, I] matrix (squeezed expert dim, transposed)."""
    g = (3, 5, 7)
    dst = TensorLayout("e1", F32, (Part("down", Shard(g, ((1, 2), (0, 5), (0, 7))), (1, 0), (1, 0)),), (9, 5))
    assert dst.is_padded
    tp = _run({0: [TensorLayout.plain("down", F32, g)]}, [dst]).tensors[0]
    assert tp.padded and tp.staged[0].dst_perm == (1, 0)


def test_past_the_run_cap_the_whole_source_tensor_is_staged():
    """A box needing more runs than the cap comes as one copy of the whole source tensor."""
    g = (4, 8, 12)
    box = ((0, 4), (2, 6), (3, 9))  # 4 x 4 rows of 6: 4 runs of 4 rows each
    dst = TensorLayout("w", F32, (Part("x", Shard(g, box), None, (2, 1, 0)),))
    src = {0: [TensorLayout.plain("x", F32, g)]}
    compact = _run(src, [dst]).tensors[0]
    assert len(compact.staged[0].runs) == 4 and compact.link_nbytes == dst.nbytes
    whole = _run(src, [dst], max_runs_per_tensor=2).tensors[0]
    assert whole.staged[0].runs == () and whole.link_nbytes == src[0][0].nbytes


@st.composite
def _transposed_case(draw):
    """A 3-D logical tensor split along one dim over 1-3 sources; a destination holding a random box
    of it transposed by a random perm, squeezing a leading extent-1 dim or not, padded or not."""
    shape = tuple(draw(st.integers(1, 5)) for _ in range(3))
    dim, num = draw(st.integers(0, 2)), draw(st.integers(1, 3))
    sources = {r: [TensorLayout.plain(f"s{r}", F32, shape, dim, num, r, logical="x")] for r in range(num)}
    bounds = []
    for d in shape:
        a = draw(st.integers(0, d - 1))
        bounds.append((a, draw(st.integers(a + 1, d))))
    squeeze = bounds[0][1] - bounds[0][0] == 1 and draw(st.booleans())
    ndim = 2 if squeeze else 3
    perm = tuple(draw(st.permutations(range(ndim))))
    extents = [b - a for a, b in bounds[3 - ndim:]]
    placed = [extents[p] for p in perm]
    offset = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    pad = tuple(o + e + draw(st.integers(0, 1)) for o, e in zip(offset, placed))
    dst = TensorLayout("t", F32, (Part("x", Shard(shape, tuple(bounds)), offset, perm),), pad)
    return sources, dst, draw(st.integers(1, 8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_transposed_case())
def test_random_transposed_parts_reproduce_exactly(case):
    sources, dst, cap = case
    _run(sources, [dst], max_runs_per_tensor=cap)


def test_a_cast_after_the_permute():
    g = (2, 3, 4)
    dst = TensorLayout("w", F32, (Part("x", Shard(g), None, (0, 2, 1)),))
    plan = build_plan({0: [TensorLayout.plain("x", BF16, g)]}, [dst])
    assert plan.tensors[0].needs_cast and plan.tensors[0].staged[0].dst_perm == (0, 2, 1)


# -- GPT-OSS in vLLM's layout, over shm --------------------------------------------------------------
def _sources(tp: int, ep: int, sd: dict) -> dict:
    """The hf convention's ranks at ``tp`` / ``ep``: rank -> name -> (tensor, layout)."""
    m = model("gpt_oss")
    out = {}
    for i, (r, er) in enumerate(world(tp, ep)):
        lays = layouts(m, convention="hf", tp=tp, rank=r, ep=ep, ep_rank=er)
        ref = ref_hf(config("gpt_oss"), sd, tp, r, ep, er)
        check(lays, ref, ref, f"gpt_oss hf source tp={tp} ep={ep} rank {i}")
        out[i] = {n: (ref[n].clone(), lay) for n, lay in lays.items()}
    return out


RECEIVERS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, ep): vLLM TP 1, TP 2, EP 2, TP 2 with EP 2


@pytest.mark.parametrize(("src_tp", "src_ep"), [(2, 1), (1, 2)], ids=["trainer_tp2", "trainer_ep2"])
def test_gpt_oss_trainer_to_vllm_bit_exact(src_tp, src_ep):
    """Must hold: GPT-OSS TP 2 -> vLLM TP 1 and 2 bit-exact (and EP 2, and TP 2 with EP 2), two
    versions through the real Publisher and Receiver; the second changes every source tensor."""
    m, cfg = model("gpt_oss"), config("gpt_oss")
    sd = state(m)
    sources = _sources(src_tp, src_ep, sd)
    specs = [(tp, ep, r, er) for tp, ep in RECEIVERS for r, er in world(tp, ep)]
    recv = [layouts(m, convention="vllm", tp=tp, rank=r, ep=ep, ep_rank=er) for tp, ep, r, er in specs]

    def step(version):
        for tensors in sources.values():
            for t, _ in tensors.values():
                t.add_(1)

    got = refit_layouts(sources, recv, versions=2, step=step)
    for version, want_sd in ((1, sd), (2, {n: t + 1 for n, t in sd.items()})):
        for (tp, ep, r, er), lays, g in zip(specs, recv, got[version - 1]):
            check(lays, g, ref_vllm(cfg, want_sd, tp, r, ep, er), f"gpt_oss v{version} -> vllm tp={tp} ep={ep} rank {r}/{er}")


def test_gpt_oss_vllm_plans_pull_only_the_experts_boxes():
    """Experts reach a vLLM TP-2 rank as compact boxes, permuted locally: no byte it does not hold."""
    m = model("gpt_oss")
    sources = {r: list(layouts(m, convention="hf", tp=2, rank=r).values()) for r in range(2)}
    for r in range(2):
        targets = list(layouts(m, convention="vllm", tp=2, rank=r).values())
        plan = build_plan(sources, targets)
        for lay, tp in zip(targets, plan.tensors):
            if lay.transposed:
                assert not tp.runs and {s.dst_perm for s in tp.staged} == {(0, 2, 1)}, lay.name
                assert all(s.runs for s in tp.staged) and tp.link_nbytes == lay.nbytes, lay.name


def test_gpt_oss_hidden_split_trainer_and_a_float32_receiver():
    """Experts split along the hidden dim across two trainer ranks (each vLLM box then needs both)
    into a float32 vLLM TP-2 receiver: pulled in bfloat16, permuted, then cast."""
    m, cfg = model("gpt_oss"), config("gpt_oss")
    sd = {n: t for n, t in state(m).items() if ".mlp.experts." in n}
    hidden = {"gate_up_proj": 1, "down_proj": 2, "down_proj_bias": 1}  # gate_up_proj_bias [E, 2I] has none: whole
    sources = {}
    for r in range(2):
        sources[r] = {}
        for n, x in sd.items():
            dim = hidden.get(n.rpartition(".")[2])
            if dim is None:
                sources[r][n] = (x.clone(), TensorLayout.plain(n, BF16, x.shape))
            else:
                sources[r][n] = (x.chunk(2, dim)[r].clone(), TensorLayout.plain(n, BF16, x.shape, dim, 2, r))
    for r in range(2):
        lays = {n: lay for n, lay in layouts(m, convention="vllm", tp=2, rank=r, dtype=F32).items()
                if ".routed_experts." in n}
        got = refit_layouts(sources, [lays])[0][0]
        ref = ref_vllm(cfg, sd, 2, r)
        check(lays, got, {n: t.float() for n, t in ref.items()}, f"gpt_oss hidden-split -> vllm tp=2 rank {r}")


def test_gpt_oss_streamed_to_a_loader():
    """``Receiver.stream`` (an engine loading through ``load_weights``) hands the permuted tensors."""
    m, cfg = model("gpt_oss"), config("gpt_oss")
    sd = state(m)
    sources = _sources(2, 1, sd)
    with new_store() as store:
        pubs, recs = [], []
        try:
            for rank, tensors in sources.items():
                pub = Publisher(store, rank=rank, world_size=len(sources), backend="shm", timeout_s=TIMEOUT_S)
                pubs.append(pub)
                for name, (tensor, lay) in tensors.items():
                    pub.add(name, tensor, lay)
                pub.export()
            for r in range(2):
                lays = layouts(m, convention="vllm", tp=2, rank=r)
                rec = Receiver(store, num_publishers=len(sources), backend="shm", timeout_s=TIMEOUT_S)
                recs.append(rec)
                for n, lay in lays.items():
                    rec.add(n, lay)
                handed = {}

                def load_weights(weights, handed=handed):
                    for n, t in weights:
                        handed[n] = t.clone()

                rec.stream(load_weights, buffer_bytes=1 << 20)
                check(lays, handed, ref_vllm(cfg, sd, 2, r), f"gpt_oss streamed -> vllm tp=2 rank {r}")
                assert all(zeros_like_layout(lay).shape == handed[n].shape for n, lay in lays.items())
        finally:
            for rec in recs:
                rec.close()
            for pub in pubs:
                pub.close()
