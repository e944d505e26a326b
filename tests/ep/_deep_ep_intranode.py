"""DeepEP's intranode correctness test (its ``tests/legacy/test_intranode.py``, the checks without
the tuning loops), run against ``import warmlink.ep.deep_ep as deep_ep`` as DeepEP code calls it.

Each rank joins a gloo group (ranks sharing one GPU cannot form an NCCL group), sets the default
dtype and device as DeepEP's harness does, and runs every check: the layout against one computed
here, dispatch with and without top-k for random BF16, rank-valued BF16, FP8 and UE8M0-packed FP8
tokens, with and without ``previous_event`` and ``async_finish``, padded outputs
(``num_worst_tokens``), cached dispatch, and combine sums. The group's reductions run on CPU
copies (gloo), the only change to the checks' own arithmetic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_workers import gloo_group
from tests.ep._deep_ep_utils import calc_diff, inplace_unique, per_token_cast_back, per_token_cast_to_fp8


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    host = t.cpu()
    dist.all_reduce(host, group=group)
    return host.to(t.device)


def _fp8(x: torch.Tensor, ue8m0: bool = False):
    """DeepEP's test input: FP8 values and their scales stored column-major."""
    values, scales = per_token_cast_to_fp8(x, ue8m0)
    return values, scales.T.contiguous().T


