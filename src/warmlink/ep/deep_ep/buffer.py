"""``deep_ep.Buffer``: DeepEP's legacy normal-mode ``Buffer``, as DeepEP code calls it, on warmlink's ``ep.Buffer``.

Each method checks DeepEP's arguments, calls the warmlink Buffer (once per round), and gives back DeepEP's
return tuple: fresh output tensors, DeepEP's handle (``deep_ep.handle``) and ``EventOverlap``.

The warmlink Buffer inside is built by the first dispatch and grown by a wider one (deep_ep.inner,
Note [Built on first dispatch]).
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

from warmlink.ep import Buffer as _EPBuffer
from warmlink.ep import dispatch_layout
from warmlink.ep.deep_ep import calls
from warmlink.ep.deep_ep.absent import INTERNODE, NO_RING, not_here
from warmlink.ep.deep_ep.comm import CommCalls
from warmlink.ep.deep_ep.config import NVL_PEERS, Config, combine_config, dispatch_config
from warmlink.ep.deep_ep.events import EventHandle, EventOverlap, returned_event, wait_previous
from warmlink.ep.deep_ep.handle import DispatchHandle, combine_biases
from warmlink.ep.deep_ep.inner import built
from warmlink.ep.deep_ep.low_latency import LowLatencyCalls
from warmlink.ep.deep_ep.scales import pack_scales
from warmlink.ep.paths.setup import group_store
from warmlink.errors import ConfigError

__all__ = ["Buffer"]


def _flag(func: str, name: str, value, refused: str | None = None) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{func}: {name}={value!r}; expected a bool")
    if value and refused:
        raise ConfigError(f"{func}: {name}=True {refused}")
    return value


def _check_config(func: str, config) -> None:
    if config is not None and not isinstance(config, Config):
        raise ConfigError(f"{func}: config is a {type(config).__name__}; expected a deep_ep.Config or None")


class Buffer(LowLatencyCalls, CommCalls):
    """DeepEP's ``Buffer`` for the ranks of one node: normal-mode dispatch and combine, and the
    low-latency calls with ``low_latency_mode=True`` (``deep_ep.low_latency``).

    Args:
        group: the ``torch.distributed`` group of the ep ranks (gloo or NCCL), all on one node.
        num_nvl_bytes: the byte budget of this rank's normal-mode buffer, typically the largest
            ``Config.get_nvl_buffer_size_hint`` of ``get_dispatch_config`` / ``get_combine_config``.
            The warmlink Buffer within it is built by the first dispatch and grown by a wider one
            (deep_ep.inner, Note [Built on first dispatch]).
            May be 0 with ``low_latency_mode`` (then normal-mode ``dispatch`` is refused).
        num_rdma_bytes: with ``low_latency_mode``, the byte budget of the low-latency calls, from
            ``get_low_latency_rdma_size_hint`` (Note [Low-latency built on first call]). Otherwise
            DeepEP's internode buffer: accepted and unused within one node; refused past ``NVL_PEERS`` ranks.
        low_latency_mode: also offer DeepEP's low-latency calls (on the host over shm, or on a GPU: ep.low_latency).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: RDMA,
            low-latency and multi-node NVLink settings; accepted and ignored (nothing here uses RDMA
            queue pairs, and within one node memory is shared through CUDA IPC handles, which the
            fabric API is needed for only across nodes). In DeepEP's positional order.
        explicitly_destroy: as DeepEP's: True means the caller calls ``destroy()``; otherwise the
            buffer is released when collected.
        enable_shrink: with ``low_latency_mode``, DeepEP's mask buffer: a rank that stalls or dies
            is masked and the low-latency calls go on without it (ep.low_latency._mask).
        comm: must be None (an mpi4py communicator is not supported; pass ``group``).
        timeout_s: warmlink's limit for every wait (default ``WARMLINK_TIMEOUT_S``); not DeepEP's.

    Raises:
        ConfigError: an argument asks for what this Buffer cannot do, naming it.

    Collective? Construction is not (it checks arguments only); the first ``dispatch`` and the
    first ``low_latency_dispatch`` are, as every call that moves tokens.
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 timeout_s: float | None = None) -> None:
        func = "deep_ep.Buffer"
        self._inner = None
        self._destroyed = False
        if comm is not None:
            raise ConfigError(f"{func}: comm={type(comm).__name__}; an mpi4py communicator is not supported (pass group, "
                              "a torch.distributed process group)")
        if group is None:
            raise ConfigError(f"{func}: group=None; expected the torch.distributed process group of the ep ranks")
        self.low_latency_mode = _flag(func, "low_latency_mode", low_latency_mode)
        for name, value in (("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                            ("allow_mnnvl", allow_mnnvl), ("use_fabric", use_fabric)):
            _flag(func, name, value)
        _flag(func, "enable_shrink", enable_shrink)
        self.explicitly_destroy = _flag(func, "explicitly_destroy", explicitly_destroy)
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{func}: {name}={value!r}; expected an int >= 0 (bytes)")
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        if num_nvl_bytes == 0 and not low_latency_mode:
            raise ConfigError(f"{func}: num_nvl_bytes=0; normal-mode dispatch needs a budget (size it with "
                              f"Config.get_nvl_buffer_size_hint, as for DeepEP)")
        if num_rdma_bytes == 0 and low_latency_mode:
            raise ConfigError(f"{func}: low_latency_mode=True with num_rdma_bytes=0; the low-latency calls need a budget "
                              "(size it with Buffer.get_low_latency_rdma_size_hint, as for DeepEP)")
        if num_rdma_bytes and self.group_size > NVL_PEERS and not low_latency_mode:
            raise ConfigError(f"{func}: num_rdma_bytes={num_rdma_bytes} with {self.group_size} ranks is DeepEP's internode "
                              f"mode; warmlink.ep runs the ranks of one node (at most {NVL_PEERS} in DeepEP's terms)")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.enable_shrink = enable_shrink
        self._timeout_s = timeout_s
        self._widest_topk = 0  # of get_dispatch_layout's calls so far: deep_ep.inner, Note [Built on first dispatch]
        # the rendezvous store of the warmlink Buffers the first calls build, made here, where every
        # rank is present (Note [Built on first dispatch], Note [Low-latency built on first call]):
        # a rank that then makes no call costs the others a timeout, not a wait in a collective of
        # the group. Without torch.distributed (a group that runs no collective) the first build makes it
        self._store = None
        self._exchanges = 0  # batch-size exchanges of normal-mode builds so far (deep_ep.inner): their keys
        if dist.is_available() and dist.is_initialized():
            self._store = group_store(group, timeout_s, None)[0]

    # -- DeepEP's static methods ---------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 dispatch needs no SM90 build here (DeepEP's tests ask before testing FP8)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count the recommended configs carry (even, as DeepEP requires). warmlink's
        kernels do not take an SM count: it changes the configs and their size hints only."""
        if not isinstance(new_num_sms, int) or isinstance(new_num_sms, bool) or new_num_sms <= 0 or new_num_sms % 2:
            raise ConfigError(f"deep_ep.Buffer.set_num_sms: new_num_sms={new_num_sms!r}; expected an even int > 0")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` at the current point of the current stream (for ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config for ``num_ranks`` ranks (for its size hint)."""
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config for ``num_ranks`` ranks (for its size hint)."""
        return combine_config(num_ranks, Buffer.num_sms)

    # -- layout ----------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank
        [T, R] bool, event)`` for ``topk_idx`` ``[T, K]`` (``topk_idx_t``; -1 = no expert).
        Local work, not collective; ``previous_event``, ``async_finish`` and ``allocate_on_comm_stream``
        as ``dispatch``'s."""
        func = "get_dispatch_layout"
        self._check_usable(func)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.is_floating_point():
            raise ConfigError(f"deep_ep.Buffer.{func}: topk_idx must be a [num_tokens, num_topk] integer tensor; got "
                              f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)} of shape "
                              f"{tuple(getattr(topk_idx, 'shape', ()))}")
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % self.group_size:
            raise ConfigError(f"deep_ep.Buffer.{func}: num_experts={num_experts!r}; expected a positive multiple of "
                              f"the group size {self.group_size}")
        self._widest_topk = max(self._widest_topk, topk_idx.shape[1])
        with self._call(async_finish, previous_event, topk_idx) as call:  # ep.paths.comm_stream, Note [Communication stream]
            wait_previous(previous_event, func)
            call.hold(topk_idx)
            lay = dispatch_layout(topk_idx, num_experts, self.group_size)
            call.give(lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank)
            return (lay.num_tokens_per_rank, None, lay.num_tokens_per_expert, lay.is_token_in_rank,
                    returned_event(async_finish))

    # -- dispatch and combine ----------------------------------------------------------------------
    def dispatch(self, x, handle: DispatchHandle | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token once to every rank holding one of its experts (DeepEP's intranode dispatch).

        Args:
            x: ``[T, hidden]`` bf16, or FP8 ``(float8_e4m3fn [T, hidden], scales [T, ceil(hidden / 128)]
                float32)``, or UE8M0 scales packed four to an int32 ``[T, ceil(ceil(hidden / 128) / 4)]``.
            handle: an earlier fresh dispatch's handle: a cached dispatch with its routing (then
                ``topk_idx`` and ``topk_weights`` must be None).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: ``get_dispatch_layout``'s
                outputs (required for a fresh dispatch). num_tokens_per_rdma_rank: must be None.
            topk_idx: ``[T, K]`` ``topk_idx_t``, -1 = no expert; None dispatches without top-k
                (rows go by ``is_token_in_rank``; the per-expert counts still come back).
            topk_weights: ``[T, K]`` float32, with ``topk_idx`` only.
            expert_alignment, num_worst_tokens: as DeepEP's (``num_worst_tokens``: every output
                padded to that many rows, expert id -1). A streamed Buffer within (deep_ep.inner:
                on GPUs) keeps its counts on the device: its padded fresh dispatch returns at
                launch, and with its cached dispatch and combine can be captured in a CUDA graph
                with ``get_dispatch_layout`` (after an eager call built it). A slot Buffer sends an
                unpadded batch in one round, or after a refused one in as many as the largest batch
                needs (deep_ep.rounds); a padded one in the rounds ``num_worst_tokens`` implies (the
                same on every rank, and at least ``num_ranks`` times the most tokens a rank sends),
                in one round returning at launch, the next call raising its refusal
                (ep.protocol.normal, Note [Padded dispatch returns at launch]).
            config: a ``Config`` or None; accepted and unused.
            previous_event: an ``EventOverlap`` (``capture()``, an earlier call's) the work waits for.
            async_finish: as DeepEP's: run on the communication stream (``get_comm_stream()``) after
                ``previous_event`` (or, without one, the current stream), leave the current stream
                unordered after the call, and return the event that marks its end. Without it the
                call runs on the current stream.
            allocate_on_comm_stream: accepted; with ``async_finish`` outputs are always allocated on
                the communication stream and marked used by the current one (ep.paths.comm_stream,
                Note [Communication stream], says why).

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``.
            ``recv_x`` (or its FP8 pair) is a fresh tensor that no later call writes; rows are
            ordered by source rank, then source token. A cached dispatch returns
            ``(recv_x, None, None, None, None, event)``, as DeepEP's.

        Raises:
            ConfigError: bad arguments, or a budget that holds not one token (naming the bytes one
                needs), before any byte moves; a fresh dispatch's peers too (Note [Refused dispatch]).
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        func = "dispatch"
        self._check_usable(func)
        _check_config(f"deep_ep.Buffer.{func}", config)
        if num_tokens_per_rdma_rank is not None:
            raise ConfigError("deep_ep.Buffer.dispatch: num_tokens_per_rdma_rank is set; it is DeepEP's internode "
                              "layout, and this Buffer runs within one node (expected None, as get_dispatch_layout returns)")
        rows = x[0] if isinstance(x, tuple) else x
        with self._call(async_finish, previous_event, rows) as call:  # ep.paths.comm_stream, Note [Communication stream]
            wait_previous(previous_event, func)
            call.hold(x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            tokens, packed = pack_scales(x, "deep_ep.Buffer.dispatch")
            if handle is not None:
                if isinstance(handle, DispatchHandle):
                    call.hold(handle)
                out = self._cached(tokens, packed, handle, topk_idx, topk_weights, expert_alignment, num_worst_tokens)
            else:
                out = self._fresh(tokens, packed, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                  topk_weights, expert_alignment, num_worst_tokens)
                call.give(out[4])
            call.give(out[:3])
            return (*out, returned_event(async_finish))

    def _fresh(self, tokens, packed, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
               topk_weights, expert_alignment, num_worst_tokens):
        """A fresh dispatch's five outputs (``dispatch``'s but the event)."""
        missing = [name for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                        ("num_tokens_per_expert", num_tokens_per_expert)) if t is None]
        if missing:
            raise ConfigError(f"deep_ep.Buffer.dispatch: {', '.join(missing)} missing; a dispatch without a handle takes "
                              "get_dispatch_layout's outputs")
        if topk_idx is None and topk_weights is not None:
            raise ConfigError("deep_ep.Buffer.dispatch: topk_weights without topk_idx; pass both or neither")
        rows = tokens[0] if isinstance(tokens, tuple) else tokens
        inner = self._built(rows, topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0)
        return calls.fresh(inner, self.group_size, tokens, packed, num_tokens_per_rank, is_token_in_rank,
                           num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens)

    def _cached(self, tokens, packed, handle, topk_idx, topk_weights, expert_alignment, num_worst_tokens):
        if topk_idx is not None or topk_weights is not None:
            raise ConfigError("deep_ep.Buffer.dispatch: a cached dispatch (handle=...) takes no topk_idx or topk_weights; "
                              "they travel with the dispatch that made the handle")
        inner = self._owner_of(handle, "dispatch")
        return calls.cached(inner, tokens, packed, handle, expert_alignment, num_worst_tokens)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sum each token's copies from the ranks it went to (DeepEP's intranode combine).

        Args:
            x: ``[num_recv_tokens, hidden]`` bf16, aligned with the dispatch's ``recv_x``.
            handle: that dispatch's handle.
            topk_weights: ``[num_recv_tokens, K]`` float32, summed the same way, or None.
            bias: None, a ``[T, hidden]`` tensor or a pair of them, added to the sums (in float32
                after the sum is rounded to x's dtype, then rounded again: within one unit in the last
                place of DeepEP's single rounding).
            config, previous_event, async_finish, allocate_on_comm_stream: as ``dispatch``'s.

        Returns:
            ``(combined_x [T, hidden], combined_topk_weights [T, K] or None, event)``, fresh tensors.

        Raises:
            ConfigError: bad arguments or a handle of another Buffer, before any byte moves.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        func = "combine"
        self._check_usable(func)
        _check_config(f"deep_ep.Buffer.{func}", config)
        inner = self._owner_of(handle, func)
        biases = combine_biases(bias, handle, x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1, x)
        with self._call(async_finish, previous_event, x) as call:  # ep.paths.comm_stream, Note [Communication stream]
            wait_previous(previous_event, func)
            call.hold(x, topk_weights, biases, handle)
            out, out_w = calls.combine(inner, x, handle, topk_weights, biases)
            call.give(out, out_w)
            return out, out_w, returned_event(async_finish)

    # -- lifecycle -------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffer (DeepEP's ``destroy``; ``explicitly_destroy=True`` asks for it).
        Collective: after every rank's last call. Later calls raise ``ConfigError``.

        Raises:
            ConfigError: the Buffer was made without ``explicitly_destroy=True``, as DeepEP refuses it.
        """
        if not self.explicitly_destroy:
            raise ConfigError("deep_ep.Buffer.destroy: explicitly_destroy=False; a Buffer made without "
                              "explicitly_destroy=True is released when collected")
        self.close()

    def _rendezvous(self):
        """The store the warmlink Buffers of this one meet over (the constructor's; made here,
        collectively, where it could not make it)."""
        if self._store is None:
            self._store = group_store(self.group, self._timeout_s, None)[0]
        return self._store

    def close(self) -> None:
        """Release the buffer whatever ``explicitly_destroy`` says (warmlink's verb; idempotent).
        Collective, as ``destroy``."""
        self._destroyed = True
        self._close_comm()
        for inner in (self._inner, self._ll):
            if inner is not None:
                inner.close()
        self._inner = self._ll = None
        store, self._store = getattr(self, "_store", None), None
        if store is not None:
            store.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound now: module globals are gone at exit
        """Release when collected, as DeepEP does without ``explicitly_destroy``; with it, warn first."""
        if (getattr(self, "_inner", None) is None and getattr(self, "_ll", None) is None) or _finalizing():
            return
        if self.explicitly_destroy:
            warnings.warn(f"{self!r} was not destroyed; call destroy() (explicitly_destroy=True)", ResourceWarning,
                          stacklevel=2)
        try:
            self.close()
        except Exception:  # best effort: a peer may be gone already
            pass

    @property
    def warmlink_buffer(self) -> _EPBuffer | None:
        """The normal-mode ``warmlink.ep.Buffer`` inside (None before the first dispatch): its ``layout``
        (sizes, ``nbytes``) and ``last_phases`` (timings). Not DeepEP's; owned by this Buffer."""
        return self._inner

    @property
    def warmlink_low_latency_buffer(self) -> _EPBuffer | None:
        """The low-latency ``warmlink.ep.Buffer`` inside (None before the first ``low_latency_dispatch``).
        Not DeepEP's; owned by this Buffer."""
        return self._ll

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else ("built" if self._inner is not None else "not built yet")
        low_latency = f", num_rdma_bytes={self.num_rdma_bytes}, low_latency={self._ll!r}" if self.low_latency_mode else ""
        return (f"deep_ep.Buffer(rank={self.rank}/{self.group_size}, num_nvl_bytes={self.num_nvl_bytes}, {state}, "
                f"inner={self._inner!r}{low_latency})")

    # -- DeepEP's methods that are not here -------------------------------------------------------
    internode_dispatch = not_here("internode_dispatch", INTERNODE)
    internode_combine = not_here("internode_combine", INTERNODE)
    get_local_buffer_tensor = not_here("get_local_buffer_tensor", NO_RING)

    # -- helpers ---------------------------------------------------------------------------------
    def _check_usable(self, func: str) -> None:
        if self._destroyed:
            raise ConfigError(f"deep_ep.Buffer.{func}: the buffer was destroyed")

    def _built(self, rows: torch.Tensor, num_topk: int) -> _EPBuffer:
        """The warmlink Buffer for a fresh dispatch of ``rows`` (deep_ep.inner, Note [Built on first dispatch])."""
        self._inner = built(self, rows, num_topk)
        return self._inner

    def _owner_of(self, handle, func: str) -> _EPBuffer:
        if not isinstance(handle, DispatchHandle):
            raise ConfigError(f"deep_ep.Buffer.{func}: handle is a {type(handle).__name__}; expected the handle a fresh "
                              "dispatch of this Buffer returned")
        if handle.owner is not self._inner:
            raise ConfigError(f"deep_ep.Buffer.{func}: the handle comes from another Buffer; pass a handle of this one")
        return self._inner

