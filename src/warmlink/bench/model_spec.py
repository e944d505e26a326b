"""A synthetic Qwen3-4B-shaped model in the vLLM layout, for refit benchmarks.

At ``scale=1``: 36 layers, hidden 2560, 32 query / 8 KV heads of 128, intermediate 9728, vocab
151936, untied embeddings, bf16; per layer fused ``qkv_proj``, ``o_proj``, fused ``gate_up_proj``,
``down_proj`` and four norms. That is 290 tensors and 8.83 GB, the seed's workload (seed 000: ~290
buffers, 8 GB). Smaller scales drop layers first, then narrow every width.
"""

from __future__ import annotations

from dataclasses import dataclass

from warmlink.refit.manifest import TensorLayout
from warmlink.refit.plan import gate_up_layout, qkv_layout

__all__ = ["ModelSpec", "qwen3_4b_like", "scale_for_nbytes"]


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    hidden: int
    intermediate: int
    vocab: int
    dtype: str = "bfloat16"

    def layouts(self, tp: int, rank: int) -> dict[str, TensorLayout]:
        """Physical name -> layout for tensor-parallel ``rank`` of ``tp`` (Megatron/vLLM rules)."""
        d = self.dtype
        split = (lambda dim: dict(split_dim=dim, num_shards=tp, shard_idx=rank)) if tp > 1 else (lambda dim: {})
        out = {
            "embed_tokens": TensorLayout.plain("embed_tokens", d, (self.vocab, self.hidden), **split(0)),
            "lm_head": TensorLayout.plain("lm_head", d, (self.vocab, self.hidden), **split(0)),
        }
        q_dim = self.num_q_heads * self.head_dim
        for i in range(self.num_layers):
            p = f"layers.{i}."
            out[p + "qkv_proj"] = qkv_layout(
                p + "qkv_proj", d, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                hidden=self.hidden, tp=tp, rank=rank, logical=(p + "q_proj", p + "k_proj", p + "v_proj"))
            out[p + "o_proj"] = TensorLayout.plain(p + "o_proj", d, (self.hidden, q_dim), **split(1))
            out[p + "gate_up_proj"] = gate_up_layout(
                p + "gate_up_proj", d, intermediate=self.intermediate, hidden=self.hidden, tp=tp, rank=rank,
                logical=(p + "gate_proj", p + "up_proj"))
            out[p + "down_proj"] = TensorLayout.plain(p + "down_proj", d, (self.hidden, self.intermediate), **split(1))
            for norm, size in (("input_layernorm", self.hidden), ("post_attention_layernorm", self.hidden),
                               ("q_norm", self.head_dim), ("k_norm", self.head_dim)):
                out[p + norm] = TensorLayout.plain(p + norm, d, (size,))
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.layouts(1, 0).values())


def qwen3_4b_like(scale: float = 1.0) -> ModelSpec:
    """The Qwen3-4B shape at ``scale`` (0 < scale <= 1) of its 8.83 GB.

    Layers and vocabulary scale with ``scale`` (at least 1 layer, 256 rows); below one layer's worth every width
    narrows too, keeping Qwen3's ratios (hidden = 20 head_dim, intermediate = 76 head_dim).
    """
    if not 0 < scale <= 1:
        from warmlink.errors import ConfigError

        raise ConfigError(f"qwen3_4b_like: scale={scale!r}; expected 0 < scale <= 1")
    layers = max(1, round(36 * scale))
    width = min(1.0, 36 * scale)
    head_dim = max(8, 8 * round(16 * width))
    return ModelSpec(
        num_layers=layers, head_dim=head_dim, num_q_heads=32, num_kv_heads=8, hidden=20 * head_dim,
        intermediate=76 * head_dim, vocab=max(256, round(151936 * scale)),
    )


def scale_for_nbytes(nbytes: int) -> float:
    """The largest ``qwen3_4b_like`` scale whose model holds at most ``nbytes`` bytes (the smallest
    model, about 1 MB, where even that is more): bytes grow with the scale in steps, so a bisection."""
    lo, hi = 1e-6, 1.0
    if qwen3_4b_like(hi).nbytes <= nbytes:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if qwen3_4b_like(mid).nbytes <= nbytes else (lo, mid)
    return lo
