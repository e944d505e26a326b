"""Refits between the hf and vllm conventions of warmlink.refit.families, every family, over shm.

Each receiver tensor is compared with a reference built here from the full transformers tensors
with plain torch ops (``chunk``, ``cat``, zero padding), written from transformers' TP/EP plans
and vLLM's loaders, never from warmlink's layouts. Publishers hold those reference tensors too, so
a publisher layout that says the wrong thing about its bytes fails as surely as a receiver's.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import TIMEOUT_S, new_store, refit_layouts, zeros_like_layout  # noqa: E402
from _references import REF  # noqa: E402
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
    """The conventions a receiver of ``family`` may hold."""
    return ("hf", "vllm")


def publishing(family: str) -> tuple[str, ...]:
    """The conventions a publisher of ``family`` may hold: vLLM's GPT-OSS experts are transposed,
    which only receivers may be (Note [Transposed parts] in refit.manifest)."""
    return ("hf",) if family == "gpt_oss" else ("hf", "vllm")



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
    return [(layouts(m, convention=conv, tp=tp, rank=r, ep=ep, ep_rank=er), REF[conv](config(family), sd, tp, r, ep, er))
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
    if src_conv not in publishing(family):
        pytest.skip("vLLM holds GPT-OSS experts transposed: receivers only (test_transposed checks the refusal)")
    dst = conventions(family)
    _refit(family, (src_conv, 2, 1), [(c, tp, 1) for c in dst for tp in (1, 4)])
    _refit(family, (src_conv, 1, 1), [(c, 2, 1) for c in dst])


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("src_conv", ["hf", "vllm"])
def test_ep_refit(family, src_conv):
    """EP 2 -> 1 and 1 -> 2, with and without TP beside it."""
    if src_conv not in publishing(family):
        pytest.skip("vLLM holds GPT-OSS experts transposed: receivers only")
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

    for conv in publishing(family):
        before = state(m)
        versions = _refit_module(m, conv, 2, receivers, step)
        after = state(m)
        for sd, got in zip((before, after), versions):
            specs = [(c, tp, r) for c, tp in receivers for r in range(tp)]
            for (c, tp, r), g in zip(specs, got):
                check(layouts(m, convention=c, tp=tp, rank=r), g, REF[c](config(family), sd, tp, r), f"{family} {conv} -> {c}")
