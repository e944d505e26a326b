"""Rank side of the several-rounds tests (deep_ep.rounds, Note [Rounds beyond the budget]): the
same batches through a deep_ep Buffer that holds them in one round and one whose budget holds a
few tokens per rank, compared bit for bit. Ranks hold different token counts, one of them none."""

from __future__ import annotations

import torch

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_workers import gloo_group
from warmlink.ep.deep_ep.sizing import needed_bytes
from warmlink.ep.wire.fp8 import quantize
from warmlink.errors import ConfigError


def _inputs(case: dict, rank: int):
    gen = torch.Generator().manual_seed(case["seed"] * 100 + rank)
    t = case["tokens"][rank]
    x = torch.randint(-3, 4, (t, case["hidden"]), generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, case["experts"], generator=gen).topk(case["topk"], dim=1).indices
    idx[torch.rand(t, case["topk"], generator=gen) < 0.2] = -1
    return x, idx.to(deep_ep.topk_idx_t), torch.rand(t, case["topk"], generator=gen)


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def rounds_equal_one_round(rank: int, num_ranks: int, store, case: dict) -> dict:
    """Every call kind through both Buffers; per kind, whether the outputs are identical."""
    out: dict = {}
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        x, idx, w = _inputs(case, rank)
        small_budget = needed_bytes(case["held"], num_ranks, case["hidden"], case["topk"])
        one = deep_ep.Buffer(group, needed_bytes(max(case["tokens"]), num_ranks, case["hidden"], case["topk"]))
        many = deep_ep.Buffer(group, small_budget)
        lay = one.get_dispatch_layout(idx, case["experts"])
        args = {"num_tokens_per_rank": lay[0], "is_token_in_rank": lay[3], "num_tokens_per_expert": lay[2]}
        got = {}
        for name, buf in (("one", one), ("many", many)):
            r = {}
            recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                           expert_alignment=4, **args)
            r["dispatch"] = (recv_x, recv_idx, recv_w, per_expert, handle[0], handle[4])
            y = recv_x.float().mul(rank + 2).to(torch.bfloat16)  # an "expert" that differs per rank
            r["combine"] = buf.combine(y, handle, topk_weights=recv_w)[:2]
            r["cached"] = buf.dispatch(x, handle=handle)[0]
            r["fp8"] = buf.dispatch(quantize(x), topk_idx=idx, topk_weights=w, **args)[0]
            r["no_topk"] = buf.dispatch(x, **args)[:4]
            worst = 2 * sum(case["tokens"])
            padded = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst, **args)
            r["padded"] = padded[:4]
            r["padded_combine"] = buf.combine(padded[0], padded[4], topk_weights=padded[2])[:2]
            try:
                buf.dispatch(x, topk_idx=idx, num_worst_tokens=1, **args)
                r["too_few_worst"] = "ok"
            except ConfigError as exc:
                r["too_few_worst"] = f"ConfigError: {exc}"
            r["rounds"] = None if handle.rounds is None else len(handle.rounds)
            r["repr"] = repr(handle)
            got[name] = r
        # one rank's wrong routing shape: every rank raises at once, nothing is sent, the next call works
        bad = dict(args, is_token_in_rank=args["is_token_in_rank"][:-1]) if rank == 1 else args
        try:
            many.dispatch(x, topk_idx=idx, **bad)
            out["one_bad_rank"] = "ok"
        except ConfigError as exc:
            out["one_bad_rank"] = str(exc)
        out["after_bad"] = _same(many.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=4, **args)[0],
                                 got["many"]["dispatch"][0])
        # the same, padded: no meeting first, so rank 1 refuses in the round itself (ep.Buffer.refuse_dispatch)
        worst = 2 * sum(case["tokens"])
        try:
            many.dispatch(x, topk_idx=idx, num_worst_tokens=worst, **bad)
            out["one_bad_rank_padded"] = "ok"
        except ConfigError as exc:
            out["one_bad_rank_padded"] = str(exc)
        out["after_bad_padded"] = _same(many.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst,
                                                      **args)[:4], got["many"]["padded"])
        # a padded dispatch never meets the peers' hosts; an unpadded one only after its one round was
        # refused (here: rank 0's 23 tokens need rounds), and not at all where every batch fits a round
        inner, meets = many.warmlink_buffer, []
        gather = inner.all_gather_int
        inner.all_gather_int = lambda *a, **k: meets.append(a) or gather(*a, **k)
        many.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst, **args)
        out["padded_meets"] = len(meets)
        many.dispatch(x, topk_idx=idx, topk_weights=w, **args)
        out["unpadded_meets"] = len(meets) - out["padded_meets"]
        del inner.all_gather_int
        one_inner, one_meets = one.warmlink_buffer, []
        one_gather = one_inner.all_gather_int
        one_inner.all_gather_int = lambda *a, **k: one_meets.append(a) or one_gather(*a, **k)
        out["one_round_same"] = _same(one.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=4, **args)[:4],
                                      got["one"]["dispatch"][:4])
        out["one_round_meets"] = len(one_meets)
        del one_inner.all_gather_int
        for kind in ("dispatch", "combine", "cached", "fp8", "no_topk", "padded", "padded_combine"):
            out[kind] = _same(got["one"][kind], got["many"][kind])
        out["rounds"] = (got["one"]["rounds"], got["many"]["rounds"])
        out["too_few_worst"] = (got["one"]["too_few_worst"], got["many"]["too_few_worst"])
        out["repr"] = got["many"]["repr"]
        out["inner_tokens"] = many.warmlink_buffer.layout.max_tokens
        out["inner_bytes"] = many.warmlink_buffer.layout.nbytes
        out["budget"] = small_budget
        out["received"] = int(got["one"]["dispatch"][0].shape[0])
        many.close()
        one.close()
    return out


