"""DeepEP's low-latency calls on ``deep_ep.Buffer`` (mixed into it), on ``ep.Buffer``'s low-latency mode.

# Note [Low-latency built on first call]
DeepEP's constructor takes ``num_rdma_bytes``, not shapes; warmlink's low-latency mode is built
for fixed shapes. So ``deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True)`` builds
its low-latency warmlink Buffer on the first ``low_latency_dispatch``, which is collective as
DeepEP's constructor is, for that call's ``num_max_dispatch_tokens_per_rank``, hidden size, top-k
width and ``num_experts``, on the device of ``x``. The ranks meet for it over a rendezvous store
that the constructor made (one collective of the group there, where DeepEP's constructor has
its own): the build waits for its peers with the Buffer's timeout, so a rank gone before its
first call costs the others a ``TransferTimeout`` naming it, not a wait in a group collective it
never joins. Such a rank is not masked, even with ``enable_shrink``: its memory was never
mapped. Before building, the bytes those shapes need
(``deep_ep.sizing.low_latency_bytes``, what ``get_low_latency_rdma_size_hint`` returns) are
checked against ``num_rdma_bytes``: a call that needs more raises ``ConfigError`` naming both,
before any byte moves. Every later call must have the same ``num_max_dispatch_tokens_per_rank``,
hidden size and ``num_experts`` and at most that top-k width, else ``ConfigError`` naming the call's
and the built ones (DeepEP's buffer layout depends on them too; it asks for a clean, warmlink for
one Buffer per shape). This warmlink Buffer is apart from the one normal-mode ``dispatch`` builds
within ``num_nvl_bytes`` (deep_ep.inner, Note [Built on first dispatch]), so one
``deep_ep.Buffer`` does both modes, as DeepEP's does.
"""

from __future__ import annotations

from typing import Callable

import torch

from warmlink.ep import Buffer as _EPBuffer
from warmlink.ep.deep_ep import sizing
from warmlink.ep.deep_ep.sizing import LL_MAX_TOPK
from warmlink.ep.deep_ep.events import EventOverlap, returned_event
from warmlink.errors import ConfigError

__all__ = ["LowLatencyCalls"]


def _check_async(func: str, async_finish) -> None:
    """The inner Buffer is called with ``async_finish=False`` (this Buffer's stream runs the call): check it here."""
    if not isinstance(async_finish, bool):
        raise ConfigError(f"deep_ep.Buffer.{func}: async_finish={async_finish!r}; expected a bool")


