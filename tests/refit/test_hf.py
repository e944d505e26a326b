"""Tests for warmlink.refit.hf (TP layouts of HF Llama / Qwen2) and warmlink.refit._demo_model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from warmlink.errors import LayoutError  # noqa: E402
from warmlink.refit import _demo_model  # noqa: E402
from warmlink.refit.hf import shard_into, shard_state, tp_layouts  # noqa: E402
from warmlink.refit.manifest import TensorLayout  # noqa: E402


def _llama(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                head_dim=8, intermediate_size=48, vocab_size=51, tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _qwen2(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=50, tie_word_embeddings=True)
    base.update(kw)
    return transformers.Qwen2Config(**base)


def _model(config):
    torch.manual_seed(0)
    cls = transformers.Qwen2ForCausalLM if config.model_type == "qwen2" else transformers.LlamaForCausalLM
    return cls(config).eval()


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


CASES = {
    "llama_mha": _llama(),
    "llama_gqa_kv2": _llama(num_key_value_heads=2),  # tp=4 replicates each KV head on 2 ranks
    "llama_biases": _llama(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "qwen2_tied": _qwen2(),
    "qwen2_untied": _qwen2(tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    config = CASES[request.param]
    model = _model(config)
    return config, model, _state(model)


def _reconstruct(per_rank: list[tuple[dict[str, TensorLayout], dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Rebuild full logical tensors from every rank's physical shards (un-fuse, place by box)."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for layouts, tensors in per_rank:
        for name, layout in layouts.items():
            phys = tensors[name]
            assert tuple(phys.shape) == layout.local_shape
            for part in layout.parts:
                piece = phys[tuple(slice(a, b) for a, b in part.local_box())]
                shape = part.shard.global_shape
                dst = full.setdefault(part.logical, torch.full(shape, float("nan"), dtype=phys.dtype))
                mask = covered.setdefault(part.logical, torch.zeros(shape, dtype=torch.bool))
                idx = tuple(slice(a, b) for a, b in part.shard.box())
                seen = mask[idx]
                # Replicated blocks (norms, GQA KV heads) must agree wherever two ranks hold them.
                assert torch.equal(dst[idx][seen], piece[seen]), part.logical
                dst[idx] = piece
                mask[idx] = True
    for logical, mask in covered.items():
        assert bool(mask.all()), f"{logical} not fully covered"
    return full


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_and_reconstruct_exact(case, tp, fused):
    config, model, state = case
    per_rank = []
    for rank in range(tp):
        layouts = tp_layouts(config, tp=tp, rank=rank, fused=fused)
        tensors = shard_state(state, layouts)
        for name, layout in layouts.items():
            t = tensors[name]
            assert tuple(t.shape) == layout.local_shape, name
            assert t.is_contiguous()
            assert t.untyped_storage().data_ptr() != state[layout.parts[0].logical].untyped_storage().data_ptr()
        per_rank.append((layouts, tensors))
    full = _reconstruct(per_rank)
    assert set(full) == set(state)
    for name, tensor in state.items():
        assert torch.equal(full[name], tensor), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_config_layouts_match_model_layouts(case, tp):
    config, model, _ = case
    for rank in range(tp):
        from_config = tp_layouts(config, tp=tp, rank=rank)
        from_model = tp_layouts(model, tp=tp, rank=rank)
        assert list(from_config) == list(from_model)
        assert from_config == from_model


def test_unfused_matches_plain_concat():
    config = CASES["llama_gqa_kv2"]
    state = _state(_model(config))
    name = "model.layers.1.self_attn.q_proj.weight"
    shards = [shard_state(state, tp_layouts(config, tp=2, rank=r)) for r in range(2)]
    assert torch.equal(torch.cat([s[name] for s in shards], 0), state[name])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[down] for s in shards], 1), state[down])
    norm = "model.norm.weight"
    assert all(torch.equal(s[norm], state[norm]) for s in shards)


def test_gqa_replication_tp4_kv2():
    config = CASES["llama_gqa_kv2"]
    state = _state(_model(config))
    k = "model.layers.0.self_attn.k_proj.weight"
    kv_rows = 8  # head_dim
    shards = []
    for rank in range(4):
        layout = tp_layouts(config, tp=4, rank=rank)[k]
        shard = layout.parts[0].shard
        assert shard.bounds[0] == ((0, 8) if rank < 2 else (8, 16))
        shards.append(shard_state(state, {k: layout})[k])
    assert torch.equal(shards[0], shards[1]) and torch.equal(shards[2], shards[3])
    assert torch.equal(shards[0], state[k][:kv_rows]) and torch.equal(shards[2], state[k][kv_rows:])


def test_fused_names_and_order():
    config = CASES["llama_gqa_kv2"]
    state = _state(_model(config))
    layouts = tp_layouts(config, tp=2, rank=1, fused=True)
    qkv = layouts["model.layers.0.self_attn.qkv_proj.weight"]
    gate_up = layouts["model.layers.0.mlp.gate_up_proj.weight"]
    assert [p.logical for p in qkv.parts] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert [p.logical for p in gate_up.parts] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert qkv.local_shape == (16 + 8 + 8, 32) and gate_up.local_shape == (48, 32)
    assert not any(n.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for n in layouts)
    t = shard_state(state, layouts)["model.layers.0.self_attn.qkv_proj.weight"]
    pre = "model.layers.0.self_attn"
    expect = torch.cat([state[f"{pre}.q_proj.weight"][16:], state[f"{pre}.k_proj.weight"][8:],
                        state[f"{pre}.v_proj.weight"][8:]], 0)
    assert torch.equal(t, expect)


def test_fused_and_unfused_cover_same_logical_boxes():
    config = CASES["qwen2_untied"]
    for rank in range(2):
        plain = tp_layouts(config, tp=2, rank=rank)
        fused = tp_layouts(config, tp=2, rank=rank, fused=True)
        boxes = lambda ls: sorted((p.logical, p.shard.box()) for l in ls.values() for p in l.parts)  # noqa: E731
        assert boxes(plain) == boxes(fused)
        assert "model.layers.0.self_attn.qkv_proj.bias" in fused


def test_tied_embeddings_listed_once():
    tied = tp_layouts(CASES["qwen2_tied"], tp=2, rank=0)
    untied = tp_layouts(CASES["qwen2_untied"], tp=2, rank=0)
    assert "lm_head.weight" not in tied and "lm_head.weight" in untied
    model = _model(CASES["qwen2_tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in tp_layouts(model, tp=2, rank=0)
    # A full state_dict (which does list lm_head) is accepted; the extra key is ignored.
    out = shard_state(model.state_dict(), tied)
    assert "lm_head.weight" not in out


def test_uneven_vocab_split():
    config = CASES["llama_mha"]  # vocab 51 over 4 ranks: 13, 13, 13, 12
    sizes = [tp_layouts(config, tp=4, rank=r)["model.embed_tokens.weight"].local_shape[0] for r in range(4)]
    assert sizes == [13, 13, 13, 12]


def test_dtype_defaults_and_override():
    config = _llama(dtype="bfloat16")
    assert {l.dtype for l in tp_layouts(config, tp=2, rank=0).values()} == {"bfloat16"}
    assert {l.dtype for l in tp_layouts(_llama(), tp=2, rank=0).values()} == {"float32"}
    model = _model(_llama()).to(torch.float16)
    assert {l.dtype for l in tp_layouts(model, tp=2, rank=0).values()} == {"float16"}
    layouts = tp_layouts(model, tp=2, rank=0, dtype="bfloat16", fused=True)
    assert {l.dtype for l in layouts.values()} == {"bfloat16"}
    out = shard_state(_state(model), layouts)
    assert all(t.dtype == torch.bfloat16 for t in out.values())


def test_shard_into_copies_in_place():
    config = CASES["qwen2_untied"]
    model = _model(config)
    layouts = tp_layouts(config, tp=2, rank=1, fused=True)
    out = {n: torch.zeros(l.local_shape) for n, l in layouts.items()}
    ptrs = {n: t.data_ptr() for n, t in out.items()}
    shard_into(_state(model), layouts, out)
    expect = shard_state(_state(model), layouts)
    assert all(torch.equal(out[n], expect[n]) and out[n].data_ptr() == ptrs[n] for n in layouts)
    # Parameters that require grad as destinations: written under no_grad.
    params = {n: torch.nn.Parameter(torch.zeros(l.local_shape)) for n, l in layouts.items()}
    shard_into(model.state_dict(keep_vars=True), layouts, params)
    assert all(torch.equal(params[n], expect[n]) for n in layouts)


def test_shard_errors():
    config = CASES["llama_mha"]
    layouts = tp_layouts(config, tp=2, rank=0)
    state = _state(_model(config))
    missing = dict(state)
    del missing["model.norm.weight"]
    with pytest.raises(LayoutError, match="model.norm.weight"):
        shard_state(missing, layouts)
    wrong = dict(state, **{"model.norm.weight": torch.zeros(7)})
    with pytest.raises(LayoutError, match=r"global_shape=\(32,\)"):
        shard_state(wrong, layouts)
    out = {n: torch.zeros(l.local_shape) for n, l in layouts.items()}
    out["model.norm.weight"] = torch.zeros(31)
    with pytest.raises(LayoutError, match="out\\['model.norm.weight'\\]"):
        shard_into(state, layouts, out)
    del out["model.norm.weight"]
    with pytest.raises(LayoutError, match="missing"):
        shard_into(state, layouts, out)
    out["model.norm.weight"] = torch.zeros(32, dtype=torch.float16)
    with pytest.raises(LayoutError, match="float16"):
        shard_into(state, layouts, out)


@pytest.mark.parametrize(
    ("config", "tp", "match"),
    [
        (_llama(), 3, r"num_attention_heads=4 is not divisible by tp=3"),
        (_llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8), 2, r"num_key_value_heads=3 .*tp=2"),
        (_llama(hidden_size=48, num_attention_heads=12, num_key_value_heads=3, head_dim=4), 4, r"tp=4 > num_key_value_heads=3"),
        (_llama(intermediate_size=50), 4, r"intermediate_size=50 is not divisible by tp=4"),
        (_llama(vocab_size=3), 4, r"vocab_size=3 .*tp=4"),
        (_llama(), 0, r"tp=0"),
    ],
)
def test_bad_tp_raises(config, tp, match):
    with pytest.raises(LayoutError, match=match):
        tp_layouts(config, tp=tp, rank=0)


def test_bad_rank_and_model_type():
    with pytest.raises(LayoutError, match=r"rank=2 out of range; expected 0 <= rank < tp=2"):
        tp_layouts(_llama(), tp=2, rank=2)
    with pytest.raises(LayoutError, match="model_type='gpt2'"):
        tp_layouts(transformers.GPT2Config(), tp=1, rank=0)


# -- _demo_model ---------------------------------------------------------------------------------
def test_demo_model_deterministic():
    # See Note [Demo determinism]: same seed and steps -> bit-identical parameters and probe.
    config = _demo_model.tiny_llama_config(num_hidden_layers=2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (8, 4, False)
    rng_before = torch.get_rng_state()
    models = [_demo_model.build_model(config, seed=3) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), rng_before), "build_model must not disturb the caller's RNG"
    losses = []
    for model in models:
        opt = _demo_model.make_optimizer(model)
        losses.append([_demo_model.train_step(model, opt, step, seed=3) for step in range(2)])
    assert losses[0] == losses[1]
    a, b = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(_demo_model.probe_logits(models[0], 3), _demo_model.probe_logits(models[1], 3))
    other = _demo_model.build_model(config, seed=4)
    assert not torch.equal(other.model.embed_tokens.weight, models[0].model.embed_tokens.weight)
    assert not models[0].training
    # The demo model's layouts are well-formed at tp 1, 2, 4 (8 heads, 4 KV heads, 688 intermediate).
    for tp in (1, 2, 4):
        assert tp_layouts(models[0], tp=tp, rank=tp - 1, fused=True)
