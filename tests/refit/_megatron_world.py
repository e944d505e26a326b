"""Megatron-core on CPU in a gloo world: build the real ``GPTModel`` of each tiny family, fill it
through a warmlink refit, and let Megatron-core's own modules say what the bytes mean.

``run_world(cases, world_size)`` spawns ``world_size`` processes (``torch.multiprocessing``, gloo
over loopback), runs every case in each (``parallel_state.initialize_model_parallel`` per case)
and returns each rank's findings: ``{case_id: [problem, ...]}`` per rank, empty when all is well.
Every wait is bounded: a rank that hangs or dies fails the run within ``timeout_s``.

What runs on CPU here (megatron-core 0.16.1, torch CPU): ``GPTModel`` built with the local spec
(``get_gpt_decoder_block_spec(use_transformer_engine=False)``) and ``use_cpu_initialization``;
the forward of ``SelfAttention.get_query_key_value_tensors``, ``linear_proj``, ``MLP`` (dense,
shared and each local expert), ``VocabParallelEmbedding``, ``output_layer``, the norms and MLA's
down/up projections, with their gloo all-reduces and all-gathers. Not on CPU: a whole
``GPTModel.forward`` (its rotary embedding and core attention call ``torch.cuda``), and a router
with ``moe_router_enable_expert_bias`` is only built with ``torch.cuda.current_device`` answering
``"cpu"`` (its buffers are created on that device).
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

import _megatron_ref as ref

Case = tuple  # (case_id, family, tp, ep, etp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(cases: list[Case], world_size: int, timeout_s: float = 600.0) -> list[dict[str, list[str]]]:
    """Run ``cases`` in a spawned gloo world of ``world_size``; each rank's findings, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, cases, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    found: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(found) < world_size:
            try:
                rank, value = results.get(timeout=1.0)
                found[rank] = value
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"megatron world: rank process {dead[0].pid} died (exit code {dead[0].exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"megatron world: {world_size - len(found)} ranks gave no answer in {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [found[r] for r in range(world_size)]


def _worker(rank: int, world_size: int, port: int, cases: list[Case], results) -> None:
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict[str, list[str]] = {}
    try:
        import torch.distributed as dist

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        # A collective waits for the slowest rank, which on a loaded 2-core machine may build its
        # models long after the others: bounded, but generously (run_world bounds the whole).
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
        # Megatron-core creates some buffers on torch.cuda.current_device(); on this CPU-only build
        # that device is the CPU (nothing else calls it before the modules exist).
        torch.cuda.current_device = lambda: "cpu"
        for case in cases:
            try:
                out[case[0]] = _run_case(*case[1:])
            except Exception:  # noqa: BLE001 - a case's failure is reported, the world goes on
                out[case[0]] = [traceback.format_exc()]
            dist.barrier()
        results.put((rank, out))
    except Exception:  # noqa: BLE001
        results.put((rank, {"world": [traceback.format_exc()]}))


class _NoCoreAttention(torch.nn.Module):
    """A parameter-free stand-in for MLA's core attention (never called here)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


# -- the Megatron model of a tiny family ------------------------------------------------------------
def megatron_config(cfg, tp: int, ep: int, etp: int):
    """The ``TransformerConfig`` (``MLATransformerConfig`` for DeepSeek-V3) Megatron-core would train
    ``cfg`` with: RMSNorm, SwiGLU, no linear biases but Qwen2's QKV bias, Qwen3's q/k layernorm."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    mt = cfg.model_type
    kw = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, layernorm_epsilon=cfg.rms_norm_eps, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_qkv_bias=mt == "qwen2",
        add_bias_linear=bool(getattr(cfg, "attention_bias", False) and getattr(cfg, "mlp_bias", False)),
        qk_layernorm=mt in ("qwen3", "qwen3_moe", "deepseek_v3"), use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    if mt in ("qwen3_moe", "mixtral", "deepseek_v3"):
        num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
        if mt == "qwen3_moe":
            dense = set(cfg.mlp_only_layers)
        elif mt == "deepseek_v3":
            dense = set(range(cfg.first_k_dense_replace))
        else:
            dense = set()
        kw.update(num_moe_experts=num_experts, moe_router_topk=cfg.num_experts_per_tok,
                  moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
                  moe_layer_freq=[0 if i in dense else 1 for i in range(cfg.num_hidden_layers)],
                  moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    if mt == "deepseek_v3":
        kw.update(moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
                  moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                  q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                  qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_type="rope",
                  kv_channels=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        return MLATransformerConfig(**kw)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return TransformerConfig(**kw, num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim)


def megatron_model(cfg, tp: int, ep: int, etp: int):
    """Megatron-core's ``GPTModel`` of ``cfg`` for this rank (local spec, one pipeline stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = megatron_config(cfg, tp, ep, etp)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if cfg.model_type == "deepseek_v3":  # MLA
        # The local spec's DotProductAttention takes no k_channels/v_channels, which MLA passes:
        # megatron-core 0.16.1 builds MLA's core attention only with Transformer Engine. It holds no
        # parameter, so a stand-in leaves every tensor of the layout where Megatron puts it.
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _NoCoreAttention
        # Without Transformer Engine, megatron.core.extensions stands MagicMocks in for its classes,
        # so MLA's HAVE_TE is True and isinstance(linear_proj, TELinear) raises. The flag gates an
        # fp8 path only; say what is true here: no Transformer Engine.
        import importlib.util

        import megatron.core.transformer.multi_latent_attention as mla

        mla.HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
    # Megatron-LM's _vocab_size_with_padding (megatron/training/tokenizer/tokenizer.py), written out.
    multiple = ref.DIVISIBLE * tp
    return GPTModel(config, spec, vocab_size=-(-cfg.vocab_size // multiple) * multiple,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings)).eval()


# -- one case ---------------------------------------------------------------------------------------
def _close(problems: list[str], what: str, got, want, exact: bool = False) -> None:
    try:
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 sums in other orders
    except AssertionError as e:
        problems.append(f"{what}: {' '.join(str(e).split())} (got {tuple(got.shape)}, want {tuple(want.shape)})")


def _refit_from_hf(hf, mg, layouts) -> None:
    """Fill ``mg`` from the TP-1 HF model through a warmlink refit over shm, in this process."""
    from _harness import TIMEOUT_S, new_store
    from warmlink.refit import Publisher, Receiver

    store = new_store()
    pub = rec = None
    try:
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
        pub.add_module(hf)
        pub.export()
        rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S)
        rec.add_module(mg, layouts)
        rec.refit()
    finally:
        for x in (rec, pub):
            if x is not None:
                x.close()
        store.close()


def _run_case(family: str, tp: int, ep: int, etp: int) -> list[str]:
    from megatron.core import parallel_state as ps

    from warmlink.refit.families import layouts

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    hf = ref.hf_model(family)
    cfg = hf.config
    torch.manual_seed(1234)  # Megatron's own init: different from HF's, so a tensor left unfilled shows
    mg = megatron_model(cfg, tp, ep, etp)
    # dp: which boxes other ranks hold too (Note [Megatron layouts]); ranks beyond tp * ep are DP replicas
    lay = layouts(hf, convention="megatron", tp=tp, rank=tp_rank, ep=ep, ep_rank=ep_rank, etp=etp, etp_rank=etp_rank,
                  dp=ps.get_data_parallel_world_size(), make_vocab_size_divisible_by=ref.DIVISIBLE)
    problems: list[str] = []
    if etp == tp and etp_rank != tp_rank:  # the layouts' default etp_rank
        problems.append(f"expert tensor-parallel rank {etp_rank} != tensor-parallel rank {tp_rank} with etp == tp")
    try:
        _check_rank(problems, hf, mg, lay, cfg, tp, tp_rank, ep, ep_rank, etp, etp_rank)
    except Exception:  # noqa: BLE001 - reported; the collective steps below still run on every rank
        problems.append(traceback.format_exc())
    # Every rank publishes only if every rank's checks passed (a rank that skips would hang the rest).
    import torch.distributed as dist

    ok = torch.tensor([0 if problems else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item():
        problems += _megatron_to_hf(hf, mg, lay, cfg)
    return problems


def _check_rank(problems, hf, mg, lay, cfg, tp, tp_rank, ep, ep_rank, etp, etp_rank) -> None:
    from warmlink.refit._declare import module_tensors

    # (a) Megatron's names, local shapes and dtypes are what the layouts say.
    held = module_tensors(mg)
    if set(held) != set(lay):
        problems.append(f"names: only in Megatron {sorted(set(held) - set(lay))}; only in layouts {sorted(set(lay) - set(held))}")
    for name in sorted(set(held) & set(lay)):
        if tuple(held[name].shape) != lay[name].shape or str(held[name].dtype) != f"torch.{lay[name].dtype}":
            problems.append(f"{name}: Megatron holds {tuple(held[name].shape)} {held[name].dtype}; layout says "
                            f"{lay[name].shape} {lay[name].dtype}")
    if problems:
        return
    # (b) filled through warmlink from the HF model, Megatron holds what plain torch ops say it should.
    _refit_from_hf(hf, mg, lay)
    want = ref.megatron_rank(ref.hf_state(hf), cfg, tp=tp, rank=tp_rank, ep=ep, ep_rank=ep_rank, etp=etp,
                             etp_rank=etp_rank)
    for name, t in held.items():
        _close(problems, f"{name} against the torch-op reference", t.detach(), want[name], exact=True)
    # (c) Megatron-core's own modules read those bytes as the HF weights.
    with torch.no_grad():
        _check_embedding(problems, hf, mg, cfg, tp, tp_rank)
        for i in range(cfg.num_hidden_layers):
            _check_layer(problems, hf.model.layers[i], mg.decoder.layers[i], cfg, tp, tp_rank, ep_rank, i)
    # (d) a Megatron module under vLLM-style layouts is refused, publishing or receiving.
    _check_refusals(problems, hf, mg, cfg, tp, tp_rank)


def _check_refusals(problems, hf, mg, cfg, tp, tp_rank) -> None:
    from _harness import TIMEOUT_S, new_store
    from warmlink.errors import LayoutError
    from warmlink.refit import Publisher, Receiver

    vllm = ref.vllm_layouts(ref.hf_state(hf), cfg, tp=tp, rank=tp_rank)
    before = {k: v.detach().clone() for k, v in mg.state_dict().items() if torch.is_tensor(v)}
    store = new_store()
    try:
        for side in ("Publisher", "Receiver"):
            obj = (Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S) if side == "Publisher"
                   else Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S))
            try:
                obj.add_module(mg, vllm)
                problems.append(f"{side}.add_module(Megatron module, vLLM layouts) was accepted")
            except LayoutError:
                pass
            finally:
                obj.close()
    finally:
        store.close()
    for k, v in mg.state_dict().items():
        if torch.is_tensor(v) and not torch.equal(v, before[k]):
            problems.append(f"{k} changed by a refused declaration")


def _megatron_to_hf(hf, mg, lay, cfg) -> list[str]:
    """Every rank publishes its Megatron tensors in place (one Publisher per rank, one store across
    processes); rank 0 receives a whole HF model from them. The tensors are first set to
    ``-2 w + 0.5`` on every rank alike, so what arrives is not what the HF model already held."""
    import uuid

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from _harness import TIMEOUT_S
    from warmlink.refit import Publisher, Receiver
    from warmlink.refit._declare import module_tensors
    from warmlink.rendezvous import Store

    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for t in module_tensors(mg).values():
            t.mul_(-2).add_(0.5)
    server = (Store("127.0.0.1", 0, is_server=True, prefix=f"megatron-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S)
              if rank == 0 else None)
    where = [server.address, server.prefix, server.secret] if server is not None else [None, None, None]
    dist.broadcast_object_list(where, src=0)
    store = server if server is not None else Store.connect(where[0], prefix=where[1], timeout_s=TIMEOUT_S,
                                                                      secret=where[2])
    problems: list[str] = []
    pub = Publisher(store, rank=rank, world_size=world, backend="shm", timeout_s=TIMEOUT_S)
    try:
        pub.add_module(mg, lay)
        pub.export()
        if rank == 0:
            fresh = AutoModelForCausalLM.from_config(cfg)
            with torch.no_grad():
                for t in module_tensors(fresh).values():
                    t.zero_()
            rec = Receiver(store, num_publishers=world, backend="shm", timeout_s=TIMEOUT_S)
            try:
                rec.add_module(fresh)
                rec.refit()
            finally:
                rec.close()
            want = {k: v * -2 + 0.5 for k, v in ref.hf_state(hf).items()}
            for name, t in module_tensors(fresh).items():
                _close(problems, f"{name} from {world} Megatron publishers", t.detach(), want[name], exact=True)
        dist.barrier()
    finally:
        pub.close()
        dist.barrier()
        if server is None:
            store.close()
        dist.barrier()
        if server is not None:
            server.close()
    return problems


def _inputs(cfg, seed: int, *last: int) -> torch.Tensor:
    """``[s=5, b=2, *last]`` (Megatron's sequence-first order), the same on every rank."""
    return torch.randn(5, 2, *last, generator=torch.Generator().manual_seed(seed))


def _check_embedding(problems, hf, mg, cfg, tp, tp_rank) -> None:
    from megatron.core.tensor_parallel.utils import VocabUtility

    vocab = cfg.vocab_size
    emb = mg.embedding.word_embeddings
    padded = emb.num_embeddings  # the global (padded) vocabulary Megatron was built with
    start, stop = VocabUtility.vocab_range_from_global_vocab_size(padded, tp_rank, tp)
    if (emb.vocab_start_index, emb.vocab_end_index) != (start, stop):
        problems.append(f"embedding range {(emb.vocab_start_index, emb.vocab_end_index)} != VocabUtility {(start, stop)}")
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(7))
    ids[0, :2] = torch.tensor([0, vocab - 1])
    _close(problems, "VocabParallelEmbedding(ids)", emb(ids), hf.model.embed_tokens(ids), exact=True)
    x = _inputs(cfg, 8, cfg.hidden_size)
    _close(problems, "final_layernorm", mg.decoder.final_layernorm(x), hf.model.norm(x))
    weight = mg.shared_embedding_or_output_weight() if cfg.tie_word_embeddings else None
    logits, _ = mg.output_layer(x, weight=weight)
    full = torch.nn.functional.pad(hf.lm_head(x), (0, padded - vocab))  # padded rows hold zeros
    _close(problems, "output_layer logits (this rank's vocabulary, padding 0)", logits, full[..., start:stop])


def _check_layer(problems, hl, ml, cfg, tp, tp_rank, ep_rank, i) -> None:
    x = _inputs(cfg, 100 + i, cfg.hidden_size)
    _close(problems, f"layer {i} input_layernorm", ml.input_layernorm(x), hl.input_layernorm(x))
    _close(problems, f"layer {i} pre_mlp_layernorm", ml.pre_mlp_layernorm(x), hl.post_attention_layernorm(x))
    if cfg.model_type == "deepseek_v3":
        _check_mla(problems, hl.self_attn, ml.self_attention, cfg, tp, tp_rank, i)
    else:
        _check_qkv(problems, hl.self_attn, ml.self_attention, cfg, tp, tp_rank, x, i)
    heads_dim = ml.self_attention.linear_proj.input_size  # full input size of the row-parallel linear
    full_in = _inputs(cfg, 200 + i, heads_dim)
    per = heads_dim // tp
    out, bias = ml.self_attention.linear_proj(full_in[..., tp_rank * per:(tp_rank + 1) * per])
    _close(problems, f"layer {i} linear_proj (all-reduced)", out if bias is None else out + bias, hl.self_attn.o_proj(full_in))
    mlp = ml.mlp
    if hasattr(mlp, "router"):
        _check_moe(problems, hl.mlp, mlp, cfg, ep_rank, x, i)
    else:
        out, bias = mlp(x)
        _close(problems, f"layer {i} MLP (linear_fc1 [gate; up], glu, linear_fc2)", out if bias is None else out + bias,
               hl.mlp(x))


def _check_qkv(problems, attn, sa, cfg, tp, tp_rank, x, i) -> None:
    """``get_query_key_value_tensors`` un-interleaves linear_qkv into HF's heads (and norms them)."""
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q, k, v = sa.get_query_key_value_tensors(x, None)
    hq = attn.q_proj(x).view(5, 2, heads, hd)
    hk = attn.k_proj(x).view(5, 2, groups, hd)
    hv = attn.v_proj(x).view(5, 2, groups, hd)
    if hasattr(attn, "q_norm"):
        hq, hk = attn.q_norm(hq), attn.k_norm(hk)
    per = heads // tp
    if groups >= tp:
        g0, g1 = tp_rank * groups // tp, (tp_rank + 1) * groups // tp
    else:  # tp / groups ranks share one group (Attention.get_query_key_value_tensors)
        g0 = tp_rank // (tp // groups)
        g1 = g0 + 1
    _close(problems, f"layer {i} query heads", q, hq[:, :, tp_rank * per:(tp_rank + 1) * per])
    _close(problems, f"layer {i} key heads", k, hk[:, :, g0:g1])
    _close(problems, f"layer {i} value heads", v, hv[:, :, g0:g1])


def _check_mla(problems, attn, sa, cfg, tp, tp_rank, i) -> None:
    """MLA's column-parallel down projections (gathered) and up projections (by heads)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    x = _inputs(cfg, 300 + i, cfg.hidden_size)
    kv = gather_from_tensor_model_parallel_region(sa.linear_kv_down_proj(x)[0])
    _close(problems, f"layer {i} linear_kv_down_proj", kv, attn.kv_a_proj_with_mqa(x))
    ckv = _inputs(cfg, 500 + i, cfg.kv_lora_rank)
    _close(problems, f"layer {i} kv_layernorm", sa.kv_layernorm(ckv), attn.kv_a_layernorm(ckv))
    heads, per = cfg.num_attention_heads, cfg.num_attention_heads // tp
    sl = slice(tp_rank * per, (tp_rank + 1) * per)
    if cfg.q_lora_rank is None:
        q = sa.linear_q_proj(x)[0].view(5, 2, per, sa.q_head_dim)
        _close(problems, f"layer {i} linear_q_proj heads", q, attn.q_proj(x).view(5, 2, heads, -1)[:, :, sl])
    else:
        q_c = gather_from_tensor_model_parallel_region(sa.linear_q_down_proj(x)[0])
        _close(problems, f"layer {i} linear_q_down_proj", q_c, attn.q_a_proj(x))
        c = _inputs(cfg, 400 + i, cfg.q_lora_rank)
        _close(problems, f"layer {i} q_layernorm", sa.q_layernorm(c), attn.q_a_layernorm(c))
        q = sa.linear_q_up_proj(c)[0].view(5, 2, per, sa.q_head_dim)
        _close(problems, f"layer {i} linear_q_up_proj heads", q, attn.q_b_proj(c).view(5, 2, heads, -1)[:, :, sl])
    kvu = sa.linear_kv_up_proj(ckv)[0].view(5, 2, per, -1)
    _close(problems, f"layer {i} linear_kv_up_proj heads", kvu, attn.kv_b_proj(ckv).view(5, 2, heads, -1)[:, :, sl])


def _check_moe(problems, hmoe, mmoe, cfg, ep_rank, x, i) -> None:
    """Router, shared experts and each local expert, Megatron's MLP against HF's experts module."""
    from megatron.core import parallel_state as ps

    _close(problems, f"layer {i} router.weight", mmoe.router.weight, hmoe.gate.weight, exact=True)
    if getattr(mmoe.router, "expert_bias", None) is not None:
        _close(problems, f"layer {i} router.expert_bias", mmoe.router.expert_bias, hmoe.gate.e_score_correction_bias, exact=True)
    tokens = x.reshape(-1, x.shape[-1])
    local = mmoe.experts.local_experts
    for j, expert in enumerate(local):
        e = ep_rank * len(local) + j
        ones = torch.ones(tokens.shape[0], 1)
        want = hmoe.experts(tokens, torch.full((tokens.shape[0], 1), e), ones)
        out, _ = expert(tokens)
        # An expert's RowParallelLinear leaves its sum to the token dispatcher (explicit_expert_comm):
        # sum the expert tensor-parallel partials here.
        torch.distributed.all_reduce(out, group=ps.get_expert_tensor_parallel_group())
        _close(problems, f"layer {i} local expert {j} (global {e}, all-reduced over expert TP)", out, want)
    if getattr(mmoe, "shared_experts", None) is not None:
        from megatron.core.transformer.mlp import MLP

        out, _ = MLP.forward(mmoe.shared_experts, x)
        _close(problems, f"layer {i} shared experts", out, hmoe.shared_experts(x))
