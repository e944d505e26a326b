"""The steps of each normal-mode round, in one place: ``NormalMode`` runs a dispatch or a combine
from its checked arguments to its outputs, over the round protocol's meetings (ep.protocol.rounds,
Note [Round protocol]) and the Buffer's data path (ep.paths.senders: SMs, copy engines or host
copies, chosen once). ``ep.Buffer`` checks that it is open, picks a call's stream
(ep.paths.comm_stream) and hands the call here; where the bytes move is the path's.

Over 400 lines: one object owns a round's steps (the fresh orders, the cached, refused and broken
rounds) and its Notes; split, a round's steps would be read across files again.

A fresh dispatch takes one of two orders, by its path:

- staged (host, copy engines): plan and gather, the counts to the host, publish them and meet
  every peer, complete the plan from their counts, then issue the copies (``_fresh_staged``);
- SM: publish the config, launch plan + count exchange + push (the device trades the counts and
  refuses a round any rank refused), then read the board on the host and meet (``_fresh_sm``),
  or, with ``num_worst_tokens``, leave that to the next call (below).

# Note [Padded dispatch returns at launch]
A fresh SM dispatch used to wait on the host for its count board (Note [SM sends] in ep.paths.sm_pushes)
before returning: its outputs' row count, the unpack and the handle's plan come from the peers'
counts. With ``num_worst_tokens`` the outputs' shape is known at the call, so, as DeepEP's, it
returns at launch:

- its handle is pending (ep.wire.handle, ``Handle.resolve``): the board is copied on the device, right
  after the exchange, into a tensor the handle keeps, and the counts reach the host when the
  Buffer's next call (or a reader of the counts) resolves it. That waits for this rank's exchange
  on the device, not for its push, and it comes before the next fresh send rewrites the call
  block, the board's and words' landing places and the event;
- the unpack reads the received row count from that copy on the device, and gives every row past
  it expert id -1 and weight 0 (ep.kernels.steps.unpack, ``Padded``). A round any rank refused (a bad
  input, a late peer, a rank receiving more than ``num_worst_tokens`` rows) received nothing:
  every row is padding, so no expert sees a row of a refused round;
- the refusal itself is raised by the next call on every rank alike (each reads the same board),
  and by every use of the handle after it.

The copy-engine and host paths still meet the peers on the host first: they issue their copies
from the counts.

# Note [Refused dispatch]
A rank whose fresh dispatch fails its own checks (a bad shape, too many tokens, an expert id out
of range) must not just raise: its peers would wait for its counts until their timeout, and their
rounds would then no longer line up with its. So it takes part in the round without tokens,
marked refused (``FreshSend.refused``), and raises its reason after. Its config word is
``REFUSED`` (ep.wire.words), so every peer that meets it raises ``ConfigError`` naming it; with
SM sends it also launches the count exchange with a count per rank that no row matches, so the
device refuses the round on every rank (the plan's valid flag, Note [SM sends] in ep.paths.sm_pushes):
no rank pushes a row, and a padded peer that returned at launch gets padding and raises at its
next call. The round is spent on every rank, and the next call works. A cached dispatch refused
(bad arguments, another Buffer's handle) publishes its round ``REFUSED`` too, with host copies,
whose receives meet the peers' words before they read a byte, so every peer raises naming it and
the rounds stay in step; on a device the peers' kernels wait for no word, so there it raises on
that rank alone. A combine one rank refuses (``combine_args``) goes the same way.

# Note [Broken rounds]
A call that times out or loses a peer inside a round leaves the ranks' rounds out of step: this
rank's round may be one a late peer still joins with other rows, and a round number used again
would pair two different calls without any word telling them apart. So the first
``TransferTimeout`` or ``PeerLostError`` of a call or hook breaks the Buffer: every later call
raises the same error type, naming the first, and a new Buffer is the way on (as in low-latency
mode, ep.low_latency._runtime).
"""

from __future__ import annotations

import functools
import time
from typing import NoReturn

import numpy as np
import torch

