"""Rules of warmlink.refit.families' hf and vllm conventions without moving bytes: every layout tiles
its logical tensors, sizes a convention cannot shard are refused by name, and the hf convention
agrees with transformers' own plan resolution and parallel styles."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_families import FAMILIES, MOE, config, conventions, world  # noqa: E402

from warmlink.errors import LayoutError  # noqa: E402
from warmlink.refit.families import layouts, logical_model  # noqa: E402
from warmlink.refit.families._model import ROLES  # noqa: E402
from warmlink.refit.families import hf as fam_hf  # noqa: E402


@lru_cache(maxsize=None)
def meta(family: str, **overrides):
    """The transformers model of ``family`` on the meta device (names and shapes only)."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config(family, **overrides))


def assert_tiles(m, conv: str, tp: int, ep: int = 1) -> None:
    """Across the ranks of ``conv`` at ``tp`` / ``ep``, the distinct boxes of every logical tensor
    cover each of its elements exactly once (replicas hold equal boxes; padding is in no box), and
    a box is marked replicated exactly where several ranks hold it (Note [Replicated parts]; whole
    tensors need no flag)."""
    shapes = {t.name: t.shape for t in logical_model(m).tensors}
    boxes: dict[str, set] = {}
    flags: dict[tuple, list[bool]] = {}
    for r, er in world(tp, ep):
        for lay in layouts(m, convention=conv, tp=tp, rank=r, ep=ep, ep_rank=er).values():
            for p in lay.parts:
                boxes.setdefault(p.logical, set()).add(p.shard.bounds)
                if p.shard.numel and p.shard.bounds != tuple((0, d) for d in p.shard.global_shape):
                    flags.setdefault((p.logical, p.shard.bounds), []).append(p.replicated)
    for (name, bounds), held in flags.items():
        want = [len(held) > 1] * len(held)
        assert held == want, f"{conv} tp={tp} ep={ep}: {name}{list(bounds)} held {len(held)} times, replicated={held}"
    assert set(boxes) == set(shapes), f"{conv} tp={tp} ep={ep}: held {sorted(set(boxes) ^ set(shapes))}"
    for name, shape in shapes.items():
        count = torch.zeros(shape, dtype=torch.int32)
        for bounds in boxes[name]:
            count[tuple(slice(a, b) for a, b in bounds)] += 1
        assert bool((count == 1).all()), f"{conv} tp={tp} ep={ep}: {name} covered {count.min()}..{count.max()} times"


def test_families_exercise_every_role():
    seen = {t.role for f in FAMILIES for t in logical_model(meta(f)).tensors}
    assert set(ROLES) <= seen, f"roles no family config holds: {sorted(set(ROLES) - seen)}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp_layouts_tile(family):
    for conv in conventions(family):
        for tp in (1, 2, 4, 8):
            assert_tiles(meta(family), conv, tp)


@pytest.mark.parametrize("family", MOE)
def test_ep_layouts_tile(family):
    for conv in conventions(family):
        for tp, ep in ((1, 2), (2, 2), (1, 4), (2, 4), (4, 4)):
            assert_tiles(meta(family), conv, tp, ep)


def test_vllm_uneven_experts_tile_and_hf_refuses():
    """vLLM's linear placement gives 6 experts over 4 ranks as [2, 2, 1, 1]; transformers refuses."""
    m = meta("deepseek_v3", n_routed_experts=6)
    assert_tiles(m, "vllm", 1, 4)
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    shapes = [layouts(m, convention="vllm", ep=4, ep_rank=er)[w13].shape for er in range(4)]
    assert [s[0] for s in shapes] == [2, 2, 1, 1]
    with pytest.raises(LayoutError, match=r"num_experts=6 is not divisible by ep=4"):
        layouts(m, convention="hf", ep=4, ep_rank=0)


def test_vllm_vocab_padding_and_empty_rank():
    """vocab 100 pads to 128; at tp=8 rank 7 holds rows 112.. of which none is real: all padding."""
    lays = [layouts(meta("llama"), convention="vllm", tp=8, rank=r)["lm_head.weight"] for r in range(8)]
    assert all(lay.shape == (16, 64) for lay in lays)
    assert [lay.parts[0].shard.bounds[0] for lay in lays] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80),
                                                              (80, 96), (96, 100), (100, 100)]
    assert lays[6].is_padded and lays[7].covered_numel == 0


