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

1. layout counts come to the host (one synchronization of the caller's stream; it also proves
   that every earlier reader of this rank's receive area, on that stream, has finished);
2. publish counts and "ready for round n"; wait until every peer has done the same;
3. every source computes where its rows go in every destination (Note [Send order], ep.layout),
   issues them, marks them sent, and publishes "round n sent";
4. the receive phase (inline or in the hook) waits for every source's "round n sent" and its
   copies, then returns views of the receive area.

No rank writes into a peer's area before that peer published "ready for round n", so a slow
reader is never overwritten. Outputs of ``dispatch`` are views of this rank's receive area, valid
until the next ``dispatch`` on this buffer (as DeepEP's low-latency outputs are); copy them to
keep them longer. Every wait has the buffer's timeout; a dead peer raises ``PeerLostError``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from warmlink import _env
from warmlink._closing import Closing
from warmlink.ep import _mailbox as mb
from warmlink.ep._info import KIND, check_config
from warmlink.ep._movers import CudaMover, HostMover
from warmlink.ep._reduce import combine_sum
from warmlink.ep._regions import RegionLayout
from warmlink.ep.layout import dispatch_layout, local_topk, send_plan
from warmlink.errors import ConfigError, MetadataError

__all__ = ["Buffer", "Handle"]

log = logging.getLogger("warmlink.ep")

_X_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Handle:
    """What a dispatch leaves for its combine and for a cached re-dispatch (opaque to users).

    Counts are host ints (the round protocol brought them there); ``recv_starts[s]`` /
    ``recv_counts[s]`` locate source ``s``'s rows in this rank's output, ``dst_rows[d]`` where this
    rank's rows start in ``d``'s receive area.
    """

    num_experts: int
    num_tokens: int
    is_token_in_rank: torch.Tensor
    send_index: torch.Tensor
    combine_rows: torch.Tensor
    send_starts: list[int]
    send_counts: list[int]
    dst_rows: list[int]
    recv_starts: list[int]
    recv_counts: list[int]
    num_recv_tokens_per_expert_list: list[int]
    num_topk: int = 0

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)


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


class Buffer(Closing):
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

    Raises:
        ConfigError: bad sizes, or a peer built with different sizes.
        MetadataError: a peer's rank info is malformed. TransferTimeout: a peer never came.

    Collective? Construction, ``dispatch`` and ``combine`` are. Warm path? Regions, mappings,
    streams and events come from the pool; a second Buffer in the same processes opens nothing.
    """

    def __init__(self, store, rank: int, num_ranks: int, *, max_tokens_per_rank: int, hidden: int,
                 num_topk: int = 8, device=None, backend: str | None = None, timeout_s: float | None = None) -> None:
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
        if (self.backend == "shm") != (self.device < 0):
            raise ConfigError(f"ep.Buffer: backend={self.backend!r} does not fit device={self.device}")
        self._config = {"num_ranks": num_ranks, "max_tokens": max_tokens_per_rank, "hidden": hidden, "num_topk": num_topk}
        self._leases: list = []
        self._remotes: list = []
        self._event_tokens: list = []
        self._round = {"dispatch": 0, "combine": 0}
        self._pending: _Pending | None = None
        self._reduced = None
        self.last_phases: dict[str, float] = {}
        self._store = store
        try:
            self._link_lease = lease_link(self.backend, self.device, self.timeout_s)
            self._link = self._link_lease.resource
            self._mail_lease = lease_link("shm", -1, self.timeout_s)
            self._region = self._link.allocate(self.layout.nbytes)
            self._mail_region = self._mail_lease.resource.allocate(mb.mailbox_nbytes(num_ranks))
            self.mailbox = mb.Mailbox(self._mail_region.tensor, rank, num_ranks)
            self._closed = False
            self._connect(store)
        except BaseException:
            self.close()
            raise

    # -- setup ------------------------------------------------------------------------------------
    def _connect(self, store) -> None:
        from warmlink.rendezvous import schema
        from warmlink.transport.base import PeerRef, local_identity

        generation = store.next_generation(f"ep/{self.rank}")
        self.mailbox.set_generation(generation)
        # Buffers are built collectively: the n-th build of every rank forms epoch n.
        epoch = (store.add("ep/joins", 1, checked=False) - 1) // self.num_ranks + 1
        host, pid, start = local_identity()
        events = self._lease_events() if self.backend == "cuda_ipc" else {"dispatch": [], "combine": []}
        info = {
            "schema_version": 1, "kind": KIND,
            "peer": {"schema_version": 1, "kind": "peer_info", "role": "ep", "rank": self.rank,
                     "world_size": self.num_ranks, "generation": generation, "host": host, "pid": pid,
                     "start_time": start, "device": self.device, "backend": self.backend},
            "config": dict(self._config), "data": self._region.desc, "mailbox": self._mail_region.desc,
            "events": events,
        }
        store.set(f"ep/{epoch}/{self.rank}", schema.encode(info))
        peers, regions, recv_events = {}, {}, {"dispatch": {}, "combine": {}}
        for r in range(self.num_ranks):
            if r == self.rank:
                continue
            name = f"ep/{r}"
            theirs = schema.decode(store.get(f"ep/{epoch}/{r}", timeout_s=self.timeout_s), KIND, name)
            check_config(self._config, theirs["config"], name)
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
            for phase in ("dispatch", "combine"):
                if theirs["events"][phase]:
                    recv_events[phase][r] = self._open_event(ref, theirs["events"][phase][self.rank])
        self.peers = peers
        if self.backend == "cuda_ipc":
            from warmlink.pool.streams import lease_stream

            streams = [lease_stream(self.device) for _ in range(self.num_ranks)]
            self._leases += streams
            own = self._region.tensor
            self._mover = CudaMover(self.layout, self.rank, self.device, own, {r: reg.ptr for r, reg in regions.items()},
                                    [s.resource for s in streams], self._send_events, recv_events, peers)
        else:
            self._mover = HostMover(self.layout, self.rank, self._region.tensor, {r: reg.tensor for r, reg in regions.items()})

    def _lease_events(self) -> dict:
        from warmlink import _cuda
        from warmlink.pool.events import lease_event

        self._send_events = {}
        out = {}
        for phase in ("dispatch", "combine"):
            leases = [lease_event(self.device, interprocess=True) for _ in range(self.num_ranks)]
            self._leases += leases
            self._send_events[phase] = [lease.resource.handle for lease in leases]
            out[phase] = [_cuda.ipc_get_event_handle(h).hex() for h in self._send_events[phase]]
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
        """DeepEP's layout tuple: ``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, None)``.

        Entries outside ``[-1, num_experts)`` are routed nowhere here and refused by ``dispatch``.
        """
        self._check_experts(num_experts)
        lay = dispatch_layout(self._check_topk(topk_idx, "topk_idx"), num_experts, self.num_ranks)
        return lay.num_tokens_per_rank, None, lay.num_tokens_per_expert, lay.is_token_in_rank, None

    # -- checks (host only, before any byte moves) -------------------------------------------------
    def _check_open(self, func: str) -> None:
        if self._closed:
            raise ConfigError(f"ep.Buffer.{func}: the buffer is closed")
        if self._pending is not None and not self._pending.done:
            raise ConfigError(f"ep.Buffer.{func}: the receive hook of {self._pending.phase} round "
                              f"{self._pending.round} was not called; call it before the next operation")

    def _check_experts(self, num_experts) -> None:
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % self.num_ranks:
            raise ConfigError(f"ep: num_experts={num_experts!r}; expected a positive multiple of num_ranks={self.num_ranks}")
        if num_experts > mb.MAX_EXPERTS:
            raise ConfigError(f"ep: num_experts={num_experts} exceeds {mb.MAX_EXPERTS}")

    def _check_rows(self, t: torch.Tensor, what: str, rows: int | None = None) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ConfigError(f"ep: {what} must be a 2-D tensor; got {type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
        expected = torch.device("cpu") if self.device < 0 else torch.device("cuda", self.device)
        if t.device != expected:
            raise ConfigError(f"ep: {what} is on {t.device}; expected {expected}")
        if rows is not None and t.shape[0] != rows:
            raise ConfigError(f"ep: {what} has {t.shape[0]} rows; expected {rows}")
        if t.shape[0] > self.layout.max_tokens and rows is None:
            raise ConfigError(f"ep: {what} has {t.shape[0]} tokens; the buffer holds at most "
                              f"max_tokens_per_rank={self.layout.max_tokens} (build it with a larger size_hint)")
        return t.contiguous()

    def _check_topk(self, topk_idx, what: str, rows: int | None = None) -> torch.Tensor:
        t = self._check_rows(topk_idx, what, rows)
        if t.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"ep: {what}.dtype={t.dtype}; expected torch.int64 or torch.int32")
        if t.shape[1] > self.layout.num_topk:
            raise ConfigError(f"ep: {what} has {t.shape[1]} experts per token; the buffer holds num_topk={self.layout.num_topk}")
        return t

    def _check_layout(self, per_rank, in_rank, per_expert, num_tokens: int, num_experts: int) -> None:
        shapes = {"num_tokens_per_rank": (per_rank, (self.num_ranks,)), "is_token_in_rank": (in_rank, (num_tokens, self.num_ranks)),
                  "num_tokens_per_expert": (per_expert, (num_experts,))}
        for name, (t, shape) in shapes.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ConfigError(f"ep.Buffer.dispatch: {name} has shape {tuple(getattr(t, 'shape', ()))}; expected {shape} "
                                  "(pass get_dispatch_layout's outputs for this topk_idx)")
        if in_rank.dtype != torch.bool:
            raise ConfigError(f"ep.Buffer.dispatch: is_token_in_rank.dtype={in_rank.dtype}; expected torch.bool")

    def _check_x(self, x):
        """``(tokens, scales or None)``; FP8 comes as ``(float8_e4m3fn [T, H], float32 [T, H // 128])``."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ConfigError(f"ep: FP8 x must be a (tokens, scales) pair; got {len(x)} elements")
            q, s = self._check_rows(x[0], "x[0]"), self._check_rows(x[1], "x[1]", x[0].shape[0])
            if q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
                raise ConfigError(f"ep: FP8 x dtypes ({q.dtype}, {s.dtype}); expected (torch.float8_e4m3fn, torch.float32)")
            if q.shape[1] != self.layout.hidden or s.shape[1] != self.layout.hidden // 128:
                raise ConfigError(f"ep: FP8 x shapes {tuple(q.shape)}, {tuple(s.shape)}; expected [T, {self.layout.hidden}] "
                                  f"and [T, {self.layout.hidden // 128}]")
            return q, s
        t = self._check_rows(x, "x")
        if t.dtype not in _X_DTYPES:
            raise ConfigError(f"ep: x.dtype={t.dtype}; expected one of {list(_X_DTYPES)} or an FP8 (tokens, scales) pair")
        if t.shape[1] != self.layout.hidden:
            raise ConfigError(f"ep: x has {t.shape[1]} channels; the buffer was built for hidden={self.layout.hidden}")
        return t, None

    # -- the round protocol -----------------------------------------------------------------------
    def _sync_caller(self) -> None:
        if self.device >= 0:
            torch.cuda.current_stream(self.device).synchronize()

    def _handshake(self, phase: str, round_: int, counts=None, config: int = 0) -> None:
        """Publish "ready for ``round_``" (with the dispatch config word and counts), then wait for
        every peer's. See Note [Round protocol]."""
        if phase == "dispatch":
            self.mailbox.publish_dispatch(round_, config, *(counts or (None, None)))
            self.mailbox.wait(mb.DISPATCH, round_, self.timeout_s)
            self._check_peer_configs(round_, config)
        else:
            self.mailbox.publish(mb.COMBINE, round_)
            self.mailbox.wait(mb.COMBINE, round_, self.timeout_s)

    def _order(self) -> list[int]:
        """Destinations starting after this rank, self last: ranks start on different peers."""
        return [(self.rank + i) % self.num_ranks for i in range(1, self.num_ranks + 1)]

    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 num_experts: int | None = None, return_recv_hook: bool = False):
        """Send each token once to every rank holding one of its experts.

        Args:
            x: ``[T, hidden]`` bf16/fp16, or FP8 ``(float8_e4m3fn [T, hidden], float32 [T, hidden // 128])``.
            handle: a previous dispatch's handle: re-send with the same routing, skipping the layout
                and the count exchange (``topk_*`` are then not sent).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``
                (computed here when omitted).
            topk_idx: ``[T, K]`` expert ids in ``[-1, num_experts)`` (-1 = masked).
            topk_weights: ``[T, K]`` float32.
            num_experts: needed only when ``num_tokens_per_expert`` is omitted.
            return_recv_hook: return after the send phase, with a hook that finishes the receive.
            The remaining DeepEP arguments are accepted for compatibility; ``expert_alignment`` must
            be 1 and ``num_worst_tokens`` 0.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, None)``,
            plus ``hook`` when asked. ``recv_x`` rows are ordered by source rank, then source token;
            ``recv_topk_idx`` holds local expert ids (-1 elsewhere). Views valid until the next dispatch.

        Raises:
            ConfigError: bad shapes, dtypes, sizes or expert ids (before any byte moves).
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        self._check_open("dispatch")
        if expert_alignment != 1 or num_worst_tokens:
            raise ConfigError("ep.Buffer.dispatch: expert_alignment must be 1 and num_worst_tokens 0 (not supported)")
        phases = {}
        t0 = time.perf_counter()
        tokens, scales = self._check_x(x)
        num_tokens = tokens.shape[0]
        round_ = self._round["dispatch"] + 1
        if handle is not None:
            if not isinstance(handle, Handle) or handle.num_tokens != num_tokens:
                raise ConfigError(f"ep.Buffer.dispatch: handle is for {getattr(handle, 'num_tokens', '?')} tokens; x has {num_tokens}")
            num_experts = handle.num_experts
            self._sync_caller()
            phases["layout"] = time.perf_counter() - t0
            config = self._call_config(num_experts, 0, scales is not None, cached=True)
            self._handshake("dispatch", round_, config=config)
            idx_local = w_local = None
            num_topk, weights_sent = 0, False
        else:
            if topk_idx is None:
                raise ConfigError("ep.Buffer.dispatch: topk_idx is required without a handle")
            topk = self._check_topk(topk_idx, "topk_idx", num_tokens)
            weights = None
            if topk_weights is not None:
                weights = self._check_rows(topk_weights, "topk_weights", num_tokens)
                if weights.shape != topk.shape or not weights.is_floating_point():
                    raise ConfigError(f"ep: topk_weights {tuple(weights.shape)} {weights.dtype}; expected float of shape {tuple(topk.shape)}")
            if num_experts is None:
                if num_tokens_per_expert is None:
                    raise ConfigError("ep.Buffer.dispatch: pass num_tokens_per_expert (from get_dispatch_layout) or num_experts")
                num_experts = int(num_tokens_per_expert.numel())
            self._check_experts(num_experts)
            given = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            if any(t is None for t in given):
                lay = dispatch_layout(topk, num_experts, self.num_ranks)
                given = (lay.num_tokens_per_rank, lay.is_token_in_rank, lay.num_tokens_per_expert)
                bad = lay.num_bad_ids
            else:
                bad = ((topk < -1) | (topk >= num_experts)).sum(dtype=torch.int64).reshape(1)
            per_rank, in_rank, per_expert = given
            self._check_layout(per_rank, in_rank, per_expert, num_tokens, num_experts)
            host = torch.cat([per_rank.to(torch.int64).reshape(-1), per_expert.to(torch.int64).reshape(-1),
                              bad.to(torch.int64)]).cpu()  # the one synchronization
            phases["layout"] = time.perf_counter() - t0
            if int(host[-1]):
                raise ConfigError(f"ep.Buffer.dispatch: topk_idx has {int(host[-1])} entries outside [-1, {num_experts}); "
                                  "nothing was sent")
            send_counts = host[:self.num_ranks]
            if send_counts.numel() != self.num_ranks or bool((send_counts > num_tokens).any()):
                raise ConfigError(f"ep.Buffer.dispatch: num_tokens_per_rank={send_counts.tolist()} does not fit {num_tokens} tokens")
            config = self._call_config(num_experts, topk.shape[1], scales is not None, cached=False)
            t1 = time.perf_counter()
            self._handshake("dispatch", round_, (send_counts.numpy(), host[self.num_ranks:-1].numpy()), config)
            phases["handshake"] = time.perf_counter() - t1
            handle = self._build_handle(round_, num_experts, num_tokens, in_rank, send_counts.tolist())
            idx_local, w_local = local_topk(topk, weights, num_experts, self.num_ranks)
            num_topk = topk.shape[1]
            weights_sent = weights is not None
        if "handshake" not in phases:
            phases["handshake"] = time.perf_counter() - t0 - phases["layout"]
        t2 = time.perf_counter()
        mover = self._mover
        mover.begin()
        for d in self._order():
            index = handle.send_index[handle.send_starts[d]:handle.send_starts[d] + handle.send_counts[d]]
            row0 = handle.dst_rows[d]
            mover.scatter(d, tokens, index, "recv_x", row0)
            if scales is not None:
                mover.scatter(d, scales, index, "recv_scales", row0)
            if idx_local is not None:
                mover.scatter(d, idx_local[d], index, "recv_idx", row0)
                if weights_sent:
                    mover.scatter(d, w_local[d], index, "recv_w", row0)
            mover.sent(d, "dispatch")
        self.mailbox.publish(mb.DISPATCH_SENT, round_)
        self._round["dispatch"] = round_
        phases["send"] = time.perf_counter() - t2
        self.last_phases = phases
        if idx_local is not None:
            handle.num_topk = num_topk
        views = self._recv_views(handle, tokens.dtype, scales is not None, num_topk, idx_local is not None and weights_sent)
        result = (views[0], views[1], views[2], list(handle.num_recv_tokens_per_expert_list), handle, None)

        def receive() -> None:
            t3 = time.perf_counter()
            self.mailbox.wait(mb.DISPATCH_SENT, round_, self.timeout_s)
            mover.arrived(range(self.num_ranks), "dispatch", self.timeout_s)
            self.last_phases["receive"] = time.perf_counter() - t3

        return self._finish("dispatch", round_, receive, return_recv_hook, result)

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None, config=None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                return_recv_hook: bool = False):
        """Send each received row back to its source and sum, per token, the copies of its ranks.

        Args:
            x: ``[num_recv_tokens, hidden]`` bf16/fp16, rows aligned with the dispatch output.
            handle: that dispatch's handle.
            topk_weights: optional ``[num_recv_tokens, K]`` float32, summed the same way.
            return_recv_hook: return after the send phase, with a hook that finishes the receive.

        Returns:
            ``(combined_x [T, hidden], combined_topk_weights or None, None)``, plus ``hook`` when asked
            (the tensors are filled when it returns). Sums are float32 in rank order.
        """
        self._check_open("combine")
        if not isinstance(handle, Handle):
            raise ConfigError(f"ep.Buffer.combine: handle is a {type(handle).__name__}; expected the Handle from dispatch")
        t0 = time.perf_counter()
        rows = self._check_rows(x, "x", handle.num_recv_tokens)
        if rows.dtype not in _X_DTYPES or rows.shape[1] != self.layout.hidden:
            raise ConfigError(f"ep.Buffer.combine: x is {rows.dtype} with {rows.shape[1]} channels; expected one of "
                              f"{list(_X_DTYPES)} with hidden={self.layout.hidden}")
        weights = None
        if topk_weights is not None:
            weights = self._check_rows(topk_weights, "topk_weights", handle.num_recv_tokens).float()
            if weights.shape[1] > self.layout.num_topk:
                raise ConfigError(f"ep.Buffer.combine: topk_weights has {weights.shape[1]} columns; at most {self.layout.num_topk}")
        round_ = self._round["combine"] + 1
        if self._reduced is not None:  # this rank's combine area is free once its last sum ran
            self._wait_local(self._reduced, "the previous combine's sum")
        self._handshake("combine", round_)
        phases = {"handshake": time.perf_counter() - t0}
        t1 = time.perf_counter()
        mover = self._mover
        mover.begin()
        slot = self.rank * self.layout.max_tokens
        for s in self._order():
            start, count = handle.recv_starts[s], handle.recv_counts[s]
            mover.copy(s, rows[start:start + count], "comb_x", slot)
            if weights is not None:
                mover.copy(s, weights[start:start + count], "comb_w", slot)
            mover.sent(s, "combine")
        self.mailbox.publish(mb.COMBINE_SENT, round_)
        self._round["combine"] = round_
        phases["send"] = time.perf_counter() - t1
        self.last_phases = phases

        out = torch.empty(handle.num_tokens, self.layout.hidden, dtype=rows.dtype, device=rows.device)
        out_w = None if weights is None else torch.empty(handle.num_tokens, weights.shape[1], dtype=torch.float32,
                                                         device=rows.device)

        def receive() -> None:
            t2 = time.perf_counter()
            self.mailbox.wait(mb.COMBINE_SENT, round_, self.timeout_s)
            mover.arrived(range(self.num_ranks), "combine", self.timeout_s)
            area = self.layout.view(self._region.tensor, "comb_x", rows.dtype, self.layout.hidden)
            combine_sum(area, handle.combine_rows, out)
            if out_w is not None:
                warea = self.layout.view(self._region.tensor, "comb_w", torch.float32, out_w.shape[1])
                combine_sum(warea, handle.combine_rows, out_w, use_triton=False)
            self._reduced = self._mark_local()
            self.last_phases["receive"] = time.perf_counter() - t2

        return self._finish("combine", round_, receive, return_recv_hook, (out, out_w, None))

    # -- helpers ----------------------------------------------------------------------------------
    def _finish(self, phase: str, round_: int, receive, return_recv_hook: bool, result: tuple):
        """Run the receive phase now, or return ``(*result, hook)`` whose hook runs it once."""
        if not return_recv_hook:
            receive()
            return result
        pending = self._pending = _Pending(phase, round_)

        def hook() -> None:
            if not pending.done:
                receive()
                pending.done = True

        return (*result, hook)

    def _call_config(self, num_experts: int, num_topk: int, fp8: bool, cached: bool) -> int:
        return (num_experts << 20) | (num_topk << 4) | (int(fp8) << 1) | int(cached)

    def _check_peer_configs(self, round_: int, config: int) -> None:
        for r in range(self.num_ranks):
            theirs = self.mailbox.config(r, round_)
            if r != self.rank and theirs != config:
                raise ConfigError(
                    f"ep.Buffer.dispatch: rank {r} dispatches with (num_experts={theirs >> 20}, num_topk={(theirs >> 4) & 0xFFFF}, "
                    f"fp8={bool(theirs & 2)}, cached={bool(theirs & 1)}), this rank with (num_experts={config >> 20}, "
                    f"num_topk={(config >> 4) & 0xFFFF}, fp8={bool(config & 2)}, cached={bool(config & 1)})")

    def _build_handle(self, round_: int, num_experts: int, num_tokens: int, in_rank, send_counts: list[int]) -> Handle:
        num_ranks, me = self.num_ranks, self.rank
        matrix, per_expert = [], []
        for s in range(num_ranks):
            if s == me:
                row = send_counts
                experts = self.mailbox.counts(s, round_, num_experts)[1]
            else:
                r, experts = self.mailbox.counts(s, round_, num_experts)
                row = [int(v) for v in r]
                if any(not 0 <= v <= self.layout.max_tokens for v in row):
                    raise MetadataError(f"ep: rank {s} published counts {row}; expected each in [0, {self.layout.max_tokens}]")
            matrix.append(row)
            per_expert.append(experts)
        epr = num_experts // num_ranks
        recv_counts = [matrix[s][me] for s in range(num_ranks)]
        recv_starts = [sum(recv_counts[:s]) for s in range(num_ranks)]
        dst_rows = [sum(matrix[s][d] for s in range(me)) for d in range(num_ranks)]
        send_starts = [sum(send_counts[:d]) for d in range(num_ranks)]
        tokens_per_expert = [int(sum(int(per_expert[s][me * epr + j]) for s in range(num_ranks))) for j in range(epr)]
        dev = in_rank.device
        plan = send_plan(in_rank.to(torch.bool), torch.tensor(send_starts, dtype=torch.int64, device=dev),
                         sum(send_counts), self.layout.max_tokens)
        return Handle(num_experts, num_tokens, in_rank, plan.send_index, plan.combine_rows, send_starts, list(send_counts),
                      dst_rows, recv_starts, recv_counts, tokens_per_expert)

    def _recv_views(self, handle: Handle, dtype, fp8: bool, num_topk: int, with_weights: bool):
        total, region, lay = handle.num_recv_tokens, self._region.tensor, self.layout
        if fp8:
            x = (lay.view(region, "recv_x", torch.float8_e4m3fn, lay.hidden)[:total],
                 lay.view(region, "recv_scales", torch.float32, lay.hidden // 128)[:total])
        else:
            x = lay.view(region, "recv_x", dtype, lay.hidden)[:total]
        idx = lay.view(region, "recv_idx", torch.int64, num_topk)[:total] if num_topk else None
        w = lay.view(region, "recv_w", torch.float32, num_topk)[:total] if with_weights else None
        return x, idx, w

    def _mark_local(self):
        if self.device < 0:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait_local(self, event, what: str) -> None:
        from warmlink.errors import TransferTimeout

        deadline = time.perf_counter() + self.timeout_s
        while not event.query():
            if time.perf_counter() > deadline:
                raise TransferTimeout(f"ep: {what} did not finish within {self.timeout_s:.3g} s on cuda:{self.device}")
            time.sleep(20e-6)

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Give regions, mappings, streams and events back to the pool. Idempotent.

        Peers may still be running a round with this rank: close after the last operation of the
        group (as with DeepEP's ``Buffer.destroy``)."""
        if getattr(self, "_closed", True) and getattr(self, "_link", None) is None:
            return
        self._closed = True
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

    def __repr__(self) -> str:
        return (f"ep.Buffer(rank={self.rank}/{self.num_ranks}, backend={getattr(self, 'backend', '?')!r}, "
                f"device={getattr(self, 'device', '?')}, nbytes={self.layout.nbytes}, closed={self._closed})")
