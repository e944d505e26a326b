"""``Handle``: what a dispatch leaves for its combine and its cached re-dispatches, and how its plan
is filled in once every rank's counts are known (from the mailboxes, or from an SM dispatch's count
board, ep.paths.sm_pushes Note [SM sends]; a padded SM dispatch's plan later, ep.protocol.normal Note [Padded
dispatch returns at launch]).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from warmlink.ep.wire.words import RefusedRound
from warmlink.errors import ConfigError, MetadataError, TransferTimeout

__all__ = ["Handle", "check_worst_tokens", "fill_plan", "next_owner", "per_expert_list", "plan_from_board",
           "recv_starts"]

_OWNERS = itertools.count(1)


def next_owner() -> int:
    """A new serial for a Buffer's mode to stamp on the handles it makes (``Handle.owner``)."""
    return next(_OWNERS)


@dataclass
class Handle:
    """What a dispatch leaves for its combine and for a cached re-dispatch (opaque to users).

    Counts are host ints (the round protocol brought them there); ``combine_rows[t, d]`` is token
    ``t``'s row in slot ``d`` (-1 where it does not go to ``d``; ep.kernels.steps.plan), ``dst_rows[d]``
    where this rank's rows start in ``d``'s receive area, ``recv_starts[s]`` / ``recv_counts[s]``
    where source ``s``'s rows lie in this rank's output. A padded SM dispatch returns before its
    counts reach the host (ep.protocol.normal, Note [Padded dispatch returns at launch]): until
    ``resolve()`` (which the Buffer's next call makes) they are None, and ``board`` holds the
    round's count board on the device.
    """

    num_experts: int
    num_tokens: int
    is_token_in_rank: torch.Tensor
    combine_rows: torch.Tensor
    send_counts: list[int]
    dst_rows: list[int] | None = None
    recv_starts: list[int] | None = None
    recv_counts: list[int] | None = None
    num_recv_tokens_per_expert_list: list[int] | None = None
    count_matrix: list[list[int]] | None = None  # [s][d]: rows rank s sends rank d (every rank's view alike)
    num_topk: int = 0
    round: int = 0  # the dispatch round that built it: every rank must combine with the same one
    num_worst_tokens: int = 0  # the rows of its padded outputs (0: exactly num_recv_tokens)
    owner: int = 0  # the serial of the mode that made it (ep.protocol.normal): a handle serves its own Buffer
    # push bases of cached SM dispatches (host ints), per (Buffer, parity, row words), made on first use (ep.paths.senders)
    sm_bases: dict = field(default_factory=dict, repr=False)
    board: torch.Tensor | None = field(default=None, repr=False)  # [R, board row] int64: the padded round's counts
    pending: Callable[[], None] | None = field(default=None, repr=False)  # fills the counts in (resolve)
    error: BaseException | None = field(default=None, repr=False)  # what resolving raised: raised at every use
    # a streamed dispatch's (ep.protocol.streamed), on the device: where each source's rows start in
    # the outputs [R], and the rows each receiver channel took from each source [R, C]
    recv_offset: torch.Tensor | None = field(default=None, repr=False)
    taken: torch.Tensor | None = field(default=None, repr=False)
    # the count matrix summed over the sources, int32 [R, R] on the device, where the compiled host
    # steps made it with the outputs (ep.paths.planned, Note [Posted outputs])
    recv_prefix: torch.Tensor | None = field(default=None, repr=False)

    def resolve(self) -> None:
        """Bring a padded SM dispatch's counts to the host; raise what that round ended with (a
        refusal every rank raises alike, or a peer's timeout) now and at every later use. The
        host waits for this rank's count exchange on the device, not for its push. No-op otherwise."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending()
            except Exception as exc:
                self.error = exc
                raise
            except BaseException as exc:  # an interrupt: later uses get an error, not the interrupt again
                self.error = ConfigError(f"ep.Buffer.dispatch: the counts of dispatch round {self.round} never reached "
                                         f"the host ({type(exc).__name__} while waiting); its outputs and handle are "
                                         "void: dispatch again")
                raise
        if self.error is not None:
            raise self.error

    @property
    def num_recv_tokens(self) -> int:
        self.resolve()
        return sum(self.recv_counts)


def per_expert_list(handle: Handle, expert_alignment: int) -> list[int]:
    """The dispatch's ``num_recv_tokens_per_expert_list``, each rounded up to ``expert_alignment``;
    empty for padded outputs, as DeepEP's (the exact counts stay on the handle)."""
    if handle.num_worst_tokens:
        return []
    if expert_alignment == 1:  # (a copy: the caller may change it; on a fresh dispatch's host path)
        return list(handle.num_recv_tokens_per_expert_list)
    return [-(-n // expert_alignment) * expert_alignment for n in handle.num_recv_tokens_per_expert_list]


def check_worst_tokens(matrix: list[list[int]], num_worst_tokens: int, func: str) -> list[int]:
    """The rows each rank receives under ``matrix[s][d]`` (rows ``s`` sends ``d``). Every rank holds
    the same matrix, so a rank that would receive more than ``num_worst_tokens`` (0: no bound)
    makes every rank raise ``ConfigError`` alike."""
    totals = [sum(row[d] for row in matrix) for d in range(len(matrix))]
    over = {d: n for d, n in enumerate(totals) if n > num_worst_tokens} if num_worst_tokens else {}
    if over:
        raise ConfigError(f"{func}: ranks receive {over} rows; num_worst_tokens={num_worst_tokens} is the most "
                          "any may (pass a larger num_worst_tokens, or 0 for outputs sized by the counts)")
    return totals


def fill_plan(handle: Handle, matrix: list[list[int]], per_expert: list[int], rank: int) -> None:
    """The handle's receive counts and starts, and rank ``rank``'s rows in each destination, from
    ``matrix[s][d]`` (rows ``s`` sends ``d``): ``d``'s rows come by source (Note [Send order] in
    ep.kernels.layout). Every rank holds the same matrix, so a rank that would receive more rows than the
    call's ``num_worst_tokens`` makes every rank refuse the round alike (``ConfigError``)."""
    num_ranks = len(matrix)
    check_worst_tokens(matrix, handle.num_worst_tokens, "ep.Buffer.dispatch")
    handle.recv_counts = [row[rank] for row in matrix]
    handle.recv_starts = [sum(handle.recv_counts[:s]) for s in range(num_ranks)]
    handle.dst_rows = [sum(row[d] for row in matrix[:rank]) for d in range(num_ranks)]
    handle.num_recv_tokens_per_expert_list = per_expert
    handle.count_matrix = [list(row) for row in matrix]


def plan_from_board(handle: Handle, board: np.ndarray, round_: int, rank: int, max_tokens: int) -> None:
    """``fill_plan`` from rank ``rank``'s count board of an SM dispatch: row ``s`` holds the round
    tag, whether ``s``'s input was valid, its counts per destination and its counts for this rank's
    experts. A refused input stopped every push: nothing was sent."""
    num_ranks = board.shape[0]
    epr = handle.num_experts // num_ranks
    matrix = _board_matrix(board, round_, max_tokens)
    if matrix is None:
        refused = [s for s in range(num_ranks) if not board[s, 1]]
        raise RefusedRound(f"ep.Buffer.dispatch: ranks {refused} refused their dispatch input (bad expert ids or "
                           "layout; see their errors); nothing was sent", refused)
    fill_plan(handle, matrix, board[:, 2 + num_ranks:2 + num_ranks + epr].sum(0).tolist(), rank)


def recv_starts(board: np.ndarray, rank: int, max_tokens: int) -> list[int] | None:
    """Where each source's rows start in rank ``rank``'s outputs, then how many arrive in all, from
    its count board of this round (``board[rank, 0]``): what a streamed dispatch needs before its
    launch, its handle's plan filled in after (``plan_from_board``). None when a rank refused its
    input (nothing is sent); missing or out-of-range counts raise as ``plan_from_board``."""
    matrix = _board_matrix(board, int(board[rank, 0]), max_tokens)
    if matrix is None:
        return None
    return list(itertools.accumulate((row[rank] for row in matrix), initial=0))


def _board_matrix(board: np.ndarray, round_: int, max_tokens: int) -> list[list[int]] | None:
    """The ``[s][d]`` counts of a count board whose every row is of ``round_``; None when a rank
    refused its input. Raises TransferTimeout (a source's counts missing: the exchange ended at its
    deadline) or MetadataError (a count out of range). In Python on the board's first columns, read
    at once: on a launch's path, where each numpy call on a few words costs more than the loop."""
    num_ranks = board.shape[0]
    rows = board[:, :2 + num_ranks].tolist()
    late = [s for s, row in enumerate(rows) if row[0] != round_]
    if late:
        raise TransferTimeout(f"ep: the count exchange of dispatch round {round_} ended without the counts of "
                              f"ranks {late}")
    if not all(row[1] for row in rows):
        return None
    matrix = [row[2:] for row in rows]
    if min(map(min, matrix)) < 0 or max(map(max, matrix)) > max_tokens:
        raise MetadataError(f"ep: the count board holds {matrix}; expected each count in [0, {max_tokens}]")
    return matrix
