"""What a streamed Buffer keeps on the device between its calls (ep.paths.streamed): the seq and round
counts, which a one-program kernel advances before each call, and a padded dispatch's offsets and
verdict, which one program takes from its count board. Both so that no host value is baked into a
launch a CUDA graph replays (Note [Streamed calls] in ep.protocol.streamed).
"""

from __future__ import annotations

import functools

import torch

from warmlink.ep.kernels.launch import launch

__all__ = ["advance", "padded_plan", "padded_plan_torch"]


def advance(counters: torch.Tensor, call_round: torch.Tensor | None = None, kernel=None) -> None:
    """On the current stream: ``counters[1] += 1`` (the next call's seq), and with ``call_round`` (a
    fresh dispatch) ``counters[0] += 1`` (its count exchange's round) written into ``call_round`` too.
    ``counters``: ``[2]`` int64 on the device, zero before the first call."""
    launch(kernel or _advance(), (1,), (counters, call_round if call_round is not None else counters),
           {"FRESH": call_round is not None})


def padded_plan(board: torch.Tensor, exchange_valid: torch.Tensor, me: int, num_worst_tokens: int,
                kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(recv_offset [R], valid [1])`` int64 on the device, from a padded round's ``[R, row]`` count
    board (row s: tag, valid flag, the rows s sends each rank, ...): where each source's rows start
    in rank ``me``'s outputs, and 1 when the round stands: ``exchange_valid`` (the count exchange's
    word) is not 0 and no rank receives more than ``num_worst_tokens`` rows. One launch."""
    r = board.shape[0]
    offsets = torch.empty(r, dtype=torch.int64, device=board.device)
    valid = torch.empty(1, dtype=torch.int64, device=board.device)
    launch(kernel or _padded_plan(), (1,), (board, board.stride(0), exchange_valid, offsets, valid, me, num_worst_tokens),
           {"NUM_RANKS": r, "R_BLOCK": max(2, 1 << max(0, r - 1).bit_length())})
    return offsets, valid


def padded_plan_torch(board: torch.Tensor, exchange_valid: torch.Tensor, me: int,
                      num_worst_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``padded_plan``'s reference."""
    counts = board[:, 2:2 + board.shape[0]]
    mine = counts[:, me]
    fits = counts.sum(0).amax() <= num_worst_tokens
    return mine.cumsum(0) - mine, ((exchange_valid[:1] != 0) & fits).to(torch.int64)


@functools.cache
def _padded_plan():
    from warmlink.ep.kernels import stream_programs
    from warmlink.ep.kernels.launch import FastLaunch

    return FastLaunch(stream_programs.padded_plan_kernel)


@functools.cache
def _advance():
    from warmlink.ep.kernels import stream_programs
    from warmlink.ep.kernels.launch import FastLaunch

    return FastLaunch(stream_programs.advance_kernel)
