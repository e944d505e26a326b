"""Refits between the hf and vllm conventions of warmlink.refit.families, every family, over shm.

Each receiver tensor is compared with a reference built here from the full transformers tensors
with plain torch ops (``chunk``, ``cat``, zero padding), written from transformers' TP/EP plans
and vLLM's loaders, never from warmlink's layouts. Publishers hold those reference tensors too, so
a publisher layout that says the wrong thing about its bytes fails as surely as a receiver's.
"""

from __future__ import annotations

import contextlib
import re
from functools import lru_cache

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import TIMEOUT_S, new_store, refit_layouts, zeros_like_layout  # noqa: E402
from warmlink._dtypes import dtype_name  # noqa: E402
from warmlink.refit import Publisher, Receiver  # noqa: E402
from warmlink.refit._declare import module_tensors  # noqa: E402
from warmlink.refit.families import layouts  # noqa: E402

_BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             head_dim=8, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts_per_tok=2)
#: family -> config overrides: tiny, but with what makes each family itself (biases, ties, MLA, experts).
FAMILIES = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(tie_word_embeddings=True),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(),
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, mlp_only_layers=[1], **_MOE),
    "mixtral": dict(num_local_experts=4, intermediate_size=32, **_MOE),
    "deepseek_v3": dict(moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_group=1, topk_group=1, **_MOE),
    # DeepSeek-V2-Lite's shape: MLA without q_lora_rank (q_proj, kv_a_proj_with_mqa), attention in its tp_plan
    "deepseek_v2": dict(moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1,
                        q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **_MOE),
    "gemma2": dict(),
    "gemma3_text": dict(),
    "phi3": dict(),
    "gpt_oss": dict(num_local_experts=4, intermediate_size=32, **_MOE),
}
MOE = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss")
PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def config(family: str, **overrides):
    return transformers.AutoConfig.for_model(family, **{**_BASE, **FAMILIES[family], **overrides})


@lru_cache(maxsize=None)
def model(family: str):
    """The transformers model, bfloat16, every parameter and persistent buffer seeded random."""
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config(family)).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(sum(map(ord, family)))
    with torch.no_grad():
        for t in module_tensors(m).values():
            t.copy_(torch.randn(t.shape, generator=gen))
    return m


def state(m) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module_tensors(m).items()}


def conventions(family: str) -> tuple[str, ...]:
    return ("hf",) if family == "gpt_oss" else ("hf", "vllm")  # vLLM holds GPT-OSS experts transposed


# -- references: plain torch ops on the full transformers tensors ---------------------------------
def ref_hf(family: str, sd: dict, tp: int, r: int, ep: int = 1, er: int = 0) -> dict[str, torch.Tensor]:
    """What transformers' TP (``tp_plan``: colwise = dim 0 ``chunk``, rowwise = last dim, packed_colwise
    = ``[gate.chunk; up.chunk]``) and EP (``grouped_gemm``: experts ``chunk``) give rank ``r`` / ``er``."""
    attn = family not in ("deepseek_v3", "gpt_oss", "phi3")  # no q/k/v/o rules in their tp_plan
    mlp = family != "gpt_oss"
    out = {}
    for name, x in sd.items():
        if ".mlp.experts." in name and ep > 1:
            y = x.chunk(ep)[er]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            y = x.chunk(tp)[r]
        elif attn and re.search(r"self_attn\.([qkv]|q_b|kv_b)_proj\.(weight|bias)$", name):
            y = x.chunk(tp)[r]
        elif family == "phi3" and re.search(r"(qkv_proj|gate_up_proj)\.weight$", name):
            y = x.chunk(tp)[r]
        elif (attn or family == "phi3") and name.endswith("self_attn.o_proj.weight"):
            y = x.chunk(tp, -1)[r]
        elif mlp and re.search(r"mlp\.(shared_experts\.)?(gate|up)_proj\.(weight|bias)$", name):
            y = x.chunk(tp)[r]
        elif mlp and re.search(r"mlp\.(shared_experts\.)?down_proj\.weight$", name):
            y = x.chunk(tp, -1)[r]
        elif mlp and name.endswith("mlp.experts.gate_up_proj"):
            gate, up = x.chunk(2, dim=1)
            y = torch.cat([gate.chunk(tp, 1)[r], up.chunk(tp, 1)[r]], dim=1)
        elif mlp and name.endswith("mlp.experts.down_proj"):
            y = x.chunk(tp, -1)[r]
        else:
            y = x
        out[name] = y.contiguous()
    return out


