"""How rows reach a peer's region: host copies (shm) or copy engines (cuda_ipc).

Both movers offer the same operations, so ``Buffer`` holds one protocol for both backends:

- ``begin()``: later pushes are ordered after the caller's stream;
- ``stage(dest, src, index, area)``: rows ``src[index]`` are bound for ``dest``'s ``area``;
  ``flush(dest, phase, row0)`` sends everything staged for ``dest`` to rows ``row0...`` and marks
  it (staging needs no peer; the rows' place in the peer is known only after the handshake);
- ``gather_local(src, index, area, row0)``: the same into this rank's own area;
- ``copy(dest, rows, area, row0)``: contiguous ``rows`` go there directly; ``sent(dest, phase)``
  marks them;
- ``arrived(sources, phase, timeout_s)``: block until the marks of ``sources`` toward this rank
  are complete, then order the caller's stream after this rank's own pushes.

# Note [Copy-engine sends]
On CUDA a remote gather is an ``index_select`` on the caller's stream into this rank's staging
slot for ``dest``; ``flush`` records an event there, makes ``dest``'s copy stream wait for it and
issues one ``cudaMemcpyAsync`` per gathered area into the peer's mapped region: the gathers run
for microseconds on the SMs, the copy engines move the bytes while no SM waits, and each
destination's copies overlap the next destination's gather. ``sent``/``flush`` record an
interprocess event on the copy stream; the receiver, once the sender's mailbox says the event was
recorded for this round, polls it from the host (a dead or stalled sender turns into a timeout,
never a hung stream). The self destination gathers straight into this rank's own area. Rows move
as int64 words when their size allows: ``index_select`` is fastest on wide elements.
"""

from __future__ import annotations

import math
import time

import torch

from warmlink.ep._regions import RegionLayout
from warmlink.errors import PeerLostError, TransferTimeout

