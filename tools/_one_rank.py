"""A one-rank ep Buffer on GPU 0 with random top-8 of 256 routing: the setup of the host-time
tools (``ep_host_profile.py``, ``ep_host_steps.py``). A one-rank group runs the same host path as
a larger one up to the peer loops."""

from __future__ import annotations

import torch

from warmlink.ep import Buffer
from warmlink.rendezvous import Store

EXPERTS, TOPK = 256, 8


def one_rank(tokens: int, hidden: int, prefix: str, **options):
    """``(buf, store, x, kw)``: the Buffer (built with ``options``, e.g. ``send="copy"``) and its
    store (the caller closes both), BF16 ``x`` and the dispatch's routing keywords
    (get_dispatch_layout's outputs, ids and weights)."""
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(tokens, EXPERTS, generator=gen).topk(TOPK, 1).indices.cuda()
    w = torch.rand(tokens, TOPK).cuda()
    x = torch.randn(tokens, hidden).bfloat16().cuda()
    store = Store(is_server=True, prefix=prefix, timeout_s=30)
    buf = Buffer(store, 0, 1, max_tokens_per_rank=tokens, hidden=hidden, num_topk=TOPK, timeout_s=30, **options)
    lay = buf.get_dispatch_layout(idx, EXPERTS)
    kw = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2], "topk_idx": idx,
          "topk_weights": w}
    return buf, store, x, kw
