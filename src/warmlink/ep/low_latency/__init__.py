"""DeepEP's low-latency mode on ``ep.Buffer``: ``low_latency_dispatch`` / ``low_latency_combine``
for decode, where a rank sends at most a few hundred tokens and shapes are fixed::

    buf = Buffer(store, rank, num_ranks, max_tokens_per_rank=128, hidden=7168, num_topk=8,
                 low_latency_mode=True, num_experts=256, backend="shm")
    recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
        x, topk_idx, 128, 256, return_recv_hook=True)
    ...                                     # other work while the rows travel
    hook()                                  # recv_x: (FP8 [L, R * 128, 7168], scales), recv_count [L]
    y = experts(recv_x, recv_count)         # BF16 [L, R * 128, 7168]
    combined_x, _, _ = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

The memory is set up once, when the Buffer is built (ep.low_latency._layout, Note [Low-latency layout]);
the rounds are ep.low_latency._runtime's Note [Low-latency rounds]. On the shm backend (and in CI) the
host moves the rows; on a GPU (cuda_ipc, with Triton) kernels do, and a call never waits on the host,
so a dispatch + hook + combine + hook can be captured in a CUDA graph and replayed
(ep.low_latency._device, Note [Low-latency device path]).
"""

from __future__ import annotations

from typing import Callable

import torch

from warmlink.ep.low_latency._handle import LowLatencyHandle
from warmlink.ep.low_latency._layout import size_hint
from warmlink.errors import ConfigError

__all__ = ["LowLatencyHandle", "LowLatencyMethods"]


