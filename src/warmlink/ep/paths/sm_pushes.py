"""The SM pushes of ``CudaMover``: a fresh dispatch's plan, count exchange and push, and a cached
dispatch's push, each launched eagerly once, then replayed as a CUDA graph (the kernels are
ep.kernels.steps'; the notes below say why the SMs send and why graphs).

``SmPushes`` is a part of ``CudaMover`` (ep.paths.cuda_mover), kept apart because it is a concern of
its own: it reads the mover's addresses, events, streams and host waits, and owns the call blocks,
the count board's landing place and the graphs.

# Note [SM sends]
A fresh dispatch must learn every peer's counts before its rows can land (Note [Send order] in
ep.kernels.layout). Through the host that costs a count copy, a mailbox meeting that waits for the
slowest rank's host, and the copy issue: 0.3-0.5 ms on 4 x H200 before the first byte, while the
bytes then take ~0.47 ms whether copy engines or SM stores move them (benchmarks/history-2026-11-22.md, "SM stores
alone"). So without a receive hook (normal mode) kernels do it, as DeepEP's normal mode does:

1. ``exchange``, one program per destination ``d``, right after ``plan`` on the caller's stream:
   it writes this rank's row into ``d``'s count board of the round's parity (ep.wire.regions): its
   counts per destination, its counts for ``d``'s experts and its call's config word
   (ep.wire.words; 0 when the plan refused the input: an expert id out of range or counts that
   disagree, the host's check, ep.protocol.checks), then the round number as a tag, with release
   semantics at system scope. It then waits (acquire) for every source's tag in this rank's own
   board and writes where this rank's rows start in ``d``: after the rows of the ranks below it.
   The base is 0 (nothing is stored) when any rank refused its input, called with another
   config (whose word it then sets to 0, a refusal to every later reader), or the wait ended.
   So ranks that called different kinds of call never store a row, whatever their hosts see.
2. The exchange lands the board and the plan words in pinned host memory itself (Note [Board
   landing]), before the push.
3. ``push``, a persistent kernel, stores every token's row and meta row at those bases: into the
   peers' mapped regions and this rank's own. An arrival flag per destination follows it
   (ep.wire.flags), and the receive side is the copy-engine path's (ep.paths.cuda_mover).

A cached dispatch already knows where its rows go (its handle): without a hook it launches only
``push``, at bases made once per handle and parity.

The host waits for the board with a deadline, checking the peers' liveness and the configs they
published; when it gives up it writes the round into a pinned host word the exchange polls, so no
kernel is left waiting on a dead or absent peer (the kernel's own backstop is twice the timeout).
A refused input on any rank stops every push: no byte moves, every rank raises ``ConfigError``, and
the round is spent on all of them. Round ``n``'s board rows and rows land in parity ``n % 2``, so
the copy-engine path's reasoning holds (ep.wire.regions, Note [Two parities]). With a receive hook the
copy engines keep the send: a push kernel would hold SMs between the send and the hook.

# Note [Fresh send graph]
Launching ``plan``, ``exchange`` and ``push`` from Python costs the host 0.15-0.35 ms (FastLaunch
included; more at 8 ranks), and the slowest rank's launches are on every rank's critical path:
the pushes wait in ``exchange`` for its counts. So the fresh send is two CUDA graphs per parity
and ``FreshShape`` (the dtypes and sizes the kernels are specialized for): one holds ``take_call``
(the call block from pinned memory to the device), ``plan`` and ``exchange`` (which lands the
board on the host); the other ``push``. Between the two launches the host records the event it polls for the
board: an ordinary record, whose state the host sees change at once (an event recorded by a graph
node might still read as the previous round's). What changes per call (every input's address, the
new ``rows`` tensor the handle keeps, the FP8 scales' strides, the token count, the round) is in the call block
(``CALL_SLOTS``), which the host writes into pinned memory before it launches the graph; the
kernels' ``*_call_kernel`` forms read it there. One block is enough: the host waits for a
fresh dispatch's board, which comes after ``take_call`` read the block, before the next one (a padded one's
when it is resolved: ep.protocol.normal). The first call of a parity and shape runs the steps eagerly
(compiling the kernels: nothing compiles during a capture), the next one captures them. A cached
dispatch's push is replayed the same way, from a call block per parity that also holds its
handle's bases (ep.paths.sm_pushes). ``ep.Buffer(graphs=False)`` keeps every call eager.

# Note [Board landing]
The host waits for the count board on every unpadded fresh dispatch, and everything the GPUs do
between the exchange's last store and the host seeing it is on the way to the rows: copies queued
behind the exchange (a graph's copy nodes each start some microseconds after the kernel before
them ends) and an event the host queries. So the exchange lands the round itself: each program,
its wait over, stores its source's board row (and program 0 the plan's words) into pinned memory,
fences them to the system and sets its landed word; the host zeroes the landed words before the
launch and reads the board once every one is set (``board_landed``: a compiled spin), or, past
that spin, by the event recorded after the exchange, which follows every store of it. A padded
call names a device copy of the board in its call block, which the exchange writes as well (no
copy queued behind it). An exchange captured in a caller's graph lands in device scratch: its
replays run while the host may wait for an eager call's board.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from warmlink._backoff import poll
from warmlink.ep.kernels import host, steps
from warmlink.ep.kernels.call_block import CALL_SLOTS, FreshShape, Sources, scale_words
from warmlink.ep.wire.regions import MAX_EXPERTS, PARITIES, RegionLayout, board_words

__all__ = ["SmPushes"]

log = logging.getLogger("warmlink.ep")

# words of a call block (CALL_SLOTS) a cached dispatch fills
_ROWS, _X, _TOKENS, _SCALES, _S_TOKEN, _S_COL, _BOARD_COPY = (CALL_SLOTS.index(name) for name in (
    "rows", "x", "tokens", "scales", "scales_token_stride", "scales_col_stride", "board_copy"))


class SmPushes:
    """``CudaMover``'s SM pushes; ``_init_pushes`` makes their state, ``_close_pushes`` destroys their graphs."""

    layout: RegionLayout
    rank: int
    device: int
    _cuda: object
    _own: torch.Tensor
    _ptrs: dict[int, int]
    _offsets: dict[str, int]
    _send_events: dict
    _refs: dict
    _host: torch.Tensor
    _host_words: int
    _counted: int
    _recv_stream: torch.cuda.Stream

    def _init_pushes(self, own: torch.Tensor, pinned: bool) -> None:
        layout = self.layout
        # SM sends (ep.paths.sm_pushes, Note [SM sends]): the board's landing place, the host word that ends a wait, and
        # per parity the exchange's address tables (every rank's board, receive x and meta areas;
        # then the push's bases, which the exchange writes), made once
        r, self._board_row = layout.num_ranks, board_words(layout.num_ranks)
        # where the exchange lands its round (Note [Board landing]): landed words, board, plan words
        size = steps.landing_size(r, self._board_row, MAX_EXPERTS)
        self._landing = torch.zeros(size, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self.landing_address = self._landing.data_ptr()  # (its landed words: ep.kernels.host's compiled steps)
        self._landed_view = self._landing[:r].numpy()
        self._board_host = self._landing[r:r + r * self._board_row]
        self._board_view = self._board_host.numpy().reshape(r, self._board_row)
        self.board_address = self._board_host.data_ptr()  # (read there by ep.kernels.host's compiled steps)
        self._host_view = self._landing[r + r * self._board_row:].numpy()  # the plan's words (wait_board copies them)
        # a captured exchange lands in device scratch: a replay must not write where the host waits
        self._captured_landing = torch.zeros(size, dtype=torch.int64, device=own.device)
        self._abort = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._abort_word, self._abort_ptr = self._abort.numpy(), self._abort.data_ptr()
        self._tables: dict[int, torch.Tensor] = {}
        # the fresh send's graphs (ep.paths.sm_pushes, Note [Fresh send graph]): the call block (pinned, and
        # its device copy), the plan's words, and per launch key the steps seen run eagerly once,
        # then their graph
        self._call_host = torch.zeros(len(CALL_SLOTS), dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._call_words = self._call_host.numpy()
        self._call = torch.zeros(len(CALL_SLOTS), dtype=torch.int64, device=own.device)
        self._words = torch.zeros(self._host.numel(), dtype=torch.int64, device=own.device)
        self._ran_eagerly: set[tuple] = set()
        self._graphs: dict[tuple, object] = {}  # launch key -> graph executable
        self._fronts: dict[tuple, int] = {}  # the count exchange's graphs as handles (ep.kernels.host's front_launch)
        self._call_address = self._call_host.data_ptr()
        # a cached SM dispatch's call block per parity: the CALL_SLOTS words, then its x and meta
        # bases per destination (its graph replays one push; round n + 2 rewrites round n's block
        # once round n's push ran: _push_cached)
        width = len(CALL_SLOTS) + 2 * layout.num_ranks
        self._cached_host = torch.zeros(PARITIES, width, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._cached_words = self._cached_host.numpy()
        self._cached_call = torch.zeros(PARITIES, width, dtype=torch.int64, device=own.device)

    def _sm_tables(self, parity: int) -> torch.Tensor:
        """The exchange's ``[5, R]`` address tables of ``parity`` (ep.kernels.steps.fresh_front), made once."""
        tables = self._tables.get(parity)
        if tables is None:
            ranks = range(self.layout.num_ranks)
            at = {kind: self._offsets[f"{kind}.{parity}"] for kind in ("board", "recv_x", "recv_meta")}
            rows = [[self._ptrs[r] + at[kind] for r in ranks] for kind in ("board", "recv_x", "recv_meta")]
            tables = self._tables[parity] = torch.tensor(rows + [[0] * len(ranks)] * 2, dtype=torch.int64,
                                                         device=self._own.device)
        return tables

    def send_sm(self, shape: FreshShape, call: tuple[int, ...], round_: int, phase: str, timeout_s: float,
                graphs: bool = True, board_copy: torch.Tensor | None = None) -> None:
        """A fresh dispatch's whole send on the current stream, with no host wait: the exchange
        kernel trades counts with the peers' exchange kernels through the boards, the board comes
        to the host (and into ``board_copy``, a ``board_like()`` tensor, when given), and the push
        kernel stores every row in its destination; then every destination's event. See Note [SM
        sends]. ``call``: the call block's words (``steps.call_words``). With ``graphs``, the
        second call of a parity and shape on replays graphs of those steps (Note [Fresh send graph])."""
        key = self.send_counts(shape, call, round_, timeout_s, graphs, board_copy)
        self._launch(("push", *key), lambda: steps.fresh_push(shape, self._call, self._sm_tables(key[0])), graphs)
        self._pushed(phase)

    def send_counts(self, shape: FreshShape, call: tuple[int, ...], round_: int, timeout_s: float,
                    graphs: bool = True, board_copy: torch.Tensor | None = None,
                    counters: torch.Tensor | None = None) -> tuple:
        """``send_sm``'s steps up to the board, without the push (a streamed dispatch moves its rows
        itself, ep.paths.streamed); the key its launches ran under. ``counters``: the streamed
        path's (ep.kernels.stream_counts), which the first step advances, the round taken from them."""
        parity = round_ % PARITIES
        self._abort_word[0] = 0
        self._host_words = steps.words_size(shape.num_ranks, shape.num_experts)
        if board_copy is not None:  # the exchange writes it too (before the event: the handle's reader waits for that)
            call = (*call[:_BOARD_COPY], board_copy.data_ptr(), *call[_BOARD_COPY + 1:])
        key = (parity, shape, timeout_s)
        current = self._current()
        front = self._fronts.get(key) if graphs else None
        compiled = host.module() if front is not None else None
        if compiled is not None:  # the same steps compiled (ep.kernels.host): words, landed words, graph, event
            graph_launch, event_record = host.front_addresses()
            error, step = compiled.front_launch(call, self._call_address, front, self.landing_address,
                                                shape.num_ranks, self._counted, current, graph_launch, event_record)
            if error:
                what = ("cuGraphLaunch of the count exchange", "cuEventRecord")[step - 1]
                self._cuda.check(error, f"{what} on stream {current:#x}")
            return key
        self._call_words[:] = call
        self._landed_view[:] = 0  # (the last exchange landed: its host waited, or resolved its handle)
        # two launches with the board's event between them: an event recorded by a graph node
        # might read as the previous round's on the host
        launch_key = ("front", *key)
        self._launch(launch_key, lambda: self._fresh_front(key, counters), graphs)
        if graphs and key not in self._fronts and launch_key in self._graphs:  # (just captured)
            self._fronts[key] = int(self._graphs[launch_key])
        self._cuda.event_record(self._counted, current)
        return key

    def front_graph(self, shape: FreshShape, timeout_s: float) -> tuple | None:
        """``(graph, call block address, abort word address, landing address, board event, plan
        words)`` of the count exchange of ``shape`` (parity 0, ``timeout_s``) once it runs as a
        graph, for a planned call that launches it itself (ep.paths.planned, then
        ``expect_words``). None before."""
        graph = self._fronts.get((0, shape, timeout_s))
        if graph is None:
            return None
        return (graph, self._call_address, self._abort_ptr, self.landing_address, self._counted,
                steps.words_size(shape.num_ranks, shape.num_experts))

    def expect_words(self, count: int) -> None:
        """``count`` plan words for ``wait_board`` to copy: a planned call's exchange writes them
        (``send_counts`` sets them for its own)."""
        self._host_words = count

    def exchange_valid(self, round_: int) -> torch.Tensor:
        """A device word the count exchange of ``round_``'s parity wrote: 0 when it refused the round
        (rank 0's push base, never 0 otherwise: the address of its receive area, Note [SM sends])."""
        return self._sm_tables(round_ % PARITIES)[3, :1]

    def captured_counts(self, shape: FreshShape, call: tuple[int, ...], timeout_s: float, board_copy: torch.Tensor,
                        counters: torch.Tensor) -> None:
        """``send_counts``'s device steps inside a caller's CUDA graph capture (a padded streamed
        dispatch, ep.protocol.streamed): the call block is a device tensor of its own, filled by
        kernels (a copy from the pinned block would replay whatever the host wrote there last),
        then ``take_call`` advances ``counters`` and writes the round into it; ``plan`` and
        ``exchange`` of parity 0, which lands the board in ``board_copy`` and in device scratch
        (a replay must not write where an eager call's host waits). Nothing reaches the host."""
        block = torch.empty(len(CALL_SLOTS), dtype=torch.int64, device=self._own.device)
        for i, word in enumerate((*call[:_BOARD_COPY], board_copy.data_ptr(), *call[_BOARD_COPY + 1:])):
            block[i].fill_(word)
        steps.take_call(block.data_ptr(), block, counters)
        steps.fresh_front(shape, block, self._words, self._sm_tables(0), self._abort_ptr, self.rank, timeout_s,
                          self._board_row, self._captured_landing.data_ptr())

    def _fresh_front(self, key: tuple, counters: torch.Tensor | None = None) -> None:
        """``send_sm``'s steps up to the board on the host, on the current stream: the call block
        to the device (``take_call``, ``counters`` advanced), then ``plan`` and ``exchange``, which
        lands the board and the plan's words in pinned memory (Note [Board landing])."""
        parity, shape, timeout_s = key
        steps.take_call(self._call_address, self._call, counters)
        steps.fresh_front(shape, self._call, self._words, self._sm_tables(parity), self._abort_ptr, self.rank,
                          timeout_s, self._board_row, self.landing_address)

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

    def send_sm_cached(self, rows: torch.Tensor, src: Sources, bases: list[int], parity: int, phase: str,
                       timeout_s: float, graphs: bool = True) -> None:
        """A cached dispatch's send on the current stream: the push kernel stores every row at
        ``bases`` (``sm_bases``), then every destination's event (Note [SM sends]). Its values
        travel in the parity's call block, so that from the second call of a parity and row shape
        on one graph launch replays it (Note [Fresh send graph])."""
        self._push_cached(rows, src, bases, parity, timeout_s, graphs)
        self._pushed(phase)

    def _push_cached(self, rows: torch.Tensor, src: Sources, bases: list[int], parity: int,
                     timeout_s: float, graphs: bool) -> None:
        """The push at ``bases`` from the parity's call block, eager once per key, then a graph.

        The block is rewritten only once the push that last read it (round n - 2) ran: its own
        send event, recorded right after it on the stream it ran on, completed (so a caller more
        than a round ahead of its stream waits here)."""
        last = self._send_events[f"dispatch.{parity}"][self.rank]
        if not self._cuda.event_query(last):
            self._poll(lambda: self._cuda.event_query(last), timeout_s, lambda: (
                f"ep: the cached dispatch two rounds back (parity {parity}) did not run on cuda:{self.device} within "
                f"{timeout_s:.3g} s; its call block cannot be rewritten"))
        block = self._cached_words[parity]
        block[_ROWS], block[_X], block[_TOKENS] = rows.data_ptr(), src.x.data_ptr(), rows.shape[0]
        # the caller's own scales, as laid out (ep.kernels.steps, Note [Scales in place])
        block[_SCALES], block[_S_TOKEN], block[_S_COL] = scale_words(src)
        block[len(CALL_SLOTS):] = bases
        # no strides in the key: they are words of the block, so one graph serves either layout
        key = ("cached", parity, src.x.shape[1], src.scales.shape[1] if src.scales is not None else 0)
        self._launch(key, lambda: self._cached_push(key), graphs)

    def _pushed(self, phase: str) -> None:
        """Every destination's event and arrival flag of ``phase`` after an SM push, on the current
        stream (the push stored every destination's rows: ``sent``'s per-destination copy streams
        do not apply)."""
        self._mark_sent(phase, self._current(), range(self.layout.num_ranks))

    def _cached_push(self, key: tuple) -> None:
        _, parity, x_words, num_scales = key
        cuda, current, call, r = self._cuda, self._current(), self._cached_call[parity], self.layout.num_ranks
        cuda.memcpy_async(call.data_ptr(), self._cached_host[parity].data_ptr(), call.numel() * 8, current)
        n = len(CALL_SLOTS)
        steps.push_from_call(call, call[n:n + r], call[n + r:], x_words, r, 0, num_scales, self.layout.num_topk,
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

    def board_like(self) -> torch.Tensor:
        """A fresh ``[R, board row]`` int64 device tensor for ``send_sm``'s ``board_copy``."""
        return torch.empty(self.layout.num_ranks, self._board_row, dtype=torch.int64, device=self._own.device)

    def abort_exchange(self, round_: int) -> None:
        """End ``round_``'s count exchange on the device if it still waits for a peer (at close,
        for a dispatch nobody waited for: no kernel is left waiting after the Buffer is gone)."""
        self._abort_word[0] = round_

    def board_landed(self, spin_s: float) -> bool:
        """Whether the last eager exchange landed its board, spun for up to ``spin_s`` on its landed
        words by the compiled steps (ep.kernels.host ``wait_landed``, the GIL released): the way to a
        streamed launch that no Python poll delays. False at once where they do not run."""
        compiled = host.module()
        return compiled is not None and compiled.wait_landed(self.landing_address, self.layout.num_ranks,
                                                             int(spin_s * 1e9))

    def board_now(self) -> np.ndarray | None:
        """The last exchange's board where it landed in pinned memory (not a copy: the next exchange
        rewrites it) if that exchange has ended, else None: one event query, no wait."""
        return self._board_view if self._cuda.event_query(self._counted) else None

    def wait_board(self, round_: int, timeout_s: float, check=None) -> tuple[np.ndarray, np.ndarray]:
        """``(plan words, board [R, board_words])`` of ``send_sm``'s round, host-polled with a
        deadline; every 5 ms the peers' liveness and ``check()`` (which raises to give up). Giving
        up ends the exchange kernel's wait first, so no kernel is left waiting on a peer."""
        query, counted = self._cuda.event_query, self._counted
        if query(counted):  # (the common case: the exchange ended while the host did other work)
            return self._host_view[:self._host_words].copy(), self._board_view.copy()
        try:
            self._poll(lambda: query(counted), timeout_s, lambda: (
                f"ep: the dispatch's count exchange on cuda:{self.device} did not complete within {timeout_s:.3g} s"),
                watch=list(self._refs), lost="before the dispatch's count exchange", check=check)
        except BaseException:
            self._abort_word[0] = round_
            poll(lambda: query(counted), 5.0, first_s=1e-4, cap_s=1e-4)
            raise
        return self._host_view[:self._host_words].copy(), self._board_view.copy()

    def _close_pushes(self) -> None:
        graphs, self._graphs = self._graphs, {}  # they write into this Buffer's mappings
        self._fronts = {}
        for graph in graphs.values():
            try:
                self._cuda.graph_destroy(graph)
            except Exception as exc:  # a broken context: the driver frees it with the context
                log.warning("ep: could not destroy a fresh-send graph at close: %s", exc)
