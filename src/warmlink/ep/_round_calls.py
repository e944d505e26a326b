"""The round bodies of ``ep.Buffer``'s dispatch and combine: what a call does once ``buffer.py``
has checked its arguments and chosen its stream (ep._comm_stream), and how it finishes (inline,
or in a receive hook) and reports its event.

``RoundCalls`` is mixed into ``Buffer``: the API, its argument checks and its lifecycle stay in
ep.buffer; each call here is one round of the protocol in ep._rounds (Note [Round protocol]).
"""

from __future__ import annotations

import time
from typing import NoReturn

import torch

from warmlink.ep import _mailbox as mb
from warmlink.ep._call_block import Sources
from warmlink.ep._call_config import REFUSED, encode_call, encode_combine
from warmlink.ep._launch import current_stream
from warmlink.ep._movers import as_words
from warmlink.ep._outputs import dispatch_outputs
from warmlink.ep._regions import PARITIES, area
from warmlink.ep._rounds import Pending
from warmlink.ep._senders import FreshSend
from warmlink.ep.event import EventOverlap
from warmlink.ep.handle import Handle, per_expert_list
from warmlink.errors import ConfigError

__all__ = ["RoundCalls"]


class RoundCalls:
    """``Buffer``'s dispatch and combine rounds (mixed into it; its attributes are the Buffer's)."""

    def _dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                  expert_alignment, num_worst_tokens, async_finish, num_experts, return_recv_hook):
        t0 = time.perf_counter()
        cached = handle is not None
        try:
            self._checks.padding(expert_alignment, num_worst_tokens)
            tokens, scales = self._checks.x(x)
            if not cached:
                topk, weights, num_experts, per_rank, in_rank, per_expert = self._checks.routing(
                    tokens, topk_idx, topk_weights, num_experts, num_tokens_per_rank, is_token_in_rank,
                    num_tokens_per_expert)
                # the send path is part of the config: a rank that meets in the mailbox while another
                # trades counts on the device would read counts that were never published
                config = encode_call(num_experts, topk.shape[1], tokens.dtype, False,
                                     self._sender.by_sm(return_recv_hook), num_worst_tokens, weights is not None)
        except ConfigError as exc:
            if cached:  # no meeting to refuse in (ep._senders, Note [Refused dispatch])
                raise
            self.refuse_dispatch(str(exc), return_recv_hook)
        num_tokens = tokens.shape[0]
        rounds, mover = self._rounds, self._mover
        round_ = rounds.next("dispatch")
        mover.start_round("dispatch", round_)
        phase = f"dispatch.{round_ % PARITIES}"
        parts = (area("recv_x", round_), area("recv_meta", round_))
        if cached:
            if not isinstance(handle, Handle) or handle.num_tokens != num_tokens:
                raise ConfigError(f"ep.Buffer.dispatch: handle is for {getattr(handle, 'num_tokens', '?')} tokens; x has {num_tokens}")
            handle.resolve()  # a refused padded dispatch's handle raises its refusal at every use
            if num_worst_tokens not in (0, handle.num_worst_tokens):
                raise ConfigError(f"ep.Buffer.dispatch: num_worst_tokens={num_worst_tokens}; a cached dispatch pads its "
                                  f"outputs as the dispatch that made its handle did ({handle.num_worst_tokens})")
            config = encode_call(handle.num_experts, 0, tokens.dtype, True, num_worst_tokens=handle.num_worst_tokens)
            src = Sources(as_words(tokens), scales=scales)
            rounds.wait_readers(round_)  # ranks run at most one round apart: Note [Mailbox rounds]
            self.mailbox.publish_dispatch(round_, config)
            marks = {"start": t0, "counts": time.perf_counter()}
            # No wait for the peers (ep._regions, Note [Two parities]): the bytes move at once.
            self._sender.send_cached(handle, src, round_, phase, parts, return_recv_hook)
            marks["staged"] = marks["ready"] = time.perf_counter()
        else:
            marks = {"start": t0, "checked": time.perf_counter()}
            src = Sources(as_words(tokens), topk, weights, scales)
            handle = self._sender.send_fresh(FreshSend(src, in_rank, per_rank, per_expert, num_experts, config,
                                                       num_worst_tokens, round_, phase, parts), marks, return_recv_hook)
        mover.send_done()
        self.mailbox.publish(mb.DISPATCH_SENT, round_)
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

    def refuse_dispatch(self, reason: str, return_recv_hook: bool = False) -> NoReturn:
        """Take part in the next fresh dispatch round without tokens, refused, then raise
        ``ConfigError(reason)``: every peer raises ``ConfigError`` naming this rank in that round
        (or, after a padded dispatch that returned at launch, at its next call), and the round is
        spent everywhere (ep._senders, Note [Refused dispatch]). ``return_recv_hook`` must be the
        peers' (it picks the send path). Collective."""
        self._check_open("refuse_dispatch")
        rounds, num_ranks = self._rounds, self.num_ranks
        round_ = rounds.next("dispatch")
        self._mover.start_round("dispatch", round_)
        dev = torch.device("cpu") if self.device < 0 else torch.device("cuda", self.device)
        src = Sources(as_words(torch.empty(0, self.layout.hidden, dtype=torch.bfloat16, device=dev)),
                      torch.empty(0, 1, dtype=torch.int64, device=dev))
        per_rank = torch.full((num_ranks,), -1, dtype=torch.int32, device=dev)  # no row matches: the device refuses
        call = FreshSend(src, torch.empty(0, num_ranks, dtype=torch.bool, device=dev), per_rank,
                         torch.zeros(num_ranks, dtype=torch.int32, device=dev), num_ranks, REFUSED, 0, round_,
                         f"dispatch.{round_ % PARITIES}", (area("recv_x", round_), area("recv_meta", round_)),
                         refused=reason)
        self._sender.send_fresh(call, {}, return_recv_hook)
        raise ConfigError(reason)  # each sender raises it after the round; this holds if one did not

    def _combine(self, rows, weights, handle: Handle, async_finish: bool, return_recv_hook: bool):
        t0 = time.perf_counter()
        rounds, combiner = self._rounds, self._combiner
        round_ = rounds.next("combine")
        self._mover.start_round("combine", round_)
        word = encode_combine(handle.round, rows.dtype, weights.shape[1] if weights is not None else 0)
        rounds.wait_readers(round_, mb.COMBINE)  # ranks run at most one round apart: Note [Mailbox rounds]
        self.mailbox.publish_combine(round_, word)  # the bytes wait for no peer: Note [Two parities]
        t1 = time.perf_counter()
        counts = combiner.send(handle, rows, weights, round_)
        self.mailbox.publish(mb.COMBINE_SENT, round_)
        rounds.end("combine", round_)
        self.last_phases = {"handshake": t1 - t0, "send": time.perf_counter() - t1}
        out = torch.empty(handle.num_tokens, self.layout.hidden, dtype=rows.dtype, device=rows.device)
        out_w = None if weights is None else torch.empty(handle.num_tokens, weights.shape[1], dtype=torch.float32,
                                                         device=rows.device)

        def receive() -> None:
            t2 = time.perf_counter()
            rounds.before_receive(mb.COMBINE, mb.COMBINE_SENT, round_, self._mover.host_ordered)
            queued = combiner.receive(handle, rows, weights, round_, counts, out, out_w, self._arrived)
            # "queued": from the receive's start until the last sum is queued (the rest waits for bytes)
            self.last_phases.update(receive=time.perf_counter() - t2, queued=queued - t2)

        return self._finish("combine", round_, receive, return_recv_hook, (out, out_w), async_finish)

    def _finish(self, phase: str, round_: int, receive, return_recv_hook: bool, result: tuple, async_finish: bool):
        """Run the receive phase now and return ``(*result, event)``, or return ``(*result, event,
        hook)`` whose hook runs it once (the event then marks the send phase, as DeepEP's does)."""
        slot = (phase == "combine") * PARITIES + round_ % PARITIES
        if not return_recv_hook:
            receive()
            return (*result, self._overlap(slot, async_finish))
        pending = self._rounds.pending = Pending(phase, round_)

        def hook() -> None:
            if not pending.done:
                receive()
                pending.done = True

        return (*result, self._overlap(slot, async_finish), hook)

    def _overlap(self, slot: int, async_finish: bool) -> EventOverlap:
        """DeepEP's event: with ``async_finish`` on CUDA, pooled event ``slot`` recorded on the current stream now."""
        if self.device < 0 or not async_finish:
            return EventOverlap(None, self.device)
        from warmlink import _cuda

        event = self._done_events[slot]
        _cuda.event_record(event, current_stream(self.device))
        return EventOverlap(event, self.device)

    def _arrived(self, phase: str, then, writes, early=()) -> None:
        """The mover's ``arrived`` for every source; after a failure the receive stream may wait on a
        dead peer for good, so ``close`` stops ordering the caller's stream after it."""
        try:
            self._mover.arrived(range(self.num_ranks), phase, then=then, writes=writes, early=early)
        except BaseException:
            self._recv_failed = True
            raise
