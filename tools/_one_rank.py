"""A one-rank ep Buffer on GPU 0 with random top-8 of 256 routing: the setup of the host-time
tools (``ep_host_profile.py``, ``ep_host_steps.py``; ``one_rank_low_latency`` and, beside it,
``one_rank_deep_ep`` for ``ll_kernel_time.py``, ``deep_ep_sides`` for ``ll_host_profile.py`` and
``ll_eager_loop.py``). A one-rank group runs
the same host path as a larger one up to the peer loops."""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist

from warmlink.ep import Buffer
from warmlink.rendezvous import Store

EXPERTS, TOPK = 256, 8


def _inputs(tokens: int, hidden: int, experts: int, topk: int):
    """``(x, idx, w)`` on GPU 0 (made current), seeded: the same every run."""
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, 1).indices.cuda()
    w = torch.rand(tokens, topk, generator=gen).cuda()
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().cuda()
    return x, idx, w


def one_rank(tokens: int, hidden: int, prefix: str, **options):
    """``(buf, store, x, kw)``: the Buffer (built with ``options``, e.g. ``send="copy"``) and its
    store (the caller closes both), BF16 ``x`` and the dispatch's routing keywords
    (get_dispatch_layout's outputs, ids and weights)."""
    x, idx, w = _inputs(tokens, hidden, EXPERTS, TOPK)
    store = Store(is_server=True, prefix=prefix, timeout_s=30)
    buf = Buffer(store, 0, 1, max_tokens_per_rank=tokens, hidden=hidden, num_topk=TOPK, timeout_s=30, **options)
    lay = buf.get_dispatch_layout(idx, EXPERTS)
    kw = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2], "topk_idx": idx,
          "topk_weights": w}
    return buf, store, x, kw


def add_shape_args(parser) -> None:
    """The low-latency tools' shape arguments: DeepEP's decode shape by default."""
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)


def one_rank_low_latency(args, prefix: str):
    """``(buf, store, x, idx, w)``: a one-rank low-latency Buffer of ``args``' shape (the caller
    closes both), BF16 ``x``, top-k ids and weights."""
    x, idx, w = _inputs(args.tokens, args.hidden, args.experts, args.topk)
    store = Store(is_server=True, prefix=prefix, timeout_s=30)
    buf = Buffer(store, 0, 1, max_tokens_per_rank=args.tokens, hidden=args.hidden, num_topk=args.topk, timeout_s=30,
                 low_latency_mode=True, num_experts=args.experts)
    return buf, store, x, idx, w


def one_rank_deep_ep(x, args):
    """``(buffer, id dtype)``: DeepEP V1's low-latency Buffer over a one-rank group (NVSHMEM with one
    PE) of ``args``' shape and the dtype its ``topk_idx`` takes; ``(None, None)`` where DeepEP is
    not importable or ``args.no_deepep``. The caller destroys the buffer and the process group."""
    from warmlink.bench.ep_deep_ep import real_deep_ep

    deep_ep = None if args.no_deepep else real_deep_ep()
    if deep_ep is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=x.device)
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, 1, args.experts)
    buf = deep_ep.Buffer(dist.new_group([0]), 0, size, low_latency_mode=True, num_qps_per_rank=args.experts,
                         explicitly_destroy=True)
    return buf, deep_ep.topk_idx_t


@contextlib.contextmanager
def deep_ep_sides(x, idx, args):
    """Yields ``{"warmlink deep_ep": (buffer, ids), "DeepEP V1": (buffer, ids)}``: warmlink under
    DeepEP's API (``warmlink.ep.deep_ep.Buffer``, what DeepEP's callers call) and DeepEP V1 itself,
    both one-rank low-latency Buffers of ``args``' shape, each with ``idx`` in the dtype it takes;
    empty where DeepEP is not importable or ``args.no_deepep``. Destroys both on leaving."""
    from warmlink.ep import deep_ep

    deep_buf, id_dtype = one_rank_deep_ep(x, args)
    if deep_buf is None:
        yield {}
        return
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, 1, args.experts, args.topk)
    facade = deep_ep.Buffer(dist.new_group([0]), 0, size, low_latency_mode=True, explicitly_destroy=True)
    try:
        yield {"warmlink deep_ep": (facade, idx), "DeepEP V1": (deep_buf, idx.to(id_dtype))}
    finally:
        facade.destroy()
        deep_buf.destroy()
        dist.destroy_process_group()
