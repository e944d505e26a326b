"""DeepEP's intranode correctness test through ``warmlink.ep.deep_ep`` (tests/ep/_deep_ep_intranode.py):
on CPU over shared memory at small shapes, and on a GPU at DeepEP's own shape (4096 tokens of
7168 channels, top-8 of 256 experts) with 2 and 4 ranks sharing the device, the default device
"cuda" and DeepEP's 2e9-byte budget, as its harness sets them (and at gpt-oss's 2880 channels,
top-4 of 128)."""

from __future__ import annotations

import pytest
import torch

from tests.ep._deep_ep_intranode import intranode_rank
from tests.ep._deep_ep_workers import free_port
from tests.ep._group import run_ranks

# what test_main runs: (previous_event or not) x (async or not) x 4 kinds of x x (top-k or not)
SETTINGS = 2 * 2 * 4 * 2


@pytest.mark.parametrize("num_ranks,hidden", [(2, 256), (2, 2880)])
def test_deep_eps_intranode_checks_pass_on_cpu(num_ranks, hidden):
    case = {"num_tokens": 48, "hidden": hidden, "num_topk": 4, "num_experts": 6 * num_ranks, "cuda": False,
            "dist_port": free_port()}
    assert run_ranks(intranode_rank, num_ranks, case=case, timeout_s=240) == [SETTINGS] * num_ranks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_ranks,hidden,num_topk,num_experts", [(2, 7168, 8, 256), (4, 7168, 8, 256),
                                                                  (2, 2880, 4, 128)])  # the last: gpt-oss's
def test_deep_eps_intranode_checks_pass_on_gpu_at_deep_eps_shape(num_ranks, hidden, num_topk, num_experts):
    case = {"num_tokens": 4096, "hidden": hidden, "num_topk": num_topk, "num_experts": num_experts, "cuda": True,
            "num_nvl_bytes": int(2e9), "dist_port": free_port()}
    assert run_ranks(intranode_rank, num_ranks, case=case, timeout_s=600) == [SETTINGS] * num_ranks
