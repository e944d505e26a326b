"""The calls of a streamed Buffer (``send="stream"``): ``StreamedMode`` runs a dispatch or a combine
from its checked arguments to its outputs over ``StreamPath`` (ep.paths.streamed). No host meets
a peer on the warm path: the GPUs trade the counts (the count exchange, Note [SM sends] in
ep.paths.sm_pushes) and pace the rows (Note [Streamed dispatch] in ep.kernels.stream).

# Note [Streamed calls]
A fresh dispatch launches ``plan`` and the count exchange; without ``num_worst_tokens`` the host
then packs the streamed dispatch's launch but for its outputs (while the GPUs trade the counts),
reads the board where it landed (the received row count sizes the outputs, as DeepEP's host
reads its counters), places each source's rows (``recv_offset``) and launches (those steps
compiled where they can be: ep.kernels.host; a kind planned before launches the stream with the
exchange and posts it the outputs: Note [Posted outputs] in ep.paths.planned), and only then
reads the earlier calls' status words (while it waits for the board too, every few
milliseconds: not first, since the board may land while the host reads them) and fills the
handle's plan from a copy of the board (the GPUs idle from the board to that launch: nothing
else is on the way). With
``num_worst_tokens`` the host reads nothing: a few device steps take the offsets from the board's
copy and decide whether the round stands (the exchange accepted every rank's call, and no rank
receives more than ``num_worst_tokens`` rows: every rank holds every source's counts, so all
decide alike), and the streamed dispatch then sends nothing for a refused round; the counts reach
the host when the Buffer's next call resolves the handle, which raises the refusal on every rank
(Note [Padded dispatch returns at launch] in ep.protocol.normal has the same contract). A cached
dispatch and a combine launch one streamed kernel each, from the handle: no count exchange.

Every fresh dispatch launches its streamed kernel on every rank, a refused one too (sending
nothing), so the space's seq count (ep.paths.streamed) stays the same on every rank whatever the
ranks were told. A rank whose own arguments are wrong takes part the same way, without tokens
(Note [Refused dispatch] in ep.protocol.normal).

CUDA graphs: the seq and round counts live on the device, so a padded fresh dispatch, a cached
dispatch and a combine may be captured in a caller's graph (``torch.cuda.graph``) and replayed,
every rank replaying the same graphs in the same order as its calls. A captured call reads no
host memory at replay; its handle's counts come from its board copy when something asks for
them (``Handle.resolve``, which then waits for the device). A replay's failure is raised by the
Buffer's next eager call, which reads every captured call's status words back.

Failures: a call returns at launch; a program that misses its deadline (a dead or stalled peer)
or is aborted leaves a status word that the Buffer's next call reads and raises as
``TransferTimeout`` (a dispatch or a combine once its own launches are out, fresh ones too: off
the way to them, ``raise_failures``). The rings then hold rows of unknown state, so the call after
clears the space with every peer (``_clear``): each rank ends its launches (the abort words),
meets the others through the mailboxes (``Rounds.all_gather_int``, a value marked ``_CLEAR``),
zeroes its space, boards and counts, meets again, and counts from 1. A peer that sees a clear
asked for at its next call joins it, and raises for that call (its peers left theirs). A count
exchange that timed out asks for a clear too (a peer may have launched the round's stream).
"""

from __future__ import annotations

import functools
import time
from typing import NoReturn

import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.kernels.launch import capturing
from warmlink.ep.kernels.stream import outputs as stream_outputs
from warmlink.ep.paths.event import EventOverlap, record_done
from warmlink.ep.paths.host_mover import as_words
from warmlink.ep.paths.senders import FreshSend, refused_send
from warmlink.ep.protocol.checks import Checks
from warmlink.ep.protocol.rounds import Rounds
from warmlink.ep.wire import mailbox as mb
from warmlink.ep.wire.handle import Handle, fill_plan, next_owner, per_expert_list, plan_from_board, recv_starts
from warmlink.ep.wire.regions import PARITIES, RegionLayout
from warmlink.errors import ConfigError, TransferTimeout

__all__ = ["StreamedMode"]

_CLEAR = 1 << 62  # a meet value asking every rank to clear the stream space
_FAILURES_AFTER_LAUNCH = ("dispatch", "combine", "refuse_dispatch")  # calls that read them late (raise_failures)


