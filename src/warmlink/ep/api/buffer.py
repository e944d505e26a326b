"""``Buffer``: MoE dispatch and combine over pre-registered regions, with optional receive hooks.

The API follows DeepEP's normal mode (``get_dispatch_layout``, ``dispatch``, ``combine``; the
README's "MoE dispatch and combine" shows a call sequence), so MoE code switches with small changes.

``Buffer`` is the facade: it checks that it is open, picks a call's stream (with ``async_finish``,
the communication stream: ep.paths.comm_stream) and hands the call to its ``NormalMode``
(ep.protocol.normal), which runs the round (Note [Round protocol] in ep.protocol.rounds) over the
data path chosen once by ``send=`` (ep.paths.senders: SMs, copy engines or host copies). With
``return_recv_hook=True`` each call returns after its send phase (rows packed per destination,
the bytes handed to the copy engines, the round marked sent) with one more element, ``hook``; no
kernel stays resident. ``hook()`` waits for arrival and finishes the receive. The low-latency
calls are ep.low_latency's.
"""

from __future__ import annotations

import torch

from warmlink import _env
from warmlink._closing import Closing
from warmlink.ep.api.options import resolve_device, resolve_options, resolve_stream
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.low_latency import LowLatencyMethods
from warmlink.ep.paths.combine import Combiner
from warmlink.ep.paths.comm_stream import INLINE
from warmlink.ep.paths.event import wait_for
from warmlink.ep.paths.senders import PATHS
from warmlink.ep.paths.streamed import StreamPath
from warmlink.ep.paths.setup import Resources, group_store
from warmlink.ep.protocol.checks import Checks
from warmlink.ep.protocol.normal import NormalMode
from warmlink.ep.protocol.rounds import Rounds
from warmlink.ep.protocol.streamed import StreamedMode
from warmlink.ep.wire.handle import Handle
from warmlink.ep.wire.regions import PARITIES, RegionLayout
from warmlink.errors import ConfigError

__all__ = ["Buffer"]

