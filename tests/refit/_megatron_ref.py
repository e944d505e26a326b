"""Tiny models of each family and what Megatron or vLLM ranks hold of them, built with plain torch ops.

The references here never read warmlink's layouts: Megatron's interleaved QKV is a view and a
``torch.cat`` per query group, fc1 a ``torch.cat`` of gate and up chunks, the padded vocabulary
``F.pad`` then ``torch.chunk``. The tests compare what warmlink moves against them, and the
megatron-core world (``_megatron_world``) checks them against what Megatron-core ranks hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DIVISIBLE = 64  # make_vocab_size_divisible_by for the tiny vocabularies (300 rows)
VLLM_VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def hf_config(family: str):
    """A tiny float32 transformers config of ``family`` (Megatron-splittable at tp 1, 2 and 4)."""
    import transformers as T

    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, dtype="float32", max_position_embeddings=64)
    if family in ("llama", "llama_bias"):  # one query group per rank at tp=2, groups cut across ranks at tp=4
        bias = family == "llama_bias"  # every linear with a bias: Megatron's add_bias_linear
        return T.LlamaConfig(**common, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                             attention_bias=bias, mlp_bias=bias)
    if family == "mistral":  # MQA: one group, cut at any tp > 1
        return T.MistralConfig(**common, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    if family == "qwen2":  # QKV bias, two groups per rank at tp=2
        return T.Qwen2Config(**common, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4)
    if family == "qwen3":  # q/k norms, tied embeddings
        return T.Qwen3Config(**common, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                             tie_word_embeddings=True)
    if family == "qwen3_moe":  # experts; layer 1 is dense
        return T.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=16, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                mlp_only_layers=[1], norm_topk_prob=True)
    if family == "mixtral":
        return T.MixtralConfig(**common, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2)
    if family in ("deepseek_v3", "deepseek_v3_no_q_lora"):
        # MLA, one dense layer, shared and routed experts, score-correction bias; without q_lora_rank
        # the query is one projection (q_proj), as in DeepSeek-V2-Lite's shape.
        return T.DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=16, num_attention_heads=4,
                                  num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                  n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                  q_lora_rank=None if family.endswith("no_q_lora") else 32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    raise ValueError(family)


def hf_model(family: str, seed: int = 0):
    """The transformers model of ``hf_config(family)``, every tensor random (norms and buffers too)."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in sorted(model.state_dict(keep_vars=True).items()):
            if torch.is_tensor(t) and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


def hf_state(model) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name, detached clones."""
    from warmlink.refit._declare import module_tensors

    return {k: v.detach().clone() for k, v in module_tensors(model).items()}


def _padded_rows(w: torch.Tensor, multiple: int, num: int, idx: int) -> torch.Tensor:
    rows = -(-w.shape[0] // multiple) * multiple
    return F.pad(w, (0, 0, 0, rows - w.shape[0])).chunk(num)[idx].clone()


def _interleaved_qkv(q, k, v, groups: int) -> torch.Tensor:
    """Megatron's full ``linear_qkv``: ``[q_g; k_g; v_g]`` for each query group ``g``."""
    tail = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)],
                     dim=1).reshape(-1, *tail)