__all__ = ["CudaMover", "HostMover", "as_words"]


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``[N, words]`` view of a row-major tensor's bytes: int64 words when a row's size allows,
    else bytes (``view(N, -1)`` alone fails when N == 0)."""
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

    def get(self, rank: int, area: str, like: torch.Tensor) -> torch.Tensor:
        key = (rank, area, like.dtype, like.shape[1])
        view = self._cache.get(key)
        if view is None:
            view = self._cache[key] = self.layout.view(self.regions[rank], area, like.dtype, like.shape[1])
        return view


class HostMover:
    """Shared-memory regions written directly by this process's CPU (the shm backend)."""

    def __init__(self, layout: RegionLayout, rank: int, own: torch.Tensor, peers: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.rank = rank
        self._views = _Views(layout, {rank: own, **peers})
        self._staged: dict[int, list] = {}

    def begin(self) -> None:
        pass

    def stage(self, dest: int, src: torch.Tensor, index: torch.Tensor, area: str) -> None:
        self._staged.setdefault(dest, []).append((as_words(src), index, area))  # written at flush

    def flush(self, dest: int, phase: str, row0: int) -> None:
        for words, index, area in self._staged.pop(dest, ()):
            torch.index_select(words, 0, index, out=self._views.get(dest, area, words)[row0:row0 + index.numel()])

    def gather_local(self, src: torch.Tensor, index: torch.Tensor, area: str, row0: int) -> None:
        self.stage(self.rank, src, index, area)
        self.flush(self.rank, "", row0)

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        words = as_words(rows)
        self._views.get(dest, area, words)[row0:row0 + words.shape[0]].copy_(words)

    def sent(self, dest: int, phase: str) -> None:
        pass

    def arrived(self, sources, phase: str, timeout_s: float) -> None:
        pass  # the mailbox's "sent" round already orders them

    def close(self) -> None:
        self._views = None


class CudaMover:
    """Copy-engine pushes into peers' IPC-mapped regions. See Note [Copy-engine sends].

    Args:
        layout: the group's region layout.
        rank, device: this rank and its CUDA device.
        own: flat ``uint8`` device tensor of this rank's region.
        peer_ptrs: ``{rank: address of byte 0 of that peer's region in this process}``.
        streams: one pooled ``Stream`` per rank (index = destination).
        local_events: ``R + 1`` pooled event handles: one per destination ("gathered") and one
            for ``begin``.
        send_events: ``{phase: [interprocess event handle per destination]}`` (this rank records).
        recv_events: ``{phase: {source: opened event handle}}`` (the sources' events toward this rank).
        peer_refs: ``{rank: PeerRef}`` for liveness checks while waiting.
    """

    def __init__(self, layout: RegionLayout, rank: int, device: int, own: torch.Tensor, peer_ptrs: dict[int, int],
                 streams: list, local_events: list[int], send_events: dict, recv_events: dict, peer_refs: dict) -> None:
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
        self._gathered = local_events[:-1]
        self._begun = local_events[-1]
        self._send_events = send_events
        self._recv_events = recv_events
        self._refs = peer_refs
        self._queued: dict[int, list] = {}

    def _current(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def begin(self) -> None:
        """Order every destination's copy stream after the caller's current stream."""
        self._cuda.event_record(self._begun, self._current())
        for s in self._streams:
            self._cuda.stream_wait_event(s, self._begun)

    def stage(self, dest: int, src: torch.Tensor, index: torch.Tensor, area: str) -> None:
        """Gather ``src[index]`` on the current stream into the staging slot of ``dest`` (a peer)."""
        words = as_words(src)
        count = index.numel()
        stage = self._views.get(self.rank, "stage_" + area.split("_", 1)[1], words)
        slot = stage[dest * self.layout.max_tokens:dest * self.layout.max_tokens + count]
        torch.index_select(words, 0, index, out=slot)
        # the copy of this destination may start as soon as its own gathers ran
        self._cuda.event_record(self._gathered[dest], self._current())
        if count:
            row_nbytes = words.shape[1] * words.element_size()
            self._queued.setdefault(dest, []).append((area, slot.data_ptr(), count * row_nbytes, row_nbytes))

    def gather_local(self, src: torch.Tensor, index: torch.Tensor, area: str, row0: int) -> None:
        words = as_words(src)
        count = index.numel()
        torch.index_select(words, 0, index, out=self._views.get(self.rank, area, words)[row0:row0 + count])

    def flush(self, dest: int, phase: str, row0: int) -> None:
        """Copy what was staged for ``dest`` to rows ``row0...`` once the gathers ran, then mark it sent."""
        queued = self._queued.pop(dest, ())
        if dest == self.rank:  # gathered on the current stream straight into place
            self._cuda.event_record(self._send_events[phase][dest], self._current())
            return
        stream = self._streams[dest]
        if queued:
            self._cuda.stream_wait_event(stream, self._gathered[dest])
            for area, src, nbytes, row_nbytes in queued:
                self._cuda.memcpy_async(self._ptrs[dest] + self._offsets[area] + row0 * row_nbytes, src, nbytes, stream)
        self._cuda.event_record(self._send_events[phase][dest], stream)

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        """Copy contiguous ``rows`` (kept alive by the caller until ``arrived``) on ``dest``'s stream."""
        words = as_words(rows)
        if words.shape[0]:
            row_nbytes = words.shape[1] * words.element_size()
            self._cuda.memcpy_async(self._ptrs[dest] + self._offsets[area] + row0 * row_nbytes, words.data_ptr(),
                                    words.shape[0] * row_nbytes, self._streams[dest])

    def sent(self, dest: int, phase: str) -> None:
        self._cuda.event_record(self._send_events[phase][dest], self._streams[dest])

    def arrived(self, sources, phase: str, timeout_s: float) -> None:
        """Host-poll the peers' events (deadline, liveness), then order the current stream after this
        rank's own pushes of ``phase`` (so the caller may reuse its inputs)."""
        query = self._cuda.event_query
        pending = [s for s in sources if s != self.rank]
        start = last = time.perf_counter()
        while pending:
            pending = [s for s in pending if not query(self._recv_events[phase][s])]
            if not pending:
                break
            now = time.perf_counter()
            if now - last > 0.005:
                last = now
                for s in pending:
                    if not self._refs[s].alive():
                        raise PeerLostError(f"ep: rank {s} (pid {self._refs[s].pid}) died with its {phase} bytes in flight")
                if now - start > timeout_s:
                    raise TransferTimeout(f"ep: {phase} bytes from ranks {pending} not complete after {timeout_s:.3g} s")
        current = self._current()
        for event in self._send_events[phase]:
            self._cuda.stream_wait_event(current, event)

    def close(self) -> None:
        self._ptrs = {}
        self._views = None
        self._queued = {}