class LowLatencyCalls:
    """``deep_ep.Buffer``'s low-latency calls; each checks the shapes against the built warmlink
    Buffer (or builds it) and calls that Buffer's method of the same name once."""

    _ll: _EPBuffer | None = None
    # num_max_dispatch_tokens_per_rank, hidden, num_experts and num_topk it was built for (every call reads them)
    _ll_tokens = _ll_hidden = _ll_experts = _ll_topk = None
    _call: Callable  # deep_ep.Buffer's: where a call runs (ep.paths.comm_stream, Note [Communication stream])
    _rendezvous: Callable  # deep_ep.Buffer's: the store its warmlink Buffers meet over

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, num_topk: int = LL_MAX_TOPK) -> int:
        """Bytes ``num_rdma_bytes`` must hold for low-latency calls of these sizes (DeepEP's hint).

        Args:
            num_max_dispatch_tokens_per_rank: T, as the calls pass it. hidden: H, a multiple of 128.
            num_ranks: R. num_experts: E, a multiple of R.
            num_topk: K, the top-k width of the calls (not DeepEP's: its hint reserves a combine
                row per expert and token; warmlink's reserves one per token and top-k column). By
                default the widest DeepEP's low-latency kernels take, 9, so that DeepEP's call, which
                names none, sizes a budget for any top-k it could pass.

        Returns:
            Bytes: warmlink's low-latency region and outputs plus the normal-mode slots of the same
            Buffer (``deep_ep.sizing.low_latency_bytes``); no send buffer.

        Raises:
            ConfigError: sizes the low-latency mode refuses.
        """
        return sizing.low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:
        """DeepEP's ``low_latency_dispatch``: ``ep.Buffer.low_latency_dispatch`` (its docstring has
        the shapes), on the warmlink Buffer built by the first call (Note [Low-latency built on first call]).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)`` as DeepEP's: ``handle`` unpacks to DeepEP's
            5-tuple; ``event`` a ``deep_ep.EventOverlap`` (recorded with ``async_finish``);
            ``hook`` None without ``return_recv_hook``.

        Raises:
            ConfigError: no ``low_latency_mode``, a shape the budget cannot hold or other than the
                built one, or what ``ep.Buffer`` refuses, before any byte moves.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        inner = self._ll
        if (inner is not None and async_finish is False and (self._comm is None or self._comm.joined)
                and not self._destroyed
                and num_max_dispatch_tokens_per_rank == self._ll_tokens and num_experts == self._ll_experts
                and type(x) is torch.Tensor and type(topk_idx) is torch.Tensor and x.dim() == 2 and topk_idx.dim() == 2
                and x.shape[1] == self._ll_hidden and topk_idx.shape[1] <= self._ll_topk):
            # the common call, which the steps below would pass straight through: a decode step's host time
            recv_x, count, handle, _, hook = inner.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, False, return_recv_hook)
            return recv_x, count, handle, EventOverlap(), hook
        func = "low_latency_dispatch"
        self._check_low_latency(func)
        _check_async(func, async_finish)
        hidden = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        num_topk = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else None
        if hidden is None or num_topk is None:
            raise ConfigError(f"deep_ep.Buffer.{func}: x and topk_idx must be 2-D tensors ([num_tokens, hidden], "
                              f"[num_tokens, num_topk]); got shapes {tuple(getattr(x, 'shape', ()))} and "
                              f"{tuple(getattr(topk_idx, 'shape', ()))}")
        inner = self._low_latency(func, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk, x.device)
        # as DeepEP's: on the communication stream with async_finish and no hook (ep.paths.comm_stream)
        with self._call(async_finish is True and not return_recv_hook, None, x) as call:
            call.hold(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
            recv_x, count, handle, _, hook = inner.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, False, return_recv_hook)
            return recv_x, count, handle, returned_event(async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """DeepEP's call: the BF16 ``[L, R*T, H]`` buffer the next ``low_latency_combine`` reads with
        ``zero_copy=True`` (``ep.Buffer.get_next_low_latency_combine_buffer``)."""
        func = "get_next_low_latency_combine_buffer"
        self._check_low_latency(func)
        if self._ll is None:
            raise ConfigError(f"deep_ep.Buffer.{func}: no low_latency_dispatch on this Buffer yet; pass the handle "
                              "its low_latency_dispatch returned")
        return self._ll.get_next_low_latency_combine_buffer(handle)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None) -> tuple:
        """DeepEP's ``low_latency_combine``: ``ep.Buffer.low_latency_combine`` (its docstring has the
        shapes). With ``zero_copy`` the rows are read from ``get_next_low_latency_combine_buffer``'s
        buffer, not from ``x``; ``use_logfmt`` must be False.

        Returns:
            ``(combined_x, event, hook)`` as DeepEP's.

        Raises:
            ConfigError: no low-latency dispatch on this Buffer yet, or what ``ep.Buffer`` refuses
                (a handle of another Buffer, bad shapes), before any byte moves.
            TransferTimeout / PeerLostError: a peer stalled or died.
        """
        inner = self._ll
        if (inner is not None and async_finish is False and (self._comm is None or self._comm.joined)
                and not self._destroyed):
            # the common call, as the dispatch's
            combined, _, hook = inner.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                                          False, return_recv_hook, out, combine_wait_recv_cost_stats)
            return combined, EventOverlap(), hook
        func = "low_latency_combine"
        self._check_low_latency(func)
        _check_async(func, async_finish)
        if self._ll is None:
            raise ConfigError(f"deep_ep.Buffer.{func}: no low_latency_dispatch on this Buffer yet; pass the handle "
                              "its low_latency_dispatch returned")
        with self._call(async_finish is True and not return_recv_hook, None, x) as call:  # as the dispatch's
            call.hold(x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats)
            combined, _, hook = self._ll.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                                             False, return_recv_hook, out, combine_wait_recv_cost_stats)
            if out is None:
                call.give(combined)
            return combined, returned_event(async_finish), hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's ``clean_low_latency_buffer``: zero the low-latency region and outputs and meet
        every peer (collective). Before the first ``low_latency_dispatch`` nothing is built, so
        there is nothing to clean: a no-op on every rank (the first dispatch builds a zeroed one).

        Raises:
            ConfigError: no ``low_latency_mode``, sizes other than the built ones, or rounds awaiting
                their hooks.
        """
        func = "clean_low_latency_buffer"
        self._check_low_latency(func)
        if self._ll is None:
            return
        self._check_shape(func, num_max_dispatch_tokens_per_rank, hidden, num_experts, None)
        self._ll.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    # -- the mask buffer (enable_shrink: ep.low_latency._mask) -------------------------------------
    _mask_before_build: dict = {}

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """DeepEP's call: 1 in int32 ``mask_status`` ``[num_ranks]`` where a rank is masked
        (``ep.Buffer.low_latency_query_mask_buffer``); before the first ``low_latency_dispatch``,
        the updates made so far."""
        func = "low_latency_query_mask_buffer"
        self._check_mask(func)
        if self._ll is not None:
            self._ll.low_latency_query_mask_buffer(mask_status)
            return
        if not isinstance(mask_status, torch.Tensor) or mask_status.shape != (self.group_size,):
            raise ConfigError(f"deep_ep.Buffer.{func}: mask_status must be an int32 tensor of shape [{self.group_size}]")
        mask_status.zero_()
        for rank, masked in self._mask_before_build.items():
            mask_status[rank] = int(masked)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's call: mask (or unmask) a rank (``ep.Buffer.low_latency_update_mask_buffer``)."""
        func = "low_latency_update_mask_buffer"
        self._check_mask(func)
        if self._ll is not None:
            self._ll.low_latency_update_mask_buffer(rank_to_mask, mask)
            return
        if type(rank_to_mask) is not int or not 0 <= rank_to_mask < self.group_size:
            raise ConfigError(f"deep_ep.Buffer.{func}: rank={rank_to_mask!r}; expected an int in [0, {self.group_size})")
        self._mask_before_build = {**self._mask_before_build, rank_to_mask: bool(mask)}

    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP's call: unmask every rank."""
        self._check_mask("low_latency_clean_mask_buffer")
        if self._ll is not None:
            self._ll.low_latency_clean_mask_buffer()
        self._mask_before_build = {}

    def _check_mask(self, func: str) -> None:
        self._check_low_latency(func)
        if not self.enable_shrink:
            raise ConfigError(f"deep_ep.Buffer.{func}: this Buffer was made with enable_shrink=False, so it has no mask "
                              "buffer; make it with enable_shrink=True, as for DeepEP")

    # -- helpers ---------------------------------------------------------------------------------
    def _check_low_latency(self, func: str) -> None:
        self._check_usable(func)
        if not self.low_latency_mode:
            raise ConfigError(f"deep_ep.Buffer.{func}: this Buffer was made with low_latency_mode=False; make it with "
                              "low_latency_mode=True and num_rdma_bytes from get_low_latency_rdma_size_hint, as for DeepEP")

    def _low_latency(self, func: str, tokens, hidden: int, num_experts, num_topk: int, device) -> _EPBuffer:
        """The low-latency warmlink Buffer for a call of these shapes: built on the first call within
        ``num_rdma_bytes``, else checked against the built one (Note [Low-latency built on first call])."""
        if self._ll is not None:
            self._check_shape(func, tokens, hidden, num_experts, num_topk)
            return self._ll
        need = sizing.low_latency_bytes(tokens, hidden, self.group_size, num_experts, num_topk)
        if need > self.num_rdma_bytes:
            raise ConfigError(
                f"deep_ep.Buffer.{func}: num_max_dispatch_tokens_per_rank={tokens}, hidden={hidden}, "
                f"num_experts={num_experts} and {num_topk} top-k columns on {self.group_size} ranks need {need} bytes "
                f"({need / 2**30:.3f} GiB); num_rdma_bytes={self.num_rdma_bytes} ({self.num_rdma_bytes / 2**30:.3f} GiB) "
                f"cannot hold them: pass num_rdma_bytes >= {need} (get_low_latency_rdma_size_hint(..., "
                f"num_topk={num_topk}))")
        dev, backend = (device.index, None) if device.type == "cuda" else (-1, "shm")
        self._ll = _EPBuffer(self._rendezvous(), self.rank, self.group_size, max_tokens_per_rank=tokens, hidden=hidden,
                             num_topk=num_topk, device=dev, backend=backend, timeout_s=self._timeout_s,
                             low_latency_mode=True, num_experts=num_experts, enable_shrink=self.enable_shrink)
        self._ll_tokens, self._ll_hidden, self._ll_experts, self._ll_topk = tokens, hidden, num_experts, num_topk
        for rank, masked in self._mask_before_build.items():  # updates made before there was a mask
            self._ll.low_latency_update_mask_buffer(rank, masked)
        self._mask_before_build = {}
        return self._ll

    def _check_shape(self, func: str, tokens, hidden, num_experts, num_topk: int | None) -> None:
        built = (self._ll_tokens, self._ll_hidden, self._ll_experts, self._ll_topk)
        if (tokens, hidden, num_experts) != built[:3] or (num_topk is not None and num_topk > built[3]):
            topk = "" if num_topk is None else f" and {num_topk} top-k columns"
            raise ConfigError(
                f"deep_ep.Buffer.{func}: num_max_dispatch_tokens_per_rank={tokens}, hidden={hidden}, "
                f"num_experts={num_experts}{topk}; this Buffer's low-latency mode was built by its first call for "
                f"num_max_dispatch_tokens_per_rank={built[0]}, hidden={built[1]}, num_experts={built[2]} and at most "
                f"{built[3]} top-k columns (see deep_ep.low_latency, Note [Low-latency built on first call]); "
                "use one Buffer per shape")
