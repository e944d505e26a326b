"""``StreamPath`` (``send="stream"``, cuda_ipc): rows stream through a fixed receive space the
GPUs pace themselves (ep.kernels.stream, Note [Streamed dispatch]; the combine's way back,
ep.kernels.stream_combine). A fresh dispatch's counts are still traded by the count exchange
kernel (ep.paths.sm_pushes, Note [SM sends]), whose board gives every rank where each source's
rows start in its outputs; then one kernel streams the rows. The order of those steps, and what
the host waits for, is the protocol's (ep.protocol.streamed); this path launches them.

Every launch is a call of the space's seq count (1, 2, 3, ... on every rank: dispatch, cached
dispatch and combine alike). Its ``2C`` status words are copied to pinned host memory behind it,
with an event: ``failures`` reads the finished ones without waiting, so a call returns at launch
and its failure (a peer's deadline, an abort) is raised by a later call. ``abort_all`` ends every
queued launch's waits at once; ``clear`` zeroes the space and starts the count again.
"""

from __future__ import annotations

from collections import deque

import torch

from warmlink.ep.kernels import stream, stream_combine
from warmlink.ep.kernels.call_block import Sources, call_words
from warmlink.ep.kernels.stream import Failure, StreamOutputs
from warmlink.ep.paths.senders import FreshSend, fresh_shape
from warmlink.ep.wire.regions import RegionLayout
from warmlink.errors import TransferTimeout

__all__ = ["ABORT_ALL", "StreamPath"]

ABORT_ALL = 1 << 40  # an abort word past every seq: ends the waits of every launch queued
_SLOTS = 8  # status words in flight: a caller more than this many calls ahead of its stream waits