class StreamedMode:
    """One rank's calls over a ``StreamPath`` (Note [Streamed calls]); ``NormalMode``'s interface.

    Args:
        rounds: the mailboxes' meets (only a clear uses them) and ``all_gather_int``.
        path: the ``StreamPath``. checks: the argument checks. layout: the streamed layout.
        device: the CUDA device. done_events: the pooled events ``async_finish`` records.
    """

    def __init__(self, rounds: Rounds, path, checks: Checks, layout: RegionLayout, device: int, done_events) -> None:
        self.rounds, self.path, self.checks, self.layout, self.device = rounds, path, checks, layout, device
        self.mover = path.mover
        self.rank, self.num_ranks, self.timeout_s = rounds.rank, rounds.num_ranks, rounds.timeout_s
        self.done_events = done_events
        self.unresolved: tuple[Handle, FreshSend] | None = None  # a padded dispatch's, settled by the next call
        self.must_clear = False
        self._clearing = 0  # a clear whose meet timed out: 1 in its first meet, 2 in its second
        self.recv_failed = False  # no receive stream: close always orders the caller's stream after the calls
        self.last_marks: dict[str, float] = {}
        self.last_phases: dict[str, float] = {}
        self.in_graph = False  # the current call is captured in a CUDA graph (before_call)
        self.serial = next_owner()  # on the handles it makes

    # -- between calls ------------------------------------------------------------------------------
    def before_call(self, func: str) -> None:
        """Clear the space if a failure (here or at a peer) asks for it; raise a finished call's
        failure (a dispatch or a combine does once its launch is out: ``raise_failures``); bring a
        padded dispatch's counts to the host (raising its refusal). Inside a graph capture none of
        that can run: a clear still due refuses the call."""
        asked = self._clear_asked()
        self.in_graph = capturing()
        if self.in_graph:
            if self.must_clear or asked:
                raise ConfigError(f"ep.Buffer.{func}: captured in a CUDA graph while the stream space awaits a clear "
                                  "after a failure; make an eager call first (it clears the space with every peer)")
            return
        if self.must_clear or asked:
            mine = self.must_clear
            self._clear()
            if not mine:  # this rank's call is void: the peers that asked for the clear left theirs
                raise TransferTimeout(f"ep.Buffer.{func}: ranks {asked} failed a streamed call and cleared the stream "
                                      "space with this rank; this call did not run, and the outputs of this rank's "
                                      "calls since that one are void (the next call works)")
        if func not in _FAILURES_AFTER_LAUNCH:
            self.raise_failures()
        self.resolve()

    def raise_failures(self) -> None:
        """Raise the failure of an earlier call that finished (ep.paths.streamed ``failures``). A
        dispatch or a combine reads them once its launches are out, off the way to them: it spends
        the call as a failure found before it would (its launch then joins the clear the next call
        makes), and a call is never sure to find one anyway (an earlier call may still be waiting
        out its deadline)."""
        if self.in_graph:
            return
        failed = self.path.failures()
        if failed is not None:
            self.must_clear = True
            raise failed

    def resolve(self) -> None:
        """Settle the last padded dispatch's round before anything else runs (its refusal raised
        now, on every rank): where its board landed and stands, the plan is filled only when its
        handle is used (``_settled``), else here, raising what is wrong."""
        unresolved, self.unresolved = self.unresolved, None
        if unresolved is not None:
            handle, call = unresolved
            if handle.pending is None or not self._settled(handle, call):
                handle.resolve()

    def _settled(self, handle: Handle, call: FreshSend) -> bool:
        """Whether a padded ``handle``'s round stands on its board, landed (one event query and the
        compiled checks, ep.kernels.host ``padded_stands``); then its pending fill reads a copy of
        the board. False (nothing changed) where the board is not in, or the checks do not pass."""
        compiled = host.module()
        board = self.path.board_now() if compiled is not None else None
        if board is None or not compiled.padded_stands(self.mover.board_address, self.num_ranks, board.shape[1],
                                                       self.rank, self.layout.max_tokens, call.num_worst_tokens):
            return False
        board = board.copy()  # (the next exchange rewrites it)
        handle.round = int(board[self.rank, 0])
        handle.pending = functools.partial(self._fill_stood, handle, board)
        return True

    def _fill_stood(self, handle: Handle, board) -> None:
        """``_fill`` of a round that ``_settled`` found standing (nothing left to raise)."""
        plan_from_board(handle, board, handle.round, self.rank, self.layout.max_tokens)
        handle.send_counts = board[self.rank, 2:2 + self.num_ranks].tolist()

    def abandon(self) -> None:
        """At close, after the Buffer's drain: end every launch still waiting on a peer (one that
        did not end within the timeout)."""
        self.unresolved = None
        self.path.abort_all()
        torch.cuda.synchronize(self.device)  # no launch writes a region that goes back to the pool
        self.path.close()

    def _clear_asked(self) -> list[int]:
        """The peers that asked for a clear in a meet this rank has not joined (a host read per peer)."""
        mailbox, meet = self.rounds.mailbox, self.rounds.meets + 1
        return [r for r in range(self.num_ranks)
                if r != self.rank and mailbox.round_of(r, mb.MEET) >= meet and mailbox.meet_value(r, meet) & _CLEAR]

    def _clear(self) -> None:
        """Clear the stream space with every peer (Note [Streamed calls]). Collective; a peer that
        does not come raises ``TransferTimeout`` here, and the next call waits for it again in the
        same meet (a new meet would leave this rank one meet ahead of a peer that joins late)."""
        self.must_clear = True
        self.unresolved = None
        again = self._clearing == 2
        if not again:  # (past the first meet the space is clear, and peers may be streaming into it)
            self.path.abort_all()
            torch.cuda.synchronize(self.device)  # every launch of this rank ended: none writes a peer's space
            retry, self._clearing = self._clearing == 1, 1
            self.rounds.all_gather_int(_CLEAR, self.timeout_s, again=retry)
            self.path.clear()
            self._clearing = 2
        self.rounds.all_gather_int(_CLEAR, self.timeout_s, again=again)  # every space is zero before any call
        self._clearing = 0
        self.must_clear = False

    # -- dispatch -----------------------------------------------------------------------------------
    def dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, async_finish, num_experts, return_recv_hook):
        """``ep.Buffer.dispatch`` on the stream path (its docstring says what each argument means)."""
        t0 = time.perf_counter()
        if return_recv_hook:
            raise ConfigError("ep.Buffer.dispatch: return_recv_hook on a Buffer built with send='stream'; the streamed "
                              "kernels receive as they send (build the Buffer with send='sm' for hook mode)")
        cached = handle is not None
        try:
            args = self.checks.dispatch(x, cached, expert_alignment, num_worst_tokens, topk_idx, topk_weights,
                                        num_experts, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, True)
        except ConfigError as exc:
            if cached or self.in_graph:  # no exchange to refuse in (Note [Refused dispatch])
                raise
            self.refuse_dispatch(str(exc))
        tokens, scales, topk, weights, num_experts, per_rank, in_rank, per_expert, config, kind = args
        marks = self.last_marks = {"start": t0, "checked": time.perf_counter()}
        if cached:
            out, handle = self._cached(handle, tokens, scales, num_worst_tokens)
            self.raise_failures()
        else:
            # a planned kind's exchange goes first: what the call keeps is made while the GPUs trade
            front = (self.path.planned_front(kind, tokens, scales, topk, weights, in_rank, per_rank, per_expert)
                     if kind and not num_worst_tokens and not self.in_graph else None)
            src = Sources(as_words(tokens), topk, weights, scales)
            call = FreshSend(src, in_rank.contiguous(), per_rank.contiguous(), per_expert.contiguous(), num_experts,
                             config, num_worst_tokens, 0, "dispatch", ("", ""), kind=kind)
            out, handle = self._fresh(call, marks, front)
        marks["sent"] = time.perf_counter()
        self.last_phases = {"layout": marks.get("counts", marks["sent"]) - t0,
                            "send": marks["sent"] - marks.get("counts", t0)}
        recv_x = out.x.view(tokens.dtype).view(-1, self.layout.hidden)
        recv_x = (recv_x, out.scales) if scales is not None else recv_x
        return (recv_x, out.idx, out.weights, per_expert_list(handle, expert_alignment), handle,
                self.event(PARITIES - 1, async_finish))

    def _fresh(self, call: FreshSend, marks: dict, front=None):
        """Plan + count exchange, then (Note [Streamed calls]) the stream; ``(outputs, handle)``
        (``front``: ``StreamPath.planned_front``'s value where it launched them already)."""
        path, src = self.path, call.src
        in_graph = self.in_graph
        padded = bool(call.num_worst_tokens)
        if in_graph and not padded:
            raise ConfigError("ep.Buffer.dispatch: a fresh dispatch captured in a CUDA graph needs num_worst_tokens "
                              "(its outputs are sized at capture; without it the host reads the received count)")
        if padded:  # the stream launched at once: its offsets, and whether the round stands, on the device
            rows, taken, recv_offset, board, out = path.fresh_padded(call, in_graph)
            marks["launched"] = marks["counts"] = marks["outputs"] = time.perf_counter()
            handle = self._handle(call, rows, taken, board)
            handle.recv_offset = recv_offset
            if in_graph:  # its counts come from its own board copy, when asked for
                handle.pending = functools.partial(self._complete_from_copy, handle)
            else:  # the counts read when the handle is resolved (raising a refusal then)
                handle.pending = functools.partial(self._complete, handle, call)
                self.unresolved = handle, call
            self.raise_failures()
            return out, handle
        # the exchange launched, and the stream's launch packed while the GPUs trade the counts: after
        # the board, only the outputs and where each source's rows start are left to give it
        rows, taken, launch = front if front is not None else path.fresh_front(call)
        marks["launched"] = time.perf_counter()
        # the board where it landed: a compiled spin on its landed words (Note [Board landing] in
        # ep.paths.sm_pushes), else the host's wait, which reads the earlier calls' failures as it
        # goes (one that failed at its deadline may mean that a peer stalls this exchange too)
        try:
            if not path.board_landed() and path.board_now() is None:
                self._wait_board()
            done = launch.from_board()  # by the compiled host steps (ep.kernels.host), or None
            plan = None
            if done is not None:
                out, recv_offset, plan = done
                marks["counts"] = marks["outputs"] = time.perf_counter()
            else:
                starts = self._starts(self._wait_board()[1])  # None: a rank refused its input
                marks["counts"] = time.perf_counter()
                out = stream_outputs(starts[-1] if starts is not None else 0, src)
                marks["outputs"] = time.perf_counter()
                recv_offset = launch(out, starts[:-1] if starts is not None else [0] * self.num_ranks)
        except BaseException:
            launch.abandon()  # a stream launched already (Note [Posted outputs]) stores none of its rows
            raise
        # the launch first; the handle, the earlier calls' failures and the plan after, off the GPUs' path
        handle = self._handle(call, rows, taken, None)
        handle.recv_offset = recv_offset
        self.raise_failures()
        if plan is not None:  # read with the post (ep.paths.planned): a round that stands
            handle.round, matrix, per_expert, handle.recv_prefix = plan
            fill_plan(handle, matrix, per_expert, self.rank)
            handle.send_counts = matrix[self.rank]
        else:
            self._fill(handle, call, *self._wait_board())  # raises a refusal
        return out, handle

    def _handle(self, call: FreshSend, rows: torch.Tensor, taken: torch.Tensor, board) -> Handle:
        src = call.src
        return Handle(call.num_experts, src.x.shape[0], call.in_rank, rows, None, num_topk=src.topk.shape[1],
                      num_worst_tokens=call.num_worst_tokens, board=board, taken=taken, owner=self.serial)

    def _wait_board(self):
        """``(plan words, count board)`` of the last eager exchange (copies), waited for on the host;
        a timeout asks for a clear (a peer may have launched the round's stream). Every few
        milliseconds of the wait the earlier calls' failures are read (``raise_failures``): not
        before it, where the board may land while the host reads them."""
        try:
            return self.path.wait_board(self.raise_failures)
        except TransferTimeout:
            self.must_clear = True
            raise

    def _starts(self, board) -> list[int] | None:
        """``recv_starts`` of the last eager exchange's ``board``; a board without a source's counts
        asks for a clear as ``_wait_board``'s timeout does."""
        try:
            return recv_starts(board, self.rank, self.layout.max_tokens)
        except TransferTimeout:
            self.must_clear = True
            raise

    def _complete(self, handle: Handle, call: FreshSend) -> None:
        """Fill a padded ``handle``'s plan in from the last eager exchange's board, waited for on the
        host."""
        words, board = self._wait_board()
        try:
            self._fill(handle, call, words, board)
        except TransferTimeout:
            self.must_clear = True
            raise

    def _fill(self, handle: Handle, call: FreshSend, words, board) -> None:
        """Fill ``handle``'s plan in from its round's board (this rank's row: its counts per
        destination). A refusal is the same on every rank (each read the same board); this rank's
        plan words name what was wrong with its own input, when it was."""
        handle.round = int(board[self.rank, 0])  # the device's round: every source's tag must be it
        if not board[self.rank, 1]:
            self.checks.counts(words, handle.num_tokens, call.num_experts)
        plan_from_board(handle, board, handle.round, self.rank, self.layout.max_tokens)
        handle.send_counts = board[self.rank, 2:2 + self.num_ranks].tolist()

    def _complete_from_copy(self, handle: Handle) -> None:
        """``_complete`` for a dispatch captured in a graph: from its board copy (a device read)."""
        board = handle.board.cpu().numpy()
        handle.round = int(board[self.rank, 0])
        handle.send_counts = board[self.rank, 2:2 + self.num_ranks].tolist()
        plan_from_board(handle, board, handle.round, self.rank, self.layout.max_tokens)

    def _cached(self, handle, tokens, scales, num_worst_tokens: int):
        """A cached dispatch: the handle's rows streamed again, no exchange; ``(outputs, handle)``."""
        if not isinstance(handle, Handle) or handle.taken is None:
            raise ConfigError(f"ep.Buffer.dispatch: handle is a {type(handle).__name__}; expected the Handle of a "
                              "dispatch of this Buffer")
        if handle.num_tokens != tokens.shape[0]:
            raise ConfigError(f"ep.Buffer.dispatch: handle is for {handle.num_tokens} tokens; x has {tokens.shape[0]}")
        if not self.in_graph:
            handle.resolve()  # a refused padded dispatch's handle raises its refusal at every use
        if num_worst_tokens not in (0, handle.num_worst_tokens):
            raise ConfigError(f"ep.Buffer.dispatch: num_worst_tokens={num_worst_tokens}; a cached dispatch pads its "
                              f"outputs as the dispatch that made its handle did ({handle.num_worst_tokens})")
        src = Sources(as_words(tokens), scales=scales)
        out = stream_outputs(handle.num_worst_tokens or handle.num_recv_tokens, src)
        self.path.dispatch(handle.combine_rows, src, out, handle.recv_offset, handle.taken,
                           handle.num_experts // self.num_ranks)
        return out, handle

    def refuse_dispatch(self, reason: str, return_recv_hook: bool = False) -> NoReturn:
        """Take part in the next fresh dispatch without tokens, refused (Note [Streamed calls]), then
        raise ``ConfigError(reason)``. Collective."""
        call = refused_send(reason, self.num_ranks, self.layout.hidden, torch.device("cuda", self.device))
        try:
            self._fresh(call, {})
        except ConfigError:  # the device's refusal of this very round
            pass
        raise ConfigError(reason)

    # -- combine ------------------------------------------------------------------------------------
    def combine_args(self, x, topk_weights, handle) -> tuple:
        """``combine``'s arguments, checked (``Checks.combine_args``); the kernels wait for no word,
        so a refusal raises on this rank alone (its peers' kernels reach their deadline)."""
        return self.checks.combine_args(x, topk_weights, handle, self.serial)

    def combine(self, rows, weights, handle: Handle, async_finish: bool, return_recv_hook: bool):
        """``ep.Buffer.combine`` on the stream path, on checked ``rows`` and ``weights``."""
        t0 = time.perf_counter()
        if return_recv_hook:
            raise ConfigError("ep.Buffer.combine: return_recv_hook on a Buffer built with send='stream'; the streamed "
                              "kernels receive as they send (build the Buffer with send='sm' for hook mode)")
        if handle.taken is None:
            raise ConfigError("ep.Buffer.combine: handle is from a Buffer that does not stream; expected the Handle "
                              "of a dispatch of this Buffer")
        out = torch.empty(handle.num_tokens, self.layout.hidden, dtype=rows.dtype, device=rows.device)
        out_w = None if weights is None else torch.empty(handle.num_tokens, weights.shape[1], dtype=torch.float32,
                                                         device=rows.device)
        self.path.combine(handle.combine_rows, rows.contiguous(), out, handle.taken, handle.recv_offset,
                          None if weights is None else weights.contiguous(), out_w)
        self.raise_failures()
        self.last_phases = {"send": time.perf_counter() - t0}
        return out, out_w, self.event(2 * PARITIES - 1, async_finish)

    def event(self, slot: int, async_finish: bool) -> EventOverlap:
        return record_done(self.done_events, slot, self.device, async_finish)
