"""``Buffer``: MoE dispatch and combine over pre-registered regions, with optional receive hooks.

The API follows DeepEP's normal mode so that MoE code can switch with small changes::

    buf = Buffer(store, rank, num_ranks, max_tokens_per_rank=4096, hidden=7168, num_topk=8)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buf.get_dispatch_layout(topk_idx, 256)
    recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    y = experts(recv_x, recv_topk_idx, recv_topk_weights)
    combined_x, combined_weights, _ = buf.combine(y, handle, topk_weights=recv_topk_weights)

With ``return_recv_hook=True`` each call returns after its send phase (rows packed per
destination, the bytes handed to the copy engines, the round marked sent) with one more element,
``hook``; no kernel stays resident. ``hook()`` waits for arrival and finishes the receive.

# Note [Round protocol]
A dispatch (and likewise a combine) is one round ``n`` of a handshake in the host mailboxes:

1. before step 4, the host waits once for the caller's stream to reach the start of the round:
   for the counts of a fresh dispatch (one kernel plans the whole send, ep._kernels), for an event
   recorded at the start otherwise (a cached dispatch gathers and copies first). It proves that
   every earlier reader of this rank's receive areas, on that stream, has finished;
2. publish "ready for round n", with the config word and, for a fresh dispatch, the counts;
3. a fresh dispatch waits until every peer published the same (it needs their counts to know
   where its rows go, Note [Send order] in ep.layout); on CUDA without a hook, kernels trade the
   counts and store the rows instead, and the host meets the peers after (ep._kernels, Note [SM
   sends]). A cached dispatch and a combine do not wait: round n lands in the receive areas of
   parity n % 2, which no one still reads (ep._regions, Note [Two parities]);
4. every source issues its rows, marks them sent, and publishes "round n sent";
5. the receive phase (inline or in the hook) checks every peer's "ready" word for round n (the
   same config, the same dispatch's handle), waits for every source's "round n sent" and its
   copies, then returns views of the receive area.

Outputs of ``dispatch`` are views of this rank's receive area, valid until the next ``dispatch`` on
this buffer (as DeepEP's low-latency outputs are); copy them to keep them longer. Every wait has
the buffer's timeout; a dead peer raises ``PeerLostError``.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from warmlink import _env
from warmlink._backoff import wait_until
from warmlink._closing import Closing
from warmlink.ep import _mailbox as mb
from warmlink.ep._checks import X_DTYPES as _X_DTYPES
from warmlink.ep._checks import Checks
from warmlink.ep._call_config import combine_handle_round, describe_call, describe_combine, encode_call, encode_combine
from warmlink.ep._info import EVENT_PHASES, KIND, check_config
from warmlink.ep._kernels import FreshShape, Sources, call_words, plan
from warmlink.ep._launch import current_stream
from warmlink.ep._kernels import unpack as unpack_meta
from warmlink.ep._movers import CudaMover, HostMover, as_words
from warmlink.ep._reduce import PARTS, combine_sum, part_bounds, part_phase, part_sums
from warmlink.ep._regions import PARITIES, RegionLayout, area
from warmlink.ep.event import EventOverlap, wait_for
from warmlink.ep.handle import Handle, fill_plan, per_expert_list, plan_from_board
from warmlink.ep.layout import dispatch_layout
from warmlink.ep.low_latency import LowLatencyMethods
from warmlink.errors import ConfigError, MetadataError

__all__ = ["Buffer"]

log = logging.getLogger("warmlink.ep")
_SERIALS = itertools.count()  # one per Buffer: keys what a handle caches about a Buffer's mappings

@dataclass
class _Pending:
    """A send phase whose receive phase has not run yet."""

    phase: str
    round: int
    done: bool = False


def _device_of(device, backend) -> int:
    if device is not None:
        return device.index if isinstance(device, torch.device) else int(device)
    if backend == "shm" or not torch.cuda.is_available():
        return -1
    return torch.cuda.current_device()


class Buffer(LowLatencyMethods, Closing):
    """One rank's end of an ep group: regions, mailboxes and streams, set up once.

    Args:
        store: a ``warmlink.rendezvous.Store`` every rank of the group reaches (its prefix names
            the group; construction is collective: every rank builds its Buffer the same number
            of times).
        rank, num_ranks: this rank and the group size.
        max_tokens_per_rank: the largest batch any rank dispatches.
        hidden: channels per token (a multiple of 128).
        num_topk: experts per token (the most any call passes).
        device: CUDA device (default: the current one, or host memory when CUDA is absent or
            ``backend="shm"``).
        backend: ``"cuda_ipc"``, ``"shm"`` or None (``WARMLINK_BACKEND``, else by device).
        timeout_s: every wait's limit (default ``WARMLINK_TIMEOUT_S``).
        low_latency_mode, num_experts: also set up DeepEP's low-latency calls for ``num_experts``
            experts, ``max_tokens_per_rank`` tokens (ep.low_latency; shm backend so far).

    Raises:
        ConfigError: bad sizes, or a peer built with different sizes.
        MetadataError: a peer's rank info is malformed. TransferTimeout: a peer never came.

    Collective? Construction, ``dispatch`` and ``combine`` are. Warm path? Regions, mappings,
    streams and events come from the pool; a second Buffer in the same processes opens nothing.
    """

    def __init__(self, store, rank: int, num_ranks: int, *, max_tokens_per_rank: int, hidden: int,
                 num_topk: int = 8, device=None, backend: str | None = None, timeout_s: float | None = None,
                 low_latency_mode: bool = False, num_experts: int | None = None) -> None:
        from warmlink.transport import lease_link, resolve_backend

        self._closed = True
        self._link = None
        if not isinstance(num_ranks, int) or not 1 <= num_ranks <= 1024:
            raise ConfigError(f"ep.Buffer: num_ranks={num_ranks!r}; expected an int in [1, 1024]")
        if not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise ConfigError(f"ep.Buffer: rank={rank!r}; expected 0 <= rank < num_ranks={num_ranks}")
        self.layout = RegionLayout(num_ranks, max_tokens_per_rank, hidden, num_topk)
        self.rank, self.num_ranks = rank, num_ranks
        self.timeout_s = float(timeout_s) if timeout_s is not None else _env.default_timeout_s()
        self.device = _device_of(device, backend)
        self.backend = resolve_backend(backend, self.device)
        self._checks = Checks(self.layout, num_ranks, self.device)
        if (self.backend == "shm") != (self.device < 0):
            raise ConfigError(f"ep.Buffer: backend={self.backend!r} does not fit device={self.device}")
        self._leases: list = []
        self._recv_stream = None
        self._recv_failed = False
        self._done_events: list[int] = []  # what async_finish records: per (op, parity), then the layout's
        self._sm_sends = False  # set in _connect: CUDA, and WARMLINK_EP_SEND=sm
        self._graphs = False  # set in _connect: WARMLINK_EP_GRAPH (ep._kernels, Note [Fresh send graph])
        # the combine's parts (ep._reduce, Note [Pipelined combine]); every rank must use the same,
        # so it follows the group size, and only bench ep and the tests change it (on every rank at
        # once). Two ranks sum in one part: their copies are too short to hide the parts' host work
        self._combine_parts = PARTS if num_ranks > 2 else 1
        self._serial = next(_SERIALS)
        self._remotes: list = []
        self._event_tokens: list = []
        self._round = {"dispatch": 0, "combine": 0}
        self._pending: _Pending | None = None
        self._meta = None
        # fill values of the receive-side unpack, made once rather than per dispatch
        on = torch.device("cpu") if self.device < 0 else torch.device("cuda", self.device)
        self._no_expert = torch.tensor(-1, dtype=torch.int64, device=on)
        self._no_weight = torch.tensor(0.0, dtype=torch.float32, device=on)
        self.last_marks: dict[str, float] = {}
        self.last_phases: dict[str, float] = {}
        try:
            self._link_lease = lease_link(self.backend, self.device, self.timeout_s)
            self._link = self._link_lease.resource
            self._mail_lease = lease_link("shm", -1, self.timeout_s)
            self._region = self._link.allocate(self.layout.nbytes)
            self._clear_boards()
            self._mail_region = self._mail_lease.resource.allocate(mb.mailbox_nbytes(num_ranks))
            self.mailbox = mb.Mailbox(self._mail_region.tensor, rank, num_ranks)
            self._closed = False
            self._connect(store)
            self._open_low_latency(store, low_latency_mode, num_experts, num_topk)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_group(cls, group=None, *, max_tokens_per_rank: int, hidden: int, num_topk: int = 8, device=None,
                   backend: str | None = None, timeout_s: float | None = None, secret: str | None = None,
                   low_latency_mode: bool = False, num_experts: int | None = None) -> "Buffer":
        """A Buffer for the ranks of a ``torch.distributed`` group, as DeepEP's ``Buffer(group, ...)``.

        Rank 0 of the group starts a rendezvous store on this host's loopback (ep runs within one
        node) under ``secret`` (rank 0's argument, else ``WARMLINK_SECRET``, else a fresh one) and
        sends its port and that secret to the others with one ``broadcast`` of an int64 tensor
        (nothing pickled; the other ranks' ``secret`` is not used); the Buffer owns that store and
        closes it with itself. Collective over ``group``. The other arguments are the constructor's.
        """
        import torch.distributed as dist

        from warmlink.rendezvous import Store

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        limit = timeout_s if timeout_s is not None else _env.default_timeout_s()
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        store = (Store("127.0.0.1", 0, is_server=True, prefix="ep-group", timeout_s=limit, secret=secret)
                 if rank == 0 else None)
        # [port, secret's length, its UTF-8 bytes one per element, zeros]: one broadcast, any backend
        sent = [0] * (2 + _env.MAX_SECRET_BYTES)
        if store is not None:
            raw = store.secret.encode("utf-8")
            sent[: 2 + len(raw)] = [store.port, len(raw), *raw]
        meet = torch.tensor(sent, dtype=torch.int64, device=on)
        dist.broadcast(meet, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if store is None:
            port, nbytes, *raw = meet.tolist()
            store = Store.connect(f"127.0.0.1:{port}", prefix="ep-group", timeout_s=limit,
                                  secret=bytes(raw[:nbytes]).decode("utf-8"))
        try:
            buf = cls(store, rank, world, max_tokens_per_rank=max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                      device=device, backend=backend, timeout_s=timeout_s, low_latency_mode=low_latency_mode,
                      num_experts=num_experts)
        except BaseException:
            store.close()
            raise
        buf._owned_store = store
        return buf

    # -- setup ------------------------------------------------------------------------------------
    def _clear_boards(self) -> None:
        """Zero this rank's count boards before any peer can see its info. A region comes back from
        the pool with a closed Buffer's bytes, and rounds restart at 1: a board row whose round tag
        matched would let the exchange (ep._kernels, Note [SM sends]) take another lifecycle's
        counts instead of waiting for the peer's."""
        lay, region = self.layout, self._region.tensor
        for p in range(PARITIES):
            name = f"board.{p}"
            start = lay.offsets()[name]
            region[start:start + lay.area_rows(name) * lay.row_bytes(name)].zero_()
        if self.device >= 0:  # done on the device before the rank info is published
            torch.cuda.current_stream(self.device).synchronize()

    def _connect(self, store) -> None:
        from warmlink.rendezvous import schema
        from warmlink.transport.base import PeerRef, local_identity

        limit_s = self.timeout_s  # each store call's own limit: Note [Store deadlines] in rendezvous.store
        generation = store.next_generation(f"ep/{self.rank}", timeout_s=limit_s)
        self.mailbox.set_generation(generation)
        # Buffers are built collectively: the n-th build of every rank forms epoch n.
        epoch = (store.add("ep/joins", 1, checked=False, timeout_s=limit_s) - 1) // self.num_ranks + 1
        host, pid, start = local_identity()
        events = self._lease_events() if self.backend == "cuda_ipc" else {phase: [] for phase in EVENT_PHASES}
        info = {
            "schema_version": 1, "kind": KIND,
            "peer": {"schema_version": 1, "kind": "peer_info", "role": "ep", "rank": self.rank,
                     "world_size": self.num_ranks, "generation": generation, "host": host, "pid": pid,
                     "start_time": start, "device": self.device, "backend": self.backend},
            "config": self.layout.config(), "data": self._region.desc, "mailbox": self._mail_region.desc,
            "events": events,
        }
        store.set(f"ep/{epoch}/{self.rank}", schema.encode(info), timeout_s=limit_s)
        peers, regions = {}, {}
        recv_events = {f"{phase}.{p}": {} for phase in EVENT_PHASES for p in range(PARITIES)}
        for r in range(self.num_ranks):
            if r == self.rank:
                continue
            name = f"ep/{r}"
            theirs = schema.decode(store.get(f"ep/{epoch}/{r}", timeout_s=limit_s), KIND, name)
            check_config(self.layout.config(), theirs["config"], name)
            p = theirs["peer"]
            if p["rank"] != r:
                raise MetadataError(f"ep rank info from peer={name!r}: peer.rank={p['rank']}; expected {r}")
            ref = PeerRef(f"{store.prefix}:{name}", p["generation"], p["host"], p["pid"], p["start_time"])
            self._link.forget_peer(ref.key, keep_process=ref.process_id)  # a replaced process's mappings
            peers[r] = ref
            data = self._link.open(ref, theirs["data"])
            mail = self._mail_lease.resource.open(ref, theirs["mailbox"])
            self._remotes += [(self._link, data), (self._mail_lease.resource, mail)]
            if data.nbytes < self.layout.nbytes:
                raise MetadataError(f"ep rank info from peer={name!r}: data.nbytes={data.nbytes}; expected >= {self.layout.nbytes}")
            regions[r] = data
            self.mailbox.attach(r, mail.tensor, ref)
            for phase in EVENT_PHASES:
                for p, handle_hex in enumerate(theirs["events"][phase][self.rank::self.num_ranks]):
                    recv_events[f"{phase}.{p}"][r] = self._open_event(ref, handle_hex)
        self.peers = peers
        if self.backend == "cuda_ipc":
            from warmlink.pool.events import lease_event
            from warmlink.pool.streams import lease_stream

            # One stream runs the destinations' copies back to back in issue order, each at the
            # full rate of one copy engine; per-peer streams let them share the sender's egress.
            # On 4 x H200 one stream was faster in 4 of 5 paired bench runs (BENCHMARKS.md), so it
            # is the default; WARMLINK_EP_COPY_STREAMS=per-peer restores the other.
            own = self.num_ranks if _env.ep_copy_streams() == "per-peer" else 1
            leased = [lease_stream(self.device) for _ in range(own)]
            streams = [leased[d % own] for d in range(self.num_ranks)]
            local = [lease_event(self.device) for _ in range(CudaMover.LOCAL_EVENTS + 1)]  # + the combine's "reduced"
            done = [lease_event(self.device) for _ in range(2 * PARITIES + 1)]
            self._leases += leased + local + done
            self._done_events = [e.resource.handle for e in done]
            # not among self._leases: close() must not order the caller's stream after it (it may
            # wait on a dead peer; ep._movers, Note [Receive work on its own stream])
            self._recv_stream = lease_stream(self.device)
            self._reduced_event = local[-1].resource.handle
            self._sm_sends = _env.ep_send() == "sm"
            self._graphs = _env.ep_graph()
            self._mover = CudaMover(self.layout, self.rank, self.device, self._region.tensor,
                                    {r: reg.ptr for r, reg in regions.items()}, [s.resource for s in streams],
                                    self._recv_stream.resource, [e.resource.handle for e in local[:-1]],
                                    self._send_events, recv_events, peers)
        else:
            self._mover = HostMover(self.layout, self.rank, self._region.tensor, {r: reg.tensor for r, reg in regions.items()})

    def _lease_events(self) -> dict:
        from warmlink import _cuda
        from warmlink.pool.events import lease_event

        self._send_events = {}
        out = {}
        for phase in EVENT_PHASES:  # the rank info's events[phase][p * R + d] (ep._info)
            out[phase] = []
            for p in range(PARITIES):
                leases = [lease_event(self.device, interprocess=True) for _ in range(self.num_ranks)]
                self._leases += leases
                self._send_events[f"{phase}.{p}"] = [lease.resource.handle for lease in leases]
                out[phase] += [_cuda.ipc_get_event_handle(lease.resource.handle).hex() for lease in leases]
        return out

    def _open_event(self, ref, handle_hex: str) -> int:
        from warmlink import _cuda
        from warmlink.pool.peers import mapping_cache

        cache = mapping_cache("cuda_ipc_event", lambda key: _cuda.ipc_open_event_handle(bytes.fromhex(key[2]), key[3]),
                              _cuda.event_destroy)
        event, token = cache.acquire((ref.key, ref.process_id, handle_hex, self.device))
        self._event_tokens.append((cache, token))
        return event

    # -- layout -----------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's layout tuple: ``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)``
        (``event``: an ``ep.EventOverlap``, as ``dispatch`` returns).

        Entries outside ``[-1, num_experts)`` are routed nowhere here and refused by ``dispatch``.
        """
        self._checks.experts(num_experts)
        wait_for(previous_event, "get_dispatch_layout")
        lay = dispatch_layout(self._checks.topk(topk_idx, "topk_idx"), num_experts, self.num_ranks)
        return (lay.num_tokens_per_rank, None, lay.num_tokens_per_expert, lay.is_token_in_rank,
                self._overlap(2 * PARITIES, async_finish))

    # -- checks (host only, before any byte moves) -------------------------------------------------
    def _check_open(self, func: str) -> None:
        if self._closed:
            raise ConfigError(f"ep.Buffer.{func}: the buffer is closed")
        if self._pending is not None and not self._pending.done:
            raise ConfigError(f"ep.Buffer.{func}: the receive hook of {self._pending.phase} round "
                              f"{self._pending.round} was not called; call it before the next operation")

    # -- the round protocol -----------------------------------------------------------------------
    def _meet(self, field: int, round_: int) -> None:
        """Wait until every peer published ``field`` (``mb.DISPATCH`` or ``mb.COMBINE``, "ready")
        for ``round_``, then check it called with the same config (dispatch) or handle (combine)."""
        self.mailbox.wait(field, round_, self.timeout_s)
        if field == mb.DISPATCH:
            self._check_peer_configs(round_, self.mailbox.config(self.rank, round_))
            return
        mine = self.mailbox.combine_handle(self.rank, round_)  # a word: ep._call_config.encode_combine
        for r in range(self.num_ranks):  # rows are counted by the handle: all ranks must use the same dispatch's
            theirs = self.mailbox.combine_handle(r, round_)
            if combine_handle_round(theirs) != combine_handle_round(mine):
                raise ConfigError(f"ep.Buffer.combine: rank {r} combines with the handle of dispatch round "
                                  f"{combine_handle_round(theirs)}, this rank with round {combine_handle_round(mine)}; "
                                  "every rank must pass the handle of the same dispatch")
            if theirs != mine:
                raise ConfigError(f"ep.Buffer.combine: rank {r} combines with {describe_combine(theirs)}, this rank with "
                                  f"{describe_combine(mine)}; every rank must pass x of the same dtype, and topk_weights "
                                  "of the same width or none")

    def _order(self) -> list[int]:
        """Peers starting after this rank: ranks start on different peers."""
        return [(self.rank + i) % self.num_ranks for i in range(1, self.num_ranks)]

    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 num_experts: int | None = None, return_recv_hook: bool = False):
        """Send each token once to every rank holding one of its experts.

        Args:
            x: ``[T, hidden]`` bf16/fp16, or FP8 ``(float8_e4m3fn [T, hidden], float32 [T, hidden // 128])``,
                of the same dtype on every rank.
            handle: a previous dispatch's handle: re-send with the same routing, skipping the layout
                and the count exchange (``topk_*`` are then not sent).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``
                (computed here when omitted).
            topk_idx: ``[T, K]`` expert ids in ``[-1, num_experts)`` (-1 = masked).
            topk_weights: ``[T, K]`` float32 (every rank passes them, or none does).
            num_experts: needed only when ``num_tokens_per_expert`` is omitted.
            return_recv_hook: return after the send phase, with a hook that finishes the receive.
                Every rank must pass the same value to a fresh dispatch: without a hook the SMs send
                (Note [SM sends] in ep._kernels), with one the copy engines do.
            expert_alignment: round each count of ``num_recv_tokens_per_expert_list`` up to a
                multiple of this (an int >= 1), as DeepEP does for grouped GEMMs.
            num_worst_tokens: 0, or the rows of every output (at most ``num_ranks *
                max_tokens_per_rank``; every rank passes the same): rows past the received ones hold
                stale bytes, expert id -1 and weight 0, and ``num_recv_tokens_per_expert_list`` is
                empty (the handle keeps the counts). If any rank would receive more rows, every rank
                raises ``ConfigError`` and the round is spent. Unlike DeepEP's, the host still meets
                the peers, so the call is not graph-capturable. A cached dispatch pads as its handle's.
            previous_event: an ``EventOverlap`` or ``torch.cuda.Event`` the current stream waits for first.
            async_finish: also record an event after the call's work (``EventOverlap``); the caller's
                stream is ordered after the outputs either way.
            ``allocate_on_comm_stream`` and ``config`` are accepted for compatibility and unused.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``,
            plus ``hook`` when asked (the tensors are filled when it returns). ``recv_x`` rows are
            ordered by source rank, then source token, and are a view of the receive area valid until
            the next dispatch; ``recv_topk_idx`` holds local expert ids (-1 elsewhere). ``event`` is an
            ``ep.EventOverlap`` (in hook mode it marks the send phase).

        Raises:
            ConfigError: bad shapes, dtypes, sizes or expert ids (before any byte moves), or peers
                that called with another configuration.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        self._check_open("dispatch")
        self._checks.padding(expert_alignment, num_worst_tokens)
        wait_for(previous_event, "dispatch")
        t0 = time.perf_counter()
        tokens, scales = self._checks.x(x)
        num_tokens = tokens.shape[0]
        round_ = self._round["dispatch"] + 1
        phase = f"dispatch.{round_ % PARITIES}"
        parts = (area("recv_x", round_), area("recv_meta", round_))
        mover = self._mover
        cached = handle is not None
        if cached:
            if not isinstance(handle, Handle) or handle.num_tokens != num_tokens:
                raise ConfigError(f"ep.Buffer.dispatch: handle is for {getattr(handle, 'num_tokens', '?')} tokens; x has {num_tokens}")
            if num_worst_tokens not in (0, handle.num_worst_tokens):
                raise ConfigError(f"ep.Buffer.dispatch: num_worst_tokens={num_worst_tokens}; a cached dispatch pads its "
                                  f"outputs as the dispatch that made its handle did ({handle.num_worst_tokens})")
            config = encode_call(handle.num_experts, 0, tokens.dtype, True, num_worst_tokens=handle.num_worst_tokens)
            src = Sources(as_words(tokens), scales=scales)
            self.mailbox.publish_dispatch(round_, config)
            marks = {"start": t0, "counts": time.perf_counter()}
            # No wait for the peers (ep._regions, Note [Two parities]): the bytes move at once.
            sm = self._sm_sends and not return_recv_hook
            self._send_cached(handle, src, round_, phase, parts, sm)
            marks["staged"] = marks["ready"] = time.perf_counter()
        else:
            topk, weights, num_experts, per_rank, in_rank, per_expert = self._checks.routing(
                tokens, topk_idx, topk_weights, num_experts, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            sm = self._sm_sends and not return_recv_hook
            # the send path is part of the config: a rank that meets in the mailbox while another
            # trades counts on the device would read counts that were never published
            config = encode_call(num_experts, topk.shape[1], tokens.dtype, False, sm, num_worst_tokens, weights is not None)
            marks = {"start": t0, "checked": time.perf_counter()}
            src = Sources(as_words(tokens), topk, weights, scales)
            send = self._send_fresh_sm if sm else self._send_fresh_copy
            handle = send(src, in_rank, per_rank, per_expert, num_experts, config, round_, phase, parts, marks,
                          num_worst_tokens)
        mover.send_done()
        if cached:  # see Note [Round protocol], step 1 (a fresh dispatch waited for its counts)
            mover.wait_begun(self.timeout_s)
        self.mailbox.publish(mb.DISPATCH_SENT, round_)
        self._round["dispatch"] = round_
        marks["sent"] = time.perf_counter()
        staged = marks.get("staged", marks["counts"])  # a fresh dispatch stages nothing apart
        self.last_phases = {"layout": marks["counts"] - t0, "stage": staged - marks["counts"],
                            "handshake": marks["ready"] - staged, "send": marks["sent"] - marks["ready"]}
        # host clock marks (CLOCK_MONOTONIC, comparable across processes of one host) for skew analysis
        self.last_marks = marks
        recv_x, recv_idx, recv_w, unpack, unpacked = self._recv_outputs(handle, parts, tokens.dtype, scales is not None,
                                                              src.topk is not None, src.weights is not None)
        def receive() -> None:
            t3 = time.perf_counter()
            if cached:  # a fresh dispatch met the peers before sending
                self._meet(mb.DISPATCH, round_)
            self.mailbox.wait(mb.DISPATCH_SENT, round_, self.timeout_s)
            self._arrived(phase, unpack, unpacked)
            self.last_marks["received"] = time.perf_counter()
            self.last_phases["receive"] = self.last_marks["received"] - t3

        result = (recv_x, recv_idx, recv_w, per_expert_list(handle, expert_alignment), handle)
        return self._finish("dispatch", round_, receive, return_recv_hook, result, async_finish)

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
            previous_event, async_finish: as ``dispatch``'s.

        Returns:
            ``(combined_x [T, hidden], combined_topk_weights or None, event)``, plus ``hook`` when
            asked (the tensors are filled when it returns). Sums are float32 in rank order; a
            token's sum reads only its own copies (a NaN in one token stays in that token).

        Raises:
            ConfigError: bad shapes or dtypes (before any byte moves), or, on every rank, peers that
                combine with another dispatch's handle, another x dtype, or other ``topk_weights``.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        self._check_open("combine")
        if not isinstance(handle, Handle):
            raise ConfigError(f"ep.Buffer.combine: handle is a {type(handle).__name__}; expected the Handle from dispatch")
        wait_for(previous_event, "combine")
        t0 = time.perf_counter()
        padded = handle.num_worst_tokens or handle.num_recv_tokens  # the rows of that dispatch's outputs
        rows = self._checks.rows(x, "x", padded)
        if handle.num_worst_tokens:  # the padding rows are not combined
            rows = rows[:handle.num_recv_tokens]
        if rows.dtype not in _X_DTYPES or rows.shape[1] != self.layout.hidden:
            raise ConfigError(f"ep.Buffer.combine: x is {rows.dtype} with {rows.shape[1]} channels; expected one of "
                              f"{list(_X_DTYPES)} with hidden={self.layout.hidden}")
        weights = None
        if topk_weights is not None:
            weights = self._checks.rows(topk_weights, "topk_weights", padded)[:handle.num_recv_tokens].float()
            if weights.shape[1] > self.layout.num_topk:
                raise ConfigError(f"ep.Buffer.combine: topk_weights has {weights.shape[1]} columns; at most {self.layout.num_topk}")
        round_ = self._round["combine"] + 1
        phase = f"combine.{round_ % PARITIES}"
        comb_x, comb_w = area("comb_x", round_), area("comb_w", round_)
        if self._round["combine"]:  # the sum of the round before last read this parity: see Note [Two parities]
            self._wait_reduced()
        word = encode_combine(handle.round, rows.dtype, weights.shape[1] if weights is not None else 0)
        self.mailbox.publish_combine(round_, word)  # no wait for the peers: Note [Two parities]
        t1 = time.perf_counter()
        mover, parity, order = self._mover, round_ % PARITIES, self._order()
        # the rows each rank sends back, for the sum's parts (Note [Pipelined combine]); before begin
        counts = mover.combine_counts(handle.send_counts, parity, self.timeout_s)
        mover.begin()
        slot = self.rank * self.layout.max_tokens
        parts, words = self._combine_parts, as_words(rows)  # one view for every part's copy
        bounds = [part_bounds(handle.recv_counts[s], parts) for s in order]
        for k in range(parts):  # part-major: one copy stream serving every peer pipelines too
            copies = [(s, words[handle.recv_starts[s] + b[k]:handle.recv_starts[s] + b[k + 1]], comb_x, slot + b[k])
                      for s, b in zip(order, bounds)]
            if k == parts - 1 and weights is not None:
                copies += [(s, weights[handle.recv_starts[s]:handle.recv_starts[s] + b[-1]], comb_w, slot)
                           for s, b in zip(order, bounds)]
            mover.copy_all(copies)
            for s in order:
                mover.sent(s, part_phase(k, parity, parts))
        mover.sent(self.rank, phase)  # nothing to copy: this rank's own rows are summed where they lie
        mover.send_done()
        self.mailbox.publish(mb.COMBINE_SENT, round_)
        self._round["combine"] = round_
        self.last_phases = {"handshake": t1 - t0, "send": time.perf_counter() - t1}
        out = torch.empty(handle.num_tokens, self.layout.hidden, dtype=rows.dtype, device=rows.device)
        out_w = None if weights is None else torch.empty(handle.num_tokens, weights.shape[1], dtype=torch.float32,
                                                         device=rows.device)

        def receive() -> None:
            t2 = time.perf_counter()
            self._meet(mb.COMBINE, round_)
            self.mailbox.wait(mb.COMBINE_SENT, round_, self.timeout_s)
            # this rank's own copy of token t is row combine_rows[t, me] - me * max_tokens + recv_starts[me] of x
            shift = handle.recv_starts[self.rank] - self.rank * self.layout.max_tokens
            sums = part_sums(self._mover.own_view(comb_x, rows.dtype, self.layout.hidden), handle.combine_rows, out,
                             local=(rows, self.rank, shift), counts=counts, slot_rows=self.layout.max_tokens, parts=parts)

            queued = []

            def last() -> None:
                sums[-1]()
                if out_w is not None:  # the weights came with the last part
                    combine_sum(self._mover.own_view(comb_w, torch.float32, out_w.shape[1]),
                                handle.combine_rows, out_w, local=(weights, self.rank, shift))
                queued.append(time.perf_counter())

            # rows/weights stay referenced until this returns
            early = [(part_phase(k, parity, parts), sums[k]) for k in range(parts - 1)]
            self._arrived(phase, last, (out, out_w), early)
            self._mark_reduced()
            # "queued": from the receive's start until the last sum is queued (the rest waits for bytes)
            self.last_phases.update(receive=time.perf_counter() - t2, queued=queued[0] - t2)

        return self._finish("combine", round_, receive, return_recv_hook, (out, out_w), async_finish)

    # -- the dispatch's send paths (Note [SM sends], Note [Copy-engine sends]) ----------------------
    def _send_cached(self, handle: Handle, src: Sources, round_: int, phase: str, parts: tuple[str, str],
                     sm: bool) -> None:
        """A cached dispatch's send: every row goes where the handle says, with no wait for the peers."""
        mover = self._mover
        mover.begin(copies=False)  # the SMs push, or the copies wait for the gather, which follows the start
        if sm:  # one push kernel (Note [SM sends])
            key = (self._serial, round_ % PARITIES, src.x.shape[1])  # addresses of this Buffer's mappings
            bases = handle.sm_bases.get(key)
            if bases is None:
                bases = handle.sm_bases[key] = mover.sm_bases(handle.dst_rows, key[1], src.x.shape[1] * src.x.element_size())
            mover.send_sm_cached(handle.combine_rows, src, bases, key[1], phase, self.timeout_s, self._graphs)
            return
        # One gather for every destination, this rank's own rows included: a launch per peer cost a
        # slow rank's host up to 0.15 ms more before its last copy, and every peer waits for that copy.
        me = self.rank
        mover.gather_all(handle.combine_rows, src, parts, handle.dst_rows[me] - me * self.layout.max_tokens,
                         round_ % PARITIES, self.timeout_s, self._graphs)
        mover.flush_all(phase, src, parts, [(d, handle.dst_rows[d], handle.send_counts[d]) for d in (*self._order(), me)])

    def _send_fresh_sm(self, src: Sources, in_rank, per_rank, per_expert, num_experts: int, config: int, round_: int,
                       phase: str, parts: tuple[str, str], marks: dict, num_worst_tokens: int) -> Handle:
        """A fresh dispatch's send by the SMs: kernels plan, trade the counts and store the rows
        (Note [SM sends]); then the handle from the board. Adds its host marks to ``marks``."""
        mover, num_tokens = self._mover, src.x.shape[0]
        rows = torch.empty(num_tokens, self.num_ranks, dtype=torch.int64, device=src.x.device)  # the handle's
        in_rank, per_rank, per_expert = (t.contiguous() for t in (in_rank, per_rank, per_expert))
        shape = self._fresh_shape(num_experts, src, per_rank, per_expert)
        # before the launch: a first call compiles its kernels there (seconds), and a peer that
        # called the other kind must see this call's kind before its wait for it ends
        self.mailbox.publish_dispatch(round_, config)
        mover.send_sm(shape, call_words(in_rank, src.topk, per_rank, per_expert, rows, src, round_), round_, phase,
                      self.timeout_s, self._graphs)
        marks["planned"] = marks["launched"] = time.perf_counter()
        words, board = mover.wait_board(round_, self.timeout_s, lambda: self._check_peer_configs(
            round_, config, self.mailbox.published(mb.DISPATCH, round_)))
        try:
            handle = self._handle_from_words(words, num_experts, in_rank, rows, src, round_, marks, num_worst_tokens)[0]
            self._meet(mb.DISPATCH, round_)
            marks["met"] = time.perf_counter()
            plan_from_board(handle, board, round_, self.rank, self.layout.max_tokens)
        except ConfigError:  # every rank's board showed the same refusal: the round is spent everywhere
            self._round["dispatch"] = round_
            raise
        marks["ready"] = time.perf_counter()
        return handle

    def _send_fresh_copy(self, src: Sources, in_rank, per_rank, per_expert, num_experts: int, config: int, round_: int,
                         phase: str, parts: tuple[str, str], marks: dict, num_worst_tokens: int) -> Handle:
        """A fresh dispatch's send by the copy engines: the counts go to the host, the ranks meet in
        the mailboxes, then the copies (Note [Copy-engine sends]). Adds its host marks to ``marks``."""
        mover = self._mover
        rows, words = plan(in_rank, src.topk, per_rank, per_expert, self.layout.max_tokens)
        mover.start_to_host(words)
        marks["planned"] = time.perf_counter()
        # The peers' rows are gathered into staging while the counts travel to the host and the
        # ranks meet: that needs only this rank's own plan. See Note [Copy-engine sends].
        mover.begin()
        mover.gather(rows, src, range(self.num_ranks), self.rank)
        marks["launched"] = time.perf_counter()
        handle, send_counts, expert_counts = self._handle_from_words(mover.wait_host(self.timeout_s), num_experts,
                                                                     in_rank, rows, src, round_, marks, num_worst_tokens)
        self.mailbox.publish_dispatch(round_, config, send_counts, expert_counts)
        try:
            self._meet(mb.DISPATCH, round_)
            marks["met"] = time.perf_counter()
            self._complete_plan(handle, round_)
        except ConfigError:  # every rank read the same words and counts and refused: the round is spent everywhere
            self._round["dispatch"] = round_
            raise
        marks["ready"] = time.perf_counter()
        mover.flush_all(phase, src, parts, [(d, handle.dst_rows[d], handle.send_counts[d]) for d in self._order()])
        me = self.rank
        mover.place_local(handle.combine_rows, src, parts, handle.dst_rows[me] - me * self.layout.max_tokens)
        mover.flush(me, phase, src, 0, 0, parts)
        return handle

    def _handle_from_words(self, words: np.ndarray, num_experts: int, in_rank, rows, src: Sources, round_: int,
                           marks: dict, num_worst_tokens: int):
        """``(handle, send counts, per-expert counts)`` of a fresh dispatch from its plan's words,
        checked first (ep._checks: ``ConfigError`` before any byte moved)."""
        num_tokens = src.x.shape[0]
        send_counts, expert_counts = self._checks.counts(words, num_tokens, num_experts)
        handle = Handle(num_experts, num_tokens, in_rank, rows, send_counts.tolist(), num_topk=src.topk.shape[1],
                        round=round_, num_worst_tokens=num_worst_tokens)
        marks["counts"] = time.perf_counter()
        return handle, send_counts, expert_counts

    # -- helpers ----------------------------------------------------------------------------------
    def _recv_outputs(self, handle: Handle, parts: tuple[str, str], dtype, fp8: bool, with_topk: bool, with_weights: bool):
        """``(recv_x, recv_topk_idx, recv_topk_weights, unpack, writes)``: ``recv_x`` is a view of the
        receive area; ``unpack``, the receive-phase step, fills the other outputs (and FP8 scales),
        ``writes``, made now so that hook mode can return them before the bytes land (None when
        there is nothing to unpack). With ``num_worst_tokens`` the outputs have that many rows; the
        rows past the received ones get expert id -1 and weight 0 now, on the caller's stream (the
        receive work writes only the others)."""
        total, lay, view = handle.num_recv_tokens, self.layout, self._mover.own_view
        rows = handle.num_worst_tokens or total
        x = view(parts[0], torch.float8_e4m3fn if fp8 else dtype, lay.hidden)[:rows]
        meta = view(parts[1], torch.uint8, lay.meta_bytes)[:total]
        kt, dev = handle.num_topk, x.device
        idx = torch.empty(rows, kt, dtype=torch.int64, device=dev) if with_topk else None
        w = torch.empty(rows, kt, dtype=torch.float32, device=dev) if with_weights else None
        scales = torch.empty(rows, lay.hidden // 128, dtype=torch.float32, device=dev) if fp8 else None
        received = (idx, w, scales)
        if rows > total:  # padded: the receive work fills the first rows, the rest are filled now
            for t, fill in ((idx, -1), (w, 0)):
                if t is not None:
                    t[total:].fill_(fill)
            received = tuple(t[:total] if t is not None else None for t in received)
        epr = handle.num_experts // self.num_ranks

        def unpack() -> None:
            unpack_meta(meta, lay.num_topk, *received, self.rank * epr, epr)

        busy = total and (idx is not None or scales is not None)
        return ((x, scales) if fp8 else x), idx, w, (unpack if busy else None), (idx, w, scales)

    def _finish(self, phase: str, round_: int, receive, return_recv_hook: bool, result: tuple, async_finish: bool):
        """Run the receive phase now and return ``(*result, event)``, or return ``(*result, event,
        hook)`` whose hook runs it once (the event then marks the send phase, as DeepEP's does)."""
        slot = (phase == "combine") * PARITIES + round_ % PARITIES
        if not return_recv_hook:
            receive()
            return (*result, self._overlap(slot, async_finish))
        pending = self._pending = _Pending(phase, round_)

        def hook() -> None:
            if not pending.done:
                receive()
                pending.done = True

        return (*result, self._overlap(slot, async_finish), hook)

    def _overlap(self, slot: int, async_finish: bool) -> EventOverlap:
        """DeepEP's event: with ``async_finish`` on CUDA, pooled event ``slot`` recorded on the current stream now."""
        if self.device < 0 or not async_finish:
            return EventOverlap(None, self.device)
        from warmlink import _cuda

        event = self._done_events[slot]
        _cuda.event_record(event, current_stream(self.device))
        return EventOverlap(event, self.device)

    def _fresh_shape(self, num_experts: int, src: Sources, per_rank: torch.Tensor, per_expert: torch.Tensor) -> FreshShape:
        """What a fresh SM send's kernels are specialized for (its graphs' key, with the parity)."""
        lay = self.layout
        return FreshShape(self.num_ranks, num_experts, src.topk.shape[1], src.x.shape[1],
                          src.scales.shape[1] if src.scales is not None else 0, lay.max_tokens, lay.num_topk,
                          lay.meta_bytes, src.topk.dtype, per_rank.dtype, per_expert.dtype,
                          src.weights.dtype if src.weights is not None else None)

    def _check_peer_configs(self, round_: int, config: int, ranks=None) -> None:
        for r in (range(self.num_ranks) if ranks is None else ranks):
            theirs = self.mailbox.config(r, round_)
            if r != self.rank and theirs != config:
                raise ConfigError(f"ep.Buffer.dispatch: rank {r} dispatches with {describe_call(theirs)}, this rank with "
                                  f"{describe_call(config)}; every rank must pass the same kind of call (a fresh "
                                  "dispatch with a hook sends through the copy engines, one without through the SMs)")

    def _complete_plan(self, handle: Handle, round_: int) -> None:
        """Fill in what needs every rank's counts of ``round_``: rows in each destination, rows from each source."""
        num_ranks, me, cap = self.num_ranks, self.rank, self.layout.max_tokens
        epr = handle.num_experts // num_ranks
        mine = slice(me * epr, (me + 1) * epr)  # only this rank's experts are read
        matrix, per_expert = [], np.zeros(epr, dtype=np.int64)
        for s in range(num_ranks):  # plain lists: R is small, and this sits before the first copy
            per_rank, experts = self.mailbox.counts(s, round_, mine)
            row = handle.send_counts if s == me else per_rank.tolist()
            if min(row) < 0 or max(row) > cap:
                raise MetadataError(f"ep: rank {s} published counts {row}; expected each in [0, {cap}]")
            matrix.append(row)
            per_expert += experts
        fill_plan(handle, matrix, per_expert.tolist(), self.rank)

    def _arrived(self, phase: str, then, writes, early=()) -> None:
        """The mover's ``arrived`` for every source; after a failure the receive stream may wait on a
        dead peer for good, so ``close`` stops ordering the caller's stream after it."""
        try:
            self._mover.arrived(range(self.num_ranks), phase, self.timeout_s, then=then, writes=writes, early=early)
        except BaseException:
            self._recv_failed = True
            raise

    def _mark_reduced(self) -> None:
        if self.device >= 0:
            from warmlink import _cuda

            _cuda.event_record(self._reduced_event, current_stream(self.device))

    def _wait_reduced(self) -> None:
        """Block (bounded) until this rank's last combine sum finished reading its combine area."""
        if self.device < 0:
            return
        from warmlink import _cuda

        wait_until(lambda: _cuda.event_query(self._reduced_event), timeout_s=self.timeout_s, first_s=20e-6, cap_s=20e-6,
                   what=f"ep: the previous combine's sum did not finish within {self.timeout_s:.3g} s on cuda:{self.device}")

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Give regions, mappings, streams and events back to the pool. Idempotent.

        Peers may still be running a round with this rank: close after the last operation of the
        group (as with DeepEP's ``Buffer.destroy``)."""
        if getattr(self, "_closed", True) and getattr(self, "_link", None) is None:
            return
        self._closed = True
        self._close_low_latency()
        owned, self._owned_store = getattr(self, "_owned_store", None), None
        mover = getattr(self, "_mover", None)
        if mover is not None:
            if self.device >= 0:
                for lease in self._leases:
                    if hasattr(lease.resource, "torch_stream"):
                        torch.cuda.current_stream(self.device).wait_stream(lease.resource.torch_stream())
            mover.close()
        for cache, token in self._event_tokens:
            cache.release(token)
        self._event_tokens = []
        for link, region in self._remotes:
            link.close_region(region)
        self._remotes = []
        for lease in reversed(self._leases):
            lease.release()
        self._leases = []
        if self._recv_stream is not None:  # drained by the pool, or destroyed if it cannot drain
            if not self._recv_failed:  # its last reads of the region come before the region's reuse
                torch.cuda.current_stream(self.device).wait_stream(self._recv_stream.resource.torch_stream())
            self._recv_stream.release()
            self._recv_stream = None
        self._recv_failed = False
        self._sm_sends = self._graphs = False  # set in _connect
        self._serial = next(_SERIALS)
        for name in ("_region", "_mail_region"):
            region = getattr(self, name, None)
            if region is not None:
                (self._link if name == "_region" else self._mail_lease.resource).release(region)
                setattr(self, name, None)
        for name in ("_mail_lease", "_link_lease"):
            lease = getattr(self, name, None)
            if lease is not None:
                lease.release()
                setattr(self, name, None)
        self._link = None
        if owned is not None:
            owned.close()

    def __repr__(self) -> str:
        return (f"ep.Buffer(rank={self.rank}/{self.num_ranks}, backend={getattr(self, 'backend', '?')!r}, "
                f"device={getattr(self, 'device', '?')}, nbytes={self.layout.nbytes}, closed={self._closed})")
