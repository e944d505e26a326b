"""How rows reach a peer's region: host copies (shm) or copy engines (cuda_ipc).

Both movers offer the same operations, so ``Buffer`` holds one protocol for both backends:

- ``begin(copies)``: later pushes are ordered after the caller's stream;
- ``gather(rows, src, dests, skip)``: the rows (and meta rows) of ``src`` bound for ``dests``
  (but ``skip``) go into this rank's staging slots (ep._kernels.gather); staging needs no peer,
  and a row's place in the peer may be known only after the handshake;
- ``flush(dest, phase, src, row0, count, parts)``: ``count`` staged rows of ``src`` in ``dest``'s
  slot go to rows ``row0...`` of its areas ``parts``, then are marked sent; ``flush_all(phase,
  src, parts, plan)`` several destinations at once;
- ``place_local(rows, src, parts, shift)``: this rank's own rows straight into its own areas;
- ``gather_all(rows, src, parts, shift, parity, graphs)``: both at once, for every destination (a
  cached dispatch's, whose own rows' place is known before the send);
- ``copy(dest, rows, area, row0)``: contiguous ``rows`` go there directly; ``copy_all(copies)``
  several such at once; ``sent(dest, phase)`` marks them;
- ``start_to_host(words)`` / ``wait_host(timeout_s)``: a small device vector on the host (the
  dispatch's one wait for the device), with work queued in between;
- ``wait_begun(timeout_s)``: block until the caller's stream reached ``begin``;
- ``send_done()``: the end of a send phase on the caller's stream (what the receive work follows);
- ``arrived(sources, phase, timeout_s, then, writes, early)``: run ``then`` (the receive work:
  the unpack, the combine's sum) once the marks of ``sources`` toward this rank are complete
  (and each ``(phase, work)`` of ``early`` once that phase's marks are: the combine's parts),
  block until they are, then order the caller's stream after it and after this rank's own pushes;
- ``combine_counts(counts, parity, timeout_s)``: a combine's per-rank row counts where its sum
  can read them (ep._reduce, Note [Pipelined combine]).

``phase`` names the marks of one phase and parity (``"dispatch.0"``, ...; ep._regions, Note [Two
parities]).

# Note [Copy-engine sends]
On CUDA a gather is one kernel on the caller's stream (ep._kernels) into this rank's staging
slots, for every peer at once; ``gather`` then records one event that the copy streams wait for,
and ``flush`` issues one ``cudaMemcpyAsync`` per area into the peer's mapped region
(``flush_all``: every peer's in one ``cudaMemcpyBatchAsync`` on the shared copy stream): the gather
runs for tens of microseconds on the SMs, and the copy engines move the bytes while no SM waits.
(A gather per destination let the first copy start sooner, but cost a launch per peer on the
host, and a slow rank's host then delayed its last copy; BENCHMARKS.md.) A cached dispatch knows
where its own rows go before it sends, so ``gather_all`` stages the peers' rows and places its
own with one push, replayed from the parity's call block (ep._kernels, Note [Fresh send graph]):
in hook mode the send phase's host time is what delays work queued before the hook. ``sent``/``flush`` record an
interprocess event on the copy stream; the receiver, once the sender's mailbox says the event was
recorded for this round, polls it from the host (a dead or stalled sender turns into a timeout,
never a hung caller's stream). Rows move as int64 words: a row is a multiple of 8 channels.

# Note [Receive work on its own stream]
The receive work (the unpack, the combine's sum) is launched before the bytes land, on this
rank's receive stream, behind stream waits on the sources' events: it starts the moment the last
byte is in, not a host poll and a 20-30 us launch later. The host still polls the same events
(deadline, liveness) and only then makes the caller's stream wait for the receive stream, so a
dead sender can block the receive stream, never the caller's. Outputs the receive work writes are
marked with ``record_stream``, so the allocator never hands their memory out while it may still
run; a Buffer whose receive failed gives the stream back to the pool, which destroys a stream that
does not drain (pool.streams).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from warmlink._backoff import poll, wait_until
from warmlink.ep import _kernels
from warmlink.ep._launch import current_stream, on_stream
from warmlink.ep._mailbox import MAX_EXPERTS
from warmlink.ep._regions import PARITIES, RegionLayout, board_words

log = logging.getLogger("warmlink.ep")

# words of a call block (ep._kernels.CALL_SLOTS) a cached dispatch fills
_ROWS, _X, _SCALES, _TOKENS = (_kernels.CALL_SLOTS.index(name) for name in ("rows", "x", "scales", "tokens"))

__all__ = ["CudaMover", "HostMover", "as_words"]


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``[N, words]`` view of a row-major tensor's bytes: int64 words when a row's size allows,
    else bytes (``view(N, -1)`` alone fails when N == 0)."""
    if t.dim() == 2 and t.shape[1] * t.element_size() % 8 == 0:  # every dispatch's x: one view
        return t if t.dtype == torch.int64 else t.view(torch.int64)
    row_nbytes = math.prod(t.shape[1:]) * t.element_size()
    flat = t.view(t.shape[0], math.prod(t.shape[1:]))
    word = torch.int64 if row_nbytes % 8 == 0 else torch.uint8
    return flat.view(torch.uint8).view(word) if t.dtype != word else flat