def megatron_rank(state, config, *, tp=1, rank=0, ep=1, ep_rank=0, etp=None, etp_rank=None,
                  divisible=DIVISIBLE, dp=None) -> dict[str, torch.Tensor]:
    """What Megatron-core (local spec) rank ``rank`` of ``tp`` / ``ep_rank`` of ``ep`` holds, by its
    names (``dp`` changes which ranks hold the same bytes, not what this one holds)."""
    etp = tp if etp is None else etp
    etp_rank = rank if etp_rank is None else etp_rank
    groups = config.num_key_value_heads
    mla = config.model_type == "deepseek_v3"
    col = lambda w: w.chunk(tp, dim=0)[rank].clone()  # noqa: E731
    row = lambda w: w.chunk(tp, dim=1)[rank].clone()  # noqa: E731
    out = {"embedding.word_embeddings.weight": _padded_rows(state["model.embed_tokens.weight"], divisible * tp, tp, rank),
           "decoder.final_layernorm.weight": state["model.norm.weight"].clone()}
    if "lm_head.weight" in state:
        out["output_layer.weight"] = _padded_rows(state["lm_head.weight"], divisible * tp, tp, rank)
    for i in range(config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        s = {k[len(hf):]: v for k, v in state.items() if k.startswith(hf)}
        out[mg + "input_layernorm.weight"] = s["input_layernorm.weight"].clone()
        out[mg + "pre_mlp_layernorm.weight"] = s["post_attention_layernorm.weight"].clone()
        out[mg + "self_attention.linear_proj.weight"] = row(s["self_attn.o_proj.weight"])
        if "self_attn.o_proj.bias" in s:  # a row-parallel bias is whole on every rank
            out[mg + "self_attention.linear_proj.bias"] = s["self_attn.o_proj.bias"].clone()
        if mla and "self_attn.q_proj.weight" in s:
            out[mg + "self_attention.linear_q_proj.weight"] = col(s["self_attn.q_proj.weight"])
        elif mla:
            out[mg + "self_attention.linear_q_down_proj.weight"] = col(s["self_attn.q_a_proj.weight"])
            out[mg + "self_attention.q_layernorm.weight"] = s["self_attn.q_a_layernorm.weight"].clone()
            out[mg + "self_attention.linear_q_up_proj.weight"] = col(s["self_attn.q_b_proj.weight"])
        if mla:
            out[mg + "self_attention.linear_kv_down_proj.weight"] = col(s["self_attn.kv_a_proj_with_mqa.weight"])
            out[mg + "self_attention.kv_layernorm.weight"] = s["self_attn.kv_a_layernorm.weight"].clone()
            out[mg + "self_attention.linear_kv_up_proj.weight"] = col(s["self_attn.kv_b_proj.weight"])
        else:
            for kind in ("weight", "bias"):
                if f"self_attn.q_proj.{kind}" in s:
                    full = _interleaved_qkv(*(s[f"self_attn.{p}_proj.{kind}"] for p in "qkv"), groups)
                    out[mg + f"self_attention.linear_qkv.{kind}"] = full.chunk(tp, dim=0)[rank].clone()
            for hf_norm, mg_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
                if f"self_attn.{hf_norm}.weight" in s:
                    out[mg + f"self_attention.{mg_norm}.weight"] = s[f"self_attn.{hf_norm}.weight"].clone()
        for hf_mlp, mg_mlp in (("mlp.", "mlp."), ("mlp.shared_experts.", "mlp.shared_experts.")):
            if hf_mlp + "gate_proj.weight" in s:
                gate, up = s[hf_mlp + "gate_proj.weight"], s[hf_mlp + "up_proj.weight"]
                out[mg + mg_mlp + "linear_fc1.weight"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
                out[mg + mg_mlp + "linear_fc2.weight"] = row(s[hf_mlp + "down_proj.weight"])
                if hf_mlp + "gate_proj.bias" in s:
                    gate, up = s[hf_mlp + "gate_proj.bias"], s[hf_mlp + "up_proj.bias"]
                    out[mg + mg_mlp + "linear_fc1.bias"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
                    out[mg + mg_mlp + "linear_fc2.bias"] = s[hf_mlp + "down_proj.bias"].clone()
        if "mlp.experts.gate_up_proj" in s:
            out[mg + "mlp.router.weight"] = s["mlp.gate.weight"].clone()
            if "mlp.gate.e_score_correction_bias" in s:
                out[mg + "mlp.router.expert_bias"] = s["mlp.gate.e_score_correction_bias"].float().clone()
            gate_up, down = s["mlp.experts.gate_up_proj"], s["mlp.experts.down_proj"]
            local = gate_up.shape[0] // ep
            for j in range(local):
                gate, up = gate_up[ep_rank * local + j].chunk(2)
                out[mg + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.cat(
                    [gate.chunk(etp)[etp_rank], up.chunk(etp)[etp_rank]])
            for j in range(local):
                out[mg + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = (
                    down[ep_rank * local + j].chunk(etp, dim=1)[etp_rank].clone())
    return out


def vllm_rank(state, config, *, tp=1, rank=0, ep=1, ep_rank=0) -> dict[str, torch.Tensor]:
    """vLLM-style tensors of a dense GQA or MoE model: ``qkv_proj = [q_r; k_r; v_r]``, ``gate_up_proj =
    [gate_r; up_r]``, experts stacked ``w13_weight [E/ep, 2I/tp, H]`` / ``w2_weight [E/ep, H, I/tp]``,
    vocabulary padded to a multiple of 64 rows and split ``tp`` ways. KV heads replicate when ``tp``
    exceeds them."""
    kv = config.num_key_value_heads
    out = {"model.embed_tokens.weight": _padded_rows(state["model.embed_tokens.weight"], VLLM_VOCAB_PAD, tp, rank),
           "model.norm.weight": state["model.norm.weight"].clone()}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = _padded_rows(state["lm_head.weight"], VLLM_VOCAB_PAD, tp, rank)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        s = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
        for kind in ("weight", "bias"):
            if f"self_attn.q_proj.{kind}" in s:
                q, k, v = (s[f"self_attn.{x}_proj.{kind}"] for x in "qkv")
                kv_idx = rank if kv >= tp else rank * kv // tp
                kv_num = min(kv, tp)
                out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                    [q.chunk(tp)[rank], k.chunk(kv_num)[kv_idx], v.chunk(kv_num)[kv_idx]])
        out[p + "self_attn.o_proj.weight"] = s["self_attn.o_proj.weight"].chunk(tp, dim=1)[rank].clone()
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight", "mlp.gate.weight"):
            if name in s:
                out[p + name] = s[name].clone()
        if "mlp.gate_proj.weight" in s:
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [s["mlp.gate_proj.weight"].chunk(tp)[rank], s["mlp.up_proj.weight"].chunk(tp)[rank]])
            out[p + "mlp.down_proj.weight"] = s["mlp.down_proj.weight"].chunk(tp, dim=1)[rank].clone()
        if "mlp.experts.gate_up_proj" in s:
            gate_up, down = s["mlp.experts.gate_up_proj"].chunk(ep)[ep_rank], s["mlp.experts.down_proj"].chunk(ep)[ep_rank]
            gate, up = gate_up.chunk(2, dim=1)
            out[p + "mlp.experts.w13_weight"] = torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)
            out[p + "mlp.experts.w2_weight"] = down.chunk(tp, dim=2)[rank].clone()
    return out


def vllm_layouts(state, config, *, tp=1, rank=0, ep=1, ep_rank=0):
    """The layouts of ``vllm_rank``'s tensors, hand-built from boxes (the receiving side of the
    Megatron -> vLLM tests; the bytes they must hold come from ``vllm_rank``'s torch ops)."""
    from warmlink.refit.manifest import Part, Shard, TensorLayout

    def rows(name, num, idx, logical=None):
        shape = tuple(state[logical or name].shape)
        per = shape[0] // num
        return Shard(shape, ((idx * per, (idx + 1) * per),) + tuple((0, d) for d in shape[1:]))

    def vocab(name):
        shape = tuple(state[name].shape)
        per = -(-shape[0] // VLLM_VOCAB_PAD) * VLLM_VOCAB_PAD // tp
        a, b = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
        box = Shard(shape, ((a, b), (0, shape[1])))
        return TensorLayout(name, "float32", (Part(name, box, (0, 0)),), (per, shape[1]))

    kv = config.num_key_value_heads
    out = {"model.embed_tokens.weight": vocab("model.embed_tokens.weight"),
           "model.norm.weight": TensorLayout.plain("model.norm.weight", "float32", state["model.norm.weight"].shape)}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = vocab("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q = p + f"self_attn.q_proj.{kind}"
            k, v = q.replace("q_proj", "k_proj"), q.replace("q_proj", "v_proj")
            if q in state and k not in state:  # MLA's query projection, column-parallel
                out[q] = TensorLayout.plain(q, "float32", state[q].shape, 0, tp, rank)
            elif q in state:
                kv_num, kv_idx = (tp, rank) if kv >= tp else (kv, rank * kv // tp)
                out[p + f"self_attn.qkv_proj.{kind}"] = TensorLayout.fused(
                    p + f"self_attn.qkv_proj.{kind}", "float32",
                    [(q, rows(q, tp, rank)), (k, rows(k, kv_num, kv_idx)), (v, rows(v, kv_num, kv_idx))])
        o = p + "self_attn.o_proj.weight"
        out[o] = TensorLayout.plain(o, "float32", state[o].shape, 1, tp, rank)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight", "mlp.gate.weight"):
            if p + name in state:
                out[p + name] = TensorLayout.plain(p + name, "float32", state[p + name].shape)
        gate = p + "mlp.gate_proj.weight"
        if gate in state:
            up, down = p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"
            out[p + "mlp.gate_up_proj.weight"] = TensorLayout.fused(
                p + "mlp.gate_up_proj.weight", "float32", [(gate, rows(gate, tp, rank)), (up, rows(up, tp, rank))])
            out[down] = TensorLayout.plain(down, "float32", state[down].shape, 1, tp, rank)
        w13 = p + "mlp.experts.gate_up_proj"
        if w13 in state:
            num_experts, two_inter, hidden = state[w13].shape
            local, inter = num_experts // ep, two_inter // 2
            per = inter // tp
            e0, e1, lo = ep_rank * local, (ep_rank + 1) * local, rank * per
            shape = (num_experts, two_inter, hidden)
            out[p + "mlp.experts.w13_weight"] = TensorLayout(p + "mlp.experts.w13_weight", "float32", (
                Part(w13, Shard(shape, ((e0, e1), (lo, lo + per), (0, hidden))), (0, 0, 0)),
                Part(w13, Shard(shape, ((e0, e1), (inter + lo, inter + lo + per), (0, hidden))), (0, per, 0))))
            w2 = p + "mlp.experts.down_proj"
            out[p + "mlp.experts.w2_weight"] = TensorLayout(p + "mlp.experts.w2_weight", "float32", (
                Part(w2, Shard(tuple(state[w2].shape), ((e0, e1), (0, hidden), (lo, lo + per))), (0, 0, 0)),))
    return out
