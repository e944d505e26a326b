"""The low-latency runtime of one Buffer: its region, mailbox and outputs, and the rounds of its calls.

Over 400 lines: one object owns the rounds (Note [Low-latency rounds]) of both paths, host and
device; their calls, hooks, clean and mask calls read and advance the same round state.

# Note [Low-latency rounds]
Dispatch round ``n`` (and likewise combine round ``m``) of every rank:

1. send: check every argument (nothing has moved yet); make sure parity ``n % 2`` is free: this
   rank received round ``n - 2`` (else ``ConfigError``: its hook was not called) and so did every
   peer (their "received" words, which have almost always passed it already); write the rows into
   the peers' areas of that parity and the signal words (ep.low_latency._layout), then publish "round n" and
   the call's arguments in this rank's mailbox (payload before round number: ep.wire.mailbox, Note
   [Mailbox rounds]);
2. receive (inline, or in the hook): wait for every peer's "round n" (the Buffer's timeout; a dead
   peer raises ``PeerLostError``), check that every rank called with the same arguments
   (``ConfigError`` on every rank alike), then pack (dispatch) or sum (combine), and publish
   "received" up to the last round whose receive, and every one before it, is done.

So two rounds of each phase may await their hooks at once, DeepEP's double buffer: a decode step
sends micro-batch A, then B, then calls A's hook while B's rows travel.

``clean_low_latency_buffer`` is a dispatch round that sends no rows: each rank zeroes its region
and outputs, publishes, and waits for every peer, so no peer writes a later round into a region
still being zeroed. After a timeout or a lost peer the group's rounds are out of step; every later
call raises the same error type instead of mixing rounds.

A Buffer on a GPU runs the same rounds without the host: ep.low_latency._device, Note
[Low-latency device path].
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from warmlink import _cuda
from warmlink.ep.kernels.launch import current_stream
from warmlink.ep.low_latency import _failures
from warmlink.ep.low_latency._checks import LowLatencyChecks, check_handle, refuse_backend
from warmlink.ep.low_latency._connect import Peers, connect
from warmlink.ep.low_latency._device import BOTH, SEND, DevicePath, call_tag
from warmlink.ep.low_latency._handle import LowLatencyHandle
from warmlink.ep.low_latency._host import HostPath
from warmlink.ep.low_latency._layout import LL_PARITIES, LowLatencyLayout
from warmlink.ep.low_latency._mask import HostMask, check_mask_call
from warmlink.ep.low_latency._outputs import Outputs
from warmlink.ep.paths.event import EventOverlap
from warmlink.ep.wire import mailbox as mb
from warmlink.errors import ConfigError, MetadataError, PeerLostError, TransferTimeout

__all__ = ["LowLatencyRuntime"]

_SERIALS = itertools.count(1)
_CLEAN = 1 << 62  # the config word of a clean round


def _call_word(tokens: int, topk: int, fp8: bool, round_scale: bool, ue8m0: bool) -> int:
    """A dispatch's arguments that every rank must share, in one mailbox word."""
    return 1 | fp8 << 1 | round_scale << 2 | ue8m0 << 3 | topk << 4 | tokens << 16


def _describe(word: int) -> str:
    if word == _CLEAN:
        return "clean_low_latency_buffer"
    return (f"num_max_dispatch_tokens_per_rank={word >> 16}, {(word >> 4) & 0xFFF} top-k columns, "
            f"use_fp8={bool(word & 2)}, round_scale={bool(word & 4)}, use_ue8m0={bool(word & 8)}")


_RECEIVED = {"dispatch": mb.DISPATCH_RECEIVED, "combine": mb.COMBINE_RECEIVED}