class StreamPath:
    """The streamed data path of one rank.

    Args:
        mover: the ``CudaMover`` (its count exchange, mappings and host waits).
        layout: a streamed ``RegionLayout`` (``layout.stream`` is not None).
        rank, num_ranks: this rank and the group size. device: the CUDA device.
        graphs: replay the count exchange's launches as CUDA graphs (Note [Fresh send graph]).
        timeout_s: every device wait's deadline.
    """

    name = "stream"

    def __init__(self, mover, layout: RegionLayout, rank: int, num_ranks: int, device: int, graphs: bool,
                 timeout_s: float) -> None:
        from warmlink import _cuda
        from warmlink.pool.events import lease_event

        self._cuda, self.mover, self.layout = _cuda, mover, layout
        self.space = layout.stream
        self.rank, self.num_ranks, self.device = rank, num_ranks, device
        self.graphs, self.timeout_s = graphs, timeout_s
        self.seq = 0  # the last call launched
        on = torch.device("cuda", device)
        self.bases = torch.tensor([mover.area_address(r, "stream") for r in range(num_ranks)], dtype=torch.int64,
                                  device=on)
        start = layout.offsets()["stream"]
        self._own = mover.own_region[start:start + self.space.nbytes]
        width = 2 * self.space.channels
        self._status = torch.zeros(_SLOTS, width, dtype=torch.int64, device=on)
        self._status_host = torch.zeros(_SLOTS, width, dtype=torch.int64, device="cpu", pin_memory=True)
        self._abort = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=True)  # read by the kernels through UVA
        self._leases = [lease_event(device) for _ in range(_SLOTS)]
        self._events = [lease.resource.handle for lease in self._leases]
        self._queued: deque[tuple[int, int, str]] = deque()  # (slot, seq, what) launched, not yet read

    # -- a fresh dispatch's counts -----------------------------------------------------------------
    def launch_counts(self, call: FreshSend, rows: torch.Tensor, board: torch.Tensor | None) -> None:
        """``plan`` and the count exchange of ``call`` on the current stream (``rows``: the plan's,
        the handle keeps them; ``board``: a ``board_like()`` tensor the board is copied into)."""
        src = call.src
        self.mover.send_counts(fresh_shape(self.layout, self.num_ranks, call),
                               call_words(call.in_rank, src.topk, call.per_rank, call.per_expert, rows, src,
                                          call.round, call.config),
                               call.round, self.timeout_s, self.graphs, board_copy=board)

    def board_like(self) -> torch.Tensor:
        return self.mover.board_like()

    def wait_board(self, round_: int, check):
        """``(plan words, count board)`` of ``round_``'s exchange on the host (``check`` as ``CudaMover.wait_board``'s)."""
        return self.mover.wait_board(round_, self.timeout_s, check)

    def valid(self, round_: int) -> torch.Tensor:
        """The device word that is 0 when ``round_``'s count exchange refused the round."""
        return self.mover.exchange_valid(round_)

    def abort_counts(self, round_: int) -> None:
        self.mover.abort_exchange(round_)

    # -- the streamed calls ------------------------------------------------------------------------
    def dispatch(self, rows: torch.Tensor, src: Sources, out: StreamOutputs, recv_offset: torch.Tensor,
                 taken: torch.Tensor, experts_per_rank: int, valid: torch.Tensor | None = None) -> int:
        """Stream ``src``'s rows (``rows``: the plan's) into every destination's ``out`` on the current
        stream; its seq."""
        slot, seq = self._next()
        stream.stream_dispatch(self.space, rows, src, out, recv_offset, self.bases, self._status[slot], me=self.rank,
                               seq=seq, max_tokens=self.layout.max_tokens, experts_per_rank=experts_per_rank,
                               timeout_s=self.timeout_s, abort=self._abort.data_ptr(), taken=taken, valid=valid)
        return self._launched(slot, seq, "dispatch")

    def combine(self, rows: torch.Tensor, x: torch.Tensor, out: torch.Tensor, taken: torch.Tensor,
                recv_offset: torch.Tensor, weights: torch.Tensor | None, out_weights: torch.Tensor | None) -> int:
        """Stream ``x``'s rows back to their sources, which sum them into ``out``; its seq."""
        slot, seq = self._next()
        stream_combine.stream_combine(self.space, rows, x, out, taken, recv_offset, self.bases, self._status[slot],
                                      me=self.rank, seq=seq, timeout_s=self.timeout_s, weights=weights,
                                      out_weights=out_weights, abort=self._abort.data_ptr())
        return self._launched(slot, seq, "combine")

    def _next(self) -> tuple[int, int]:
        """The next call's status slot and seq; waits (with the timeout) for the slot's last reader."""
        seq = self.seq + 1
        slot = seq % _SLOTS
        if self._queued and len(self._queued) >= _SLOTS:
            failed = self._read(block=True)
            if failed:
                raise failed
        return slot, seq

    def _launched(self, slot: int, seq: int, what: str) -> int:
        cuda, current = self._cuda, self.mover.current_stream()
        cuda.memcpy_async(self._status_host[slot].data_ptr(), self._status[slot].data_ptr(),
                          self._status_host.shape[1] * 8, current)
        cuda.event_record(self._events[slot], current)
        self.seq = seq
        self._queued.append((slot, seq, what))
        return seq

    # -- failures ------------------------------------------------------------------------------------
    def failures(self) -> TransferTimeout | None:
        """The first finished call whose programs did not all finish, as the error to raise (None:
        none). Reads only what finished; never waits."""
        return self._read(block=False)

    def _read(self, block: bool) -> TransferTimeout | None:
        while self._queued:
            slot, seq, what = self._queued[0]
            event = self._events[slot]
            if not self._cuda.event_query(event):
                if not block:
                    return None
                self.mover.poll(lambda: self._cuda.event_query(event), 2 * self.timeout_s + 1, lambda: (
                    f"ep: streamed {what} {seq} did not end on cuda:{self.device} within its deadline"))
            self._queued.popleft()
            failed = stream.failures(self._status_host[slot], seq, self.space.channels)
            if failed:
                return TransferTimeout(_describe(what, seq, failed))
        return None

    def abort_all(self, round_: int) -> None:
        """End every queued launch's waits now (each ends as aborted), and the count exchange of ``round_``."""
        self._abort[0] = ABORT_ALL
        self.mover.abort_exchange(round_)

    def clear(self) -> None:
        """After ``abort_all`` and once every launch of this rank ended (the caller synchronized):
        zero this rank's space, forget the queued status words, and count seqs from 1 again."""
        self._own.zero_()
        torch.cuda.synchronize(self.device)
        self._queued.clear()
        self._abort[0] = 0
        self.seq = 0

    def close(self) -> None:
        for lease in self._leases:
            lease.release()
        self._leases = []


def _describe(what: str, seq: int, failed: list[Failure]) -> str:
    first = failed[0]
    how = "aborted" if first.aborted else "timed out"
    return (f"ep: streamed {what} {seq} failed: {len(failed)} program(s) did not finish; the first, {first.role} "
            f"channel {first.channel}, {how} waiting for {first.wait} from rank {first.peer}. Its outputs and "
            "those of the calls after it are void; the Buffer's next call clears the stream space with every peer")
