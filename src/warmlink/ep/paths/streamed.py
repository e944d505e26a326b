"""``StreamPath`` (``send="stream"``, cuda_ipc): rows stream through a fixed receive space the
GPUs pace themselves (ep.kernels.stream, Note [Streamed dispatch]; the combine's way back,
ep.kernels.stream_combine). A fresh dispatch's counts are still traded by the count exchange
kernel (ep.paths.sm_pushes, Note [SM sends]), whose board gives every rank where each source's
rows start in its outputs; then one kernel streams the rows. The order of those steps, and what
the host waits for, is the protocol's (ep.protocol.streamed); this path launches them.

Every launch is a call of the space's seq count (1, 2, 3, ... on every rank: dispatch, cached
dispatch and combine alike), and every fresh dispatch a round of the count exchange. Both counts
live on the device (``counters``: a fresh dispatch's first step advances both, ep.kernels.steps
``take_call``; before a cached dispatch or a combine ep.kernels.stream_counts ``advance`` moves the
seq for Triton's streamed kernels, while the CUDA ones advance it themselves, Note [Warp groups]), so that a CUDA
graph of calls runs calls of their own at every replay; the host holds neither. One board parity
serves every round: a rank's stream of round n ends only after every peer's stream of round n
began, which follows that peer's exchange of round n, so no source writes round n + 1 into a
board still read for round n.

Every launch writes ``2C`` status words (ep.paths.launch_status), which a later call reads for
its failures (a peer's deadline, an abort): a call returns at launch. ``abort_all`` ends every
queued launch's waits at once; ``clear`` zeroes the space, the boards, the counts and the status
words.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from warmlink.ep.kernels import host, stream, stream_combine, stream_cuda
from warmlink.ep.kernels.stream_counts import advance, padded_plan
from warmlink.ep.kernels.call_block import Sources, call_words
from warmlink.ep.kernels.launch import capturing
from warmlink.ep.kernels.stream import StreamOutputs
from warmlink.ep.paths.launch_status import LaunchStatus
from warmlink.ep.paths.planned import POSTED_WORDS, FreshPlan, PreparedLaunch
from warmlink.ep.paths.senders import FreshSend, fresh_shape
from warmlink.ep.wire.regions import RegionLayout, board_words
from warmlink.errors import ConfigError, MetadataError, TransferTimeout

__all__ = ["ABORT_ALL", "StreamPath"]

ABORT_ALL = 1 << 40  # an abort word past every seq and round: ends the waits of every launch queued
# how long a fresh dispatch's host spins, without the GIL, for its board before the full wait (which
# checks the peers and the earlier calls' failures every few ms, spinning too)
LANDING_SPIN_S = 2e-3


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
        self.mover, self.layout = mover, layout
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
        self.status = LaunchStatus(self.kernel, self.space.channels, device, mover, timeout_s)
        # by kind of call and num_worst_tokens (Note [Planned fresh dispatch] in ep.paths.planned)
        self._plans: dict[tuple[int, int], FreshPlan] = {}
        self._abort = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=True)  # read by the kernels through UVA
        # a planned fresh dispatch's posted outputs block (Note [Posted outputs] in ep.paths.planned)
        self._posted = torch.zeros(POSTED_WORDS, dtype=torch.int64, device="cpu", pin_memory=True)

    # -- a fresh dispatch's counts -----------------------------------------------------------------
    def launch_counts(self, call: FreshSend, rows: torch.Tensor, board: torch.Tensor | None) -> None:
        """``plan`` and the count exchange of ``call`` on the current stream, its round advanced on the
        device (``rows``: the plan's, the handle keeps them; ``board``: a ``board_like()`` tensor the
        board is copied into, which a call inside a graph capture needs)."""
        src = call.src
        shape = fresh_shape(self.layout, self.num_ranks, call)
        words = call_words(call.in_rank, src.topk, call.per_rank, call.per_expert, rows, src, 0, call.config)
        if capturing():
            self.mover.captured_counts(shape, words, self.timeout_s, board, self.counters)
        else:
            self.mover.send_counts(shape, words, 0, self.timeout_s, self.graphs, board_copy=board,
                                   counters=self.counters)

    def fresh_front(self, call: FreshSend) -> tuple[torch.Tensor, torch.Tensor, PreparedLaunch]:
        """An unpadded eager fresh dispatch's ``plan`` and count exchange launched, and its stream's
        launch packed but for the outputs (``launch_counts``, then ``prepare_dispatch``):
        ``(rows, taken, launch)``. A kind of call planned before does it in one compiled call, and
        the first call of a kind whose exchange runs as a graph plans it (Note [Planned fresh dispatch]
        in ep.paths.planned)."""
        src = call.src
        planned = self.planned_front(call.kind, src.x, src.scales, src.topk, src.weights, call.in_rank, call.per_rank,
                                     call.per_expert)
        if planned is not None:
            return planned
        rows = torch.empty(src.x.shape[0], self.num_ranks, dtype=torch.int64, device=src.x.device)
        self.launch_counts(call, rows, None)
        taken = self.taken()
        launch = self.prepare_dispatch(rows, src, self.recv_offset() if self.kernel == "cuda" else None, taken,
                                       call.num_experts // self.num_ranks, self.valid(), fresh=True, starts_given=True)
        self._plan(call, launch.prepared)
        return rows, taken, launch

    def planned_front(self, kind: int, x, scales, topk, weights, in_rank, per_rank, per_expert):
        """``fresh_front``'s value for a call of ``kind`` (the compiled argument check's, 0: none)
        planned before, from its checked tensors (contiguous: the check makes sure), in one compiled
        call; None, with nothing launched, where no plan of that kind is made yet."""
        plan = self._plans.get((kind, 0)) if kind else None
        if plan is None:
            return None
        slot = self.status.slot(in_graph=False)
        rows, taken, recv_offset = plan.front(x, scales, topk, weights, in_rank, per_rank, per_expert,
                                              self.status.address(slot), self.mover.current_stream())
        self.status.launched(slot, "dispatch")
        self.mover.expect_words(plan.host_words)
        return rows, taken, PreparedLaunch(_posted_only, lambda: _posted(plan.post_outputs(), recv_offset),
                                           abandon=plan.post_void)

    def fresh_padded(self, call: FreshSend, in_graph: bool):
        """A padded fresh dispatch's ``plan``, count exchange (its board copied to a tensor) and stream
        launched: ``(rows, taken, recv_offset, board copy, outputs)``, the outputs
        ``call.num_worst_tokens`` rows. Nothing waits: the stream takes its offsets and whether the
        round stands from the board on the device (``padded_offsets``). An eager call of a kind
        planned before is one compiled call (ep.paths.planned)."""
        nwt, src = call.num_worst_tokens, call.src
        plan = self._plans.get((call.kind, nwt)) if call.kind and not in_graph else None
        if plan is not None:
            slot = self.status.slot(in_graph=False)
            rows, taken, recv_offset, board, out = plan.padded(call, self.status.address(slot),
                                                               self.mover.current_stream())
            self.status.launched(slot, "dispatch")
            self.mover.expect_words(plan.host_words)
            return rows, taken, recv_offset, board, out
        rows = torch.empty(src.x.shape[0], self.num_ranks, dtype=torch.int64, device=src.x.device)
        board = self.board_like()
        self.launch_counts(call, rows, board)
        taken = self.taken()
        recv_offset, valid, padding = self.padded_offsets(board, nwt)
        out = stream.outputs(nwt, src)
        if padding is None:  # rows past the received ones: no expert, no weight (else the kernel pads them)
            for t, fill in ((out.idx, -1), (out.weights, 0)):
                if t is not None:
                    t.fill_(fill)
        launch = self.prepare_dispatch(rows, src, recv_offset, taken, call.num_experts // self.num_ranks, valid,
                                       fresh=True, padded=padding)
        launch(out, None)
        if not in_graph:
            self._plan(call, launch.prepared)
        return rows, taken, recv_offset, board, out

    def _plan(self, call: FreshSend, prepared: stream_cuda.PreparedDispatch | None) -> None:
        """Plan ``call``'s kind from its launch (``prepared``: the CUDA kernel's), where it can be:
        its arguments passed the compiled check, and its count exchange runs as a graph now."""
        compiled = host.module() if self.graphs and call.kind and prepared is not None else None
        if compiled is None:
            return
        front = self.mover.front_graph(fresh_shape(self.layout, self.num_ranks, call), self.timeout_s)
        if front is not None:
            self._plans[call.kind, call.num_worst_tokens] = FreshPlan(
                compiled, call, prepared, front, self.num_ranks, self.space.channels, self.device, self.rank,
                self.layout.max_tokens, self.mover.board_address, self._posted.data_ptr())

    def board_like(self) -> torch.Tensor:
        return self.mover.board_like()

    def wait_board(self, check):
        """``(plan words, count board)`` of the last eager exchange on the host (``check`` as
        ``CudaMover.wait_board``'s); giving up ends the exchange's wait whatever its round."""
        return self.mover.wait_board(ABORT_ALL, self.timeout_s, check)

    def board_landed(self) -> bool:
        """Whether the last eager exchange landed its board, after a short spin (``CudaMover.board_landed``)."""
        return self.mover.board_landed(LANDING_SPIN_S)

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
        slot = self.status.slot()
        if self.kernel == "cuda":  # checked by the protocol, made by this path: launched without a second check
            num_k = src.topk.shape[1] if src.topk is not None else 0
            num_scales = src.scales.shape[1] if src.scales is not None else 0
            topk, weights = (t.contiguous() if t is not None else None for t in (src.topk, src.weights))
            prepared = stream_cuda.prepare_dispatch(
                self.space, rows.contiguous(), src.x.contiguous(), topk, weights, src.scales, self.bases, recv_offset,
                self.status.row(slot), self._abort.data_ptr(), valid if valid is not None else self._valid,
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
            stream.stream_dispatch(self.space, rows, src, out, offsets, self.bases, self.status.row(slot),
                                   me=self.rank, seq=self.counters[1:2], max_tokens=self.layout.max_tokens,
                                   experts_per_rank=experts_per_rank, timeout_s=self.timeout_s,
                                   abort=self._abort.data_ptr(), taken=taken, valid=valid)
            self.status.launched(slot, "dispatch")
            return offsets
        return PreparedLaunch(launch)

    def _launch_of(self, prepared: stream_cuda.PreparedDispatch, slot: int, recv_offset: torch.Tensor,
                   launch_from_board) -> PreparedLaunch:
        """The ``PreparedLaunch`` of the CUDA kernel's ``prepared`` launch in status ``slot``
        (``launch_from_board``: the compiled steps' way from the board, or None)."""
        def launch(out: StreamOutputs, starts: list[int] | None) -> torch.Tensor:
            prepared.launch(out, starts)
            self.status.launched(slot, "dispatch")
            return recv_offset

        def from_board():
            done = launch_from_board()
            if done is None:
                return None
            self.status.launched(slot, "dispatch")
            return StreamOutputs(*done[0]), recv_offset, None
        return PreparedLaunch(launch, from_board if launch_from_board is not None else None, prepared)

    def combine(self, rows: torch.Tensor, x: torch.Tensor, out: torch.Tensor, taken: torch.Tensor,
                recv_offset: torch.Tensor, weights: torch.Tensor | None, out_weights: torch.Tensor | None) -> None:
        """Stream ``x``'s rows back to their sources, which sum them into ``out``."""
        step = self._advance()
        slot = self.status.slot()
        if self.kernel == "cuda":
            stream_cuda.combine(self.space, rows.contiguous(), x.view(torch.int64), weights, taken, recv_offset,
                                self.bases, out, out_weights, self.status.row(slot), self._abort.data_ptr(), self.rank,
                                self._seq, self._timeout_ns, advance=step, **stream_cuda.STEPS)
        else:
            stream_combine.stream_combine(self.space, rows, x, out, taken, recv_offset, self.bases,
                                          self.status.row(slot), me=self.rank, seq=self.counters[1:2],
                                          timeout_s=self.timeout_s, weights=weights, out_weights=out_weights,
                                          abort=self._abort.data_ptr())
        self.status.launched(slot, "combine")

    def _advance(self) -> torch.Tensor | None:
        """The next call's seq: the CUDA kernels advance it themselves (the word they count in is
        returned); for Triton's a kernel launched now does."""
        if self.kernel == "cuda":
            return self._done
        advance(self.counters)
        return None

    def failures(self) -> TransferTimeout | None:
        """The first finished call whose programs did not all finish, as the error to raise (None:
        none). Reads only what finished; never waits."""
        return self.status.failures()

    def abort_all(self) -> None:
        """End every queued launch's waits now (each ends as aborted), and every count exchange's."""
        self._abort[0] = ABORT_ALL
        self.mover.abort_exchange(ABORT_ALL)

    def clear(self) -> None:
        """After ``abort_all`` and once every launch of this rank ended (the caller synchronized):
        zero this rank's space, its boards, the counts and the status words, and lift the abort."""
        for t in (self._own, self._boards, self.counters):
            t.zero_()
        self.status.clear()  # (after a synchronize: the zeroing above ran too)
        self._abort[0] = 0
        self.mover.abort_exchange(0)

    def close(self) -> None:
        self._plans = {}
        self.status.close()


def _posted(done, recv_offset: torch.Tensor) -> tuple[StreamOutputs, torch.Tensor, tuple | None] | None:
    """``PreparedLaunch.from_board``'s value of a posted launch (``FreshPlan.post_outputs``' ``done``)."""
    return (StreamOutputs(*done[0]), recv_offset, done[2]) if done is not None else None


def _posted_only(out: StreamOutputs, starts: list[int] | None) -> NoReturn:
    raise MetadataError("ep: the count board held what the compiled check refused and the Python check passed; a "
                        "launch waiting for posted outputs cannot take them from Python (a warmlink bug)")
