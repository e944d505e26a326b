"""DeepEP's intranode dispatch handle: the 6-tuple callers pass back to ``combine`` and to a cached
``dispatch``, with the warmlink ``ep.Handle`` those calls use inside.

DeepEP's fields, by position: ``rank_prefix_matrix``, ``channel_prefix_matrix``,
``recv_channel_prefix_matrix``, ``recv_src_idx``, ``is_token_in_rank``, ``send_head``. Callers
that read one read ``rank_prefix_matrix`` (DeepEP's tests) or pass ``is_token_in_rank`` on; those
two hold DeepEP's values. The channel matrices and ``send_head`` describe DeepEP's rings, which
warmlink does not have, and ``recv_src_idx`` (each received row's source token) is known only to
the sources here: those four are None, so a caller that reads one fails at once instead of
reading values that only look like DeepEP's.
"""

from __future__ import annotations

import itertools

import torch

from warmlink.errors import ConfigError

__all__ = ["DispatchHandle", "combine_biases"]


class DispatchHandle(tuple):
    """``(rank_prefix_matrix, None, None, None, is_token_in_rank, None)``, plus ``inner`` (the
    warmlink ``ep.Handle``) and ``owner`` (the warmlink ``ep.Buffer`` that made it).

    ``rank_prefix_matrix[s][d]``: ``[R, R]`` int32 on the Buffer's device, the rows ranks ``0..s``
    send rank ``d``: rank ``d`` receives the rows of source ``s`` at
    ``[rank_prefix_matrix[s - 1][d], rank_prefix_matrix[s][d])``.
    ``is_token_in_rank``: ``[T, R]`` bool, the dispatch's own argument.
    """

    def __new__(cls, rank_prefix_matrix: torch.Tensor, is_token_in_rank: torch.Tensor, inner, owner,
                rounds=None, num_worst_tokens: int = 0) -> "DispatchHandle":
        self = super().__new__(cls, (rank_prefix_matrix, None, None, None, is_token_in_rank, None))
        self.inner = inner
        self.owner = owner
        self.rounds = rounds  # a batch sent in several rounds (deep_ep.rounds): each round's; else None
        self._num_worst_tokens = num_worst_tokens  # with rounds (the inner handle holds its own otherwise)
        return self

    @classmethod
    def of(cls, inner, is_token_in_rank: torch.Tensor, owner, device: torch.device) -> "DispatchHandle":
        """The handle of a fresh dispatch whose warmlink handle is ``inner`` (its count matrix
        summed over the sources gives ``rank_prefix_matrix``, made on ``device``; for a padded
        dispatch that returned at launch, from its board on the device: ep.protocol.normal, Note [Padded
        dispatch returns at launch])."""
        if inner.pending is not None:
            matrix = inner.board[:, 2:2 + inner.board.shape[0]]  # [s][d]: rows s sends d
            return cls(matrix.cumsum(0, dtype=torch.int32), is_token_in_rank, inner, owner)
        prefix = inner.recv_prefix if inner.recv_prefix is not None else _prefix(inner.count_matrix, device)
        return cls(prefix, is_token_in_rank, inner, owner)

    @classmethod
    def of_rounds(cls, rounds: list, matrix: list[list[int]], num_worst_tokens: int, is_token_in_rank: torch.Tensor,
                  owner, device: torch.device) -> "DispatchHandle":
        """The handle of a fresh dispatch sent in ``rounds`` (deep_ep.rounds, Note [Rounds beyond
        the budget]); ``matrix``: their count matrices summed; ``num_worst_tokens``: the call's."""
        return cls(_prefix(matrix, device), is_token_in_rank, None, owner, rounds, num_worst_tokens)

    def tensors(self) -> tuple:
        """Every tensor the handle holds (its own and its warmlink handles'), for marking the
        streams that use them (ep.paths.comm_stream, Note [Communication stream])."""
        inners = [r.handle for r in self.rounds] if self.rounds is not None else [self.inner]
        extra = [r.rows for r in self.rounds] if self.rounds is not None else []
        return (self[0], self[4], *extra, *(t for h in inners for t in (h.is_token_in_rank, h.combine_rows)))

    @property
    def rank_prefix_matrix(self) -> torch.Tensor:
        return self[0]

    @property
    def is_token_in_rank(self) -> torch.Tensor:
        return self[4]

    @property
    def num_recv_tokens(self) -> int:
        """Rows this rank received (its outputs have ``num_worst_tokens`` rows when that was set)."""
        if self.rounds is not None:
            return sum(r.rows.shape[0] for r in self.rounds)
        return self.inner.num_recv_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens this rank dispatched (the rows of its combine's outputs)."""
        return self.rounds[-1].stop if self.rounds is not None else self.inner.num_tokens

    @property
    def num_output_rows(self) -> int:
        """Rows of the dispatch's outputs: ``num_worst_tokens`` when that was set, else the rows received."""
        worst = self._num_worst_tokens if self.rounds is not None else self.inner.num_worst_tokens
        return worst or self.num_recv_tokens

    def __repr__(self) -> str:
        where = f"rounds={len(self.rounds)}" if self.rounds is not None else f"round={self.inner.round}"
        return f"deep_ep.DispatchHandle(num_tokens={self.num_tokens}, num_recv_tokens={self.num_recv_tokens}, {where})"


def _prefix(matrix: list[list[int]], device: torch.device) -> torch.Tensor:
    """DeepEP's ``rank_prefix_matrix``: the count matrix summed over the sources, int32 on ``device``.
    Summed in Python and copied without waiting: a copy from pageable memory is staged at once, while
    a blocking one synchronizes the stream (which held the host until the dispatch it follows had
    moved every row), and pinning a tensor first costs more host time than the sum and the copy."""
    sums = list(itertools.accumulate(matrix, lambda above, row: [a + b for a, b in zip(above, row)]))
    return torch.tensor(sums, dtype=torch.int32, device="cpu").to(device, non_blocking=True)


def combine_biases(bias, handle: DispatchHandle, hidden: int, x) -> tuple:
    """DeepEP's combine ``bias``: None, a tensor or a pair, each ``[T, hidden]`` like the combined
    output of ``handle``'s dispatch, on ``x``'s device; the tensors as a tuple."""
    biases = bias if isinstance(bias, tuple) else (() if bias is None else (bias,))
    if len(biases) > 2:
        raise ConfigError(f"deep_ep.Buffer.combine: bias has {len(biases)} tensors; expected at most 2")
    shape = (handle.num_tokens, hidden)
    for b in biases:
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape or b.device != getattr(x, "device", None):
            raise ConfigError(f"deep_ep.Buffer.combine: bias {type(b).__name__} of shape {tuple(getattr(b, 'shape', ()))} "
                              f"on {getattr(b, 'device', '?')}; expected a tensor of shape {shape} on {x.device}")
    return biases
