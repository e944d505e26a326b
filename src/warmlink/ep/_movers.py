"""How rows reach a peer's region: host copies (shm) or copy engines (cuda_ipc).

Both movers offer the same four operations, so ``Buffer`` holds one protocol for both backends:

- ``scatter(dest, src, index, area, row0)``: rows ``src[index]`` land at rows ``row0...`` of
  ``dest``'s ``area``;
- ``copy(dest, rows, area, row0)``: contiguous ``rows`` land there;
- ``sent(dest, phase)``: everything issued for ``dest`` in ``phase`` is marked;
- ``arrived(sources, phase, timeout_s)``: block until the marks of ``sources`` toward this rank
  are complete, then order the caller's stream after them.

# Note [Copy-engine sends]
On CUDA a remote scatter is a gather kernel into this rank's staging slot for ``dest`` followed by
``cudaMemcpyAsync`` into the peer's mapped region, both on the stream of ``dest``: the kernel runs
for microseconds, then a copy engine moves the bytes while no SM waits. One stream per destination
lets the copies of different destinations overlap the next destination's gather. ``sent`` records
an interprocess event on that stream; the receiver, once the sender's mailbox says the event was
recorded for this round, polls it from the host (a dead or stalled sender turns into a timeout,
never a hung stream). The self destination gathers straight into this rank's own receive area.
"""

from __future__ import annotations

import math
import time

import torch

from warmlink.ep._regions import RegionLayout
from warmlink.errors import PeerLostError, TransferTimeout

__all__ = ["PHASES", "CudaMover", "HostMover"]

PHASES = ("dispatch", "combine")


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """``[N, cols]`` view of a row-major tensor (``view(N, -1)`` fails when N == 0)."""
    return t.view(t.shape[0], math.prod(t.shape[1:]))


def _typed(layout: RegionLayout, region: torch.Tensor, area: str, like: torch.Tensor) -> torch.Tensor:
    return layout.view(region, area, like.dtype, math.prod(like.shape[1:]))


class HostMover:
    """Shared-memory regions written directly by this process's CPU (the shm backend)."""

    def __init__(self, layout: RegionLayout, rank: int, own: torch.Tensor, peers: dict[int, torch.Tensor]) -> None:
        self.layout = layout
        self.rank = rank
        self._regions = {rank: own, **peers}

    def begin(self) -> None:
        pass

    def scatter(self, dest: int, src: torch.Tensor, index: torch.Tensor, area: str, row0: int) -> None:
        out = _typed(self.layout, self._regions[dest], area, src)[row0:row0 + index.numel()]
        torch.index_select(_rows2d(src), 0, index, out=out)

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        _typed(self.layout, self._regions[dest], area, rows)[row0:row0 + rows.shape[0]].copy_(_rows2d(rows))

    def sent(self, dest: int, phase: str) -> None:
        pass  # host copies are complete when they return

    def arrived(self, sources, phase: str, timeout_s: float) -> None:
        pass  # the mailbox's "sent" round already orders them

    def close(self) -> None:
        self._regions = {}


class CudaMover:
    """Copy-engine pushes into peers' IPC-mapped regions. See Note [Copy-engine sends].

    Args:
        layout: the group's region layout.
        rank, device: this rank and its CUDA device.
        own: flat ``uint8`` device tensor of this rank's region.
        peer_ptrs: ``{rank: address of byte 0 of that peer's region in this process}``.
        streams: one pooled ``Stream`` per rank (index = destination).
        send_events: ``{phase: [interprocess event handle per destination]}`` (this rank records).
        recv_events: ``{phase: {source: opened event handle}}`` (the sources' events toward this rank).
        peer_refs: ``{rank: PeerRef}`` for liveness checks while waiting.
    """

    def __init__(self, layout: RegionLayout, rank: int, device: int, own: torch.Tensor, peer_ptrs: dict[int, int],
                 streams: list, send_events: dict, recv_events: dict, peer_refs: dict) -> None:
        from warmlink import _cuda

        self._cuda = _cuda
        self.layout = layout
        self.rank = rank
        self.device = device
        self._own = own
        self._ptrs = {rank: own.data_ptr(), **peer_ptrs}
        self._offsets = layout.offsets()
        self._streams = streams
        self._torch_streams = [s.torch_stream() for s in streams]
        self._send_events = send_events
        self._recv_events = recv_events
        self._refs = peer_refs
        self._self_done = torch.cuda.Event()

    def begin(self) -> None:
        """Order every destination stream after the caller's current stream."""
        current = torch.cuda.current_stream(self.device)
        for s in self._torch_streams:
            s.wait_stream(current)

    def _remote_dst(self, dest: int, area: str, row0: int, row_nbytes: int) -> int:
        return self._ptrs[dest] + self._offsets[area] + row0 * row_nbytes

    def scatter(self, dest: int, src: torch.Tensor, index: torch.Tensor, area: str, row0: int) -> None:
        stream = self._torch_streams[dest]
        count = index.numel()
        src2d = _rows2d(src)
        src.record_stream(stream)
        index.record_stream(stream)
        with torch.cuda.stream(stream):
            if dest == self.rank:
                out = _typed(self.layout, self._own, area, src2d)[row0:row0 + count]
                torch.index_select(src2d, 0, index, out=out)
                return
            stage = _typed(self.layout, self._own, "stage_" + area.split("_", 1)[1], src2d)
            slot = stage[dest * self.layout.max_tokens:dest * self.layout.max_tokens + count]
            torch.index_select(src2d, 0, index, out=slot)
        if count:
            row_nbytes = src2d.shape[1] * src2d.element_size()
            self._cuda.memcpy_async(self._remote_dst(dest, area, row0, row_nbytes), slot.data_ptr(),
                                    count * row_nbytes, self._streams[dest].handle)

    def copy(self, dest: int, rows: torch.Tensor, area: str, row0: int) -> None:
        rows2d = _rows2d(rows)
        if not rows2d.shape[0]:
            return
        stream = self._torch_streams[dest]
        rows.record_stream(stream)
        row_nbytes = rows2d.shape[1] * rows2d.element_size()
        self._cuda.memcpy_async(self._remote_dst(dest, area, row0, row_nbytes), rows2d.data_ptr(),
                                rows2d.shape[0] * row_nbytes, self._streams[dest].handle)

    def sent(self, dest: int, phase: str) -> None:
        self._cuda.event_record(self._send_events[phase][dest], self._streams[dest].handle)

    def arrived(self, sources, phase: str, timeout_s: float) -> None:
        """Host-poll the peers' events (deadline, liveness), then order the current stream after the
        self destination's stream."""
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
        if self.rank in sources:
            torch.cuda.current_stream(self.device).wait_stream(self._torch_streams[self.rank])

    def close(self) -> None:
        self._ptrs = {}
        self._torch_streams = []
