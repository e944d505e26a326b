"""Replicas and duplicated shards through the real Publisher, store, manifest and Receiver over shm
(Note [Replica choice] in ``refit.plan``, Note [Replicated parts] in ``refit.manifest``).

Two trainer ranks built with the same ``rank=`` (a launcher bug) publish the same boxes of sharded
tensors, each with its own bytes: a receiver must refuse before any byte moves, naming the tensor
and both ranks, instead of installing the other rank's bytes. True replicas (GQA KV heads at TP >
num_kv_heads, the data-parallel ranks of an EP world, whole tensors) refit bit-exactly, their
replicated flags carried by the manifests.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import TIMEOUT_S, new_store  # noqa: E402
from test_families import _refit, config, model  # noqa: E402
from warmlink.errors import LayoutError  # noqa: E402
from warmlink.refit import Publisher, Receiver  # noqa: E402
from warmlink.refit._declare import module_tensors  # noqa: E402
from warmlink.refit.families import layouts  # noqa: E402

SENTINEL = 7.0


def _other_model(family: str):
    """The family's model with other bytes in every tensor: what a second trainer rank holds."""
    m = transformers.AutoModelForCausalLM.from_config(config(family)).to(torch.bfloat16)
    m.load_state_dict(model(family).state_dict())
    with torch.no_grad():
        for t in module_tensors(m).values():
            t.add_(1)
    return m


def test_two_ranks_with_the_same_rank_are_refused_before_any_byte_moves():
    """Issue 37, item 8: publishers 0 and 1 both declare vLLM TP rank 0 of 2, each over its own
    model; a vLLM TP 2 receiver of rank 0 (which every duplicated box feeds) gets a LayoutError from
    ``refit()`` naming a tensor and both ranks, and its targets keep their bytes."""
    family = "llama"
    with contextlib.ExitStack() as closing:  # closes the receiver, then the publishers, then the store
        store = closing.enter_context(new_store())
        for rank, m in enumerate((model(family), _other_model(family))):
            pub = Publisher(store, rank=rank, world_size=2, backend="shm", timeout_s=TIMEOUT_S)
            closing.callback(pub.close)
            pub.add_module(m, layouts(m, convention="vllm", tp=2, rank=0))  # the bug: rank=0 on both
            pub.export()
        lays = layouts(model(family), convention="vllm", tp=2, rank=0)
        rec = Receiver(store, num_publishers=2, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(rec.close)
        targets = {n: torch.full(lay.shape, SENTINEL, dtype=torch.bfloat16) for n, lay in lays.items()}
        for n, lay in lays.items():
            rec.add(n, lay, targets[n])
        with pytest.raises(LayoutError) as info:
            rec.refit()
        msg = str(info.value)
        held = re.search(r"logical='(model\.[^']+)' box=\(.*?\) is held by rank=0 tensor='([^']+)' and by rank=1 "
                         r"tensor='([^']+)'", msg)
        assert held is not None and "marked replicated" in msg, msg
        assert held.group(2) == held.group(3) and held.group(2) in lays, msg  # one vLLM tensor on both ranks
        untouched = [n for n, t in targets.items() if not bool((t == SENTINEL).all())]
        assert untouched == [], f"targets written before the refusal: {untouched}"
        with pytest.raises(LayoutError, match="marked replicated"):  # refused again: nothing was cached
            rec.refit()


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_gqa_kv_replicas_refit_bit_exact(family):
    """vLLM TP 4 over 2 KV heads: each KV head on two publishers, marked replicated in their
    manifests (Phi-3's fused qkv_proj too), received by hf TP 1 and vLLM TP 2 and 4 ranks."""
    src = layouts(model(family), convention="vllm", tp=4, rank=3)
    marked = {p.logical for lay in src.values() for p in lay.parts if p.replicated}
    assert marked and all(".k_proj." in n or ".v_proj." in n or ".qkv_proj." in n for n in marked), marked
    _refit(family, ("vllm", 4, 1), [("hf", 1, 1), ("vllm", 2, 1), ("vllm", 4, 1)])


@pytest.mark.parametrize("src_conv", ["hf", "vllm"])
def test_data_parallel_replicas_of_an_ep_world_refit_bit_exact(src_conv):
    """EP 4 over TP 2: the two data-parallel ranks of each TP rank publish the same dense shards,
    marked replicated; the experts are split over all four."""
    _refit("qwen3_moe", (src_conv, 2, 4), [("hf", 1, 1), ("vllm", 2, 1)])