def later_batch_in_rounds(rank: int, num_ranks: int, store, case: dict) -> list[dict]:
    """A slot Buffer (its first batch fits a round) given ``case["batches"]`` in turn (each a token
    count per rank): per batch, how many host meets it made, its rounds, and whether its dispatch
    and combine equal the reference (tests/ep/_reference.py)."""
    from tests.ep._reference import reference_combine, reference_dispatch

    on = torch.device("cpu")
    if case.get("cuda"):  # ranks may share one GPU
        on = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(on)
    out = []
    with gloo_group(rank, num_ranks, case["dist_port"]) as group:
        buf = deep_ep.Buffer(group, needed_bytes(case["held"], num_ranks, case["hidden"], case["topk"]))
        for step, tokens in enumerate(case["batches"]):
            every = [_inputs(dict(case, tokens=tokens, seed=case["seed"] + step), r) for r in range(num_ranks)]
            x, idx, w = (t.to(on) for t in every[rank])
            meets = []
            inner = buf.warmlink_buffer
            if inner is not None:  # (built by the first dispatch)
                gather = inner.all_gather_int
                inner.all_gather_int = lambda *a, _g=gather, **k: meets.append(a) or _g(*a, **k)
            lay = buf.get_dispatch_layout(idx, case["experts"])
            recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                num_tokens_per_expert=lay[2])
            if inner is not None:
                del inner.all_gather_int
            ref = reference_dispatch([e[0] for e in every], [e[1].long() for e in every], [e[2] for e in every],
                                     case["experts"])
            got = (recv_x.cpu(), recv_idx.cpu(), recv_w.cpu())
            want = (ref[rank]["recv_x"], ref[rank]["recv_topk_idx"].to(got[1].dtype), ref[rank]["recv_topk_weights"])
            # every rank's expert outputs, as each rank makes them: its rows times (its rank + 2)
            ys = [r_["recv_x"].float().mul(r + 2).to(torch.bfloat16) for r, r_ in enumerate(ref)]
            combined = buf.combine(recv_x.float().mul(rank + 2).to(torch.bfloat16), handle, topk_weights=recv_w)[0]
            want_combined = reference_combine(ys, [r_["recv_src"] for r_ in ref], tokens,
                                              [r_["recv_topk_weights"] for r_ in ref])[rank]["out"]
            out.append({"meets": len(meets), "rounds": None if handle.rounds is None else len(handle.rounds),
                        "streamed": buf.warmlink_buffer.send == "stream", "dispatch": _same(got, want),
                        "combine": _same(combined.cpu(), want_combined)})
        buf.close()
    return out
