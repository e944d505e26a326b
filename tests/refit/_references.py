"""References for refit tests: what each framework's rank holds, built from the full transformers
tensors with plain torch ops (``chunk``, ``cat``, zero padding), written from transformers' TP/EP
plans and vLLM's loaders, never from warmlink's layouts."""

from __future__ import annotations

import re

import torch

PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def ref_hf(cfg, sd: dict, tp: int, r: int, ep: int = 1, er: int = 0) -> dict[str, torch.Tensor]:
    """What transformers' TP (``tp_plan``: colwise = dim 0 ``chunk``, rowwise = last dim, packed_colwise
    = ``[gate.chunk; up.chunk]``) and EP (``grouped_gemm``: experts ``chunk``) give rank ``r`` / ``er``."""
    family = cfg.model_type
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


def ref_vllm(cfg, sd: dict, tp: int, r: int, ep: int = 1, er: int = 0) -> dict[str, torch.Tensor]:
    """What vLLM's loaders put in rank ``r``'s parameters (VocabParallelEmbedding, QKVParallelLinear,
    MergedColumnParallelLinear, Row/ColumnParallelLinear, FusedMoE; GPT-OSS's own loader), under its
    parameter names."""
    if cfg.model_type == "gpt_oss":
        return _ref_vllm_gpt_oss(cfg, sd, tp, r, ep, er)
    return _ref_vllm_layers(cfg, sd, tp, r, ep, er)


def _ref_vllm_layers(cfg, sd: dict, tp: int, r: int, ep: int, er: int) -> dict[str, torch.Tensor]:
    """The layers vLLM's model files share (``ref_vllm`` of every family but GPT-OSS's experts)."""
    family = cfg.model_type
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
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


def _ref_vllm_gpt_oss(cfg, sd: dict, tp: int, r: int, ep: int, er: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's ``GptOssModel._load_weights_other`` (unquantized), its formulas as written there:
    expert slices by ``cdiv(intermediate_size, tp)`` (or ``num_experts // ep_size`` whole experts
    with EP), ``.permute(0, 2, 1)`` for both expert weights, ``w2_bias`` zeroed on TP ranks > 0,
    sinks ``narrow(0, head_start, heads_per_rank)``; then its ``hf_to_vllm_mapper``'s names."""
    inter, heads = cfg.intermediate_size, cfg.num_attention_heads
    per = -(-inter // tp)
    start, end = r * per, min((r + 1) * per, inter)
    n = cfg.num_local_experts // ep
    first, last = er * n, (er + 1) * n
    heads_per_rank = heads // tp
    use_ep = ep > 1
    plain, out = {}, {}
    for name, x in sd.items():
        stem = name.rpartition(".")[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            w = x[first:last, ...] if use_ep else x[:, :, 2 * start:2 * end]
            out[f"{stem}.routed_experts.w13_weight"] = w.permute(0, 2, 1)
        elif name.endswith("mlp.experts.down_proj"):
            w = x[first:last, ...] if use_ep else x[:, start:end, :]
            out[f"{stem}.routed_experts.w2_weight"] = w.permute(0, 2, 1)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out[f"{stem}.routed_experts.w13_bias"] = x[first:last, ...] if use_ep else x[:, 2 * start:2 * end]
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[f"{stem}.routed_experts.w2_bias"] = x[first:last, ...] if use_ep else (x if r == 0 else torch.zeros_like(x))
        elif name.endswith("self_attn.sinks"):
            out[name] = x.narrow(0, r * heads_per_rank, heads_per_rank)
        else:
            plain[name] = x
    out.update(_ref_vllm_layers(cfg, plain, tp, r, ep, er))  # attention, embeddings, router, norms
    renamed = {}
    for name, t in out.items():  # GptOssForCausalLM.hf_to_vllm_mapper
        name = name.replace(".self_attn.", ".attn.").replace("model.embed_tokens.weight", "model.embedding.weight")
        renamed[name] = t.contiguous()
    return renamed


REF = {"hf": ref_hf, "vllm": ref_vllm}
