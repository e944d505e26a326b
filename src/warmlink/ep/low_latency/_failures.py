"""What a low-latency kernel reports when it fails, and what the host raises for it.

A kernel cannot raise. One whose wait passed its deadline, or that finds the ranks' calls
disagree, an expert id out of range or a combine that unmasks an entry, writes a code, its
round's slot and sequence number and the rank concerned into pinned host words (the device
path's ``fail``, read by the next call on the host: Note [Low-latency device path]).
"""

from __future__ import annotations

from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

__all__ = ["F_MISMATCH", "F_REFUSED", "F_TIMEOUT", "F_UNMASKED", "error", "read"]

F_TIMEOUT, F_MISMATCH, F_REFUSED, F_UNMASKED = 1, 2, 3, 4  # (ep.low_latency._triton's constexprs)


def read(words) -> tuple[int, str, int, int] | None:
    """``(code, phase, seq, rank)`` the kernels reported in ``words`` (an int64 ``[4]`` view of the
    pinned words), or None; a code other than ``F_TIMEOUT`` is cleared (it is raised once)."""
    code = int(words[0])
    if not code:
        return None
    slot, seq, rank = (int(v) for v in words[1:])
    if code != F_TIMEOUT:
        words[0] = 0
    return code, "dispatch" if slot < 2 else "combine", seq, rank


def error(failure: tuple[int, str, int, int] | None, func: str, device: int, timeout_s: float, num_experts: int,
          refs: dict) -> Exception | None:
    """The exception of ``read``'s ``failure``, or None: ``TransferTimeout`` / ``PeerLostError``
    (the rank waited for is dead: ``refs[rank].alive()``) for a timeout, else ``ConfigError``."""
    if failure is None:
        return None
    code, phase, seq, r = failure
    what = f"{func}: an earlier low-latency {phase} on cuda:{device} (sequence {seq} of its parity)"
    if code == F_TIMEOUT:
        ref = refs.get(r)
        if ref is not None and not ref.alive():
            return PeerLostError(f"{what} waited for rank {r} (pid {ref.pid}), which died")
        return TransferTimeout(f"{what} waited {timeout_s:.3g} s for rank {r}; a peer is stalled, or the ranks made "
                               "different low-latency calls")
    if code == F_MISMATCH:
        return ConfigError(f"{what}: rank {r} called with other arguments (num_max_dispatch_tokens_per_rank, "
                           "use_fp8, round_scale, use_ue8m0) or combined another dispatch's handle; every rank must "
                           "make the same call; that call's outputs are not valid (the next call goes on)")
    if code == F_REFUSED:
        return ConfigError(f"{what}: rank {r}'s topk_idx held an expert id outside [-1, {num_experts}); that round "
                           "moved no rows and its outputs are not valid (the next call goes on)")
    return ConfigError(f"{what}: topk_idx of the combine selected experts where the dispatch's topk_idx held -1 "
                       "(entries may only be masked to -1); those rows were not summed")