class _Views:
    """Typed views of one region's areas, made once per (rank, area, word type, columns)."""

    def __init__(self, layout: RegionLayout, regions: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.regions = regions
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, rank: int, area: str, dtype: torch.dtype, cols: int) -> torch.Tensor:
        key = (rank, area, dtype, cols)
        view = self._cache.get(key)
        if view is None:
            view = self._cache[key] = self.layout.view(self.regions[rank], area, dtype, cols)
        return view

    def parts(self, rank: int, src: _kernels.Sources, parts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x rows as int64 words, meta rows as bytes or None)`` of ``rank``'s areas ``parts``."""
        x = self.get(rank, parts[0], torch.int64, src.x.shape[1])
        meta = self.get(rank, parts[1], torch.uint8, self.layout.meta_bytes) if src.has_meta else None
        return x, meta


STAGE = ("stage_x", "stage_meta")


class _Gathers:
    """The gathers both movers share: into this rank's staging slots, or into its own areas."""

    layout: RegionLayout
    rank: int
    _views: _Views

    def _stage(self, rows: torch.Tensor, src: _kernels.Sources, dests: range, skip: int) -> None:
        x, meta = self._views.parts(self.rank, src, STAGE)
        _kernels.gather(rows, src, x, meta, self.layout.num_topk, dests, skip=skip)

    def own_view(self, area: str, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """``[rows, cols]`` view of this rank's ``area`` as ``dtype``, made once per key."""
        return self._views.get(self.rank, area, dtype, cols)

    def place_local(self, rows: torch.Tensor, src: _kernels.Sources, parts: tuple[str, ...], shift: int) -> None:
        x, meta = self._views.parts(self.rank, src, parts)
        _kernels.gather(rows, src, x, meta, self.layout.num_topk, range(self.rank, self.rank + 1), shift)

    def gather_all(self, rows: torch.Tensor, src: _kernels.Sources, parts: tuple[str, ...], shift: int, parity: int,
                   timeout_s: float, graphs: bool = True) -> None:
        self.gather(rows, src, range(self.layout.num_ranks), self.rank)
        self.place_local(rows, src, parts, shift)


class HostMover(_Gathers):
    """Shared-memory regions written directly by this process's CPU (the shm backend)."""

    def __init__(self, layout: RegionLayout, rank: int, own: torch.Tensor, peers: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.rank = rank
        self._views = _Views(layout, {rank: own, **peers})
        self._words: torch.Tensor | None = None

    def begin(self, copies: bool = True) -> None:
        pass

    def gather(self, rows: torch.Tensor, src: _kernels.Sources, dests: range, skip: int) -> None:
        self._stage(rows, src, dests, skip)

    def flush(self, dest: int, phase: str, src: _kernels.Sources, row0: int, count: int, parts: tuple[str, ...]) -> None:
        if dest == self.rank or not count:
            return
        slot = dest * self.layout.max_tokens
        for staged, there in zip(self._views.parts(self.rank, src, STAGE), self._views.parts(dest, src, parts)):
            if staged is not None:
                there[row0:row0 + count].copy_(staged[slot:slot + count])

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        words = as_words(rows)
        self._views.get(dest, area, words.dtype, words.shape[1])[row0:row0 + words.shape[0]].copy_(words)

    def flush_all(self, phase: str, src: _kernels.Sources, parts: tuple[str, ...], plan) -> None:
        for dest, row0, count in plan:
            self.flush(dest, phase, src, row0, count, parts)

    def copy_all(self, copies) -> None:
        for copy in copies:
            self.copy(*copy)

    def sent(self, dest: int, phase: str) -> None:
        pass

    def start_to_host(self, words: torch.Tensor) -> None:
        self._words = words

    def wait_host(self, timeout_s: float) -> np.ndarray:
        words, self._words = self._words, None
        return words.numpy().copy()

    def wait_begun(self, timeout_s: float) -> None:
        pass

    def send_done(self) -> None:
        pass

    def arrived(self, sources, phase: str, timeout_s: float, then=None, writes=(), early=()) -> None:
        for _, work in early:  # the mailbox's "sent" round already ordered the copies
            work()
        if then is not None:
            then()

    def combine_counts(self, counts: list[int], parity: int, timeout_s: float) -> torch.Tensor:
        return torch.tensor(counts, dtype=torch.int64, device="cpu")

    def close(self) -> None:
        self._views = None


class CudaMover(_Gathers):
    """Copy-engine pushes into peers' IPC-mapped regions. See Note [Copy-engine sends].

    Args:
        layout: the group's region layout.
        rank, device: this rank and its CUDA device.
        own: flat ``uint8`` device tensor of this rank's region.
        peer_ptrs: ``{rank: address of byte 0 of that peer's region in this process}``.
        streams: the pooled ``Stream`` of each destination (one stream may serve them all).
        recv_stream: the pooled ``Stream`` of the receive work (Note [Receive work on its own stream]).
        local_events: ``LOCAL_EVENTS`` pooled event handles: for ``gather``, ``begin``,
            ``to_host``, ``send_done`` and the end of the receive work.
        send_events: ``{phase: [interprocess event handle per destination]}`` (this rank records).
        recv_events: ``{phase: {source: opened event handle}}`` (the sources' events toward this rank).
        peer_refs: ``{rank: PeerRef}`` for liveness checks while waiting.
    """

    LOCAL_EVENTS = 5

    def __init__(self, layout: RegionLayout, rank: int, device: int, own: torch.Tensor, peer_ptrs: dict[int, int],
                 streams: list, recv_stream, local_events: list[int], send_events: dict, recv_events: dict,
                 peer_refs: dict) -> None:
        from warmlink import _cuda

        self._cuda = _cuda
        self.layout = layout
        self.rank = rank
        self.device = device
        self._own = own
        self._views = _Views(layout, {rank: own})
        self._ptrs = {rank: own.data_ptr(), **peer_ptrs}
        self._offsets = layout.offsets()
        self._streams = [s.handle for s in streams]
        self._copy_streams = list(dict.fromkeys(self._streams))  # each once: one stream may serve every peer
        self._batch = len(self._copy_streams) == 1 and _cuda.batch_supported()  # copy_all in one call
        self._gathered, self._begun, self._counted, self._send_done, self._received = local_events
        self._recv_stream = recv_stream.torch_stream()
        self._send_events = send_events
        self._recv_events = recv_events
        self._refs = peer_refs
        # the landing place of start_to_host: the largest plan word vector (ep._kernels.words_layout)
        # (pinned where CUDA is, which is wherever a CudaMover does real work; tests drive it with fakes).
        # Host tensors name the CPU: a caller's torch.set_default_device("cuda") must not move them
        pinned = torch.cuda.is_available()
        self._host = torch.empty(_kernels.words_size(layout.num_ranks, MAX_EXPERTS), dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._host_words = 0
        # SM sends (Note [SM sends]): the board's landing place, the host word that ends a wait, and
        # per parity the exchange's address tables (every rank's board, receive x and meta areas;
        # then the push's bases, which the exchange writes), made once
        self._board_row = board_words(layout.num_ranks)
        self._board_host = torch.empty(layout.num_ranks * self._board_row, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._abort = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._abort_word, self._abort_ptr = self._abort.numpy(), self._abort.data_ptr()
        self._tables: dict[int, torch.Tensor] = {}
        # the fresh send's graphs (ep._kernels, Note [Fresh send graph]): the call block (pinned, and
        # its device copy), the plan's words, and per launch key the steps seen run eagerly once,
        # then their graph
        self._call_host = torch.zeros(len(_kernels.CALL_SLOTS), dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._call_words = self._call_host.numpy()
        self._call = torch.zeros(len(_kernels.CALL_SLOTS), dtype=torch.int64, device=own.device)
        self._words = torch.zeros(self._host.numel(), dtype=torch.int64, device=own.device)
        self._ran_eagerly: set[tuple] = set()
        self._graphs: dict[tuple, object] = {}  # launch key -> graph executable
        # a cached SM dispatch's call block per parity: the CALL_SLOTS words, then its x and meta
        # bases per destination (its graph replays one push; round n + 2 rewrites round n's block
        # once round n's push ran: _push_cached)
        width = len(_kernels.CALL_SLOTS) + 2 * layout.num_ranks
        self._cached_host = torch.zeros(PARITIES, width, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._cached_words = self._cached_host.numpy()
        self._cached_call = torch.zeros(PARITIES, width, dtype=torch.int64, device=own.device)
        # a combine's per-rank counts per parity, pinned and on the device (combine_counts)
        self._counts_host = torch.zeros(PARITIES, layout.num_ranks, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._counts_words = self._counts_host.numpy()
        self._counts_ptrs = [row.data_ptr() for row in self._counts_host]
        self._counts = list(torch.zeros(PARITIES, layout.num_ranks, dtype=torch.int64, device=own.device))

    def _current(self) -> int:
        return current_stream(self.device)

    def area_address(self, rank: int, area: str) -> int:
        """Byte address, in this process, of ``area`` in ``rank``'s region (this rank's or a peer's
        mapping): for diagnostics that move the same bytes outside the protocol (bench ep)."""
        return self._ptrs[rank] + self._offsets[area]

    def begin(self, copies: bool = True) -> None:
        """Mark the start of a round on the caller's current stream (``wait_begun``), and order
        every destination's copy stream after it (``copies=False``: the SMs send, or the copies
        wait for a later event on this stream)."""
        self._cuda.event_record(self._begun, self._current())
        if copies:
            for s in self._copy_streams:
                self._cuda.stream_wait_event(s, self._begun)

    def gather(self, rows: torch.Tensor, src: _kernels.Sources, dests: range, skip: int) -> None:
        """One kernel on the current stream stages the rows of ``dests`` (but ``skip``); the copies
        flushed after it start once it ran."""
        self._stage(rows, src, dests, skip)
        self._copies_follow()

    def gather_all(self, rows: torch.Tensor, src: _kernels.Sources, parts: tuple[str, ...], shift: int, parity: int,
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
        self._cuda.event_record(self._gathered, self._current())
        for s in self._copy_streams:
            self._cuda.stream_wait_event(s, self._gathered)

    def flush(self, dest: int, phase: str, src: _kernels.Sources, row0: int, count: int, parts: tuple[str, ...]) -> None:
        """Copy ``count`` staged rows of ``dest`` to rows ``row0...`` of its ``parts`` once gathered,
        then mark them sent (this rank's own rows were placed on the current stream)."""
        if dest == self.rank:
            self._cuda.event_record(self._send_events[phase][dest], self._current())
            return
        stream = self._streams[dest]
        for dst, staged, nbytes in self._flush_copies(dest, src, row0, count, parts):
            self._cuda.memcpy_async(dst, staged, nbytes, stream)
        self._cuda.event_record(self._send_events[phase][dest], stream)

    def flush_all(self, phase: str, src: _kernels.Sources, parts: tuple[str, ...], plan) -> None:
        """``flush`` of each ``(dest, row0, count)`` of ``plan``. With one copy stream for every
        destination (the default) as one batch, then every destination's mark: a receiver then
        waits for the whole batch, which ends when its last destination's copy would have anyway
        (the copies ran back to back), with no idle copy engine between copies (``copy_all``)."""
        if not self._batch:
            for dest, row0, count in plan:
                self.flush(dest, phase, src, row0, count, parts)
            return
        copies = [c for dest, row0, count in plan if dest != self.rank
                  for c in self._flush_copies(dest, src, row0, count, parts)]
        if copies:
            self._cuda.memcpy_batch_async(*(list(column) for column in zip(*copies)), self._copy_streams[0])
        for dest, _, _ in plan:
            stream = self._current() if dest == self.rank else self._streams[dest]
            self._cuda.event_record(self._send_events[phase][dest], stream)

    def _flush_copies(self, dest: int, src: _kernels.Sources, row0: int, count: int, parts: tuple[str, ...]):
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
            self._cuda.memcpy_async(self._ptrs[dest] + self._offsets[area] + row0 * row_nbytes, words.data_ptr(),
                                    words.shape[0] * row_nbytes, self._streams[dest])

    def copy_all(self, copies) -> None:
        """``copy`` of each ``(dest, rows, area, row0)``. With one copy stream for every destination
        (the default) as one ``cudaMemcpyBatchAsync``: copies issued one by one left the copy
        engine idle ~5 us between each two (a combine in parts issues 3 per part; BENCHMARKS.md)."""
        if not self._batch:
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
        self._cuda.memcpy_batch_async(dsts, srcs, sizes, self._copy_streams[0])

    def sent(self, dest: int, phase: str) -> None:
        self._cuda.event_record(self._send_events[phase][dest], self._streams[dest])

    def start_to_host(self, words: torch.Tensor) -> None:
        """Queue the copy of ``words`` (int64) to pinned host memory on the current stream."""
        self._host_words = words.numel()
        current = self._current()  # one raw copy: torch's copy_ costs ~30 us of host time here
        self._cuda.memcpy_async(self._host.data_ptr(), words.data_ptr(), self._host_words * 8, current)
        self._cuda.event_record(self._counted, current)

    def wait_host(self, timeout_s: float) -> np.ndarray:
        """The words of ``start_to_host``, host-polled with a deadline; everything queued on the
        stream before them has finished too (Note [Round protocol], step 1)."""
        self._poll(lambda: self._cuda.event_query(self._counted), timeout_s, lambda: (
            f"ep: the caller's stream on cuda:{self.device} did not reach the dispatch's count copy within "
            f"{timeout_s:.3g} s"))
        return self._host[:self._host_words].numpy().copy()

    def wait_begun(self, timeout_s: float) -> None:
        """Host-poll, with a deadline, until the caller's stream ran everything queued before ``begin``."""
        self._poll(lambda: self._cuda.event_query(self._begun), timeout_s, lambda: (
            f"ep: the caller's stream on cuda:{self.device} did not reach the round's start within {timeout_s:.3g} s"))

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
        self._cuda.event_record(self._send_done, self._current())

    def arrived(self, sources, phase: str, timeout_s: float, then=None, writes=(), early=()) -> None:
        """Launch each ``(phase, work)`` of ``early``, then ``then``, on the receive stream, each
        behind the peers' events of its phase (Note [Receive work on its own stream]); host-poll
        the events of ``phase`` (deadline, liveness; a source's earlier phases ran before it on its
        stream), then order the current stream after the receive work and after this rank's own
        pushes of ``phase`` (so the caller may reuse its inputs). ``writes``: the tensors the work
        writes."""
        pending = [s for s in sources if s != self.rank]
        current = self._current()
        if then is not None:
            side = self._recv_stream
            self._cuda.stream_wait_event(side.cuda_stream, self._send_done)
            for t in writes:
                if t is not None:
                    t.record_stream(side)
            with on_stream(side):
                for stage, work in (*early, (phase, then)):
                    for s in pending:
                        self._cuda.stream_wait_event(side.cuda_stream, self._recv_events[stage][s])
                    work()
            self._cuda.event_record(self._received, side.cuda_stream)
        query, events = self._cuda.event_query, self._recv_events[phase]

        def landed() -> bool:
            pending[:] = [s for s in pending if not query(events[s])]
            return not pending

        self._poll(landed, timeout_s, lambda: f"ep: {phase} bytes from ranks {pending} not complete after {timeout_s:.3g} s",
                   watch=pending, lost=f"with its {phase} bytes in flight")
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

    def _sm_tables(self, parity: int) -> torch.Tensor:
        """The exchange's ``[5, R]`` address tables of ``parity`` (ep._kernels.fresh_front), made once."""
        tables = self._tables.get(parity)
        if tables is None:
            ranks = range(self.layout.num_ranks)
            at = {kind: self._offsets[f"{kind}.{parity}"] for kind in ("board", "recv_x", "recv_meta")}
            rows = [[self._ptrs[r] + at[kind] for r in ranks] for kind in ("board", "recv_x", "recv_meta")]
            tables = self._tables[parity] = torch.tensor(rows + [[0] * len(ranks)] * 2, dtype=torch.int64,
                                                         device=self._own.device)
        return tables

    def send_sm(self, shape: _kernels.FreshShape, call: tuple[int, ...], round_: int, phase: str, timeout_s: float,
                graphs: bool = True) -> None:
        """A fresh dispatch's whole send on the current stream, with no host wait: the exchange
        kernel trades counts with the peers' exchange kernels through the boards, the board comes
        to the host, and the push kernel stores every row in its destination; then every
        destination's event. See Note [SM sends]. ``call``: the call block's words
        (``_kernels.call_words``). With ``graphs``, the second call of a parity and shape on
        replays graphs of those steps (Note [Fresh send graph])."""
        parity = round_ % PARITIES
        self._call_words[:] = call
        self._abort_word[0] = 0
        self._host_words = _kernels.words_size(shape.num_ranks, shape.num_experts)
        key = (parity, shape, timeout_s)
        current = self._current()
        # two launches with the board's event between them: an event recorded by a graph node
        # might read as the previous round's on the host
        self._launch(("front", *key), lambda: self._fresh_front(key), graphs)
        self._cuda.event_record(self._counted, current)
        self._launch(("push", *key), lambda: self._fresh_push(key), graphs)
        self._pushed(phase)

    def _fresh_front(self, key: tuple) -> None:
        """``send_sm``'s steps up to the board on the host, on the current stream: the call block
        to the device, ``plan`` and ``exchange``, the plan's words and the board to the host."""
        parity, shape, timeout_s = key
        cuda, current = self._cuda, self._current()
        cuda.memcpy_async(self._call.data_ptr(), self._call_host.data_ptr(), self._call_host.numel() * 8, current)
        tables = self._sm_tables(parity)
        _kernels.fresh_front(shape, self._call, self._words, tables, self._abort_ptr, self.rank, timeout_s, self._board_row)
        words = _kernels.words_size(shape.num_ranks, shape.num_experts)
        cuda.memcpy_async(self._host.data_ptr(), self._words.data_ptr(), words * 8, current)
        board = self._ptrs[self.rank] + self._offsets[f"board.{parity}"]
        cuda.memcpy_async(self._board_host.data_ptr(), board, self._board_host.numel() * 8, current)

    def _fresh_push(self, key: tuple) -> None:
        parity, shape, _ = key
        _kernels.fresh_push(shape, self._call, self._sm_tables(parity))

    def _capture(self, steps):
        """A CUDA graph of ``steps()``, captured on the receive stream (a capture needs a stream
        other than the default one). The steps allocate nothing and compile nothing: they ran
        eagerly before, with the same tables. A direct ``cudaGraphLaunch`` (``_cuda.graph_launch``)
        costs about 7 us less host time than torch's ``CUDAGraph.replay`` (one-rank profile)."""
        with torch.cuda.stream(self._recv_stream):
            return self._cuda.graph_capture(self._current(), steps)

    def sm_bases(self, dst_rows: list[int], parity: int, x_row_bytes: int) -> list[int]:
        """``push``'s x bases, then its meta bases, per destination, for rows that start at
        ``dst_rows[d]`` in each destination's areas of ``parity`` (a cached dispatch's)."""
        cap, meta = self.layout.max_tokens, self.layout.meta_bytes
        at = {kind: self._offsets[f"{kind}.{parity}"] for kind in ("recv_x", "recv_meta")}
        return [self._ptrs[d] + at[kind] + (dst_rows[d] - d * cap) * size
                for kind, size in (("recv_x", x_row_bytes), ("recv_meta", meta)) for d in range(self.layout.num_ranks)]

    def send_sm_cached(self, rows: torch.Tensor, src: _kernels.Sources, bases: list[int], parity: int, phase: str,
                       timeout_s: float, graphs: bool = True) -> None:
        """A cached dispatch's send on the current stream: the push kernel stores every row at
        ``bases`` (``sm_bases``), then every destination's event (Note [SM sends]). Its values
        travel in the parity's call block, so that from the second call of a parity and row shape
        on one graph launch replays it (Note [Fresh send graph])."""
        self._push_cached(rows, src, bases, parity, timeout_s, graphs)
        self._pushed(phase)

    def _push_cached(self, rows: torch.Tensor, src: _kernels.Sources, bases: list[int], parity: int,
                     timeout_s: float, graphs: bool) -> None:
        """The push at ``bases`` from the parity's call block, eager once per key, then a graph.

        The block is rewritten only once the push that last read it (round n - 2) ran: its own
        send event, recorded right after it on the stream it ran on, completed. On one stream
        round n - 1's ``wait_begun`` already proved that; the event covers a caller that changes
        streams between rounds."""
        last = self._send_events[f"dispatch.{parity}"][self.rank]
        if not self._cuda.event_query(last):
            self._poll(lambda: self._cuda.event_query(last), timeout_s, lambda: (
                f"ep: the cached dispatch two rounds back (parity {parity}) did not run on cuda:{self.device} within "
                f"{timeout_s:.3g} s; its call block cannot be rewritten"))
        block = self._cached_words[parity]
        block[_ROWS], block[_X], block[_TOKENS] = rows.data_ptr(), src.x.data_ptr(), rows.shape[0]
        block[_SCALES] = src.scales.data_ptr() if src.scales is not None else 0
        block[len(_kernels.CALL_SLOTS):] = bases
        key = ("cached", parity, src.x.shape[1], src.scales.shape[1] if src.scales is not None else 0)
        self._launch(key, lambda: self._cached_push(key), graphs)

    def _pushed(self, phase: str) -> None:
        """Every destination's event of ``phase`` after an SM push, on the current stream (the
        push stored every destination's rows: ``sent``'s per-destination copy streams do not apply)."""
        current = self._current()
        for event in self._send_events[phase]:
            self._cuda.event_record(event, current)

    def _cached_push(self, key: tuple) -> None:
        _, parity, x_words, num_scales = key
        cuda, current, call, r = self._cuda, self._current(), self._cached_call[parity], self.layout.num_ranks
        cuda.memcpy_async(call.data_ptr(), self._cached_host[parity].data_ptr(), call.numel() * 8, current)
        n = len(_kernels.CALL_SLOTS)
        _kernels.push_from_call(call, call[n:n + r], call[n + r:], x_words, r, 0, num_scales, self.layout.num_topk,
                                self.layout.meta_bytes, None, None)

    def _launch(self, key: tuple, steps, graphs: bool) -> None:
        """``steps()`` on the current stream: eagerly the first time for ``key``, then (with
        ``graphs``) as a graph captured once."""
        graph = self._graphs.get(key) if graphs else None
        if graph is None and graphs and key in self._ran_eagerly:
            graph = self._graphs[key] = self._capture(steps)
        if graph is not None:
            self._cuda.graph_launch(graph, self._current())
        else:
            steps()
            self._ran_eagerly.add(key)

    def wait_board(self, round_: int, timeout_s: float, check=None) -> tuple[np.ndarray, np.ndarray]:
        """``(plan words, board [R, board_words])`` of ``send_sm``'s round, host-polled with a
        deadline; every 5 ms the peers' liveness and ``check()`` (which raises to give up). Giving
        up ends the exchange kernel's wait first, so no kernel is left waiting on a peer."""
        query, counted = self._cuda.event_query, self._counted
        try:
            self._poll(lambda: query(counted), timeout_s, lambda: (
                f"ep: the dispatch's count exchange on cuda:{self.device} did not complete within {timeout_s:.3g} s"),
                watch=list(self._refs), lost="before the dispatch's count exchange", check=check)
        except BaseException:
            self._abort_word[0] = round_
            poll(lambda: query(counted), 5.0, first_s=1e-4, cap_s=1e-4)
            raise
        board = self._board_host.numpy().reshape(self.layout.num_ranks, self._board_row)
        return self._host[:self._host_words].numpy().copy(), board.copy()

    def close(self) -> None:
        self._ptrs = {}
        self._views = None
        graphs, self._graphs = self._graphs, {}  # they write into this Buffer's mappings
        for graph in graphs.values():
            try:
                self._cuda.graph_destroy(graph)
            except Exception as exc:  # a broken context: the driver frees it with the context
                log.warning("ep: could not destroy a fresh-send graph at close: %s", exc)