class Buffer(LowLatencyMethods, Closing):
    """One rank's end of an ep group: regions, mailboxes and streams, set up once.

    Args:
        store: a ``warmlink.rendezvous.Store`` every rank of the group reaches (its prefix names
            the group; construction is collective: every rank builds its Buffer the same number
            of times).
        rank, num_ranks: this rank and the group size.
        max_tokens_per_rank: the largest batch any rank dispatches.
        hidden: channels per token (a multiple of 8).
        num_topk: experts per token (the most any call passes).
        device: CUDA device (default: the current one, or host memory when CUDA is absent or
            ``backend="shm"``).
        backend: ``"cuda_ipc"``, ``"shm"`` or None (``WARMLINK_BACKEND``, else by device).
        timeout_s: every wait's limit (default ``WARMLINK_TIMEOUT_S``).
        send: how a dispatch without a receive hook moves its rows (ep.paths.senders, chosen once): ``"sm"``
            (cuda_ipc: kernels trade the counts and store the rows, Note [SM sends] in
            ep.paths.sm_pushes), ``"copy"`` (cuda_ipc: the host meets the peers, then the copy engines
            push), ``"stream"`` (cuda_ipc: the rows stream through a fixed space of ``stream_channels``
            x ``ring_rows`` rows per source, whatever the batch, paced by the GPUs; no receive hook;
            ep.protocol.streamed, Note [Streamed calls]) or ``"host"`` (shm: CPU copies). None:
            ``"host"`` on shm, ``WARMLINK_EP_SEND`` (default ``"sm"``) on cuda_ipc. A call with a hook uses the copy engines on cuda_ipc.
            Every rank passes the same.
        graphs: replay the SM and cached sends' launches as CUDA graphs from their second call per
            shape (ep.paths.sm_pushes, Note [Fresh send graph]). None: ``WARMLINK_EP_GRAPH`` (default
            True) on cuda_ipc.
        copy_streams: ``"one"`` (every destination's copies back to back on one stream) or
            ``"per-peer"``. None: ``WARMLINK_EP_COPY_STREAMS`` (default ``"one"``) on cuda_ipc.
        combine_parts: the parts a combine's rows are sent and summed in, 1 to 4 (ep.kernels.reduce,
            Note [Pipelined combine]). None: 4 for three ranks and more, else 1. Every rank passes
            the same.
        stream_channels, ring_rows: a streamed Buffer's channels (two programs each, at most half the
            SMs) and rows per ring (None: ep.api.options.stream_defaults). Every rank passes the same.
        low_latency_mode, num_experts: also set up DeepEP's low-latency calls for ``num_experts``
            experts, ``max_tokens_per_rank`` tokens (ep.low_latency: host copies on shm, kernels on cuda_ipc).
        enable_shrink: with ``low_latency_mode``, a peer that stalls or dies is masked and the
            low-latency calls go on without it, instead of raising (DeepEP's mask buffer: ep.low_latency._mask).

    Raises:
        ConfigError: bad sizes or options (naming the argument), or a peer built with different sizes.
        MetadataError: a peer's rank info is malformed. TransferTimeout: a peer never came.

    Collective? Construction, ``dispatch`` and ``combine`` are. Warm path? Regions, mappings,
    streams and events come from the pool; a second Buffer in the same processes opens nothing.
    """

    def __init__(self, store, rank: int, num_ranks: int, *, max_tokens_per_rank: int, hidden: int,
                 num_topk: int = 8, device=None, backend: str | None = None, timeout_s: float | None = None,
                 send: str | None = None, graphs: bool | None = None, copy_streams: str | None = None,
                 combine_parts: int | None = None, stream_channels: int | None = None, ring_rows: int | None = None,
                 low_latency_mode: bool = False, num_experts: int | None = None, enable_shrink: bool = False) -> None:
        from warmlink.transport import resolve_backend

        self._closed = True
        self._res = None
        self._link = None  # Closing's mark of a Buffer that holds leases: its __del__ closes one left open
        if not isinstance(num_ranks, int) or not 1 <= num_ranks <= 1024:
            raise ConfigError(f"ep.Buffer: num_ranks={num_ranks!r}; expected an int in [1, 1024]")
        if not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise ConfigError(f"ep.Buffer: rank={rank!r}; expected 0 <= rank < num_ranks={num_ranks}")
        self.rank, self.num_ranks = rank, num_ranks
        self.timeout_s = float(timeout_s) if timeout_s is not None else _env.default_timeout_s()
        self.device = resolve_device(device, backend)
        self.backend = resolve_backend(backend, self.device)
        if (self.backend == "shm") != (self.device < 0):
            raise ConfigError(f"ep.Buffer: backend={self.backend!r} does not fit device={self.device}")
        self.send, self.graphs, self.copy_streams, self.combine_parts = resolve_options(
            num_ranks, self.backend, send, graphs, copy_streams, combine_parts)
        self.layout = RegionLayout(num_ranks, max_tokens_per_rank, hidden, num_topk,
                                   *resolve_stream(self.send, num_ranks, stream_channels, ring_rows))
        self._checks = Checks(self.layout, num_ranks, self.device)
        self._check_low_latency(low_latency_mode, num_experts, enable_shrink)
        self._normal: NormalMode | None = None
        self._res = Resources(self.layout, rank, num_ranks, self.device, self.backend, self.timeout_s,
                              self.copy_streams)
        self._link = self._res.link
        self._closed = False
        try:
            self._res.connect(store)
            self._open_low_latency(store, low_latency_mode, num_experts, num_topk, enable_shrink)
            self._normal = self._mode()
        except BaseException:
            self.close()
            raise

    def _mode(self):
        """The object that runs this Buffer's calls over its data path, chosen once."""
        res, rank, num_ranks = self._res, self.rank, self.num_ranks
        rounds = Rounds(res.mailbox, rank, num_ranks, self.layout.max_tokens, self.timeout_s)
        # done_events: what async_finish records, per (op, parity), then the layout's
        if self.send == "stream":
            path = StreamPath(res.mover, self.layout, rank, num_ranks, self.device, self.graphs, self.timeout_s)
            return StreamedMode(rounds, path, self._checks, self.layout, self.device, res.done_events)
        path = PATHS[self.send](res.mover, self.layout, rank, num_ranks, self.graphs)
        combiner = Combiner(res.mover, self.layout, rank, rounds.order(), self.combine_parts, self.timeout_s)
        return NormalMode(rounds, path, combiner, res.mover, self._checks, self.layout, self.device, res.done_events)

    @property
    def fresh_outputs(self) -> bool:
        """Whether ``recv_x`` is a fresh tensor (the streamed kernels'), not a view of the receive area."""
        return self.send == "stream"

    @classmethod
    def from_group(cls, group=None, *, max_tokens_per_rank: int, hidden: int, num_topk: int = 8, device=None,
                   backend: str | None = None, timeout_s: float | None = None, secret: str | None = None,
                   **options) -> "Buffer":
        """A Buffer for the ranks of a ``torch.distributed`` group, as DeepEP's ``Buffer(group, ...)``.

        Rank 0 of the group starts a rendezvous store on this host's loopback (ep runs within one
        node: every rank raises ``ConfigError`` when the group spans machines) under ``secret``
        (rank 0's argument, else ``WARMLINK_SECRET``, else a fresh one) and sends its port and that
        secret to the others with one ``all_gather`` of int64 rows (nothing pickled; the other
        ranks' ``secret`` is not used); the Buffer owns that store and closes it with itself.
        ``options``: the constructor's ``send``, ``graphs``, ``copy_streams``, ``combine_parts``,
        ``stream_channels``, ``ring_rows``,
        ``low_latency_mode``, ``num_experts`` and ``enable_shrink``. Collective over ``group``.
        """
        store, rank, world = group_store(group, timeout_s, secret)
        try:
            buf = cls(store, rank, world, max_tokens_per_rank=max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                      device=device, backend=backend, timeout_s=timeout_s, **options)
        except BaseException:
            store.close()
            raise
        buf._owned_store = store
        return buf

    # -- layout -----------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's layout tuple: ``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)``
        (``event``: an ``ep.EventOverlap``; ``previous_event``, ``async_finish`` and
        ``allocate_on_comm_stream`` as ``dispatch``'s).

        Entries outside ``[-1, num_experts)`` are routed nowhere here and refused by ``dispatch``.
        """
        self._checks.experts(num_experts)
        topk = self._checks.topk(topk_idx, "topk_idx")
        with self._call(async_finish) as call:  # Note [Communication stream] in ep.paths.comm_stream (not a hot path)
            wait_for(previous_event, "get_dispatch_layout")
            call.hold(topk)
            lay = dispatch_layout(topk, num_experts, self.num_ranks)
            call.give(lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank)
            return (lay.num_tokens_per_rank, None, lay.num_tokens_per_expert, lay.is_token_in_rank,
                    self._normal.event(2 * PARITIES, async_finish))

    def all_gather_int(self, value: int, *, timeout_s: float | None = None) -> list[int]:
        """Every rank's ``value`` (an int in ``[0, 2**63)``), in rank order: a host-only collective
        through the mailboxes, with liveness checks and a timeout (default the Buffer's):
        ``PeerLostError``, ``TransferTimeout``. No kernel. ``deep_ep`` agrees on a call's rounds with it."""
        self._check_open("all_gather_int")
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
            raise ConfigError(f"ep.Buffer.all_gather_int: value={value!r}; expected an int in [0, 2**63)")
        return self._normal.rounds.all_gather_int(value, self.timeout_s if timeout_s is None else timeout_s)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream calls made with ``async_finish=True`` run on (DeepEP's name; ep.paths.comm_stream,
        Note [Communication stream]).

        Raises:
            ConfigError: a host-memory Buffer (its calls run on the host and finish on return), or a closed one.
        """
        if self._closed:
            raise ConfigError("ep.Buffer.get_comm_stream: the buffer is closed")
        if self.device < 0:
            raise ConfigError("ep.Buffer.get_comm_stream: a host-memory Buffer has no stream: its calls run on the "
                              "host and finish on return")
        return self._res.comm_stream().stream

    def _check_open(self, func: str) -> None:
        if self._closed:
            raise ConfigError(f"ep.Buffer.{func}: the buffer is closed")
        self._normal.before_call(func)

    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 num_experts: int | None = None, return_recv_hook: bool = False):
        """Send each token once to every rank holding one of its experts.

        Args:
            x: ``[T, hidden]`` bf16/fp16, or FP8 ``(float8_e4m3fn [T, hidden], float32 [T, ceil(hidden / 128)])``,
                of the same dtype on every rank.
            handle: a previous dispatch's handle: re-send with the same routing, skipping the layout
                and the count exchange (``topk_*`` are then not sent).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``
                (computed here when omitted).
            topk_idx: ``[T, K]`` expert ids in ``[-1, num_experts)`` (-1 = masked).
            topk_weights: ``[T, K]`` float32 (every rank passes them, or none does).
            num_experts: needed only when ``num_tokens_per_expert`` is omitted.
            return_recv_hook: return after the send phase, with a hook that finishes the receive.
                Every rank must pass the same value to a fresh dispatch: without a hook the Buffer's
                ``send`` path moves the rows, with one the copy engines do (on CUDA).
            expert_alignment: round each count of ``num_recv_tokens_per_expert_list`` up to a
                multiple of this (an int >= 1), as DeepEP does for grouped GEMMs.
            num_worst_tokens: 0, or the rows of every output (at most ``num_ranks *
                max_tokens_per_rank``; every rank passes the same): rows past the received ones hold
                stale bytes, expert id -1 and weight 0, and ``num_recv_tokens_per_expert_list`` is
                empty (the handle keeps the counts). If any rank would receive more rows, every rank
                raises ``ConfigError`` and the round is spent. With SM sends (no hook) the call
                returns at launch, as DeepEP's: the handle's counts reach the host at the Buffer's
                next call, which raises such a refusal (and so does every use of the handle); the
                refused round's outputs are all padding (ep.protocol.normal, Note [Padded dispatch returns
                at launch]). Its round numbers are host ints, so it is not graph-capturable, but on
                a streamed Buffer (``send="stream"``) it is (ep.protocol.streamed, Note [Streamed
                calls]). A cached dispatch pads as its handle's.
            previous_event: an ``EventOverlap`` or ``torch.cuda.Event`` the call's work waits for first.
            async_finish: run the call on the Buffer's communication stream (``get_comm_stream()``)
                after the caller's stream and ``previous_event``, and return an ``EventOverlap``
                marking its end: the caller's stream is not ordered after the call, so its next work
                overlaps the call's; wait for the event before reading the outputs. Without it, or
                with a receive hook (which is how hook mode overlaps; DeepEP takes not both), the
                call runs on the caller's stream, which is thus ordered after the outputs
                (ep.paths.comm_stream, Note [Communication stream]).
            allocate_on_comm_stream: accepted; with ``async_finish`` the outputs are always allocated
                on the communication stream and marked used by the caller's (the note says why).
            ``config`` is accepted for compatibility and unused.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``,
            plus ``hook`` when asked (the tensors are filled when it returns). ``recv_x`` rows are
            ordered by source rank, then source token: a view of the receive area valid until the
            next dispatch (on CUDA: until its stream runs past the caller's reads), or fresh tensors
            with ``send="stream"`` (``fresh_outputs``). ``recv_topk_idx`` holds local expert ids (-1
            elsewhere). ``event`` is an ``ep.EventOverlap`` (in hook mode it marks the send phase).

        Raises:
            ConfigError: bad shapes, dtypes, sizes or expert ids (before any byte moves; the peers
                of a fresh dispatch raise it too, naming this rank: ep.protocol.normal, Note [Refused
                dispatch]), or peers that called with another configuration.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        self._check_open("dispatch")
        args = (x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                expert_alignment, num_worst_tokens, async_finish, num_experts, return_recv_hook)
        if not self._on_comm(async_finish and not return_recv_hook):
            wait_for(previous_event, "dispatch")
            return self._normal.dispatch(*args)
        with self._call(True) as call:  # Note [Communication stream] in ep.paths.comm_stream
            wait_for(previous_event, "dispatch")
            call.hold(x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            if isinstance(handle, Handle):
                call.hold(handle.is_token_in_rank, handle.combine_rows)
            out = self._normal.dispatch(*args)
            call.give(out[:3], out[4].combine_rows)
            return out

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None, config=None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                return_recv_hook: bool = False):
        """Send each received row back to its source and sum, per token, the copies of its ranks.

        Args:
            x: ``[num_recv_tokens, hidden]`` bf16/fp16, rows aligned with the dispatch output (its
                ``num_worst_tokens`` rows for a padded dispatch; the padding rows are not read).
            handle: that dispatch's handle.
            topk_weights: optional ``[num_recv_tokens, K]`` float32, summed the same way (every rank
                passes them with the same ``K``, or none does).
            return_recv_hook: return after the send phase, with a hook that finishes the receive.
            previous_event, async_finish, allocate_on_comm_stream: as ``dispatch``'s.

        Returns:
            ``(combined_x [T, hidden], combined_topk_weights or None, event)``, plus ``hook`` when
            asked (the tensors are filled when it returns). Sums are float32 in rank order; a
            token's sum reads only its own copies (a NaN in one token stays in that token).

        Raises:
            ConfigError: bad shapes or dtypes, or another Buffer's handle (before any byte moves;
                with host copies its peers raise too, naming this rank), or, on every rank, peers that
                combine with another dispatch's handle, another x dtype, or other ``topk_weights``.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        self._check_open("combine")
        rows, weights = self._normal.combine_args(x, topk_weights, handle)
        if not self._on_comm(async_finish and not return_recv_hook):
            wait_for(previous_event, "combine")
            return self._normal.combine(rows, weights, handle, async_finish, return_recv_hook)
        with self._call(True) as call:  # Note [Communication stream] in ep.paths.comm_stream
            wait_for(previous_event, "combine")
            call.hold(rows, weights, handle.is_token_in_rank, handle.combine_rows)
            out = self._normal.combine(rows, weights, handle, async_finish, return_recv_hook)
            call.give(out[:2])
            return out

    def refuse_dispatch(self, reason: str, return_recv_hook: bool = False):
        """Take part in the next fresh dispatch round without tokens, then raise ``ConfigError(reason)``; every
        peer raises ``ep.RefusedRound``, a ``ConfigError`` naming this rank (Note [Refused dispatch]).
        ``return_recv_hook`` must be the peers'. Collective."""
        self._check_open("refuse_dispatch")
        self._normal.refuse_dispatch(reason, return_recv_hook)

    @property
    def last_phases(self) -> dict[str, float]:
        """The last normal-mode call's host phases, in seconds (for ``warmlink bench ep``)."""
        return self._normal.last_phases if self._normal is not None else {}

    @property
    def last_marks(self) -> dict[str, float]:
        """The last normal-mode call's host clock marks (``time.perf_counter``), for skew analysis."""
        return self._normal.last_marks if self._normal is not None else {}

    @property
    def _mover(self):
        """The data path's mover (ep.paths): ep.api.diagnostics times its copies alone."""
        return self._normal.mover

    # -- helpers ----------------------------------------------------------------------------------
    def _on_comm(self, async_finish: bool) -> bool:
        """Whether a call runs on the communication stream: with ``async_finish`` (and no hook) on CUDA
        (ep.paths.comm_stream, Note [Communication stream]). It then waits for the caller's stream too:
        ``recv_x`` is a view."""
        if not async_finish or self.device < 0:
            return False
        if self._res is None:
            raise ConfigError("ep.Buffer: the buffer is closed")
        return True

    def _call(self, async_finish: bool):
        """The context a call runs in: ``_on_comm``'s stream, else the caller's (``INLINE``). A call
        on the caller's stream after calls on the communication stream first waits for them: the
        low-latency kernels read and advance device words that a call still queued there has not
        advanced yet (a normal-mode call's mover orders itself: ``CudaMover.start_round``; Note
        [Communication stream])."""
        if self._on_comm(async_finish):
            return self._res.comm_stream().call(after_caller=True)
        if self._res is not None and self._res.comm is not None:
            self._res.comm.join_caller()
        return INLINE

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Give regions, mappings, streams and events back to the pool, once this rank's queued
        calls ended (within the Buffer's timeout: a peer that never sends costs that much).
        Idempotent. Peers may still be running a round with this rank: close after the last
        operation of the group (as with DeepEP's ``Buffer.destroy``)."""
        if getattr(self, "_closed", True) and getattr(self, "_res", None) is None:
            return
        self._closed = True
        normal, self._normal = getattr(self, "_normal", None), None
        if normal is not None:
            if self._res is not None and not normal.recv_failed:
                self._res.drain()  # the last calls end before anything they wait on is released
            normal.abandon()
        self._close_low_latency()
        owned, self._owned_store = getattr(self, "_owned_store", None), None
        res, self._res, self._link = self._res, None, None
        if res is not None:
            res.close(recv_failed=normal is not None and normal.recv_failed)
        if owned is not None:
            owned.close()

    def __repr__(self) -> str:
        return (f"ep.Buffer(rank={self.rank}/{self.num_ranks}, backend={getattr(self, 'backend', '?')!r}, "
                f"send={getattr(self, 'send', '?')!r}, device={getattr(self, 'device', '?')}, "
                f"nbytes={self.layout.nbytes}, closed={self._closed})")