def ref_vllm(family: str, sd: dict, tp: int, r: int, ep: int = 1, er: int = 0) -> dict[str, torch.Tensor]:
    """What vLLM's loaders put in rank ``r``'s parameters (VocabParallelEmbedding, QKVParallelLinear,
    MergedColumnParallelLinear, Row/ColumnParallelLinear, FusedMoE), under its parameter names."""
    cfg = config(family)
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    block = "block_sparse_moe" if family == "mixtral" else "mlp"

    def vocab(x):
        padded = -(-x.shape[0] // PADDING) * PADDING
        return torch.cat([x, x.new_zeros(padded - x.shape[0], *x.shape[1:])]).chunk(tp)[r]

    def kv(x):  # each KV head replicated on tp // kv_heads ranks when tp >= kv_heads
        return x.chunk(kv_heads)[r // (tp // kv_heads)] if tp >= kv_heads else x.chunk(tp)[r]

    out = {}
    for name, x in sd.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab(x)
        elif family.startswith("deepseek") and re.search(r"self_attn\.(q|q_b|kv_b)_proj\.weight$", name):
            out[name] = x.chunk(tp)[r]  # MLA: ColumnParallelLinear each
        elif m := re.match(r"(.*)\.self_attn\.q_proj\.(weight|bias)$", name):
            k, v = (sd[f"{m[1]}.self_attn.{p}_proj.{m[2]}"] for p in "kv")
            out[f"{m[1]}.self_attn.qkv_proj.{m[2]}"] = torch.cat([x.chunk(tp)[r], kv(k), kv(v)])
        elif re.search(r"self_attn\.[kv]_proj\.", name):
            continue
        elif name.endswith("self_attn.qkv_proj.weight"):  # Phi-3, fused by transformers
            q, k, v = x.split([heads * hd, kv_heads * hd, kv_heads * hd])
            out[name] = torch.cat([q.chunk(tp)[r], kv(k), kv(v)])
        elif m := re.match(r"(.*)\.gate_proj\.(weight|bias)$", name):
            up = sd[f"{m[1]}.up_proj.{m[2]}"]
            out[f"{m[1]}.gate_up_proj.{m[2]}"] = torch.cat([x.chunk(tp)[r], up.chunk(tp)[r]])
        elif re.search(r"\.up_proj\.", name):
            continue
        elif name.endswith("mlp.gate_up_proj.weight"):  # Phi-3
            gate, up = x.chunk(2)
            out[name] = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        elif re.search(r"(o_proj|down_proj)\.weight$", name):
            out[name] = x.chunk(tp, 1)[r]
        elif name.endswith("self_attn.q_a_proj.weight"):
            kv_a = sd[name.replace("q_a_proj", "kv_a_proj_with_mqa")]
            out[name.replace("q_a_proj", "fused_qkv_a_proj")] = torch.cat([x, kv_a])
        elif name.endswith("kv_a_proj_with_mqa.weight") and name.replace("kv_a_proj_with_mqa", "q_a_proj") in sd:
            continue
        elif name.endswith("mlp.experts.gate_up_proj"):
            if ep > 1:
                y = x.tensor_split(ep)[er]
            else:
                gate, up = x.chunk(2, dim=1)
                y = torch.cat([gate.chunk(tp, 1)[r], up.chunk(tp, 1)[r]], dim=1)
            out[name.replace(".mlp.", f".{block}.").replace("gate_up_proj", "routed_experts.w13_weight")] = y
        elif name.endswith("mlp.experts.down_proj"):
            y = x.tensor_split(ep)[er] if ep > 1 else x.chunk(tp, 2)[r]
            out[name.replace(".mlp.", f".{block}.").replace("down_proj", "routed_experts.w2_weight")] = y
        elif name.endswith("mlp.gate.weight"):
            out[name.replace(".mlp.", f".{block}.")] = x
        elif name.endswith("e_score_correction_bias"):
            out[name] = x.float()  # vLLM keeps it a float32 Parameter
        else:
            out[name] = x  # norms, row-parallel biases
    return {n: t.contiguous() for n, t in out.items()}


REF = {"hf": ref_hf, "vllm": ref_vllm}


def world(tp: int, ep: int) -> list[tuple[int, int]]:
    """(rank, ep_rank) of every rank: vLLM's ep_rank = dp_rank * tp + rank."""
    return [(i % tp, i if ep > 1 else 0) for i in range(max(tp, ep))]


def check(lays: dict, got: dict, ref: dict, label: str) -> None:
    assert set(lays) == set(ref), f"{label}: names differ: {sorted(set(lays) ^ set(ref))}"
    for name, lay in lays.items():
        want = ref[name]
        assert lay.shape == tuple(want.shape) and lay.dtype == dtype_name(want.dtype), (label, name, lay, want.shape)
        assert torch.equal(got[name], want), f"{label}: {name} differs from the reference"


def _side(family: str, conv: str, tp: int, ep: int) -> list[tuple[dict, dict]]:
    """(layouts, reference tensors) of every rank of one side."""
    m, sd = model(family), state(model(family))
    return [(layouts(m, convention=conv, tp=tp, rank=r, ep=ep, ep_rank=er), REF[conv](family, sd, tp, r, ep, er))
            for r, er in world(tp, ep)]


def _refit(family: str, source: tuple, receivers: list[tuple]) -> None:
    src = _side(family, *source)
    sources = {}
    for i, (lays, ref) in enumerate(src):
        check(lays, ref, ref, f"{family} source {source} rank {i}")  # the source layouts say what the bytes are
        sources[i] = {n: (ref[n].clone(), lay) for n, lay in lays.items()}
    sides = [(spec, i, lays, ref) for spec in receivers for i, (lays, ref) in enumerate(_side(family, *spec))]
    got = refit_layouts(sources, [lays for _, _, lays, _ in sides])[0]
    for (spec, i, lays, ref), g in zip(sides, got):
        check(lays, g, ref, f"{family} {source} -> {spec} rank {i}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("src_conv", ["hf", "vllm"])
def test_tp_refit(family, src_conv):
    """TP 2 -> 1, 2 -> 4 and 1 -> 2, from one convention into both."""
    if src_conv not in conventions(family):
        pytest.skip("vLLM holds GPT-OSS experts transposed (test_families_rules checks the refusal)")
    dst = conventions(family)
    _refit(family, (src_conv, 2, 1), [(c, tp, 1) for c in dst for tp in (1, 4)])
    _refit(family, (src_conv, 1, 1), [(c, 2, 1) for c in dst])


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("src_conv", ["hf", "vllm"])
def test_ep_refit(family, src_conv):
    """EP 2 -> 1 and 1 -> 2, with and without TP beside it."""
    if src_conv not in conventions(family):
        pytest.skip("vLLM holds GPT-OSS experts transposed")
    dst = conventions(family)
    _refit(family, (src_conv, 2, 2), [(c, 1, 1) for c in dst])
    _refit(family, (src_conv, 1, 2), [(c, 2, 1) for c in dst])
    _refit(family, (src_conv, 1, 1), [(c, tp, 2) for c in dst for tp in (1, 2)])


# -- a TP-1 transformers model publishing any convention ------------------------------------------
def _refit_module(m, conv: str, tp: int, receivers: list[tuple[str, int]], step) -> list[list[dict]]:
    """Publishers of ``m`` (whole, TP 1) holding ``conv`` rank layouts at ``tp`` through
    ``Publisher.add_module``; two versions, ``step()`` changing ``m`` in place before the second."""
    with contextlib.ExitStack() as closing:  # closes receivers, then publishers, then the store
        store = closing.enter_context(new_store())
        pubs, recs = [], []
        for r in range(tp):
            pub = Publisher(store, rank=r, world_size=tp, backend="shm", timeout_s=TIMEOUT_S)
            closing.callback(pub.close)
            pub.add_module(m, layouts(m, convention=conv, tp=tp, rank=r))
            pub.export()
            pubs.append(pub)
        for rconv, rtp in receivers:
            for r in range(rtp):
                lays = layouts(m, convention=rconv, tp=rtp, rank=r)
                rec = Receiver(store, num_publishers=tp, backend="shm", timeout_s=TIMEOUT_S)
                closing.callback(rec.close)
                targets = {n: zeros_like_layout(lay) for n, lay in lays.items()}
                for n, lay in lays.items():
                    rec.add(n, lay, targets[n])
                recs.append((rec, targets))
        out = []
        for version in (1, 2):
            if version == 2:
                for pub in pubs:
                    pub.begin_update()
                step()
                for pub in pubs:
                    pub.publish()
            out.append([])
            for rec, targets in recs:
                assert rec.refit().version == version
                out[-1].append({n: t.clone() for n, t in targets.items()})
        return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_module_publishes_any_convention(family):
    """A whole transformers model publishes vllm / hf rank layouts built from its live tensors."""
    m = transformers.AutoModelForCausalLM.from_config(config(family)).to(torch.bfloat16)
    m.load_state_dict(model(family).state_dict())
    receivers = [(c, tp) for c in conventions(family) for tp in (1, 2)]

    def step():
        with torch.no_grad():
            for t in module_tensors(m).values():
                t.add_(1)

    for conv in conventions(family):
        before = state(m)
        versions = _refit_module(m, conv, 2, receivers, step)
        after = state(m)
        for sd, got in zip((before, after), versions):
            specs = [(c, tp, r) for c, tp in receivers for r in range(tp)]
            for (c, tp, r), g in zip(specs, got):
                check(layouts(m, convention=c, tp=tp, rank=r), g, REF[c](family, sd, tp, r), f"{family} {conv} -> {c}")