class LowLatencyMethods:
    """The low-latency calls of ``ep.Buffer`` (mixed into it); each checks its inputs and calls the
    Buffer's low-latency runtime, built at construction with ``low_latency_mode=True``."""

    _low_latency = None
    _call: Callable  # ep.Buffer's: where a call runs (ep.paths.comm_stream, Note [Communication stream])

    def _check_low_latency(self, low_latency_mode: bool, num_experts: int | None, enable_shrink: bool = False) -> None:
        """Refuse low-latency arguments this Buffer cannot take, before ``__init__`` leases anything."""
        for name, value in (("low_latency_mode", low_latency_mode), ("enable_shrink", enable_shrink)):
            if not isinstance(value, bool):
                raise ConfigError(f"ep.Buffer: {name}={value!r}; expected a bool")
        if enable_shrink and not low_latency_mode:
            raise ConfigError("ep.Buffer: enable_shrink=True without low_latency_mode=True; the mask buffer is "
                              "low-latency mode's")
        if not low_latency_mode:
            if num_experts is not None:
                raise ConfigError(f"ep.Buffer: num_experts={num_experts!r} without low_latency_mode=True; "
                                  "num_experts sizes the low-latency region only")
            return
        if num_experts is None:
            raise ConfigError("ep.Buffer: low_latency_mode=True needs num_experts (it sizes the receive slots)")
        from warmlink.ep.low_latency._checks import refuse_backend

        refuse_backend(self.backend)

    def _open_low_latency(self, store, low_latency_mode: bool, num_experts: int | None, num_topk: int,
                          enable_shrink: bool = False) -> None:
        """Build the low-latency runtime (collective) when ``low_latency_mode``; called by ``__init__``
        after ``_check_low_latency``."""
        if not low_latency_mode:
            return
        from warmlink.ep.low_latency._runtime import LowLatencyRuntime

        self._low_latency = LowLatencyRuntime(
            store, self.rank, self.num_ranks, max_tokens=self.layout.max_tokens, hidden=self.layout.hidden,
            num_experts=num_experts, num_topk=num_topk, device=self.device, backend=self.backend,
            timeout_s=self.timeout_s, shrink=enable_shrink)

    def _close_low_latency(self) -> None:
        runtime, self._low_latency = self._low_latency, None
        if runtime is not None:
            runtime.close()

    def _runtime(self, func: str):
        if self._low_latency is None:
            raise ConfigError(f"ep.Buffer.{func}: this Buffer was built without low_latency_mode=True")
        return self._low_latency

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, num_topk: int = 8) -> int:
        """Bytes one rank's low-latency mode holds, without building a Buffer (DeepEP's name).

        Args:
            num_max_dispatch_tokens_per_rank: T, the most tokens a rank dispatches per call.
            hidden: H, channels per token (a multiple of 128).
            num_ranks: R. num_experts: E, a multiple of R.
            num_topk: K, the most experts per token (the Buffer's ``num_topk``; DeepEP's hint has
                no such argument because it reserves a combine row per expert and token).

        Returns:
            Bytes: the region peers write into, ``2 x (E*T*(2H + 8) + 8E + T*K*2H + 256*ceil(8(2R + E)/256))``
            (the last term: the device path's combine signal and ack words), plus the outputs
            this rank fills, ``2 x E*T*(2H + H/32 + 4*ceil(H/512) + 12)`` and a few counts, and the
            zero-copy combine buffers, ``2 x E*T*2H`` (both parities of each). Unlike DeepEP's, no
            send buffer otherwise: rows go straight from ``x`` to the peers.

        Raises:
            ConfigError: a size that is not a positive int, H not a multiple of 128, E not a
                multiple of R.
        """
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk)

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """BF16 ``[L, R*T, H]``: where the expert outputs of ``handle``'s rows may be written for the
        next ``low_latency_combine`` to read with ``zero_copy=True`` instead of its ``x`` (DeepEP's
        call: the expert GEMM writes straight into it). The two combine parities have a buffer
        each, made by the first call of each (``get_low_latency_rdma_size_hint`` counts them), so
        the combine after the next gets the other one.

        Raises:
            ConfigError: no ``low_latency_mode``, or a handle this Buffer would not combine.
        """
        return self._runtime("get_next_low_latency_combine_buffer").next_combine_buffer(handle)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into ``mask_status`` (int32 ``[R]`` on the Buffer's device): 1 where this
        rank masked a rank, 0 elsewhere (DeepEP's call; on a GPU a kernel on the current stream).

        Raises:
            ConfigError: no ``enable_shrink``, or another tensor.
        """
        self._runtime("low_latency_query_mask_buffer").mask_call("low_latency_query_mask_buffer", "query",
                                                                  out=mask_status)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask ``rank_to_mask`` (``mask=True``: nothing is sent to it or awaited from it again), or
        unmask it; an unmasked rank must have made the same low-latency calls meanwhile (DeepEP's call).

        Raises:
            ConfigError: no ``enable_shrink``, or a rank outside ``[0, R)``.
        """
        self._runtime("low_latency_update_mask_buffer").mask_call("low_latency_update_mask_buffer", "update",
                                                                   rank=rank_to_mask, masked=mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (DeepEP's call). Raises ``ConfigError`` without ``enable_shrink``."""
        self._runtime("low_latency_clean_mask_buffer").mask_call("low_latency_clean_mask_buffer", "clean")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero this rank's low-latency region and outputs, and meet every peer (DeepEP's call).

        warmlink's rounds never read a byte that the round did not write (Note [Low-latency
        rounds]), so normal-mode calls need no clean before a low-latency one, as DeepEP's do;
        this is for a caller that wants no earlier token left past ``recv_count``. Handles of
        earlier dispatches are refused afterwards.

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: as the Buffer's (checked).

        Raises:
            ConfigError: other sizes, a round awaiting its hook, or a peer that made another call.
            TransferTimeout / PeerLostError: a peer stalled or died (with ``enable_shrink``: it is
                masked instead).

        Collective? Yes, counted as a dispatch round. Blocking? Until every peer has cleaned.
        """
        self._runtime("clean_low_latency_buffer").clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:
        """Send each token to the rank of each of its experts; received rows grouped by local expert.

        Args:
            x: BF16 ``[N, H]``, ``N <= num_max_dispatch_tokens_per_rank``, ``H`` the Buffer's hidden.
            topk_idx: int64 (or int32) ``[N, K]``, ``K <=`` the Buffer's ``num_topk``: expert ids in
                ``[-1, num_experts)``, ``-1`` = no expert.
            num_max_dispatch_tokens_per_rank: T, the same on every rank, at most the Buffer's
                ``max_tokens_per_rank``; outputs have ``R * T`` rows per expert.
            num_experts: E, the Buffer's ``num_experts``.
            cumulative_local_expert_recv_stats: optional int32 ``[L]``; each expert's received rows
                are added to it (for load balance monitoring).
            dispatch_wait_recv_cost_stats: optional int64 ``[R]`` (per source rank, where DeepEP
                documents ``[R, R]`` and indexes ``[R]``): nanoseconds this rank waited for each
                source's rows are added to it (sources awaited in rank order: an upper bound).
            use_fp8: send FP8 e4m3 with one float32 scale per 128 channels (DeepEP's cast).
            round_scale: round scales up to powers of two (needs ``use_fp8``).
            use_ue8m0: return scales as packed UE8M0 exponents (needs ``round_scale``).
            async_finish: on a GPU and without ``return_recv_hook``, run on the Buffer's
                communication stream and return an event marking the call's end, which the caller
                waits for before reading the outputs (ep.paths.comm_stream, Note [Communication stream]);
                with a hook the call runs on the caller's stream (DeepEP refuses both at once).
                On the host the outputs are complete on return.
            return_recv_hook: return after the send phase; ``hook()`` waits for the rows and packs
                them (on a GPU: launches the kernel that does). Nothing runs between the two (no
                thread, no kernel). Two dispatches (and two
                combines) may await their hooks at once, as DeepEP's double buffer allows (send
                micro-batch A, send B, then A's hook); a third raises ``ConfigError``.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` BF16 ``[L, R*T, H]``, or with
            ``use_fp8`` ``(float8_e4m3fn [L, R*T, H], scales)``, scales float32 ``[L, R*T, H/128]``
            or with ``use_ue8m0`` int32 ``[L, R*T, ceil(H/512)]``, column-major in the last two
            dimensions as DeepEP's; expert ``e``'s valid rows are ``[0, recv_count[e])``, ordered by
            source rank then source token. ``recv_count`` int32 ``[L]``. ``handle`` a
            ``LowLatencyHandle`` (DeepEP's 5-tuple by index). ``event`` an ``EventOverlap``;
            ``hook`` None without ``return_recv_hook``. The tensors are the Buffer's, valid until
            the second dispatch after this one (DeepEP's double buffer); filled when the call, or
            its hook, returns (on a GPU: by the work it queued on the current stream, or with
            ``async_finish`` on the communication stream).

        Raises:
            ConfigError: bad arguments (before any byte moves), two dispatches awaiting their
                hooks, no low-latency mode, or ranks that called with different arguments (on
                every rank alike; that round is spent, the next may go on). On a GPU expert ids
                and the ranks' arguments are checked by the kernels: the call after the one at
                fault raises (the faulty round moved no rows, or its outputs are not valid).
            TransferTimeout / PeerLostError: a peer stalled or died (within the Buffer's timeout;
                on a GPU raised by the next call); every later call raises the same.

        Collective? Yes. Blocking? On the host: waits for the peers' rows (in the hook with
        ``return_recv_hook``), and before sending, for the peers to have received the round
        two before (almost always already true). On a GPU the kernels wait for the same,
        never the host: capturable in a CUDA graph. Warm path? Allocates nothing but small host
        index tensors (on a GPU: nothing).
        """
        runtime = self._low_latency
        if runtime is not None and async_finish is False and (self._res.comm is None or self._res.comm.joined):
            # on the caller's stream, ordered after the communication stream: what _call would pass through
            return runtime.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        runtime = self._runtime("low_latency_dispatch")
        with self._call(async_finish is True and not return_recv_hook) as call:  # ep.paths.comm_stream
            call.hold(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
            return runtime.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None) -> tuple:
        """Send each received row back to its token's rank and sum each token's rows with its weights.

        Args:
            x: BF16 ``[L, R*T, H]``, rows aligned with the dispatch's ``recv_x`` (rows past
                ``recv_count`` are not read).
            topk_idx: the dispatch's ``[N, K]`` ids; entries may be masked to ``-1`` here (those
                rows are skipped), not unmasked.
            topk_weights: float32 ``[N, K]``.
            handle: the dispatch's handle (this Buffer's, from one of its last two dispatches).
            use_logfmt: must be False (LogFMT is not implemented: ``ConfigError``).
            zero_copy: the rows were written into ``get_next_low_latency_combine_buffer(handle)``, which
                is read instead of ``x`` (``x``'s shape is still checked), as DeepEP's.
            async_finish, return_recv_hook: as ``low_latency_dispatch``'s.
            out: optional BF16 ``[N, H]`` contiguous, written and returned.
            combine_wait_recv_cost_stats: optional int64 ``[R]``, as the dispatch's (on a GPU the
                wait for the last expert rank, added to every source's entry).

        Returns:
            ``(combined_x, event, hook)``: ``combined_x`` BF16 ``[N, H]``, ``sum_k topk_weights[t, k]
            * row(t, k)`` over ``topk_idx[t, k] >= 0`` in float32 in column order (a token with no
            expert gets zeros); ``out`` when given, else a new tensor.

        Raises:
            ConfigError: bad arguments or handle (before any byte moves), two combines awaiting
                their hooks, or ranks that combine different dispatches (on every rank alike).
            TransferTimeout / PeerLostError: a peer stalled or died.

        Collective? Yes. Blocking? As ``low_latency_dispatch``.
        """
        runtime = self._low_latency
        if runtime is not None and async_finish is False and (self._res.comm is None or self._res.comm.joined):
            # as the dispatch's
            return runtime.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, combine_wait_recv_cost_stats)
        runtime = self._runtime("low_latency_combine")
        with self._call(async_finish is True and not return_recv_hook) as call:  # ep.paths.comm_stream
            call.hold(x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats)
            result = runtime.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                     return_recv_hook, out, combine_wait_recv_cost_stats)
            if out is None:
                call.give(result[0])
            return result
