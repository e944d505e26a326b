"""Rank-side scenarios of the ``warmlink.ep.deep_ep`` tests, run by ``_group.run_ranks`` over a gloo
group on the CPU (shared memory). Each builds every rank's inputs from one seed, so each rank
can check its own outputs against sums computed here from the routing alone."""

from __future__ import annotations

import contextlib
import datetime
import socket

import torch
import torch.distributed as dist

from warmlink.ep.deep_ep.sizing import tokens_within
import warmlink.ep.deep_ep as deep_ep


def free_port() -> int:
    """A TCP port free on this host now (for the gloo world's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, num_ranks: int, port: int):
    """A gloo world of ``num_ranks`` on this host; its group, destroyed on exit."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield dist.new_group(list(range(num_ranks)))
    finally:
        dist.destroy_process_group()


def routed(case: dict, rank: int):
    """``(x, topk_idx, probs)`` of ``rank``: x small integers (sums stay exact in bf16), distinct experts."""
    gen = torch.Generator().manual_seed(case["seed"] * 100 + rank)
    t, e, k = case["tokens"], case["experts"], case["topk"]
    x = torch.randint(-3, 4, (t, case["hidden"]), generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
    idx[torch.rand(t, k, generator=gen) < case.get("mask_prob", 0.0)] = -1
    probs = torch.rand(t, k, generator=gen)
    return x, idx.to(deep_ep.topk_idx_t), probs


def ranks_of(idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[T, R]`` bool: the ranks holding one of each token's experts (from the routing alone)."""
    out = torch.zeros(idx.shape[0], num_ranks, dtype=torch.bool)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        out[valid.nonzero().view(-1), idx[valid, k] // (num_experts // num_ranks)] = True
    return out


# -- Megatron's token dispatcher (megatron/core/transformer/moe/fused_a2a.py), its calls to DeepEP ----
_buffer = None


def get_buffer(group, hidden_bytes: int):
    """Megatron's ``get_buffer``: the largest hint of the recommended configs; a new Buffer when
    the group changes or the hint grows."""
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        _buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def _hidden_bytes(x: torch.Tensor) -> int:
    return x.size(1) * max(x.element_size(), 2)


def _previous(async_finish: bool):
    return deep_ep.EventOverlap(deep_ep.EventHandle()) if async_finish else None


class FusedDispatch(torch.autograd.Function):
    """Megatron's dispatch: layout, dispatch forward; combine of the gradients backward."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False, allocate_on_comm_stream=False):
        buffer = get_buffer(group, _hidden_bytes(x))
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
            buffer.get_dispatch_layout(token_indices, num_experts, previous_event=_previous(async_finish),
                                       async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle, after = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle, ctx.async_finish, ctx.allocate_on_comm_stream = group, handle, async_finish, allocate_on_comm_stream
        return recv_x, recv_token_indices, recv_token_probs, torch.tensor(num_recv_tokens_per_expert_list), handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buffer = get_buffer(ctx.group, _hidden_bytes(grad_output))
        grad_x, grad_token_probs, after = buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(),
            previous_event=_previous(ctx.async_finish), async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    """Megatron's combine: combine forward; a cached dispatch of the gradients backward."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        buffer = get_buffer(group, _hidden_bytes(x))
        combined_x, _, after = buffer.combine(x, handle=handle, async_finish=async_finish,
                                              previous_event=_previous(async_finish),
                                              allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after.current_stream_wait()
        ctx.handle, ctx.group, ctx.async_finish, ctx.allocate_on_comm_stream = handle, group, async_finish, allocate_on_comm_stream
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        buffer = get_buffer(ctx.group, _hidden_bytes(grad_output))
        grad_x, _, _, _, _, after = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                    previous_event=_previous(ctx.async_finish),
                                                    async_finish=ctx.async_finish,
                                                    allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, None, None, None


def megatron_steps(rank: int, num_ranks: int, store, case: dict) -> list[str]:
    """Forward and backward through ``FusedDispatch`` / ``FusedCombine`` with an expert that scales
    rank ``r``'s rows by ``r + 1`` and a loss on the local experts' probabilities weighted by
    ``10 * (r + 1)``; every output and gradient is checked against its value from the routing.
    ``case["cuda"]``: on GPU ``rank % device_count`` (ranks may share one). Returns what was
    checked, per step."""
    global _buffer
    on = torch.device("cpu")
    if case.get("cuda"):
        on = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(on)
    checked = []
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        _buffer = None
        for step, async_finish in enumerate((False, True, False)):
            x, idx, probs = (t.to(on) for t in routed(dict(case, seed=case["seed"] + step), rank))
            x.requires_grad_(True)
            probs.requires_grad_(True)
            recv_x, recv_idx, recv_probs, tokens_per_expert, handle = FusedDispatch.apply(
                x, idx, probs, case["experts"], group, async_finish)
            hidden = recv_x * (rank + 1)  # the expert
            combined, _ = FusedCombine.apply(hidden, group, handle, async_finish)
            grad_out = torch.randint(-2, 3, combined.shape, generator=torch.Generator().manual_seed(rank + step))
            local = (recv_idx >= 0).float()
            loss = (combined.float() * grad_out.to(on)).sum() + (recv_probs * local).sum() * 10 * (rank + 1)
            loss.backward()

            idx, epr = idx.cpu(), case["experts"] // num_ranks
            where = ranks_of(idx, case["experts"], num_ranks)
            scale = (where.float() * torch.arange(1, num_ranks + 1)).sum(1, keepdim=True)  # sum of r + 1 over its ranks
            assert torch.equal(combined.cpu(), (x.detach().cpu().float() * scale).to(torch.bfloat16)), f"step {step}: combined"
            assert torch.equal(x.grad.cpu(), (grad_out * scale).to(torch.bfloat16)), f"step {step}: x.grad"
            owner = torch.where(idx >= 0, idx // epr + 1, 0).float() * 10  # the loss weight of each slot's rank
            assert torch.equal(probs.grad.cpu(), owner), f"step {step}: probs.grad"
            assert tokens_per_expert.sum().item() == int((recv_idx >= 0).sum()), f"step {step}: tokens per expert"
            checked.append(f"step {step} async={async_finish}: combined, x.grad, probs.grad")
        _buffer.close()  # Megatron keeps its buffer for the process's life; the test releases it here
        _buffer = None
    return checked


def outputs_outlive_later_calls(rank: int, num_ranks: int, store, case: dict) -> dict:
    """A dispatch's outputs, then three more dispatches (fresh and cached, so both parities of the
    receive area are rewritten): the first outputs must still hold what they held."""
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        x, idx, probs = routed(case, rank)
        buffer = deep_ep.Buffer(group, case["num_nvl_bytes"], explicitly_destroy=True)
        layout = buffer.get_dispatch_layout(idx, case["experts"])
        args = {"num_tokens_per_rank": layout[0], "is_token_in_rank": layout[3], "num_tokens_per_expert": layout[2]}
        first = buffer.dispatch(x, topk_idx=idx, topk_weights=probs, **args)
        kept = [t.clone() for t in first[:3]]
        later = [buffer.dispatch(-x, topk_idx=idx, topk_weights=probs * 2, **args),
                 buffer.dispatch(x + 1, handle=first[4]), buffer.dispatch(x - 1, handle=first[4])]
        same = all(torch.equal(a, b) for a, b in zip(first[:3], kept, strict=True))
        moved = torch.equal(later[0][0], -first[0]) and torch.equal(later[2][0], first[0] - 1)
        buffer.destroy()
        return {"same": same, "later_differ": moved, "rows": first[0].shape[0]}


def padded_like_unpadded(rank: int, num_ranks: int, store, case: dict) -> dict:
    """A fresh dispatch with ``num_worst_tokens`` (which returns at launch on a GPU, its handle's
    ``rank_prefix_matrix`` summed from the count board on the device: ep.protocol.normal, Note [Padded
    dispatch returns at launch]) beside the same dispatch without: the same handle contents, rows,
    padding and combine. ``case["cuda"]``: on GPU ``rank % device_count``."""
    on = torch.device("cpu")
    if case.get("cuda"):
        on = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(on)
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        x, idx, probs = (t.to(on) for t in routed(case, rank))
        buffer = deep_ep.Buffer(group, case["num_nvl_bytes"], explicitly_destroy=True)
        layout = buffer.get_dispatch_layout(idx, case["experts"])
        args = {"num_tokens_per_rank": layout[0], "is_token_in_rank": layout[3], "num_tokens_per_expert": layout[2],
                "topk_idx": idx, "topk_weights": probs}
        plain = buffer.dispatch(x, **args)
        worst = case["tokens"] * num_ranks
        padded = buffer.dispatch(x, **args, num_worst_tokens=worst)
        n = plain[0].shape[0]
        out = {"prefix": torch.equal(padded[4][0], plain[4][0]), "is_token_in_rank": torch.equal(padded[4][4], plain[4][4]),
               "rows": padded[0].shape[0] == worst and torch.equal(padded[0][:n], plain[0]),
               "ids": torch.equal(padded[1][:n], plain[1]) and bool((padded[1][n:] == -1).all()),
               "weights": torch.equal(padded[2][:n], plain[2]) and bool((padded[2][n:] == 0).all()),
               "per_expert_list": padded[3] == []}
        combined = buffer.combine(padded[0], padded[4], padded[2])
        want = buffer.combine(plain[0], plain[4], plain[2])
        out["combine"] = torch.equal(combined[0], want[0]) and torch.equal(combined[1], want[1])
        buffer.destroy()
        return out


def captured_layer(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """A MoE layer's calls as code that captures DeepEP in CUDA graphs makes them: the layout, a fresh
    dispatch with ``num_worst_tokens``, a cached dispatch of its handle and a combine, captured in
    one graph (after two eager rounds, which build the Buffer within and compile the kernels); then
    per seed of ``case["seeds"]`` that seed's tokens and routing written into the captured inputs,
    the graph replayed, and the same calls made eagerly: whether each replayed output equals the
    eager one (the received rows, the padding's ids and weights, ``rank_prefix_matrix``)."""
    on = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(on)
    worst = case["tokens"] * num_ranks
    names = ("recv_x", "recv_idx", "recv_w", "cached", "combined", "combined_w", "rank_prefix_matrix")
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        buffer = deep_ep.Buffer(group, case["num_nvl_bytes"], explicitly_destroy=True)

        def inputs(seed: int) -> dict:
            x, idx, probs = routed(dict(case, seed=seed), rank)
            return {"x": x.to(on), "idx": idx.to(on), "w": probs.to(on)}

        def calls(t: dict):
            layout = buffer.get_dispatch_layout(t["idx"], case["experts"])
            recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
                t["x"], num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                topk_idx=t["idx"], topk_weights=t["w"], num_worst_tokens=worst)
            cached = buffer.dispatch(t["x"], handle=handle)[0]
            combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
            return (recv_x, recv_idx, recv_w, cached, combined, combined_w, handle[0]), handle

        static = inputs(case["seeds"][0])
        for _ in range(2):
            calls(static)
        streamed = buffer.warmlink_buffer.send == "stream"
        torch.cuda.synchronize(on)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = calls(static)
        results = []
        for seed in case["seeds"]:
            for name, value in inputs(seed).items():
                static[name].copy_(value)
            graph.replay()
            replayed = [t.cpu() for t in captured]
            eager, handle = calls(static)
            n = handle.num_recv_tokens
            same = {name: torch.equal(a[:n], b.cpu()[:n]) if name in ("recv_x", "cached") else torch.equal(a, b.cpu())
                    for name, a, b in zip(names, replayed, eager)}
            results.append({"seed": seed, "received": n, "streamed": streamed, "same": same})
        torch.cuda.synchronize(on)
        buffer.destroy()
    return results


def bias_and_refusals(rank: int, num_ranks: int, store, case: dict) -> dict:
    """combine with one and two biases; then a batch larger than the built Buffer holds (sent in
    rounds) and calls it must refuse, each followed by a round that works. Returns what each call raised, and the checks' results."""
    out: dict = {}

    def attempt(name: str, call) -> None:
        try:
            call()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test compares the type and message
            out[name] = f"{type(exc).__name__}: {exc}"

    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        x, idx, probs = routed(case, rank)
        buffer = deep_ep.Buffer(group, case["num_nvl_bytes"], explicitly_destroy=True)
        layout = buffer.get_dispatch_layout(idx, case["experts"])
        args = {"num_tokens_per_rank": layout[0], "is_token_in_rank": layout[3], "num_tokens_per_expert": layout[2]}
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=probs, **args)
        plain = buffer.combine(recv_x, handle)[0]
        b0 = torch.full_like(plain, 0.5)
        b1 = torch.randint(-2, 3, plain.shape, generator=torch.Generator().manual_seed(rank)).to(plain.dtype)
        out["one_bias"] = torch.equal(buffer.combine(recv_x, handle, bias=b0)[0], (plain.float() + 0.5).to(plain.dtype))
        out["two_biases"] = torch.equal(buffer.combine(recv_x, handle, bias=(b0, b1))[0],
                                        (plain.float() + 0.5 + b1.float()).to(plain.dtype))
        inner = buffer.warmlink_buffer
        held = tokens_within(case["num_nvl_bytes"], num_ranks, case["hidden"], case["topk"])  # what the budget holds
        more = x.repeat(-(-(held + 1) // x.shape[0]), 1)[:held + 1]
        more_idx = idx.repeat(-(-(held + 1) // idx.shape[0]), 1)[:held + 1]
        more_layout = buffer.get_dispatch_layout(more_idx, case["experts"])
        attempt("more_than_held", lambda: buffer.dispatch(more, topk_idx=more_idx, num_tokens_per_rank=more_layout[0],
                                                          is_token_in_rank=more_layout[3],
                                                          num_tokens_per_expert=more_layout[2]))
        attempt("other_hidden", lambda: buffer.dispatch(x[:, :8].contiguous(), topk_idx=idx, **args))
        attempt("plain_tuple_handle", lambda: buffer.combine(recv_x, tuple(handle)))
        attempt("bias_shape", lambda: buffer.combine(recv_x, handle, bias=b0[:1]))
        attempt("round_after", lambda: buffer.combine(recv_x, handle))
        buffer.destroy()
        attempt("after_destroy", lambda: buffer.combine(recv_x, handle))
        out["held"] = held
        out["built"] = {"max_tokens": inner.layout.max_tokens, "nbytes": inner.layout.nbytes}
    return out


def _packed_fp8(case: dict, rank: int):
    """Rank ``rank``'s FP8 x as raw random bytes (NaN patterns included) and UE8M0 scales as random
    int32 words over their whole range: every bit pattern must arrive as sent."""
    gen = torch.Generator().manual_seed(case["seed"] * 100 + 50 + rank)
    t, h = case["tokens"], case["hidden"]
    values = torch.randint(0, 256, (t, h), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    cols = -(-(-(-h // 128)) // 4)  # ceil(ceil(h / 128) / 4): four exponents a word
    words = torch.randint(-(1 << 31), 1 << 31, (t, cols), generator=gen, dtype=torch.int64)
    return values, words.to(torch.int32)


def packed_scales_arrive_bit_for_bit(rank: int, num_ranks: int, store, case: dict) -> dict:
    """A fresh and a cached dispatch of FP8 x with packed UE8M0 scales; compares what arrives with
    the rows every source sent this rank (source rank, then token order), bit for bit."""
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        buffer = deep_ep.Buffer(group, case["num_nvl_bytes"], explicitly_destroy=True)
        _, idx, _ = routed(case, rank)
        layout = buffer.get_dispatch_layout(idx, case["experts"])
        x = _packed_fp8(case, rank)
        (recv_values, recv_words), *_, handle, _ = buffer.dispatch(
            x, topk_idx=idx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
        cached_values, cached_words = buffer.dispatch(x, handle=handle)[0]
        sent = []
        for s in range(num_ranks):
            here = ranks_of(routed(case, s)[1], case["experts"], num_ranks)[:, rank]
            values, words = _packed_fp8(case, s)
            sent.append((values.view(torch.uint8)[here], words[here]))
        want_values = torch.cat([v for v, _ in sent])
        want_words = torch.cat([w for _, w in sent])
        buffer.destroy()
        return {"dtype": str(recv_words.dtype), "rows": want_words.shape[0],
                "fresh": torch.equal(recv_values.view(torch.uint8), want_values) and torch.equal(recv_words, want_words),
                "cached": torch.equal(cached_values.view(torch.uint8), want_values) and torch.equal(cached_words, want_words)}


def run_snippet(rank: int, num_ranks: int, store, case: dict) -> dict:
    """``case["code"]`` (a README snippet) run as written, given a group, this rank's tokens,
    routing, ``num_experts``, an expert that doubles its rows and other work that does nothing;
    whether its combined rows and weights (named ``case["combined_w"]``) are right, and the rows
    this rank received."""
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        x, topk_idx, topk_weights = routed(case, rank)
        ns = {"group": group, "x": x, "topk_idx": topk_idx, "topk_weights": topk_weights,
              "num_experts": case["experts"], "experts": lambda rows: rows * 2, "other_work": lambda: None}
        exec(compile(case["code"], "README.md", "exec"), ns)  # noqa: S102 - the README's own snippet
        where = ranks_of(topk_idx, case["experts"], num_ranks)
        want_x = (x.float() * 2 * where.sum(1, keepdim=True)).to(torch.bfloat16)
        want_w = torch.where(topk_idx >= 0, topk_weights, 0.0)  # each slot comes back once, from its expert's rank
        ok = torch.equal(ns["combined_x"], want_x) and torch.allclose(ns[case["combined_w"]], want_w)
        return {"ok": ok, "received": ns["recv_x"].shape[0]}


def first_call_outcome(store, buffer, call) -> dict:
    """Rank 0's side of a test where rank 1 makes no first call: ``call()``'s error (type and
    message) and the seconds it took; then rank 1 is told it may go, and ``buffer`` closed."""
    import time

    start = time.monotonic()
    try:
        call()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test compares the type and message
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    finally:
        store.set("gone-test/done", b"1")
        buffer.close()


def gone_before_first_dispatch(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Every rank builds ``deep_ep.Buffer(group, num_nvl_bytes)``; rank 1 then makes no call (alive)
    until rank 0 is done, and rank 0's first dispatch, which builds the warmlink Buffer, must end
    within its timeout (``first_call_outcome``)."""
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        buffer = deep_ep.Buffer(group, case["num_nvl_bytes"], explicitly_destroy=True, timeout_s=case["timeout_s"])
        if rank == 1:
            store.get("gone-test/done", timeout_s=60)
            buffer.close()
            return {}
        x, idx, probs = routed(case, rank)
        layout = buffer.get_dispatch_layout(idx, case["experts"])
        return first_call_outcome(store, buffer, lambda: buffer.dispatch(
            x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2]))


def codes_in_turn(rank: int, num_ranks: int, store, case: dict) -> dict:
    """``bench ep --deep-ep``'s timing of two codes at once (the drop-in twice, as DeepEP would be
    beside it on GPUs): every call of both, per budget, through the bench's own clock; and which
    code each sample of one call ran (``clocks_of`` takes them in turn)."""
    from warmlink.bench._ep_routing import routing
    from warmlink.bench.ep import clocks_of
    from warmlink.bench.ep_deep_ep import time_deep_ep

    order: list[int] = []
    with gloo_group(rank, num_ranks, case["dist_port"]):
        flag = torch.zeros(1)

        def clocks(fn, iterations=2, warmup=1):
            if isinstance(fn, list):  # record the order the codes' samples ran in
                fn = [lambda f=f, i=i: (order.append(i), f()) for i, f in enumerate(fn)]
            return clocks_of(fn, flag, lambda: None, False, iterations, warmup)

        x, topk_idx, weights = routing(rank, case["tokens"], case["experts"], case["topk"], case["hidden"],
                                       torch.device("cpu"))
        timed = time_deep_ep([deep_ep, deep_ep], x, topk_idx, weights, case["experts"], clocks)
    return {"timed": timed, "order": order}
