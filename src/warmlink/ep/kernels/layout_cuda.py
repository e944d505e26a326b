"""The dispatch layout as one CUDA C++ block (``layout.cu`` beside this module), compiled at run time
by NVRTC (warmlink._nvrtc); ``ep.kernels.steps.layout`` launches it where it ``fits`` and the Triton
layout kernel elsewhere.

Why: ``get_dispatch_layout`` opens every DeepEP-style fresh dispatch, and there its host time is
the GPUs' idle time. The Triton kernel needs its counts zeroed first (its programs add into them),
and a Triton launch binds its arguments in Python: together 60-80 us of host time per call on the
bench's H200 hosts (``tools/deep_ep_fresh_steps.py``), where an NVRTC launch costs 4-5. One block
holds every count in shared memory and writes them once, so a call is one launch into two
``torch.empty`` outputs. One block reads DeepEP's 4096 x 8 ids in a few microseconds; past
``MAX_TOKENS`` tokens the Triton kernel's grid runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from importlib import resources

import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.launch import current_stream

__all__ = ["MAX_TOKENS", "fits", "layout"]

log = logging.getLogger("warmlink.ep")

MAX_TOKENS = 16384  # one block's tokens at most (beyond, the Triton kernel's grid)
MAX_RANKS = 64  # layout.cu's: a token's ranks as one 64-bit mask
MAX_BINS = 4096  # layout.cu's: ranks + experts + 1 shared counters
THREADS = 1024
_ARGS = struct.Struct("<3Qq6i")  # layout.cu's LayoutArgs


@functools.cache
def _kernel(device: int):
    """The compiled kernel on ``device``, or None where NVRTC or the driver cannot give it (then the
    Triton kernel runs, and a warning says why once)."""
    from warmlink import _nvrtc
    from warmlink.errors import TransferError

    source = resources.files("warmlink.ep.kernels").joinpath("layout.cu").read_text()
    try:
        return _nvrtc.load(source, "warmlink_layout", device, ("warmlink_dispatch_layout",))["warmlink_dispatch_layout"]
    except (ImportError, TransferError) as exc:
        log.warning("ep: the CUDA layout kernel is unavailable on cuda:%d (%s): the Triton one runs", device, exc)
        return None


def fits(topk: torch.Tensor, num_experts: int, num_ranks: int) -> bool:
    """Whether ``layout`` takes ``topk`` (contiguous ``[T, K]``) on its device."""
    return (topk.is_cuda and topk.dtype in (torch.int64, torch.int32) and topk.shape[0] <= MAX_TOKENS
            and num_ranks <= MAX_RANKS and num_ranks + num_experts + 1 <= MAX_BINS
            and _kernel(topk.device.index) is not None)


def layout(topk: torch.Tensor, num_experts: int, num_ranks: int) -> tuple[torch.Tensor, ...]:
    """``ep.kernels.steps.layout``'s outputs from one launch on the current stream; ``topk`` contiguous
    and ``fits``."""
    device = topk.device
    compiled = host.module()
    if compiled is not None:  # the same steps compiled (ep.kernels.host)
        kernel = _kernel(device.index)
        error, *outputs = compiled.layout(topk, num_experts, num_ranks, device.index, host.launch_address(),
                                          kernel.address, THREADS, current_stream(device.index))
        if error:
            kernel.failed(error, 1, THREADS)
        return tuple(outputs)
    num_tokens, num_k = topk.shape
    counts = torch.empty(num_ranks + num_experts + 1, dtype=torch.int32, device=device)
    in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
    args = ctypes.create_string_buffer(_ARGS.pack(
        topk.data_ptr(), in_rank.data_ptr(), counts.data_ptr(), num_tokens, topk.element_size(), num_k, num_experts,
        num_experts // num_ranks, num_ranks, 0), _ARGS.size)
    _kernel(device.index)(1, THREADS, args, current_stream(device.index))
    per_rank, per_expert, bad = counts.split((num_ranks, num_experts, 1))  # (one torch call for the three views)
    return per_rank, per_expert, in_rank, bad