def test_vllm_deepseek_tied_head_is_its_own_tensor():
    """DeepseekV2ForCausalLM never ties its ParallelLMHead: a tied model's head holds the embedding."""
    m = meta("deepseek_v3", tie_word_embeddings=True)
    lays = layouts(m, convention="vllm", tp=2, rank=1)
    head, embed = lays["lm_head.weight"], lays["model.embed_tokens.weight"]
    assert [p.logical for p in head.parts] == ["model.embed_tokens.weight"]
    assert (head.parts, head.shape) == (embed.parts, embed.shape)
    assert "lm_head.weight" not in layouts(meta("llama", tie_word_embeddings=True), convention="vllm")


# -- refusals -------------------------------------------------------------------------------------
def test_unknown_parameter_is_refused_by_name():
    m = transformers.AutoModelForCausalLM.from_config(config("llama"))
    m.model.layers[1].register_parameter("mystery", torch.nn.Parameter(torch.zeros(3)))
    for conv in ("hf", "vllm"):
        with pytest.raises(LayoutError, match=r"'model\.layers\.1\.mystery'.*declare it by hand"):
            layouts(m, convention=conv)


def test_unknown_convention_and_options_are_refused():
    with pytest.raises(LayoutError, match=r"convention='sglang' is unknown"):
        layouts(meta("llama"), convention="sglang")
    for conv in ("hf", "vllm"):
        with pytest.raises(LayoutError, match=r"options \['fused'\] unknown"):
            layouts(meta("llama"), convention=conv, fused=True)


@pytest.mark.parametrize(("family", "overrides", "kw", "message"), [
    ("gpt_oss", dict(num_local_experts=6), dict(ep=4, ep_rank=0), r"num_local_experts=6 is not divisible by ep=4"),
    ("llama", {}, dict(tp=3, rank=0), r"padded vocab_size=128 is not divisible by tp=3"),
    ("llama", {}, dict(tp=16, rank=0), r"num_attention_heads=8 is not divisible by tp=16"),
    ("llama", dict(num_key_value_heads=4), dict(tp=8, rank=0), None),  # each KV head on 2 ranks: fine
    ("llama", dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=3), dict(tp=4, rank=0),
     r"tp=4 is not divisible by num_key_value_heads=3"),
    ("llama", dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6), dict(tp=4, rank=0),
     r"num_key_value_heads=6 is not divisible by tp=4"),
    ("llama", dict(intermediate_size=60), dict(tp=8, rank=0), r"intermediate_size=60 is not divisible by tp=8"),
    ("qwen3_moe", {}, dict(tp=2, rank=1, ep=2, ep_rank=0), r"ep_rank = dp_rank \* tp \+ rank"),
    ("qwen3", dict(attention_bias=True), {}, r"o_proj without a bias"),
    ("gemma2", dict(tie_word_embeddings=False), {}, r"has no lm_head"),
    ("olmo2", {}, {}, r"model_type='olmo2' has no vLLM description"),  # its q_norm is TP-sharded in vLLM
])
def test_vllm_refuses(family, overrides, kw, message):
    if family == "olmo2":
        cfg = transformers.AutoConfig.for_model("olmo2", hidden_size=64, num_attention_heads=8, num_hidden_layers=1,
                                                vocab_size=100, intermediate_size=32)
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(cfg)
    else:
        m = meta(family, **overrides)
    if message is None:
        assert layouts(m, convention="vllm", **kw)
        return
    with pytest.raises(LayoutError, match=message):
        layouts(m, convention="vllm", **kw)


@pytest.mark.parametrize(("family", "kw", "message"), [
    ("qwen3_moe", dict(tp=2, rank=0, ep=3, ep_rank=0), r"ep=3 is not a multiple of tp=2"),
    ("llama", dict(ep=2, ep_rank=0), r"ep=2 but 'llama' has no ep_plan"),
])
def test_hf_refuses(family, kw, message):
    with pytest.raises(LayoutError, match=message):
        layouts(meta(family), convention="hf", **kw)


def test_hf_shards_unevenly_as_torch_chunk():
    """transformers refuses no uneven split: vocab 100 over 8 ranks is torch.chunk's 13 x 7 + 9."""
    lays = [layouts(meta("llama"), convention="hf", tp=8, rank=r) for r in range(8)]
    rows = [lay["model.embed_tokens.weight"].shape[0] for lay in lays]
    assert rows == [len(c) for c in torch.arange(100).chunk(8)]