from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.paths.event import EventOverlap, record_done
from warmlink.ep.paths.host_mover import as_words
from warmlink.ep.paths.outputs import dispatch_outputs
from warmlink.ep.paths.senders import FreshSend, refused_send
from warmlink.ep.protocol.checks import Checks
from warmlink.ep.protocol.rounds import Pending, Rounds
from warmlink.ep.wire import mailbox as mb
from warmlink.ep.wire.handle import Handle, next_owner, per_expert_list, plan_from_board
from warmlink.ep.wire.regions import PARITIES, RegionLayout, area
from warmlink.ep.wire.words import REFUSED, encode_call, encode_combine
from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

__all__ = ["NormalMode"]


class NormalMode:
    """One rank's normal-mode rounds: dispatch and combine, each a round of Note [Round protocol].

    Args:
        rounds: the meetings and checks in the mailboxes (``Rounds``).
        path: the data path (ep.paths.senders ``PATHS``), chosen once per Buffer.
        combiner: the combine's sends and sums (ep.paths.combine).
        mover: the path's mover (``HostMover`` or ``CudaMover``): round starts, arrival, views.
        checks: the argument checks (``Checks``). layout: the regions' layout.
        device: the CUDA device, or -1 for host memory. done_events: the pooled events that
            ``async_finish`` records (per (op, parity), then the layout's).

    Attributes:
        last_phases, last_marks: the last call's host phases (seconds) and clock marks.
        recv_failed: a receive failed, so the receive stream may wait on a dead peer for good
            (``Resources.close`` then stops ordering the caller's stream after it).
    """

    def __init__(self, rounds: Rounds, path, combiner, mover, checks: Checks, layout: RegionLayout, device: int,
                 done_events) -> None:
        self.rounds, self.path, self.combiner, self.mover = rounds, path, combiner, mover
        self.checks, self.layout, self.device = checks, layout, device
        self.rank, self.num_ranks, self.timeout_s = rounds.rank, rounds.num_ranks, rounds.timeout_s
        self.done_events = done_events
        self.unresolved: Handle | None = None  # the last padded SM dispatch's handle, until resolved
        self.recv_failed = False
        self.broken: BaseException | None = None  # Note [Broken rounds]
        self.closed = False  # (a hook after the Buffer's close raises)
        self.serial = next_owner()  # on the handles it makes
        self.last_marks: dict[str, float] = {}
        self.last_phases: dict[str, float] = {}

    # -- between calls ------------------------------------------------------------------------------
    def before_call(self, func: str) -> None:
        """What every call does first: bring a padded dispatch's counts to the host (and raise its
        refusal), refuse a call while a hook is pending, raise an earlier call's bytes that never
        came (ep.wire.flags), and check the peers' words of earlier rounds once they published."""
        if self.broken is not None:
            raise type(self.broken)(f"ep.Buffer.{func}: an earlier call failed ({self.broken}); the group's rounds "
                                    "are out of step (Note [Broken rounds] in ep.protocol.normal): close this Buffer "
                                    "and build a new one")
        self.resolve()
        self.rounds.check_no_pending(func)
        self.mover.check()
        self.rounds.check_late()

    def resolve(self) -> None:
        """Resolve the last padded dispatch's handle if it is still pending (Note [Padded dispatch returns at launch])."""
        handle, self.unresolved = self.unresolved, None
        if handle is not None:
            handle.resolve()

    def abandon(self) -> None:
        """At close: end a pending dispatch's count exchange on the device without waiting for it; a
        hook called later raises, reading nothing the close released."""
        self.closed = True
        handle, self.unresolved = self.unresolved, None
        if handle is not None and handle.pending is not None:
            self.path.abort(handle.round)

    # -- dispatch -----------------------------------------------------------------------------------
    def dispatch(self, *args):
        """``ep.Buffer.dispatch``'s round (its docstring says what each argument means)."""
        try:
            return self._dispatch(*args)
        except (TransferTimeout, PeerLostError) as exc:
            self._break(exc)
            raise

    def _dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, async_finish, num_experts, return_recv_hook):
        t0 = time.perf_counter()
        cached = handle is not None
        try:
            args = self.checks.dispatch(x, cached, expert_alignment, num_worst_tokens, topk_idx, topk_weights,
                                        num_experts, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                        self.path.by_sm(return_recv_hook))
        except ConfigError as exc:
            if cached:
                self._refuse_cached(str(exc))
            self.refuse_dispatch(str(exc), return_recv_hook)
        tokens, scales, topk, weights, num_experts, per_rank, in_rank, per_expert, config, _ = args
        num_tokens = tokens.shape[0]
        if cached:
            self._check_cached(handle, num_tokens, num_worst_tokens)
        rounds, mover = self.rounds, self.mover
        round_ = rounds.next("dispatch")
        mover.start_round("dispatch", round_)
        phase = f"dispatch.{round_ % PARITIES}"
        parts = (area("recv_x", round_), area("recv_meta", round_))
        if cached:
            config = encode_call(handle.num_experts, 0, tokens.dtype, True, num_worst_tokens=handle.num_worst_tokens,
                                 handle_round=handle.round)
            src = Sources(as_words(tokens), scales=scales)
            rounds.wait_readers(round_)  # ranks run at most one round apart: Note [Mailbox rounds]
            rounds.mailbox.publish_dispatch(round_, config)
            marks = {"start": t0, "counts": time.perf_counter()}
            # No wait for the peers (ep.wire.regions, Note [Two parities]): the bytes move at once.
            self.path.send_cached(handle, src, round_, phase, parts, rounds.order(), return_recv_hook, self.timeout_s)
            marks["staged"] = marks["ready"] = time.perf_counter()
        else:
            marks = {"start": t0, "checked": time.perf_counter()}
            src = Sources(as_words(tokens), topk, weights, scales)
            handle = self.send_fresh(FreshSend(src, in_rank, per_rank, per_expert, num_experts, config, num_worst_tokens,
                                           round_, phase, parts), marks, return_recv_hook)
        mover.send_done()
        rounds.mailbox.publish(mb.DISPATCH_SENT, round_)
        rounds.end("dispatch", round_)
        marks["sent"] = time.perf_counter()
        staged = marks.get("staged", marks["counts"])  # a fresh dispatch stages nothing apart
        self.last_phases = {"layout": marks["counts"] - t0, "stage": staged - marks["counts"],
                            "handshake": marks["ready"] - staged, "send": marks["sent"] - marks["ready"]}
        # host clock marks (CLOCK_MONOTONIC, comparable across processes of one host) for skew analysis
        self.last_marks = marks
        recv_x, recv_idx, recv_w, unpack, unpacked = dispatch_outputs(
            mover.own_view, self.layout, self.rank, self.num_ranks, handle, parts, tokens.dtype, scales is not None,
            src.topk is not None, src.weights is not None)

        def receive() -> None:
            t3 = time.perf_counter()
            # a fresh dispatch met the peers before sending
            rounds.before_receive(mb.DISPATCH, mb.DISPATCH_SENT, round_, mover.host_ordered, checks=cached)
            self._arrived(phase, unpack, unpacked)
            self.last_marks["received"] = time.perf_counter()
            self.last_phases["receive"] = self.last_marks["received"] - t3

        result = (recv_x, recv_idx, recv_w, per_expert_list(handle, expert_alignment), handle)
        return self._finish("dispatch", round_, receive, return_recv_hook, result, async_finish)

    def _check_cached(self, handle, num_tokens: int, num_worst_tokens: int) -> None:
        """A cached dispatch's handle against its call: refused (``_refuse_cached``) where it is
        not this Buffer's, not for these tokens or not padded alike."""
        if not isinstance(handle, Handle) or handle.owner != self.serial:
            self._refuse_cached("ep.Buffer.dispatch: handle is not one this Buffer's dispatch returned; pass the handle "
                                "of an earlier dispatch on this Buffer")
        if handle.num_tokens != num_tokens:
            self._refuse_cached(f"ep.Buffer.dispatch: handle is for {handle.num_tokens} tokens; x has {num_tokens}")
        handle.resolve()  # a refused padded dispatch's handle raises its refusal at every use, on every rank
        if num_worst_tokens not in (0, handle.num_worst_tokens):
            self._refuse_cached(f"ep.Buffer.dispatch: num_worst_tokens={num_worst_tokens}; a cached dispatch pads its "
                                f"outputs as the dispatch that made its handle did ({handle.num_worst_tokens})")

    def _refuse_cached(self, reason: str) -> NoReturn:
        """Raise ``ConfigError(reason)`` for a cached dispatch this rank refused; with host copies
        publish its round ``REFUSED`` and spend it first (Note [Refused dispatch])."""
        if self.mover.host_ordered:
            self.rounds.refuse("dispatch")
        raise ConfigError(reason)

    def _break(self, exc: BaseException) -> None:
        """A call or hook whose round timed out or lost a peer breaks the Buffer (Note [Broken rounds])."""
        if self.broken is None:
            self.broken = exc

    def send_fresh(self, call: FreshSend, marks: dict, hook: bool) -> Handle:
        """Send a fresh dispatch in its path's order (module docstring); its handle. Adds host marks to ``marks``."""
        if self.path.by_sm(hook):
            return self._fresh_sm(call, marks)
        return self._fresh_staged(call, marks)

    def _fresh_staged(self, call: FreshSend, marks: dict) -> Handle:
        """Plan and gather; the counts to the host; publish them and meet; then the copies."""
        rounds, path = self.rounds, self.path
        if call.refused is not None:
            self._refuse_staged(call, call.refused)
        rows = path.stage(call)
        marks["planned"] = marks["launched"] = time.perf_counter()
        num_tokens = call.src.x.shape[0]
        try:  # expert ids or counts this rank's plan refused: nothing was sent yet
            send_counts, expert_counts = self.checks.counts(path.planned_words(self.timeout_s), num_tokens,
                                                            call.num_experts)
        except ConfigError as exc:
            self._refuse_staged(call, str(exc))
        handle = Handle(call.num_experts, num_tokens, call.in_rank, rows, send_counts.tolist(),
                        num_topk=call.src.topk.shape[1], round=call.round, num_worst_tokens=call.num_worst_tokens,
                        owner=self.serial)
        marks["counts"] = time.perf_counter()
        rounds.wait_readers(call.round)  # before the counts of round n - 2 are replaced: Note [Mailbox rounds]
        rounds.mailbox.publish_dispatch(call.round, call.config, send_counts, expert_counts)
        try:
            rounds.meet(mb.DISPATCH, call.round)
            marks["met"] = time.perf_counter()
            rounds.complete_plan(handle, call.round)
        except ConfigError:  # every rank read the same words and counts and refused: the round is spent everywhere
            rounds.end("dispatch", call.round)
            raise
        marks["ready"] = time.perf_counter()
        path.send_planned(handle, call, rounds.order())
        return handle

    def _refuse_staged(self, call: FreshSend, reason: str) -> NoReturn:
        """Publish ``call``'s round as refused, spend it, and raise ``reason`` (Note [Refused dispatch])."""
        rounds = self.rounds
        rounds.wait_readers(call.round)
        rounds.mailbox.publish_dispatch(call.round, REFUSED, np.zeros(self.num_ranks, np.int64), np.zeros(call.num_experts, np.int64))
        rounds.end("dispatch", call.round)
        raise ConfigError(reason)

    def _fresh_sm(self, call: FreshSend, marks: dict) -> Handle:
        """Publish the config, launch plan + exchange + push; then the handle from the board, or,
        with ``num_worst_tokens``, a pending handle (Note [Padded dispatch returns at launch])."""
        if call.refused is not None:
            self._refuse_sm(call, marks)
        rounds, src, round_ = self.rounds, call.src, call.round
        rows = torch.empty(src.x.shape[0], self.num_ranks, dtype=torch.int64, device=src.x.device)  # the handle's
        in_rank, per_rank, per_expert = (t.contiguous() for t in (call.in_rank, call.per_rank, call.per_expert))
        call = call._replace(in_rank=in_rank, per_rank=per_rank, per_expert=per_expert)
        padded = bool(call.num_worst_tokens)
        board = self.path.board_like() if padded else None
        # before the launch: a first call compiles its kernels there (seconds), and a peer that
        # called the other kind must see this call's kind before its wait for it ends
        rounds.wait_readers(round_)  # Note [Mailbox rounds]
        rounds.mailbox.publish_dispatch(round_, call.config)
        self.path.launch(call, rows, board, self.timeout_s)
        marks["planned"] = marks["launched"] = time.perf_counter()
        handle = Handle(call.num_experts, src.x.shape[0], call.in_rank, rows, None, num_topk=src.topk.shape[1],
                        round=round_, num_worst_tokens=call.num_worst_tokens, board=board, owner=self.serial)
        if padded:
            handle.pending = functools.partial(self._complete_sm, handle, call)
            self.unresolved = handle
            marks["counts"] = marks["met"] = marks["ready"] = time.perf_counter()
        else:
            self._complete_sm(handle, call, marks)
        return handle

    def _refuse_sm(self, call: FreshSend, marks: dict) -> NoReturn:
        """Launch ``call`` (no tokens, counts no row matches: the device refuses the round on every
        rank), wait for its exchange, and raise its reason (Note [Refused dispatch])."""
        try:  # unpadded: waited for here, so nothing stays pending
            self._fresh_sm(call._replace(refused=None, num_worst_tokens=0), marks)
        except ConfigError:  # the device's refusal of this very round, which _complete_sm spent
            pass
        raise ConfigError(call.refused)

    def _complete_sm(self, handle: Handle, call: FreshSend, marks: dict | None = None) -> None:
        """Fill ``handle``'s plan in from the board of its round, waited for on the host; a refusal
        spends the round on every rank (each read the same board)."""
        rounds, round_ = self.rounds, call.round
        marks = {} if marks is None else marks
        try:
            words, board = self.path.wait_board(round_, self.timeout_s, lambda: rounds.check_peer_configs(
                round_, call.config, rounds.mailbox.published(mb.DISPATCH, round_)))
            handle.send_counts = self.checks.counts(words, handle.num_tokens, call.num_experts)[0].tolist()
            marks["counts"] = time.perf_counter()
            rounds.meet(mb.DISPATCH, round_)
            marks["met"] = time.perf_counter()
            plan_from_board(handle, board, round_, self.rank, self.layout.max_tokens)
        except ConfigError:  # every rank's board showed the same refusal: the round is spent everywhere
            rounds.end("dispatch", round_)  # (a padded round was ended when it was sent)
            raise
        marks["ready"] = time.perf_counter()

    def refuse_dispatch(self, reason: str, return_recv_hook: bool = False) -> NoReturn:
        """Take part in the next fresh dispatch round without tokens, refused, then raise
        ``ConfigError(reason)``: every peer raises ``ConfigError`` naming this rank in that round
        (or, after a padded dispatch that returned at launch, at its next call), and the round is
        spent everywhere (Note [Refused dispatch]). ``return_recv_hook`` must be the peers' (it
        picks the send path). Collective."""
        rounds, num_ranks = self.rounds, self.num_ranks
        round_ = rounds.next("dispatch")
        self.mover.start_round("dispatch", round_)
        dev = torch.device("cpu") if self.device < 0 else torch.device("cuda", self.device)
        call = refused_send(reason, num_ranks, self.layout.hidden, dev, round_, f"dispatch.{round_ % PARITIES}",
                            (area("recv_x", round_), area("recv_meta", round_)))
        self.send_fresh(call, {}, return_recv_hook)
        raise ConfigError(reason)  # each order raises it after the round; this holds if one did not

    # -- combine ------------------------------------------------------------------------------------
    def combine(self, rows, weights, handle: Handle, async_finish: bool, return_recv_hook: bool):
        """``ep.Buffer.combine``'s round on checked ``rows`` and ``weights`` (and this Buffer's ``handle``)."""
        try:
            return self._combine(rows, weights, handle, async_finish, return_recv_hook)
        except (TransferTimeout, PeerLostError) as exc:
            self._break(exc)
            raise

    def combine_args(self, x, topk_weights, handle) -> tuple:
        """``combine``'s arguments, checked (``Checks.combine_args``); with host copies a rank that
        refuses them publishes its round ``REFUSED`` and spends it, so that its peers raise naming it
        and the next call lines up (as a refused dispatch, Note [Refused dispatch])."""
        try:
            return self.checks.combine_args(x, topk_weights, handle, self.serial)
        except ConfigError:
            if self.mover.host_ordered:
                self.rounds.refuse("combine")
            raise

    def _combine(self, rows, weights, handle: Handle, async_finish: bool, return_recv_hook: bool):
        t0 = time.perf_counter()
        rounds, combiner = self.rounds, self.combiner
        round_ = rounds.next("combine")
        self.mover.start_round("combine", round_)
        word = encode_combine(handle.round, rows.dtype, weights.shape[1] if weights is not None else 0)
        rounds.wait_readers(round_, mb.COMBINE)  # ranks run at most one round apart: Note [Mailbox rounds]
        rounds.mailbox.publish_combine(round_, word)  # the bytes wait for no peer: Note [Two parities]
        t1 = time.perf_counter()
        counts = combiner.send(handle, rows, weights, round_)
        rounds.mailbox.publish(mb.COMBINE_SENT, round_)
        rounds.end("combine", round_)
        self.last_phases = {"handshake": t1 - t0, "send": time.perf_counter() - t1}
        out = torch.empty(handle.num_tokens, self.layout.hidden, dtype=rows.dtype, device=rows.device)
        out_w = None if weights is None else torch.empty(handle.num_tokens, weights.shape[1], dtype=torch.float32,
                                                         device=rows.device)

        def receive() -> None:
            t2 = time.perf_counter()
            rounds.before_receive(mb.COMBINE, mb.COMBINE_SENT, round_, self.mover.host_ordered)
            queued = combiner.receive(handle, rows, weights, round_, counts, out, out_w, self._arrived)
            # "queued": from the receive's start until the last sum is queued (the rest waits for bytes)
            self.last_phases.update(receive=time.perf_counter() - t2, queued=queued - t2)

        return self._finish("combine", round_, receive, return_recv_hook, (out, out_w), async_finish)

    # -- the end of a round ---------------------------------------------------------------------------
    def _finish(self, phase: str, round_: int, receive, return_recv_hook: bool, result: tuple, async_finish: bool):
        """Run the receive phase now and return ``(*result, event)``, or return ``(*result, event,
        hook)`` whose hook runs it once (the event then marks the send phase, as DeepEP's does)."""
        slot = (phase == "combine") * PARITIES + round_ % PARITIES
        if not return_recv_hook:
            receive()
            return (*result, self.event(slot, async_finish))
        pending = self.rounds.pending = Pending(phase, round_)

        def hook() -> None:
            if pending.done:
                return
            pending.done = True  # a receive that raises spends the hook: the next call raises what broke, if anything
            if self.closed:
                raise ConfigError(f"ep.Buffer: the receive hook of {phase} round {round_} was called after the Buffer "
                                  "was closed")
            try:
                receive()
            except (TransferTimeout, PeerLostError) as exc:
                self._break(exc)
                raise

        return (*result, self.event(slot, async_finish), hook)

    def event(self, slot: int, async_finish: bool) -> EventOverlap:
        """DeepEP's event: with ``async_finish`` on CUDA, pooled event ``slot`` recorded on the current stream now."""
        return record_done(self.done_events, slot, self.device, async_finish)

    def _arrived(self, phase: str, then, writes, early=()) -> None:
        """The mover's ``arrived`` for every source; after a failure the receive stream may wait on a
        dead peer for good, so ``close`` stops ordering the caller's stream after it."""
        try:
            self.mover.arrived(range(self.num_ranks), phase, then=then, writes=writes, early=early)
        except BaseException:
            self.recv_failed = True
            raise
