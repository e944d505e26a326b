"""``CudaMover``: the mover of the cuda_ipc backend (ep.paths.host_mover lists its operations).

# Note [Copy-engine sends]
On CUDA a gather is one kernel on the caller's stream (ep.kernels.steps) into this rank's staging
slots, for every peer at once; the copy streams then follow the caller's stream, and ``flush``
copies each area into the peer's mapped region (``flush_all``: every peer's in one
``cudaMemcpyBatchAsync`` on the shared copy stream). The copies go through the link's
``CopyEngines`` (transport._copy_engines), the copy path refit's batches take too, on the link's
pooled streams: the gather runs for tens of microseconds on the SMs, and the copy engines move the
bytes while no SM waits.
(A gather per destination let the first copy start sooner, but cost a launch per peer on the
host, and a slow rank's host then delayed its last copy; benchmarks/history-2026-11-22.md.) A cached dispatch knows
where its own rows go before it sends, so ``gather_all`` stages the peers' rows and places its
own with one push, replayed from the parity's call block (ep.paths.sm_pushes, Note [Fresh send graph]):
in hook mode the send phase's host time is what delays work queued before the hook. ``sent``/``flush`` store
the rows' arrival flag in each destination from the copy stream (ep.wire.flags, Note [Arrival
flags]), and record this rank's send event there, which its caller's stream waits for before the
inputs are reused. Rows move as int64 words: a row is a multiple of 8 channels.

# Note [Receive work on its own stream]
The receive work (the unpack, the combine's sum) is launched at once on this rank's receive
stream, behind stream waits on the sources' arrival flags (ep.wire.flags, Note [Arrival flags]): it
starts the moment the last byte is in, and the host returns at launch. The caller's stream is
ordered after the receive work with a local event. A dead or stalled sender fails the Buffer at
its deadline and its flags are released from the CPU, so the receive stream never waits for
good. Outputs the receive work writes are marked with ``record_stream``, so the allocator never
hands their memory out while it may still run. The stream keeps the default priority, unlike the
communication stream (ep.paths.comm_stream): no measured row gained from the greatest
(benchmarks/history-2026-11-27.md).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from warmlink._backoff import wait_until
from warmlink.ep.kernels import steps
from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.kernels.launch import current_stream, on_stream
from warmlink.ep.kernels.reduce import PARTS
from warmlink.ep.paths.host_mover import STAGE, Gathers, Views, as_words
from warmlink.ep.paths.sm_pushes import SmPushes
from warmlink.ep.wire.flags import OPS, arrival_value
from warmlink.ep.wire.mailbox import MAX_EXPERTS
from warmlink.ep.wire.regions import PARITIES, RegionLayout

__all__ = ["CudaMover", "SEND_PHASES", "phase_flag"]

# the phases of a round that record send events: a combine's parts but the last have their own
# (ep.kernels.reduce, Note [Pipelined combine]); each has one per parity (ep.wire.regions, Note [Two parities])
SEND_PHASES = ("dispatch", "combine", *(f"combine_part{k}" for k in range(PARTS - 1)))


@functools.cache  # a handful of phase names, looked up on every send and receive
def phase_flag(phase: str) -> tuple[str, int]:
    """``(op, part)`` of an event phase's arrival flag: ``dispatch.<p>`` is part 0,
    ``combine_part<k>.<p>`` part k, and ``combine.<p>`` (a combine's last part) part 3, so that
    its value covers every earlier part's (ep.kernels.reduce: at most 4 parts)."""
    name = phase.split(".", 1)[0]
    if name == "dispatch":
        return "dispatch", 0
    if name == "combine":
        return "combine", 3
    return "combine", int(name.removeprefix("combine_part"))


class CudaMover(SmPushes, Gathers):
    """Copy-engine copies into peers' IPC-mapped regions (Note [Copy-engine sends]), and the SM
    pushes of ep.paths.sm_pushes, ordered between ranks by arrival flags (ep.wire.flags).

    Args:
        layout: the group's region layout.
        rank, device: this rank and its CUDA device.
        own: flat ``uint8`` device tensor of this rank's region.
        peer_ptrs: ``{rank: address of byte 0 of that peer's region in this process}``.
        engines: the ``CopyEngines`` of this rank's cuda_ipc link (transport._copy_engines):
            destination ``d`` copies on its stream ``d % len(engines)`` (one stream may serve all).
        recv_stream: the pooled ``Stream`` of the receive work (Note [Receive work on its own stream]).
        local_events: ``LOCAL_EVENTS`` pooled event handles: for ``to_host``, ``send_done`` and
            the end of the receive work.
        send_events: ``{phase: [event handle per destination]}`` (this rank records and waits on them).
        flags: the group's ``ArrivalFlags``.
        peer_refs: ``{rank: PeerRef}`` for liveness checks while waiting.
    """

    LOCAL_EVENTS = 3
    host_ordered = False  # arrival flags order the bytes (ep.wire.flags)

    def __init__(self, layout: RegionLayout, rank: int, device: int, own: torch.Tensor, peer_ptrs: dict[int, int],
                 engines, recv_stream, local_events: list[int], send_events: dict, flags,
                 peer_refs: dict) -> None:
        from warmlink import _cuda

        self._cuda = _cuda
        self.layout = layout
        self.rank = rank
        self.device = device
        self._own = own
        self._views = Views(layout, {rank: own})
        self._ptrs = {rank: own.data_ptr(), **peer_ptrs}
        self._offsets = layout.offsets()
        self._engines = engines
        self._index = [d % len(engines) for d in range(layout.num_ranks)]  # each destination's copy stream
        self._streams = [engines.handles[i] for i in self._index]
        self._copy_streams = engines.handles
        self._shared = len(engines) == 1  # every destination's copies in one call (flush_all, copy_all)
        self._counted, self._send_done, self._received = local_events
        self._recv_stream = recv_stream.torch_stream()
        self._send_events = send_events
        self.flags = flags
        self._rounds = {op: 0 for op in OPS}  # the round of each op in progress (start_round)
        self._sent_on: int | None = None  # the stream of the last send phase, whose end _send_done marks
        self._refs = peer_refs
        # the landing place of start_to_host: the largest plan word vector (ep.kernels.steps.words_layout)
        # (pinned where CUDA is, which is wherever a CudaMover does real work; tests drive it with fakes)
        pinned = torch.cuda.is_available()
        self._host = torch.empty(steps.words_size(layout.num_ranks, MAX_EXPERTS), dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._host_words = 0
        self._init_pushes(own, pinned)
        # a combine's per-rank counts per parity, pinned and on the device (combine_counts)
        self._counts_host = torch.zeros(PARITIES, layout.num_ranks, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._counts_words = self._counts_host.numpy()
        self._counts_ptrs = [row.data_ptr() for row in self._counts_host]
        self._counts = list(torch.zeros(PARITIES, layout.num_ranks, dtype=torch.int64, device=own.device))

    def _current(self) -> int:
        return current_stream(self.device)

    def current_stream(self) -> int:
        """The current stream's handle (the caller's, or the communication stream within a call on it)."""
        return current_stream(self.device)

    @property
    def own_region(self) -> torch.Tensor:
        """This rank's region, a flat ``uint8`` device tensor."""
        return self._own

    def poll(self, done, timeout_s: float, late) -> None:
        """Host-poll ``done()`` for up to ``timeout_s``, watching every peer's liveness (``_poll``)."""
        self._poll(done, timeout_s, late, watch=list(self._refs), lost="while this rank waited on its device")

    def area_address(self, rank: int, area: str) -> int:
        """Byte address, in this process, of ``area`` in ``rank``'s region (this rank's or a peer's
        mapping): for diagnostics that move the same bytes outside the protocol (bench ep)."""
        return self._ptrs[rank] + self._offsets[area]

    def start_round(self, op: str, round_: int) -> None:
        """Round ``round_`` of ``op`` starts on the caller's stream: on another stream than the last
        send phase ran on, after that send (Note [Communication stream]: the calls of one Buffer
        keep their issue order on the device); a dispatch's start frees the areas of round
        ``round_ - 1``'s outputs for round ``round_ + 1`` (Note [Arrival flags])."""
        self._rounds[op] = round_
        current = self._current()
        if self._sent_on not in (None, current):
            self._cuda.stream_wait_event(current, self._send_done)
        if op == "dispatch" and round_ > 1:
            self.flags.signal_freed(current, op, round_ - 1)

    def gate(self, op: str, round_: int, sm: bool) -> None:
        """Hold the writes of round ``round_`` of ``op`` into the peers (the SMs' push on the caller's
        stream, or the copy streams) until each peer freed its areas (Note [Arrival flags])."""
        peers = range(self.layout.num_ranks)
        for stream in ([self._current()] if sm else self._copy_streams):
            self.flags.gate(stream, op, peers, round_)

    def check(self) -> None:
        """Raise a failure of an earlier call's arrival (ep.wire.flags); never blocks."""
        self.flags.check()

    def _mark_sent(self, phase: str, stream: int, dests) -> None:
        """Record ``phase``'s send event of each of ``dests`` on ``stream`` (this rank orders its
        caller after it), and signal the rows' arrival to each of them."""
        for d in dests:
            self._cuda.event_record(self._send_events[phase][d], stream)
        op, part = phase_flag(phase)
        self.flags.signal_arrived(stream, op, dests, arrival_value(self._rounds[op], part))

    def begin(self, copies: bool = True) -> None:
        """Order every destination's copy stream after the work queued so far on the caller's
        stream (``copies=False``: the SMs send, or the copies wait for a later point of it)."""
        if copies:
            self._engines.follow(self._current())

    def gather(self, rows: torch.Tensor, src: Sources, dests: range, skip: int) -> None:
        """One kernel on the current stream stages the rows of ``dests`` (but ``skip``); the copies
        flushed after it start once it ran."""
        self._stage(rows, src, dests, skip)
        self._copies_follow()

    def gather_all(self, rows: torch.Tensor, src: Sources, parts: tuple[str, ...], shift: int, parity: int,
                   timeout_s: float, graphs: bool = True) -> None:
        """``gather`` for every peer and ``place_local`` in one launch: the push kernel with this
        rank's staging slots as the peers' bases and its own areas ``parts`` (rows shifted by
        ``shift``) as its own, replayed from the parity's call block like ``send_sm_cached`` (one
        graph launch where two Triton launches cost the host ~50 us before the first copy)."""
        me, own, num_ranks = self.rank, self._ptrs[self.rank], self.layout.num_ranks
        x_bases = [own + self._offsets[STAGE[0]]] * num_ranks  # rows[t, d] counts from slot d's start
        meta_bases = [own + self._offsets[STAGE[1]]] * num_ranks
        x_bases[me] = own + self._offsets[parts[0]] + shift * src.x.shape[1] * src.x.element_size()
        meta_bases[me] = own + self._offsets[parts[1]] + shift * self.layout.meta_bytes
        self._push_cached(rows, src, x_bases + meta_bases, parity, timeout_s, graphs)
        self._copies_follow()

    def _copies_follow(self) -> None:
        """Order every copy stream after the work queued so far on the current stream (a gather)."""
        self._engines.follow(self._current())

    def flush(self, dest: int, phase: str, src: Sources, row0: int, count: int, parts: tuple[str, ...]) -> None:
        """Copy ``count`` staged rows of ``dest`` to rows ``row0...`` of its ``parts`` once gathered,
        then mark them sent (this rank's own rows were placed on the current stream)."""
        if dest == self.rank:
            self._cuda.event_record(self._send_events[phase][dest], self._current())
            return
        copies = self._flush_copies(dest, src, row0, count, parts)
        if copies:
            self._engines.copy(*(list(column) for column in zip(*copies)), self._index[dest])
        self._mark_sent(phase, self._streams[dest], [dest])

    def flush_all(self, phase: str, src: Sources, parts: tuple[str, ...], plan) -> None:
        """``flush`` of each ``(dest, row0, count)`` of ``plan``. With one copy stream for every
        destination (the default) as one batch, then every destination's mark: a receiver then
        waits for the whole batch, which ends when its last destination's copy would have anyway
        (the copies ran back to back), with no idle copy engine between copies (``copy_all``)."""
        if not self._shared:
            for dest, row0, count in plan:
                self.flush(dest, phase, src, row0, count, parts)
            return
        copies = [c for dest, row0, count in plan if dest != self.rank
                  for c in self._flush_copies(dest, src, row0, count, parts)]
        if copies:
            self._engines.copy(*(list(column) for column in zip(*copies)))
        peers = [dest for dest, _, _ in plan if dest != self.rank]
        if len(peers) < len(plan):
            self._cuda.event_record(self._send_events[phase][self.rank], self._current())
        self._mark_sent(phase, self._copy_streams[0], peers)

    def _flush_copies(self, dest: int, src: Sources, row0: int, count: int, parts: tuple[str, ...]):
        """``(destination address, staged address, bytes)`` of each area ``flush`` copies."""
        if not count:
            return []
        slot, out = dest * self.layout.max_tokens, []
        for staged, area in zip(self._views.parts(self.rank, src, STAGE), parts):
            if staged is not None:
                row = staged.shape[1] * staged.element_size()
                out.append((self._ptrs[dest] + self._offsets[area] + row0 * row, staged.data_ptr() + slot * row, count * row))
        return out

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        """Copy contiguous ``rows`` (kept alive by the caller until ``arrived``) on ``dest``'s stream."""
        words = as_words(rows)
        if words.shape[0]:
            row_nbytes = words.shape[1] * words.element_size()
            self._engines.copy([self._ptrs[dest] + self._offsets[area] + row0 * row_nbytes], [words.data_ptr()],
                               [words.shape[0] * row_nbytes], self._index[dest])

    def copy_all(self, copies) -> None:
        """``copy`` of each ``(dest, rows, area, row0)``. With one copy stream for every destination
        (the default) as one ``cudaMemcpyBatchAsync``: copies issued one by one left the copy
        engine idle ~5 us between each two (a combine in parts issues 3 per part; benchmarks/history-2026-11-22.md)."""
        if not self._shared:
            for copy in copies:
                self.copy(*copy)
            return
        dsts, srcs, sizes = [], [], []
        for dest, rows, area, row0 in copies:
            words = as_words(rows)
            if words.shape[0]:
                row_nbytes = words.shape[1] * words.element_size()
                dsts.append(self._ptrs[dest] + self._offsets[area] + row0 * row_nbytes)
                srcs.append(words.data_ptr())
                sizes.append(words.shape[0] * row_nbytes)
        self._engines.copy(dsts, srcs, sizes)

    def sent(self, dest: int, phase: str) -> None:
        if dest == self.rank:
            self._cuda.event_record(self._send_events[phase][dest], self._streams[dest])
        else:
            self._mark_sent(phase, self._streams[dest], [dest])

    def start_to_host(self, words: torch.Tensor) -> None:
        """Queue the copy of ``words`` (int64) to pinned host memory on the current stream."""
        self._host_words = words.numel()
        current = self._current()  # one raw copy: torch's copy_ costs ~30 us of host time here
        self._cuda.memcpy_async(self._host.data_ptr(), words.data_ptr(), self._host_words * 8, current)
        self._cuda.event_record(self._counted, current)

    def wait_host(self, timeout_s: float) -> np.ndarray:
        """The words of ``start_to_host``, host-polled with a deadline; everything queued on the
        stream before them has finished too (a fresh dispatch's one wait for the device)."""
        self._poll(lambda: self._cuda.event_query(self._counted), timeout_s, lambda: (
            f"ep: the caller's stream on cuda:{self.device} did not reach the dispatch's count copy within "
            f"{timeout_s:.3g} s"))
        return self._host[:self._host_words].numpy().copy()

    def _poll(self, done, timeout_s: float, late, watch=(), lost: str = "", check=None) -> None:
        """Host-poll ``done()`` until it is true. Every 5 ms: ``PeerLostError`` when a rank in
        ``watch`` died (``lost`` says when), ``check()`` (which raises to give up), and past
        ``timeout_s`` ``TransferTimeout(late())``. The one wait loop of every host wait here; it
        never sleeps, since a sleep (Linux wakes later than asked) would add itself to every call."""

        def gone() -> str | None:
            for s in watch:
                if not self._refs[s].alive():
                    return f"ep: rank {s} (pid {self._refs[s].pid}) died {lost}"
            if check is not None:
                check()
            return None

        wait_until(done, timeout_s=timeout_s, what=late, lost=gone, spin_s=math.inf, every_s=0.005)

    def send_done(self) -> None:
        self._sent_on = self._current()
        self._cuda.event_record(self._send_done, self._sent_on)

    def arrived(self, sources, phase: str, then=None, writes=(), early=()) -> None:
        """Launch each ``(phase, work)`` of ``early``, then ``then``, on the receive stream, each
        behind the sources' arrival flags of its phase (Note [Receive work on its own stream]);
        then order the current stream after the receive work and after this rank's own pushes of
        ``phase`` (so the caller may reuse its inputs). No host wait: a late or dead source fails
        the Buffer at its deadline (``check``). ``writes``: the tensors the work writes (or reads
        apart from its bytes: a padded unpack's board)."""
        current, flags = self._current(), self.flags
        if then is None:  # nothing to run: the caller's stream waits for the bytes itself
            op, part = phase_flag(phase)
            flags.wait_arrived(current, op, sources, arrival_value(self._rounds[op], part), f"{phase} bytes")
        else:
            side = self._recv_stream
            self._cuda.stream_wait_event(side.cuda_stream, self._send_done)
            for t in writes:
                if t is not None:
                    t.record_stream(side)
            with on_stream(side):
                for stage, work in (*early, (phase, then)):
                    op, part = phase_flag(stage)
                    flags.wait_arrived(side.cuda_stream, op, sources, arrival_value(self._rounds[op], part),
                                       f"{stage} bytes of round {self._rounds[op]}")
                    work()
            if phase_flag(phase)[0] == "combine":  # the sum read the combine area: peers may reuse it
                flags.signal_freed(side.cuda_stream, "combine", self._rounds["combine"])
            self._cuda.event_record(self._received, side.cuda_stream)
        for event in self._send_events[phase]:
            self._cuda.stream_wait_event(current, event)
        if then is not None:
            self._cuda.stream_wait_event(current, self._received)

    def combine_counts(self, counts: list[int], parity: int, timeout_s: float) -> torch.Tensor:
        """``counts`` as an int64 device vector for the work queued next on the current stream,
        through the parity's pinned row (one raw copy; ``torch.tensor`` costs ~20 us of host).

        Call it before ``begin``: the row is rewritten only once the combine that last read it
        (round n - 2) sent, which its own final event, recorded on a copy stream that waited for
        ``begin``, proves (as ``_push_cached``'s call block)."""
        last = self._send_events[f"combine.{parity}"][self.rank]
        if not self._cuda.event_query(last):
            self._poll(lambda: self._cuda.event_query(last), timeout_s, lambda: (
                f"ep: the combine two rounds back (parity {parity}) did not send on cuda:{self.device} within "
                f"{timeout_s:.3g} s; its counts cannot be rewritten"))
        self._counts_words[parity] = counts
        dev = self._counts[parity]
        self._cuda.memcpy_async(dev.data_ptr(), self._counts_ptrs[parity], dev.numel() * 8, self._current())
        return dev

    def close(self) -> None:
        self._ptrs = {}
        self._views = None
        self._close_pushes()