def test_main(case: dict, num_sms: int, local_rank: int, num_ranks: int, rank: int, buffer: deep_ep.Buffer,
              group) -> int:
    """DeepEP's ``test_main`` checks; returns how many dispatch/combine settings passed."""
    num_tokens, hidden = case["num_tokens"], case["hidden"]
    num_topk, num_experts = case["num_topk"], case["num_experts"]
    assert num_experts % num_ranks == 0

    # Random data
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device="cuda" if case["cuda"] else "cpu") * rank
    device = x.device
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    x_e4m3 = _fp8(x) if deep_ep.Buffer.is_sm90_compiled() else None
    x_ue8m0 = _fp8(x, ue8m0=True)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1]
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32, device=device) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device)
    rank_idx = topk_idx // (num_experts // num_ranks)
    rank_idx = rank_idx.to(torch.int64)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)

    # Expert meta
    num_tokens_per_expert = torch.zeros((num_experts,), dtype=torch.int, device=device)
    for i in range(num_experts):
        num_tokens_per_expert[i] = (topk_idx == i).sum()
    gbl_num_tokens_per_expert = _all_reduce(num_tokens_per_expert.clone(), group)

    # Rank layout meta
    num_tokens_per_rank = torch.empty((num_ranks,), dtype=torch.int, device=device)
    token_idx_in_rank = torch.full((num_ranks, num_tokens), -1, dtype=torch.long, device=device)
    for i in range(num_ranks):
        num_tokens_per_rank[i] = (rank_idx == i).sum()
        token_sel = (rank_idx == i).max(dim=-1)[0]
        count = token_sel.sum().item()
        tokens = torch.sort(token_sel.to(torch.int), descending=True)[1]
        tokens[:count] = torch.sort(tokens[:count])[0]
        token_idx_in_rank[i][tokens[:count]] = torch.arange(count, dtype=torch.long, device=device)
    token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
    is_token_in_rank = token_idx_in_rank >= 0
    gbl_num_tokens_per_rank = _all_reduce(num_tokens_per_rank.clone(), group)

    ref_num_tokens_per_rank, _, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    assert torch.allclose(ref_num_tokens_per_rank, num_tokens_per_rank)
    assert torch.allclose(ref_num_tokens_per_expert, num_tokens_per_expert)
    assert torch.allclose(ref_is_token_in_rank, is_token_in_rank)
    group.barrier()

    # Config
    nvl_buffer_size = 256
    config = deep_ep.Config(num_sms, 8, nvl_buffer_size)

    def check_data(check_x, rank_prefix_matrix):
        assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
        check_start = 0
        for i in range(num_ranks):
            check_end = rank_prefix_matrix[i][rank].item()
            assert (check_x[check_start:check_end, :].int() - i).sum().item() == 0
            check_start = check_end

    passed = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in filter(lambda elem: elem is not None, (x_pure_rand, x, x_e4m3, x_ue8m0)):
                for with_topk in (False, True):
                    dispatch_args = {"x": current_x, "num_tokens_per_rank": num_tokens_per_rank,
                                     "is_token_in_rank": is_token_in_rank, "num_tokens_per_expert": num_tokens_per_expert,
                                     "config": config, "async_finish": async_mode}
                    if with_topk:
                        dispatch_args.update({"topk_idx": topk_idx, "topk_weights": topk_weights_pure_rand
                                              if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        dispatch_args.update({"previous_event": buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = \
                        buffer.dispatch(**dispatch_args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    # Checks
                    rank_prefix_matrix = handle[0]
                    assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0), \
                        f"{gbl_num_tokens_per_rank[rank].item()} != {recv_x.size(0)}"
                    assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == recv_num_tokens_per_expert_list
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix)
                    recv_topk_weights_clone = None
                    if with_topk:
                        # Check `topk_idx`
                        assert (recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < (num_experts // num_ranks)))
                                ).sum().item() == recv_topk_idx.numel()
                        for i, count in enumerate(recv_num_tokens_per_expert_list):
                            assert recv_topk_idx.eq(i).sum().item() == count

                        # Check `topk_weights`
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(
                                dim=1, keepdim=True).expand_as(recv_topk_weights)[recv_topk_idx.eq(-1)]
                            check_data(recv_topk_weights, rank_prefix_matrix)

                    # Test `num_worst_tokens != 0`
                    if with_topk:
                        num_worst_tokens = num_tokens * num_ranks
                        dispatch_args.update({"num_worst_tokens": num_worst_tokens})
                        recv_worst_x, recv_worst_topk_idx, recv_worst_topk_weights, empty_list, _, event = \
                            buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_worst_x = per_token_cast_back(*recv_worst_x) if isinstance(recv_worst_x, tuple) else recv_worst_x
                        assert len(empty_list) == 0
                        assert num_worst_tokens == recv_worst_x.size(0)
                        assert num_worst_tokens == recv_worst_topk_idx.size(0)
                        assert num_worst_tokens == recv_worst_topk_weights.size(0)
                        assert torch.equal(recv_x, recv_worst_x[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, recv_worst_topk_idx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_weights_clone, recv_worst_topk_weights[:recv_x.size(0)])
                        assert torch.all(recv_worst_topk_idx[recv_x.size(0):] == -1).item()

                    # Test cached dispatch (must without top-k staffs)
                    if not with_topk:
                        dispatch_args = {"x": current_x, "handle": handle, "config": config, "async_finish": async_mode}
                        if previous_mode:
                            dispatch_args.update({"previous_event": buffer.capture()})
                        recv_x, _, _, _, _, event = buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                        if current_x is not x_pure_rand:
                            check_data(recv_x, rank_prefix_matrix)

                    # Test combine
                    combine_args = {"x": recv_x, "handle": handle, "config": config, "async_finish": async_mode}
                    if with_topk:
                        combine_args.update({"topk_weights": recv_topk_weights})
                    if previous_mode:
                        combine_args.update({"previous_event": buffer.capture()})
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    event.current_stream_wait() if async_mode else ()
                    check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    assert calc_diff(check_x, ref_x) < 5e-6
                    if with_topk:
                        check_topk_weights = combined_topk_weights if (current_x is x_pure_rand) else (
                            combined_topk_weights / is_token_in_rank.sum(dim=1).unsqueeze(1))
                        ref_topk_weights = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        assert calc_diff(check_topk_weights, ref_topk_weights) < 1e-9
                    passed += 1

    # The recommended configs, as the tuning loop's "default" entries use them
    deep_ep.Buffer.set_num_sms(num_sms)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                                                 is_token_in_rank=is_token_in_rank,
                                                 num_tokens_per_expert=num_tokens_per_expert,
                                                 config=deep_ep.Buffer.get_dispatch_config(num_ranks))
    check_data(recv_x, handle[0])
    combined_x, _, _ = buffer.combine(recv_x, handle, config=deep_ep.Buffer.get_combine_config(num_ranks))
    assert calc_diff(combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1), x) < 5e-6
    return passed


def intranode_rank(rank: int, num_ranks: int, store, case: dict) -> int:
    """One rank of the test (``_group.run_ranks``; the store it passes is not used: the Buffer
    makes its own from the group). ``case``: num_tokens, hidden, num_topk, num_experts, dist_port,
    cuda, num_nvl_bytes (None: the largest hint of DeepEP's recommended configs), and report_send
    (return ``(checks passed, the inner Buffer's send)``)."""
    try:
        with gloo_group(rank, num_ranks, case["dist_port"]) as group:
            torch.set_default_dtype(torch.bfloat16)  # as DeepEP's init_dist, after the group
            torch.set_default_device("cuda" if case["cuda"] else "cpu")
            if case["cuda"]:
                torch.cuda.set_device(rank % torch.cuda.device_count())
            num_nvl_bytes = case.get("num_nvl_bytes") or max(
                config.get_nvl_buffer_size_hint(case["hidden"] * 2, num_ranks)
                for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)))
            buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                                    explicitly_destroy=True, allow_mnnvl=False)
            torch.manual_seed(rank)
            passed = test_main(case, 24, rank, num_ranks, rank, buffer, group)
            send = buffer.warmlink_buffer.send  # how the Buffer within the budget moves its rows
            buffer.destroy()
            dist.barrier()
            return (passed, send) if case.get("report_send") else passed
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
