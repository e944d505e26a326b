"""Rank side of the widths test (deep_ep.inner, Note [Built on first dispatch]): one deep_ep
Buffer takes calls of several hidden sizes and top-k widths, each compared bit for bit with a
Buffer built for exactly that call."""

from __future__ import annotations

import torch

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_rounds import _same
from tests.ep._deep_ep_workers import gloo_group
from tests.ep._reference import reference_dispatch
from warmlink.ep.deep_ep.sizing import needed_bytes
from warmlink.ep.wire.fp8 import quantize
from warmlink.errors import ConfigError


def _inputs(case: dict, rank: int, hidden: int, topk: int):
    gen = torch.Generator().manual_seed(case["seed"] * 100 + rank * 7 + hidden + topk)
    t = case["tokens"][rank]
    x = torch.randint(-3, 4, (t, hidden), generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, case["experts"], generator=gen).topk(topk, dim=1).indices
    idx[torch.rand(t, topk, generator=gen) < 0.2] = -1
    return x, idx.to(deep_ep.topk_idx_t), torch.rand(t, topk, generator=gen)


def _calls(buf, x, idx, w, experts: int, worst: int) -> dict:
    """Every call kind of one shape: fresh (BF16, FP8, padded), cached, combine with weights."""
    lay = buf.get_dispatch_layout(idx, experts)
    args = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2]}
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)
    y = recv_x.float().mul(2).to(torch.bfloat16)
    padded = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst, **args)
    return {"dispatch": (recv_x, recv_idx, recv_w, per_expert), "cached": buf.dispatch(x, handle=handle)[0],
            "combine": buf.combine(y, handle, topk_weights=recv_w)[:2],
            "fp8": buf.dispatch(quantize(x), topk_idx=idx, topk_weights=w, **args)[0],
            # the padding rows of recv_x hold whatever the receive area held (DeepEP's too): not compared
            "padded": (padded[0][:recv_x.shape[0]], padded[1], padded[2]),
            "handle": handle}


def widths_share_one_buffer(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Per step (hidden, topk): whether the shared Buffer's calls equal those of one built for the
    step, which warmlink Buffer served them, and what a handle from before a growth gets."""
    out: dict = {"steps": [], "inner": []}
    on = torch.device("cpu")
    if case.get("cuda"):  # ranks may share one GPU
        on = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(on)
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        shared = deep_ep.Buffer(group, case["budget"])
        old_handle, served = None, []  # every warmlink Buffer that served, kept: an id() of a freed one is reused
        for hidden, topk in case["steps"]:
            x, idx, w = (t.to(on) for t in _inputs(case, rank, hidden, topk))
            worst = num_ranks * max(case["tokens"])  # the same on every rank
            got = _calls(shared, x, idx, w, case["experts"], worst)
            with deep_ep.Buffer(group, needed_bytes(max(case["tokens"]), num_ranks, hidden, topk)) as own:
                want = _calls(own, x, idx, w, case["experts"], worst)
            out["steps"].append({k: _same(got[k], want[k]) for k in want if k != "handle"})
            every = [_inputs(case, r, hidden, topk) for r in range(num_ranks)]  # the rows every rank sent
            ref = reference_dispatch([e[0] for e in every], [e[1].long() for e in every], [e[2] for e in every],
                                     case["experts"])[rank]
            mine = tuple(t.cpu() for t in got["dispatch"][:3])
            out["steps"][-1]["reference"] = _same(mine, (ref["recv_x"], ref["recv_topk_idx"], ref["recv_topk_weights"]))
            # quantized where the ranks quantize (a GPU's division may round unlike the CPU's)
            fp8_rows = [tuple(t.cpu() for t in quantize(e[0].to(on))) for e in every]
            ref8 = reference_dispatch(fp8_rows, [e[1].long() for e in every], None, case["experts"])[rank]["recv_x"]
            for name, fp8 in (("fp8 reference", got["fp8"]), ("fp8 reference, own Buffer", want["fp8"])):
                fp8 = tuple(t.cpu() for t in fp8)
                out["steps"][-1][name] = _same(fp8, ref8)
                if not out["steps"][-1][name]:  # which rows differ, for the failure's message
                    bad = (fp8[0].view(torch.uint8) != ref8[0].view(torch.uint8)).any(1) | (fp8[1] != ref8[1]).any(1) \
                        if fp8[0].shape == ref8[0].shape else torch.ones(1, dtype=torch.bool)
                    out.setdefault("diag", []).append((hidden, topk, name, tuple(fp8[0].shape), tuple(ref8[0].shape),
                                                       bad.nonzero().flatten()[:20].tolist()))
            inner = shared.warmlink_buffer
            which = next((i for i, b in enumerate(served) if b is inner), len(served))
            served[which:which + 1] = [inner]
            out["inner"].append((which, inner.layout.hidden, inner.layout.num_topk, inner.layout.max_tokens))
            if old_handle is not None and out["inner"][-1][0] != out["inner"][-2][0]:  # it grew: the old handle is refused
                try:
                    shared.combine(old_handle[0], old_handle[1])
                    out["old_handle"] = "ok"
                except ConfigError as exc:
                    out["old_handle"] = str(exc)
            old_handle = (got["dispatch"][0].float().to(torch.bfloat16), got["handle"])
        out["nbytes"] = shared.warmlink_buffer.layout.nbytes
        shared.close()
    return out