class LowLatencyRuntime:
    """One rank's low-latency mode (the host path on shm, the device path on cuda_ipc). Collective
    construction; see ``ep.low_latency``."""

    def __init__(self, store, rank: int, num_ranks: int, *, max_tokens: int, hidden: int, num_experts: int,
                 num_topk: int, device: int, backend: str, timeout_s: float, shrink: bool = False) -> None:
        from warmlink.pool.events import lease_event
        from warmlink.transport import lease_link

        self._closed, self._path = True, None
        self._peers = Peers()
        self._leases: list = []
        self._regions: list = []
        refuse_backend(backend)
        self.layout = LowLatencyLayout(num_ranks, max_tokens, hidden, num_experts, num_topk)
        self.rank, self.device, self.timeout_s = rank, device, timeout_s
        self.serial = next(_SERIALS)
        self._on_device = backend != "shm"
        self._checks = LowLatencyChecks(self.layout, device, read_values=not self._on_device)
        self._mask = HostMask(num_ranks, rank, shrink)  # the host path's (ep.low_latency._mask)
        self._meets = 0  # the device path's clean meets (mailbox MEET rounds)
        self._round = {"dispatch": 0, "combine": 0}
        self._received = {"dispatch": 0, "combine": 0}  # every round up to this one was received
        self._done: dict[str, set[int]] = {"dispatch": set(), "combine": set()}  # received past a gap
        self._clean_round = 0
        self._broken: BaseException | None = None
        self._no_event = EventOverlap(None, device)
        try:
            link_lease, mail_lease = lease_link(backend, device, timeout_s), lease_link("shm", -1, timeout_s)
            self._leases = [link_lease, mail_lease]
            link, mail_link = link_lease.resource, mail_lease.resource
            region = link.allocate(self.layout.region_nbytes)
            self._regions.append((link, region))
            mail_region = mail_link.allocate(mb.mailbox_nbytes(num_ranks))
            self._regions.append((mail_link, mail_region))
            region.tensor.zero_()  # a pooled region comes back with an earlier Buffer's bytes
            if self._on_device:
                torch.cuda.synchronize(device)  # zeroed before any peer can map it
            self.mailbox = mb.Mailbox(mail_region.tensor, rank, num_ranks)
            self._outputs = Outputs(self.layout, device)
            connect(store, rank, self.layout, device, backend, link, region, mail_link, mail_region, self.mailbox,
                    timeout_s, self._peers)
            if self._on_device:
                self._events = {}
                for key in ((phase, p) for phase in ("dispatch", "combine") for p in range(LL_PARITIES)):
                    lease = lease_event(device)
                    self._leases.append(lease)
                    self._events[key] = lease
                bases = {rank: region.ptr, **{r: reg.ptr for r, reg in self._peers.regions.items()}}
                self._path = DevicePath(self.layout, rank, bases, torch.device("cuda", device), timeout_s,
                                        self._outputs, shrink=shrink)
            else:
                regions = {r: reg.tensor for r, reg in self._peers.regions.items()}
                self._path = HostPath(self.layout, rank, {rank: region.tensor, **regions})
            self._region = region
            self._closed = False
        except BaseException:
            self.close()
            raise

    # -- checks ----------------------------------------------------------------------------------
    def _check_usable(self, func: str) -> None:
        if not (self._closed or self._broken is not None or (self._on_device and self._path.failed())):
            return  # (every call asks: the common answer first)
        if self._closed:
            raise ConfigError(f"ep.Buffer.{func}: the buffer is closed")
        if self._broken is not None:
            raise type(self._broken)(f"ep.Buffer.{func}: an earlier low-latency call failed ({self._broken}); the "
                                     "group's rounds are out of step: close this Buffer and build a new one")
        if self._on_device:
            self._raise_device_failure(func)

    def _raise_device_failure(self, func: str) -> None:
        """Raise what a kernel of an earlier call reported (Note [Low-latency device path]); a
        timeout or a lost peer breaks the Buffer for good."""
        exc = _failures.error(self._path.failure(), f"ep.Buffer.{func}", self.device, self._path.timeout_ns / 1e9,
                              self.layout.num_experts, self._peers.refs)
        if isinstance(exc, (TransferTimeout, PeerLostError)):
            self._broken = exc
        if exc is not None:
            raise exc

    def _next_round(self, phase: str, func: str, outstanding: int = 2) -> int:
        """The round a new ``phase`` call makes, once its parity is free here and in every peer
        (Note [Low-latency rounds], step 1); at most ``outstanding`` rounds may await their hooks."""
        round_ = self._round[phase] + 1
        if self._received[phase] < round_ - outstanding:
            waiting = [r for r in range(self._received[phase] + 1, round_) if r not in self._done[phase]]
            raise ConfigError(f"ep.Buffer.{func}: the receive hooks of low-latency {phase} rounds {waiting} were not "
                              f"called; at most {outstanding} {phase} rounds may await their hooks (call the oldest first)")
        if round_ > 2 and not self._on_device:  # on a device, each send kernel waits for the acks
            self._receive(lambda: self._mask.wait(self.mailbox, _RECEIVED[phase], round_ - 2, self.timeout_s))
        return round_

    # -- the round protocol (Note [Low-latency rounds]) -------------------------------------------
    def _finish(self, phase: str, round_: int, receive, return_recv_hook: bool, async_finish: bool,
                result: tuple) -> tuple:
        """``(*result, event, hook)``: the receive ran now (hook None), or runs once in ``hook()``.
        On a GPU with ``async_finish`` the event marks the call's last kernel on the current stream."""
        if not return_recv_hook:
            self._receive(receive, phase, round_)
        event = self._event(phase, round_, async_finish)
        if not return_recv_hook:
            return (*result, event, None)
        called = []

        def hook() -> None:
            if not called:
                called.append(True)  # a receive that raises spends the round: the next call may go on
                self._receive(receive, phase, round_)

        return (*result, event, hook)

    def _device_hook(self, phase: str, round_: int, packed, args: tuple, handle: LowLatencyHandle | None = None):
        """A device-path call's receive hook: the receive's launch (``packed``: the one its send
        packed, or None), then ``handle``'s receive complete and the round received. Nothing
        else: its host time is a decode step's (the kernels wait for the peers and report
        failures to the next call)."""
        called = []

        def hook() -> None:
            if called:
                return
            called.append(True)
            try:  # a launch that raises spends the round: the next call may go on
                if self._closed:
                    raise ConfigError(f"ep.Buffer: the receive hook of low-latency {phase} round {round_} was called "
                                      "after the Buffer was closed")
                self._path.receive(phase, packed, args)
                if handle is not None:
                    handle.rows_by_source = ()
            finally:
                self._mark_received(phase, round_)

        return hook

    def _event(self, phase: str, round_: int, async_finish: bool) -> EventOverlap:
        """The call's event: recorded after its last kernel with ``async_finish`` on a GPU, else none."""
        if self._on_device and async_finish:
            handle = self._events[phase, round_ % LL_PARITIES].resource.handle
            _cuda.event_record(handle, current_stream(self.device))
            return EventOverlap(handle, self.device)
        return self._no_event

    def _receive(self, receive, phase: str | None = None, round_: int = 0) -> None:
        """Run ``receive``; then mark ``round_`` of ``phase`` received (a round refused on every
        rank is spent too), or, after a timeout or a lost peer, the Buffer broken."""
        try:
            receive()
        except (PeerLostError, TransferTimeout) as exc:
            self._broken = exc
            raise
        finally:
            if phase is not None and self._broken is None:
                self._mark_received(phase, round_)

    def _mark_received(self, phase: str, round_: int) -> None:
        done = self._done[phase]
        if done or round_ != self._received[phase] + 1:  # past a gap (a hook called out of order)
            done.add(round_)
            while self._received[phase] + 1 in done:
                self._received[phase] += 1
                done.discard(self._received[phase])
        else:
            self._received[phase] = round_
        if not self._on_device:  # (the kernels' acks tell the peers on a GPU)
            self.mailbox.publish(_RECEIVED[phase], self._received[phase])

    def _same_dispatch(self, round_: int, word: int) -> None:
        live = self._mask.live()
        for r in range(self.layout.num_ranks):
            theirs = self.mailbox.config(r, round_) if r in live else word
            if theirs != word:
                raise ConfigError(f"ep.Buffer: low-latency round {round_}: rank {r} called {_describe(theirs)}, "
                                  f"this rank {_describe(word)}; every rank must make the same call with the same "
                                  "arguments (this round is spent; the next one may go on)")

    # -- calls -------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats,
                 use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook) -> tuple:
        if self._closed or self._broken is not None or (self._on_device and self._path.failed()):
            self._check_usable("low_latency_dispatch")  # (as the combine's)
        lay, tokens = self.layout, num_max_dispatch_tokens_per_rank
        phase = SEND if return_recv_hook else BOTH  # (without a hook, one launch sends and receives)
        made = None
        if self._on_device and self._checks.plain_dispatch_flags(tokens, num_experts, use_fp8, round_scale, use_ue8m0,
                                                                 async_finish, return_recv_hook):
            # the common call: its tensors' checks and its launch in one compiled call
            round_ = self._next_round("dispatch", "low_latency_dispatch")
            tag = call_tag(tokens, use_fp8, round_scale, use_ue8m0)
            made = self._path.dispatch_made(phase, round_ % LL_PARITIES, x, topk_idx, tokens, use_fp8, round_scale,
                                            use_ue8m0, tag, cumulative_stats, wait_stats)
        if made is None:  # every check, naming what is wrong
            x, topk_idx = self._checks.dispatch(x, topk_idx, tokens, num_experts, use_fp8, round_scale, use_ue8m0,
                                                async_finish, return_recv_hook, cumulative_stats, wait_stats)
            round_ = self._next_round("dispatch", "low_latency_dispatch")
        p = round_ % LL_PARITIES
        out = self._outputs.views(p, tokens, use_fp8, use_ue8m0)
        n, num_cols = topk_idx.shape
        dispatched = self._outputs.dispatched(p, n, num_cols)
        if made is not None:
            packed = made[0]
        elif self._on_device:
            tag = call_tag(tokens, use_fp8, round_scale, use_ue8m0)
            packed = self._path.dispatch(phase, p, x, topk_idx, tokens, use_fp8, round_scale, use_ue8m0, tag,
                                         cumulative_stats, wait_stats)
        else:
            self._path.send_dispatch(round_, x, topk_idx, tokens, use_fp8, round_scale, self._mask.masked())
            word = _call_word(tokens, num_cols, use_fp8, round_scale, use_ue8m0)
            self.mailbox.publish_dispatch(round_, word)
            dispatched.copy_(topk_idx >= 0)
        self._round["dispatch"] = round_
        handle = LowLatencyHandle(out.src_info, out.layout_range, tokens, lay.hidden, lay.num_experts, n, num_cols,
                                  round_, self.serial, out.comb_slot, dispatched)
        result = ((out.x, out.scales) if use_fp8 else out.x, out.count, handle)
        if self._on_device:
            if not return_recv_hook:  # the one launch received too: the kernels' combine reads the handle's tensors
                handle.rows_by_source = ()
                self._mark_received("dispatch", round_)
                event = self._event("dispatch", round_, async_finish) if async_finish else self._no_event
                return (*result, event, None)
            args = (p, x, topk_idx, tokens, use_fp8, round_scale, use_ue8m0, tag, cumulative_stats, wait_stats)
            hook = self._device_hook("dispatch", round_, packed, args, handle)
            return (*result, self._event("dispatch", round_, async_finish), hook)

        def receive() -> None:
            self._mask.wait(self.mailbox, mb.DISPATCH, round_, self.timeout_s, wait_stats)
            self._same_dispatch(round_, word)
            counts = self._path.arrived_counts(round_, self._mask.live_array())
            if counts.max(initial=0) > tokens:
                s, e = (int(v[0]) for v in np.nonzero(counts > tokens))
                raise MetadataError(f"ep low-latency dispatch round {round_}: rank {s} wrote {counts[s, e]} rows for "
                                    f"local expert {e}; expected at most num_max_dispatch_tokens_per_rank={tokens}")
            handle.rows_by_source = self._path.receive_dispatch(p, counts, tokens, use_fp8, use_ue8m0, out)
            if cumulative_stats is not None:
                cumulative_stats.add_(out.count)

        return self._finish("dispatch", round_, receive, return_recv_hook, async_finish, result)

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
                wait_stats) -> tuple:
        if self._closed or self._broken is not None or (self._on_device and self._path.failed()):
            self._check_usable("low_latency_combine")  # (every call asks: the common answer inline)
        check_handle(handle, "low_latency_combine", self.serial, self._round["dispatch"], self._clean_round)
        phase, tag = SEND if return_recv_hook else BOTH, handle.round & 0xFFFFFF  # (every rank combines one dispatch)
        made = None
        if self._on_device and zero_copy is False and self._checks.plain_combine_flags(use_logfmt, zero_copy,
                                                                                      async_finish, return_recv_hook):
            # the common call: its tensors' checks, its output and its launch in one compiled call
            round_ = self._next_round("combine", "low_latency_combine")
            p = round_ % LL_PARITIES
            made = self._path.combine_made(phase, p, x, handle, topk_idx, topk_weights, out, tag, wait_stats)
        if made is not None:
            combined, packed = made
        else:  # every check, naming what is wrong
            x, topk_idx, topk_weights, combined = self._checks.combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                                                       zero_copy, async_finish, return_recv_hook, out,
                                                                       wait_stats)
            p = (self._round["combine"] + 1) % LL_PARITIES
            if zero_copy:  # the rows were written into this combine's buffer (next_combine_buffer): x is not read
                x = self._outputs.combine_buffer(p, handle.num_max_dispatch_tokens_per_rank, make=False)
                if x is None:
                    raise ConfigError("ep.Buffer.low_latency_combine: zero_copy=True, but "
                                      "get_next_low_latency_combine_buffer was never called: write the rows into the "
                                      "buffer it returns first")
            round_ = self._next_round("combine", "low_latency_combine")
            if self._on_device:  # without a hook, one launch sends and receives
                packed = self._path.combine(phase, p, x, handle, topk_idx, topk_weights, combined, tag, wait_stats)
            else:
                self._path.send_combine(p, x, handle.rows_by_source, handle.comb_slot, self._mask.masked())
                self.mailbox.publish_combine(round_, handle.round)
        self._round["combine"] = round_
        if self._on_device:
            if not return_recv_hook:  # the one launch received too
                self._mark_received("combine", round_)
                return combined, self._event("combine", round_, async_finish) if async_finish else self._no_event, None
            hook = self._device_hook("combine", round_, packed,
                                     (p, x, handle, topk_idx, topk_weights, combined, tag, wait_stats))
            return combined, self._event("combine", round_, async_finish), hook

        def receive() -> None:
            self._mask.wait(self.mailbox, mb.COMBINE, round_, self.timeout_s, wait_stats)
            for r in self._mask.live():
                theirs = self.mailbox.combine_handle(r, round_)
                if theirs != handle.round:
                    raise ConfigError(f"ep.Buffer.low_latency_combine: rank {r} combines the handle of dispatch round "
                                      f"{theirs}, this rank that of round {handle.round}; every rank must pass the "
                                      "handle of the same dispatch")
            self._path.receive_combine(p, topk_idx, topk_weights, combined, self._mask.live_array())

        return self._finish("combine", round_, receive, return_recv_hook, async_finish, (combined,))

    def next_combine_buffer(self, handle) -> torch.Tensor:
        """The buffer the next combine reads with ``zero_copy=True`` (its parity's: the one after
        it gets the other, so one may be filled while the other is sent)."""
        self._check_usable("get_next_low_latency_combine_buffer")
        check_handle(handle, "get_next_low_latency_combine_buffer", self.serial, self._round["dispatch"],
                     self._clean_round)
        p = (self._round["combine"] + 1) % LL_PARITIES
        return self._outputs.combine_buffer(p, handle.num_max_dispatch_tokens_per_rank, make=True)

    def clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        func = "clean_low_latency_buffer"
        self._check_usable(func)
        self._checks.max_tokens(func, num_max_dispatch_tokens_per_rank)
        self._checks.experts(func, num_experts)
        if hidden != self.layout.hidden:
            raise ConfigError(f"ep.Buffer.{func}: hidden={hidden!r}; this Buffer was built for hidden={self.layout.hidden}")
        busy = {phase: self._round[phase] - self._received[phase] for phase in self._round}
        if any(busy.values()):
            raise ConfigError(f"ep.Buffer.{func}: low-latency rounds await their hooks ({busy}); call them first")
        if self._on_device:
            self._clean_on_device()
            return
        round_ = self._next_round("dispatch", func)
        self._path.zero()
        self._outputs.zero()
        self.mailbox.publish_dispatch(round_, _CLEAN)
        self._round["dispatch"] = self._clean_round = round_

        def receive() -> None:
            self._mask.wait(self.mailbox, mb.DISPATCH, round_, self.timeout_s)
            self._same_dispatch(round_, _CLEAN)

        self._receive(receive, "dispatch", round_)

    def _clean_on_device(self) -> None:
        """Zero the rows and outputs once no kernel of any rank can still write them: every rank's
        stream has drained before the first meet; the second keeps a peer's next call from
        writing into a region still being zeroed. Sequence numbers go on (Note [Low-latency device path])."""
        torch.cuda.synchronize(self.device)
        self._raise_device_failure("clean_low_latency_buffer")
        self._mask.words.copy_(self._path.mask)  # whom the kernels masked: the meets wait for the others
        self._meet()
        for area in ("disp", "disp_meta", "comb"):
            for p in range(LL_PARITIES):
                at = self.layout.offset(f"{area}.{p}")
                self._region.tensor[at:at + self.layout.area_bytes(area)].zero_()
        self._outputs.zero()
        torch.cuda.synchronize(self.device)
        self._meet()
        self._path.mask.copy_(self._mask.words)  # and whom the meets masked
        self._clean_round = self._round["dispatch"]

    def _meet(self) -> None:
        self._meets += 1
        self.mailbox.publish_meet(self._meets, _CLEAN)
        self._receive(lambda: self._mask.wait(self.mailbox, mb.MEET, self._meets, self.timeout_s))

    # -- the mask buffer (ep.low_latency._mask) -----------------------------------------------------
    def mask_call(self, func: str, op: str, rank=None, masked: bool = True, out=None) -> None:
        """DeepEP's mask buffer calls: ``op`` "query" (into ``out``), "update" or "clean"."""
        self._check_usable(func)
        check_mask_call(func, self._mask.shrink, self.layout.num_ranks, rank, out, self.device)
        mask = self._path if self._on_device else self._mask  # on a GPU: kernels on the current stream
        if op == "query":
            mask.query_mask(out)
        elif op == "update":
            mask.update_mask(rank, bool(masked))
        else:
            mask.clean_mask()

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Give the region, mappings and leases back to the pool. Idempotent."""
        self._closed = True
        if self._path is not None:
            self._path.close()
            self._path = None
        for link, region in self._peers.opened:
            link.close_region(region)
        self._peers = Peers()
        for link, region in reversed(self._regions):
            link.release(region)
        self._regions = []
        for lease in reversed(self._leases):
            lease.release()
        self._leases = []
