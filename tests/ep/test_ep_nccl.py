"""warmlink.bench.ep_nccl (the torch + all_to_all_single baseline) against the EP oracle, in 2 and 3
gloo CPU processes: BF16 and FP8 dispatch, combine, uneven and empty ranks, masked top-k slots."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch

from warmlink.bench._proc import Group
from warmlink.bench.ep_nccl import (
    nccl_combine,
    nccl_dispatch,
    nccl_layout,
    time_nccl_ep,
)
from warmlink.errors import ConfigError, LayoutError

from ._reference import (
    decode_token_pattern,
    random_routing,
    reference_combine,
    reference_dispatch,
    reference_layout,
    token_pattern,
)

FP8 = torch.float8_e4m3fn
GROUP_TIMEOUT_S = 60  # gloo's bound on every collective in the children
TEST_TIMEOUT_S = 180  # the parent's bound on the whole run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(case: dict) -> tuple[list, list, list]:
    """Every rank's x, topk_idx and topk_weights, the same in every process (one seed)."""
    gen = torch.Generator().manual_seed(case["seed"])
    xs, topks, weights = [], [], []
    for rank, num_tokens in enumerate(case["tokens"]):
        xs.append(token_pattern(rank, num_tokens, case["hidden"], case["dtype"]))
        topk = random_routing(num_tokens, case["experts"], case["topk"], gen, mask_prob=case["mask_prob"])
        if num_tokens >= 2:
            topk[1] = -1  # a token that goes to no rank: zeros in combine
        topks.append(topk)
        # Multiples of 1/64: every float32 sum is exact, whatever the order.
        weights.append(torch.randint(1, 65, (num_tokens, case["topk"]), generator=gen).float() / 64)
    return xs, topks, weights


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(p, q) for p, q in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8 else torch.equal(a, b)


def _y(recv_x, rank: int) -> torch.Tensor:
    """What receiver ``rank`` sends back: bf16, scaled by rank + 1 so rows from different receivers differ."""
    values = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    return values.to(torch.bfloat16) * (rank + 1)


def _check_case(case: dict, rank: int) -> dict:
    num_ranks, num_experts = len(case["tokens"]), case["experts"]
    xs, topks, weights = _inputs(case)

    for got, want in zip(nccl_layout(topks[rank], num_experts, num_ranks), reference_layout(topks[rank], num_experts, num_ranks)):
        assert torch.equal(got, want), (case, rank, got, want)

    ref = reference_dispatch(xs, topks, weights, num_experts)
    got = nccl_dispatch(xs[rank], topks[rank], weights[rank], num_experts)
    mine = ref[rank]
    assert _equal(got.recv_x, mine["recv_x"]), (case, rank, "recv_x")
    assert _equal(got.recv_topk_idx, mine["recv_topk_idx"]), (case, rank, got.recv_topk_idx, mine["recv_topk_idx"])
    assert _equal(got.recv_topk_weights, mine["recv_topk_weights"]), (case, rank, "recv_topk_weights")
    assert got.num_recv_tokens_per_expert_list == mine["num_recv_tokens_per_expert_list"]
    src_rank, src_token = decode_token_pattern(got.recv_x)  # rows name their source, independently of ref
    assert list(zip(src_rank.tolist(), src_token.tolist())) == mine["recv_src"]

    ys = [_y(r["recv_x"], d) for d, r in enumerate(ref)]
    ws = [r["recv_topk_weights"] * (d + 1) for d, r in enumerate(ref)]
    want = reference_combine(ys, [r["recv_src"] for r in ref], case["tokens"], ws)[rank]
    out, combined_weights = nccl_combine(_y(got.recv_x, rank), got.handle, got.recv_topk_weights * (rank + 1))
    assert _equal(out, want["out"]), (case, rank, out, want["out"])
    assert _equal(combined_weights, want["combined_weights"]), (case, rank, "combined_weights")
    out_only, none = nccl_combine(_y(got.recv_x, rank), got.handle)
    assert none is None and _equal(out_only, want["out"])

    timing = time_nccl_ep(xs[rank], topks[rank], weights[rank], num_experts, iterations=2, warmup=1)
    hidden = case["hidden"]
    row_bytes = hidden * 2 if case["dtype"] == torch.bfloat16 else hidden + hidden // 128 * 4
    per_rank = [reference_layout(t, num_experts, num_ranks)[0] for t in topks]
    sent_away = sum(int(per_rank[rank][d]) for d in range(num_ranks) if d != rank)
    came_in = sum(int(per_rank[s][rank]) for s in range(num_ranks) if s != rank)
    assert timing["a2a_bytes"] == sent_away * row_bytes
    assert timing["combine_bytes"] == came_in * hidden * 2
    assert all(timing[k] > 0 for k in ("dispatch_s", "combine_s", "a2a_s")), timing
    return {"rows": len(mine["recv_src"])}