# -- the hf convention against transformers itself ------------------------------------------------
def _as_tuple(placement, ndim):
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if placement is None or placement.is_replicate():
        return None
    if not -ndim <= placement.dim < ndim:
        return "no such dim"  # e.g. embedding_colwise on a vector: no parameter of that style has it
    if isinstance(placement, _StridedShard):
        return ("strided", placement.dim % ndim, placement.split_factor)
    assert isinstance(placement, Shard), placement
    return ("shard", placement.dim % ndim)


def test_style_placements_are_transformers_own(monkeypatch):
    """Every registered style's ``shard_param``, run on a meta parameter, places it as
    ``style_placement`` says (``distribute_tensor`` captured instead of run)."""
    import sys

    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401 - registers the styles
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    captured = []

    def distribute_tensor(meta_tensor, mesh, placements, src_data_rank=None):
        captured.append(placements[0])
        return meta_tensor

    for module in ("transformers.distributed.tensor_parallel", "transformers.distributed.expert_parallel"):
        monkeypatch.setattr(sys.modules[module], "distribute_tensor", distribute_tensor)
    styles = list(ALL_PARALLEL_STYLES.valid_keys())
    assert len(styles) >= 20
    for name in styles:
        for attr in ("weight", "bias", "gate_up_proj"):
            for ndim in (1, 2, 3):
                owner = torch.nn.Module()
                owner.register_parameter(attr, torch.nn.Parameter(torch.empty((4,) * ndim, device="meta")))
                captured.clear()
                ALL_PARALLEL_STYLES[name].shard_param(owner, attr, None)
                want = _as_tuple(captured[0] if captured else None, ndim)
                if want == "no such dim":
                    continue
                assert fam_hf.style_placement(name, attr, ndim) == want, (name, attr, ndim)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_styles_resolve_as_transformers(family):
    """Each parameter's style at each size is what ``_resolve_parallel_plans`` gives it."""
    from transformers.distributed import DistributedConfig

    m = meta(family)
    lm = logical_model(m)
    sizes = [(2, 1), (4, 1)] + ([(2, 2), (1, 2), (2, 4)] if family in MOE else [])
    for tp, ep in sizes:
        distributed = DistributedConfig(tp_size=tp, ep_size=ep, fsdp_size=max(1, ep // tp))  # ep > tp needs FSDP
        tp_plan, ep_plan, _ = m._resolve_parallel_plans(distributed)
        mine_tp, mine_ep = fam_hf._plans(lm, tp, ep)
        for t in lm.tensors:
            if t.buffer:
                continue
            want = ep_plan.get(t.name) or tp_plan.get(t.name)
            got = fam_hf.parameter_style(t.name, mine_ep) or fam_hf.parameter_style(t.name, mine_tp)
            assert got == want, (family, tp, ep, t.name)


# -- random llama-like shapes ---------------------------------------------------------------------
@lru_cache(maxsize=None)
def _llama(heads: int, kv: int, head_dim: int, inter: int, vocab: int):
    cfg = transformers.LlamaConfig(hidden_size=4 * heads, num_attention_heads=heads, num_key_value_heads=kv,
                                   head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, num_hidden_layers=1, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv=st.sampled_from([1, 2, 4]), group=st.integers(1, 3), head_dim=st.sampled_from([2, 4]),
       inter=st.integers(1, 24), vocab=st.integers(1, 150), tp=st.sampled_from([1, 2, 3, 4, 8]))
def test_random_shapes_tile_or_are_refused(kv, group, head_dim, inter, vocab, tp):
    """hf shards anything (torch.chunk); vllm tiles exactly when its ``divide`` asserts hold and
    otherwise refuses, naming the size."""
    heads = kv * group
    m = _llama(heads, kv, head_dim, inter, vocab)
    assert_tiles(m, "hf", tp)
    padded = -(-vocab // 64) * 64
    kv_ok = tp % kv == 0 if tp >= kv else kv % tp == 0
    if heads % tp == 0 and kv_ok and inter % tp == 0 and padded % tp == 0:
        assert_tiles(m, "vllm", tp)
    else:
        with pytest.raises(LayoutError, match=r"families\.vllm: .* is not divisible by .*; expected"):
            layouts(m, convention="vllm", tp=tp, rank=0)
