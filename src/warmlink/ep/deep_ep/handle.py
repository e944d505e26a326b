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

import torch

__all__ = ["DispatchHandle"]


class DispatchHandle(tuple):
    """``(rank_prefix_matrix, None, None, None, is_token_in_rank, None)``, plus ``inner`` (the
    warmlink ``ep.Handle``) and ``owner`` (the warmlink ``ep.Buffer`` that made it).

    ``rank_prefix_matrix[s][d]``: ``[R, R]`` int32 on the Buffer's device, the rows ranks ``0..s``
    send rank ``d``: rank ``d`` receives the rows of source ``s`` at
    ``[rank_prefix_matrix[s - 1][d], rank_prefix_matrix[s][d])``.
    ``is_token_in_rank``: ``[T, R]`` bool, the dispatch's own argument.
    """

    def __new__(cls, rank_prefix_matrix: torch.Tensor, is_token_in_rank: torch.Tensor, inner, owner) -> "DispatchHandle":
        self = super().__new__(cls, (rank_prefix_matrix, None, None, None, is_token_in_rank, None))
        self.inner = inner
        self.owner = owner
        return self

    @classmethod
    def of(cls, inner, is_token_in_rank: torch.Tensor, owner, device: torch.device) -> "DispatchHandle":
        """The handle of a fresh dispatch whose warmlink handle is ``inner`` (its count matrix
        summed over the sources gives ``rank_prefix_matrix``, made on ``device``)."""
        counts = torch.tensor(inner.count_matrix, dtype=torch.int32, device="cpu")
        return cls(counts.cumsum(0, dtype=torch.int32).to(device), is_token_in_rank, inner, owner)

    @property
    def rank_prefix_matrix(self) -> torch.Tensor:
        return self[0]

    @property
    def is_token_in_rank(self) -> torch.Tensor:
        return self[4]

    @property
    def num_recv_tokens(self) -> int:
        """Rows this rank received (its outputs have ``num_worst_tokens`` rows when that was set)."""
        return self.inner.num_recv_tokens

    def __repr__(self) -> str:
        return (f"deep_ep.DispatchHandle(num_tokens={self.inner.num_tokens}, num_recv_tokens={self.num_recv_tokens}, "
                f"round={self.inner.round})")
