"""``StreamPath`` (``send="stream"``, cuda_ipc): rows stream through a fixed receive space the
GPUs pace themselves (ep.kernels.stream, Note [Streamed dispatch]; the combine's way back,
ep.kernels.stream_combine). A fresh dispatch's counts are still traded by the count exchange
kernel (ep.paths.sm_pushes, Note [SM sends]), whose board gives every rank where each source's
rows start in its outputs; then one kernel streams the rows. The order of those steps, and what
the host waits for, is the protocol's (ep.protocol.streamed); this path launches them.

Every launch is a call of the space's seq count (1, 2, 3, ... on every rank: dispatch, cached
dispatch and combine alike), and every fresh dispatch a round of the count exchange. Both counts
live on the device (``counters``: the fresh dispatch's exchange advances both, ep.kernels.stream_counts
``advance``; before a cached dispatch or a combine the same kernel advances the seq for Triton's
streamed kernels, while the CUDA ones advance it themselves, Note [Warp groups]), so that a CUDA
graph of calls runs calls of their own at every replay; the host holds neither. One board parity
serves every round: a rank's stream of round n ends only after every peer's stream of round n
began, which follows that peer's exchange of round n, so no source writes round n + 1 into a
board still read for round n.

An eager launch's ``2C`` status words reach pinned host memory: the CUDA kernels write them there
themselves (a launch has ended when its row is all set), Triton's into device memory, copied
back behind them with an event. ``failures`` reads the finished ones without waiting, so a call
returns at launch and its failure (a peer's deadline, an abort) is raised by a later call. A
launch captured in a graph writes its words into a row of its own (Triton's: every eager call
copies those back too). ``abort_all`` ends every queued launch's waits at once; ``clear`` zeroes
the space, the boards and the counts.
"""

from __future__ import annotations

from collections import deque

import torch

from warmlink.ep.kernels import host, stream, stream_combine, stream_cuda
from warmlink.ep.kernels.stream_counts import advance, padded_plan
from warmlink.ep.kernels.call_block import CALL_SLOTS, Sources, call_words
from warmlink.ep.kernels.launch import capturing
from warmlink.ep.kernels.stream import StreamOutputs
from warmlink.ep.paths.planned import FreshPlan, PreparedLaunch
from warmlink.ep.paths.senders import FreshSend, fresh_shape
from warmlink.ep.wire.regions import RegionLayout, board_words
from warmlink.errors import ConfigError, TransferTimeout

__all__ = ["ABORT_ALL", "MAX_CAPTURED", "StreamPath"]