def _rank_main(control, results, rank: int, num_ranks: int, port: int, cases: list, fault: str | None = None) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    if fault == "bad_expert" and rank == 1:
        nccl_dispatch(torch.zeros(2, 8), torch.tensor([[0, 99], [1, -1]]), None, 4)
    rows = [_check_case(case, rank)["rows"] for case in cases]
    results.put({"event": "done", "rank": rank, "rows": rows})
    # Only on success: on an error the group stays up until the process exits, so the failing
    # rank's report reaches the parent before its peers see the connection drop and report that.
    dist.destroy_process_group()


def _run(cases: list, num_ranks: int, fault: str | None = None) -> list[dict]:
    port = _free_port()
    with Group(timeout_s=TEST_TIMEOUT_S) as group:
        for rank in range(num_ranks):
            group.start(f"rank{rank}", _rank_main, rank=rank, num_ranks=num_ranks, port=port, cases=cases, fault=fault)
        return group.expect("done", num_ranks)


def _cases(tokens: list[int], experts: int, topk: int, seed: int) -> list[dict]:
    base = {"tokens": tokens, "experts": experts, "topk": topk, "mask_prob": 0.3, "seed": seed}
    return [
        {**base, "dtype": torch.bfloat16, "hidden": 16},
        {**base, "dtype": FP8, "hidden": 256, "seed": seed + 1},
        {**base, "dtype": torch.bfloat16, "hidden": 8, "tokens": [0] * len(tokens)},  # nothing moves at all
    ]


def test_two_ranks():
    cases = _cases([6, 3], experts=4, topk=2, seed=1) + _cases([5, 0], experts=8, topk=3, seed=7)[:2]
    done = _run(cases, 2)
    assert sorted(m["rank"] for m in done) == [0, 1]
    assert any(rows for m in done for rows in m["rows"])


def test_three_ranks_uneven_with_an_empty_rank():
    cases = _cases([5, 0, 7], experts=6, topk=3, seed=3) + _cases([40, 33, 1], experts=12, topk=4, seed=11)[:2]
    done = _run(cases, 3)
    assert sorted(m["rank"] for m in done) == [0, 1, 2]


def test_bad_expert_fails_the_run_not_hangs():
    with pytest.raises(RuntimeError, match=r"rank1 failed:(.|\n)*LayoutError(.|\n)*expected -1 <= id < num_experts=4"):
        _run(_cases([2, 2], experts=4, topk=2, seed=0)[:1], 2, fault="bad_expert")


def test_layout_rejects_bad_input_without_a_group():
    with pytest.raises(ConfigError, match="num_experts=6"):
        nccl_layout(torch.zeros(1, 2, dtype=torch.int64), 6, 4)
    with pytest.raises(LayoutError, match="int64"):
        nccl_layout(torch.zeros(1, 2, dtype=torch.int32), 4, 2)
    with pytest.raises(LayoutError, match=r"ids in \[-2, 1\]"):
        nccl_layout(torch.tensor([[-2, 1]]), 4, 2)
