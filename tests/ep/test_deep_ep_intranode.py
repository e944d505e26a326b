"""DeepEP's intranode correctness test through ``warmlink.ep.deep_ep`` (tests/ep/_deep_ep_intranode.py):
on CPU over shared memory at small shapes, and on a GPU at DeepEP's own shape (4096 tokens of
7168 channels, top-8 of 256 experts) with 2 and 4 ranks sharing the device, the default device
"cuda" and DeepEP's 2e9-byte budget, as its harness sets them (and at gpt-oss's 2880 channels,
top-4 of 128); and with budgets that hold a few tokens, so that every call goes in several rounds."""

from __future__ import annotations

import pytest
import torch

from tests.ep._deep_ep_intranode import intranode_rank
from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks
from warmlink.ep.deep_ep.sizing import needed_bytes

# what test_main runs: (previous_event or not) x (async or not) x 4 kinds of x x (top-k or not)
SETTINGS = 2 * 2 * 4 * 2


@pytest.mark.parametrize("num_ranks,hidden", [(2, 256), (2, 2880)])
def test_deep_eps_intranode_checks_pass_on_cpu(num_ranks, hidden):
    case = {"num_tokens": 48, "hidden": hidden, "num_topk": 4, "num_experts": 6 * num_ranks, "cuda": False,
            "dist_port": free_port()}
    assert run_ranks(intranode_rank, num_ranks, case=case, timeout_s=240) == [SETTINGS] * num_ranks


def test_deep_eps_intranode_checks_pass_on_cpu_in_rounds():
    """A budget that holds 10 tokens per rank: each call of the 48-token batches goes in 5 rounds
    (deep_ep.rounds, Note [Rounds beyond the budget]), and DeepEP's checks still all pass."""
    case = {"num_tokens": 48, "hidden": 256, "num_topk": 4, "num_experts": 12, "cuda": False,
            "num_nvl_bytes": needed_bytes(10, 2, 256, 4), "dist_port": free_port()}
    assert run_ranks(intranode_rank, 2, case=case, timeout_s=360) == [SETTINGS] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_ranks,hidden,num_topk,num_experts,num_nvl_bytes", [
    (2, 7168, 8, 256, int(2e9)), (4, 7168, 8, 256, int(2e9)),
    (2, 2880, 4, 128, int(2e9)),  # gpt-oss's
    (2, 7168, 8, 256, None)])  # DeepEP's hint
def test_deep_eps_intranode_checks_pass_on_gpu_at_deep_eps_shape(num_ranks, hidden, num_topk, num_experts, num_nvl_bytes):
    """With 2e9 bytes and with DeepEP's hint the Buffer within streams wherever the CUDA streamed
    kernels run (deep_ep.inner, Note [Built on first dispatch])."""
    case = {"num_tokens": 4096, "hidden": hidden, "num_topk": num_topk, "num_experts": num_experts, "cuda": True,
            "num_nvl_bytes": num_nvl_bytes, "dist_port": free_port(), "report_send": True}
    want = "stream"
    assert run_ranks(intranode_rank, num_ranks, case=case, timeout_s=600) == [(SETTINGS, want)] * num_ranks