ABORT_ALL = 1 << 40  # an abort word past every seq and round: ends the waits of every launch queued
_SLOTS = 8  # status words in flight: a caller more than this many calls ahead of its stream waits
MAX_CAPTURED = 256  # streamed calls a Buffer's CUDA graphs may hold: each has status words of its own
_ROUND = CALL_SLOTS.index("round")


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
        # the streamed kernels, chosen once: CUDA C++ where it compiles (Note [Warp groups]), else Triton's
        self.kernel = stream_cuda.choose(device, num_ranks)
        self._timeout_ns = int(timeout_s * 1e9)
        if 2 * self.space.channels > stream.sm_count(device):  # (Triton's launches check it per call)
            raise ConfigError(f"ep.Buffer: {self.space.channels} stream channels; their 2 programs each must be "
                              f"resident at once, at most {stream.sm_count(device) // 2} on cuda:{device}")
        on = torch.device("cuda", device)
        # [the last round, the last seq, the CUDA kernels' count of programs done (they advance the seq)]
        self.counters = torch.zeros(3, dtype=torch.int64, device=on)
        self._seq, self._done = self.counters[1:2], self.counters[2:3]  # (views made once: each costs a torch call)
        self.bases = torch.tensor([mover.area_address(r, "stream") for r in range(num_ranks)], dtype=torch.int64,
                                  device=on)
        self._valid = torch.ones(1, dtype=torch.int64, device=on)  # a cached call: every round stands
        self._exchange_valid: torch.Tensor | None = None  # valid()'s word
        at = layout.offsets()
        self._own = mover.own_region[at["stream"]:at["stream"] + self.space.nbytes]
        self._boards = mover.own_region[at["board.0"]:at["stream"]]  # both parities' (the streamed layout's order)
        rows, width = _SLOTS + MAX_CAPTURED, 2 * self.space.channels
        # the status words: the CUDA kernels write them straight into pinned host memory (a launch has
        # ended when every word of its row is set); the Triton ones into device memory, copied back
        self._status = torch.zeros(rows, width, dtype=torch.int64, device=on)
        self._status_host = torch.zeros(rows, width, dtype=torch.int64, device="cpu", pin_memory=True)
        self._status_words = self._status_host.numpy()
        self._status_rows = list(self._status_host)  # (one view per row, made once)
        self._status_addresses = [row.data_ptr() for row in self._status_rows]
        self._plans: dict[int, FreshPlan] = {}  # by kind of call (Note [Planned fresh dispatch] in ep.paths.planned)
        self._abort = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=True)  # read by the kernels through UVA
        self._leases = [lease_event(device) for _ in range(_SLOTS)]
        self._events = [lease.resource.handle for lease in self._leases]
        self.launched = 0  # eager launches: their status slots rotate by it
        self.captured = 0  # launches captured in graphs: their status rows follow the eager slots
        self._queued: deque[tuple[int, int, str]] = deque()  # (slot, captured rows then, what), not yet read

    # -- a fresh dispatch's counts -----------------------------------------------------------------
    def launch_counts(self, call: FreshSend, rows: torch.Tensor, board: torch.Tensor | None) -> None:
        """``plan`` and the count exchange of ``call`` on the current stream, its round advanced on the
        device (``rows``: the plan's, the handle keeps them; ``board``: a ``board_like()`` tensor the
        board is copied into, which a call inside a graph capture needs)."""
        src = call.src
        shape = fresh_shape(self.layout, self.num_ranks, call)
        words = call_words(call.in_rank, src.topk, call.per_rank, call.per_expert, rows, src, 0, call.config)
        if capturing():
            self.mover.captured_counts(shape, words, self.timeout_s, board, self._advance_fresh)
        else:
            self.mover.send_counts(shape, words, 0, self.timeout_s, self.graphs, board_copy=board,
                                   advance=self._advance_fresh)

    def fresh_front(self, call: FreshSend) -> tuple[torch.Tensor, torch.Tensor, PreparedLaunch]:
        """An unpadded eager fresh dispatch's ``plan`` and count exchange launched, and its stream's
        launch packed but for the outputs (``launch_counts``, then ``prepare_dispatch``):
        ``(rows, taken, launch)``. A kind of call planned before does it in one compiled call, and
        the first call of a kind whose exchange runs as a graph plans it (Note [Planned fresh dispatch]
        in ep.paths.planned)."""
        plan = self._plans.get(call.kind) if call.kind else None
        if plan is not None:
            slot = self._slot(in_graph=False)
            if slot < _SLOTS:
                self._status_words[slot] = 0  # (as _status_of: the row's last launch was read)
            rows, taken, recv_offset = plan.front(call, self._status_addresses[slot], self.mover.current_stream())
            self.mover.expect_words(plan.host_words)
            return rows, taken, self._launch_of(plan.prepared, slot, recv_offset, plan.launch_from_board)
        src = call.src
        rows = torch.empty(src.x.shape[0], self.num_ranks, dtype=torch.int64, device=src.x.device)
        self.launch_counts(call, rows, None)
        taken = self.taken()
        launch = self.prepare_dispatch(rows, src, self.recv_offset() if self.kernel == "cuda" else None, taken,
                                       call.num_experts // self.num_ranks, self.valid(), fresh=True, starts_given=True)
        if call.kind and launch.prepared is not None and host.module() is not None:
            front = self.mover.front_graph(fresh_shape(self.layout, self.num_ranks, call), self.timeout_s)
            if front is not None:
                self._plans[call.kind] = FreshPlan(
                    host.module(), call, launch.prepared, front, self.num_ranks, self.space.channels, self.device,
                    self.rank, self.layout.max_tokens, self.mover.board_address, board_words(self.num_ranks))
        return rows, taken, launch

    def _advance_fresh(self, block: torch.Tensor) -> None:
        advance(self.counters, block[_ROUND:_ROUND + 1])

    def board_like(self) -> torch.Tensor:
        return self.mover.board_like()

    def wait_board(self, check):
        """``(plan words, count board)`` of the last eager exchange on the host (``check`` as
        ``CudaMover.wait_board``'s); giving up ends the exchange's wait whatever its round."""
        return self.mover.wait_board(ABORT_ALL, self.timeout_s, check)

    def board_now(self):
        """The last eager exchange's board in place if it has ended, else None (``CudaMover.board_now``)."""
        return self.mover.board_now()

    def valid(self) -> torch.Tensor:
        """The device word that is 0 when the last count exchange refused its round (one word for
        every round: the exchange runs on one board parity)."""
        if self._exchange_valid is None:
            self._exchange_valid = self.mover.exchange_valid(0)
        return self._exchange_valid

    # -- the streamed calls ------------------------------------------------------------------------
    def taken(self) -> torch.Tensor:
        """A dispatch's ``taken`` words ``[R, channels]``: the rows each channel took, for its handle's combine."""
        return torch.empty(self.num_ranks, self.space.channels, dtype=torch.int64, device=self.bases.device)

    def recv_offset(self) -> torch.Tensor:
        """A fresh dispatch's ``recv_offset`` [R], made before its starts are known: the CUDA kernel
        takes the starts by value and fills it itself (no copy to the device on the way to the launch)."""
        return torch.empty(self.num_ranks, dtype=torch.int64, device=self.bases.device)

    def padded_offsets(self, board: torch.Tensor, num_worst_tokens: int):
        """``(recv_offset, valid, padded)`` of a padded fresh dispatch whose board copy is ``board``:
        the CUDA kernel takes the board itself (``padded`` for ``dispatch``: it decides whether the
        round stands, fills ``recv_offset`` and pads the outputs); for Triton's, ``padded_plan`` does
        the first two now and ``padded`` is None (the caller pads the outputs)."""
        if self.kernel == "cuda":
            return self.recv_offset(), self.valid(), (board, num_worst_tokens)
        return (*padded_plan(board, self.valid(), self.rank, num_worst_tokens), None)

    def dispatch(self, rows: torch.Tensor, src: Sources, out: StreamOutputs, recv_offset: torch.Tensor,
                 taken: torch.Tensor, experts_per_rank: int, valid: torch.Tensor | None = None,
                 fresh: bool = False, padded=None) -> None:
        """Stream ``src``'s rows (``rows``: the plan's) into every destination's ``out`` on the current
        stream (``fresh``: a padded fresh dispatch's, right after ``launch_counts``, which advanced the
        seq already; ``padded``: ``padded_offsets``' third value; else a cached dispatch's)."""
        self.prepare_dispatch(rows, src, recv_offset, taken, experts_per_rank, valid, fresh=fresh,
                              padded=padded)(out, None)

    def prepare_dispatch(self, rows: torch.Tensor, src: Sources, recv_offset: torch.Tensor | None,
                         taken: torch.Tensor, experts_per_rank: int, valid: torch.Tensor | None = None,
                         fresh: bool = False, padded=None, starts_given: bool = False):
        """The launch of ``dispatch``, made ready but for the outputs, as a ``PreparedLaunch``:
        ``launch(out, starts)`` then launches it on the stream current now (the caller's) and
        returns the ``recv_offset`` the launch fills. An unpadded fresh dispatch prepares it while
        the GPUs trade the counts (``fresh``: right after ``launch_counts``, which advanced the seq
        already; ``starts_given``: ``launch`` gets where each source's rows start, and
        ``recv_offset`` is ``self.recv_offset()``, or None for the Triton kernels, which read a copy
        of the starts)."""
        step = None if fresh else self._advance()
        slot = self._slot()
        if self.kernel == "cuda":  # checked by the protocol, made by this path: launched without a second check
            num_k = src.topk.shape[1] if src.topk is not None else 0
            num_scales = src.scales.shape[1] if src.scales is not None else 0
            topk, weights = (t.contiguous() if t is not None else None for t in (src.topk, src.weights))
            prepared = stream_cuda.prepare_dispatch(
                self.space, rows.contiguous(), src.x.contiguous(), topk, weights, src.scales, self.bases, recv_offset,
                self._status_of(slot), self._abort.data_ptr(), valid if valid is not None else self._valid,
                self.rank, self._seq, self.layout.max_tokens, stream.meta_words(num_k, num_scales),
                experts_per_rank, self._timeout_ns, taken, advance=step, starts_given=starts_given, padded=padded,
                **stream_cuda.STEPS)
            compiled = host.module() if starts_given else None
            if compiled is None:
                return self._launch_of(prepared, slot, recv_offset, None)
            board_args = prepared.board_args(self.mover.board_address, self.num_ranks, board_words(self.num_ranks),
                                             self.rank, self.layout.max_tokens, src)
            return self._launch_of(prepared, slot, recv_offset, lambda: prepared.launch_planned(compiled, board_args))

        def launch(out: StreamOutputs, starts: list[int] | None) -> torch.Tensor:
            offsets = recv_offset if starts is None else torch.tensor(starts, dtype=torch.int64,
                                                                      device=self.bases.device)
            stream.stream_dispatch(self.space, rows, src, out, offsets, self.bases, self._status_of(slot),
                                   me=self.rank, seq=self.counters[1:2], max_tokens=self.layout.max_tokens,
                                   experts_per_rank=experts_per_rank, timeout_s=self.timeout_s,
                                   abort=self._abort.data_ptr(), taken=taken, valid=valid)
            self._launched(slot, "dispatch")
            return offsets
        return PreparedLaunch(launch)

    def _launch_of(self, prepared: stream_cuda.PreparedDispatch, slot: int, recv_offset: torch.Tensor,
                   launch_from_board) -> PreparedLaunch:
        """The ``PreparedLaunch`` of the CUDA kernel's ``prepared`` launch in status ``slot``
        (``launch_from_board``: the compiled steps' way from the board, or None)."""
        def launch(out: StreamOutputs, starts: list[int] | None) -> torch.Tensor:
            prepared.launch(out, starts)
            self._launched(slot, "dispatch")
            return recv_offset

        def from_board():
            done = launch_from_board()
            if done is None:
                return None
            self._launched(slot, "dispatch")
            return StreamOutputs(*done[0]), recv_offset
        return PreparedLaunch(launch, from_board if launch_from_board is not None else None, prepared)

    def combine(self, rows: torch.Tensor, x: torch.Tensor, out: torch.Tensor, taken: torch.Tensor,
                recv_offset: torch.Tensor, weights: torch.Tensor | None, out_weights: torch.Tensor | None) -> None:
        """Stream ``x``'s rows back to their sources, which sum them into ``out``."""
        step = self._advance()
        slot = self._slot()
        if self.kernel == "cuda":
            stream_cuda.combine(self.space, rows.contiguous(), x.view(torch.int64), weights, taken, recv_offset,
                                self.bases, out, out_weights, self._status_of(slot), self._abort.data_ptr(), self.rank,
                                self._seq, self._timeout_ns, advance=step, **stream_cuda.STEPS)
        else:
            stream_combine.stream_combine(self.space, rows, x, out, taken, recv_offset, self.bases,
                                          self._status_of(slot), me=self.rank, seq=self.counters[1:2],
                                          timeout_s=self.timeout_s, weights=weights, out_weights=out_weights,
                                          abort=self._abort.data_ptr())
        self._launched(slot, "combine")

    def _advance(self) -> torch.Tensor | None:
        """The next call's seq: the CUDA kernels advance it themselves (the word they count in is
        returned); for Triton's a kernel launched now does."""
        if self.kernel == "cuda":
            return self._done
        advance(self.counters)
        return None

    def _status_of(self, slot: int) -> torch.Tensor:
        """Where the launch of ``slot`` writes its status words: pinned host memory for the CUDA
        kernels (zeroed now: the row's last launch was read), device memory for Triton's."""
        if self.kernel != "cuda":
            return self._status[slot]
        row = self._status_rows[slot]
        if slot < _SLOTS:
            self._status_words[slot] = 0
        return row

    def _slot(self, in_graph: bool | None = None) -> int:
        """The status row of the next launch: an eager slot (waiting, with the timeout, for its
        last reader), or a captured launch's row of its own (``in_graph``: whether it is captured,
        where the caller knows)."""
        if capturing() if in_graph is None else in_graph:
            if self.captured >= MAX_CAPTURED:
                raise ConfigError(f"ep.Buffer: {MAX_CAPTURED} streamed calls are captured in this Buffer's graphs "
                                  "already, the most it holds status words for")
            self.captured += 1
            return _SLOTS + self.captured - 1
        if len(self._queued) >= _SLOTS:
            failed = self._read(block=True)
            if failed:
                raise failed
        return self.launched % _SLOTS

    def _launched(self, slot: int, what: str) -> None:
        """Queue an eager launch for ``_read``: Triton's get their status words copied back behind
        them (and every captured launch's: their graphs may have run since), then an event."""
        if slot >= _SLOTS:
            return
        if self.kernel == "cuda":  # the words come on their own (_status_of)
            self.launched += 1
            self._queued.append((slot, self.captured, what))
            return
        cuda, current, nbytes = self._cuda, self.mover.current_stream(), self._status.shape[1] * 8
        cuda.memcpy_async(self._status_host[slot].data_ptr(), self._status[slot].data_ptr(), nbytes, current)
        if self.captured:
            cuda.memcpy_async(self._status_host[_SLOTS].data_ptr(), self._status[_SLOTS].data_ptr(),
                              self.captured * nbytes, current)
        cuda.event_record(self._events[slot], current)
        self.launched += 1
        self._queued.append((slot, self.captured, what))

    # -- failures ------------------------------------------------------------------------------------
    def failures(self) -> TransferTimeout | None:
        """The first finished call whose programs did not all finish, as the error to raise (None:
        none). Reads only what finished; never waits."""
        return self._read(block=False)

    def _read(self, block: bool) -> TransferTimeout | None:
        while self._queued:
            slot, captured, what = self._queued[0]
            ended = self._ended(slot)
            if not ended():
                if not block:
                    return None
                self.mover.poll(ended, 2 * self.timeout_s + 1, lambda: (
                    f"ep: a streamed {what} did not end on cuda:{self.device} within its deadline"))
            self._queued.popleft()
            width = 2 * self.space.channels
            if not (self._status_words[slot, :width] & 0xFFFFFFFF).any() and not (
                    captured and (self._status_words[_SLOTS:_SLOTS + captured, :width] & 0xFFFFFFFF).any()):
                continue  # (the common case, read as one array: every program of those launches finished)
            rows = [(slot, what)] + [(_SLOTS + i, "call of a CUDA graph") for i in range(captured)]
            for row, name in rows:
                failed = _failed(self._status_host[row], name, self.space.channels)
                if failed is not None:
                    return failed
        return None

    def _ended(self, slot: int):
        """Whether the launch of eager ``slot`` ended: every status word set (CUDA), or its event."""
        if self.kernel == "cuda":
            words, width = self._status_words[slot], 2 * self.space.channels
            return lambda: bool(words[:width].all())
        event = self._events[slot]
        return lambda: self._cuda.event_query(event)

    def abort_all(self) -> None:
        """End every queued launch's waits now (each ends as aborted), and every count exchange's."""
        self._abort[0] = ABORT_ALL
        self.mover.abort_exchange(ABORT_ALL)

    def clear(self) -> None:
        """After ``abort_all`` and once every launch of this rank ended (the caller synchronized):
        zero this rank's space, its boards, the counts and the status words, and lift the abort."""
        for t in (self._own, self._boards, self.counters, self._status):
            t.zero_()
        torch.cuda.synchronize(self.device)
        self._status_host.zero_()
        self._queued.clear()
        self._abort[0] = 0
        self.mover.abort_exchange(0)
        self.launched = 0

    def close(self) -> None:
        self._plans = {}
        for lease in self._leases:
            lease.release()
        self._leases = []


def _failed(words: torch.Tensor, what: str, channels: int) -> TransferTimeout | None:
    """The error of a call whose status words hold a failure, else None (all zero: never ran)."""
    bad = [w for w in words.tolist()[:2 * channels] if w & 0xFFFFFFFF]
    if not bad:
        return None
    failed = stream.failures(words, bad[0] >> 32, channels)
    first = failed[0]
    how = "aborted" if first.aborted else "timed out"
    return TransferTimeout(
        f"ep: a streamed {what} (seq {first.seq}) failed: {len(failed)} program(s) did not finish; the first, "
        f"{first.role} channel {first.channel}, {how} waiting for {first.wait} from rank {first.peer}. Its outputs "
        "and those of the calls after it are void; the Buffer's next call clears the stream space with every peer")
