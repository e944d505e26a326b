"""Every check of a low-latency call's arguments, before any byte moves.

A bad shape, dtype, device, size, flag or expert id raises ``ConfigError`` naming the argument.
Expert ids are read on the host here for the host path (it holds them there anyway); the device
path checks them in its kernels instead (no host synchronisation inside a call: Note
[Low-latency device path]).
"""

from __future__ import annotations

import torch

from warmlink.ep.low_latency._handle import LowLatencyHandle
from warmlink.ep.low_latency._layout import LL_PARITIES, LowLatencyLayout
from warmlink.errors import ConfigError

__all__ = ["LowLatencyChecks", "check_handle", "refuse_backend"]

_TOPK_DTYPES = (torch.int64, torch.int32)


def _flag(func: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"ep.Buffer.{func}: {name}={value!r}; expected a bool")
    return value


def refuse_backend(backend: str) -> None:
    """Raise ``ConfigError`` unless low-latency mode runs on ``backend``: shm (the host path), or
    cuda_ipc where Triton is (the device path's kernels)."""
    if backend == "shm":
        return
    if backend != "cuda_ipc":
        raise ConfigError(f"ep.Buffer: low_latency_mode=True with backend={backend!r}; expected 'shm' or 'cuda_ipc'")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ConfigError("ep.Buffer: low_latency_mode=True on a GPU needs Triton (its kernels move the rows); "
                          "install triton, or build the Buffer with backend='shm'") from exc


class LowLatencyChecks:
    """The checks of one Buffer's low-latency calls: its layout and device (-1 = host);
    ``read_values``: also check expert ids, which reads them on the host."""

    def __init__(self, layout: LowLatencyLayout, device: int, read_values: bool = True) -> None:
        self.layout = layout
        self.read_values = read_values
        self.device = torch.device("cpu") if device < 0 else torch.device("cuda", device)
        self._index = device if device >= 0 else -1  # what Tensor.get_device() says of this device
        self._compiled = None  # ep.kernels.host's module (False: none), at the first call offered to it

    # -- what every check passes unchanged, asked first (an eager call's host time is its latency) --
    def _plain(self, t, dtype, dims: int) -> bool:
        """Whether ``t`` is a contiguous ``torch.Tensor`` (not a subclass) of ``dtype`` with ``dims``
        dimensions on this Buffer's device."""
        return (type(t) is torch.Tensor and t.dtype is dtype and t.get_device() == self._index and t.dim() == dims
                and t.is_contiguous())

    def _stats(self, t, dtype, length: int) -> bool:
        return t is None or (self._plain(t, dtype, 1) and t.shape[0] == length)

    def _plain_topk(self, t) -> bool:
        return (type(t) is torch.Tensor and (t.dtype is torch.int64 or t.dtype is torch.int32)
                and self._plain(t, t.dtype, 2))

    def _host_steps(self):
        """``ep.kernels.host``'s module, whose ``ll_*_accepts`` check the tensors in one call, or
        None (the checks below then run in Python)."""
        if self._compiled is None:
            from warmlink.ep.kernels import host

            self._compiled = host.module() or False
        return self._compiled or None

    def plain_dispatch_flags(self, tokens, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
                             return_recv_hook) -> bool:
        """Whether the dispatch's flags and ints are the common call's (the first test of
        ``accepts_dispatch``)."""
        lay = self.layout
        return (type(use_fp8) is bool and type(round_scale) is bool and type(use_ue8m0) is bool
                and type(async_finish) is bool and type(return_recv_hook) is bool
                and (use_fp8 or not round_scale) and (round_scale or not use_ue8m0)
                and type(num_experts) is int and num_experts == lay.num_experts
                and type(tokens) is int and 1 <= tokens <= lay.max_tokens and not self.read_values)

    def accepts_dispatch(self, x, topk_idx, tokens, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
                         return_recv_hook, cumulative_stats, wait_stats) -> bool:
        """Whether ``dispatch`` would pass these arguments through unchanged: the common call (the
        device path's checks; statistics or not, as DeepEP's own tests pass them) in a few
        comparisons, the full checks run otherwise."""
        if not self.plain_dispatch_flags(tokens, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
                                         return_recv_hook):
            return False
        lay = self.layout
        compiled = self._compiled if self._compiled is not None else self._host_steps()
        if compiled:
            return compiled.ll_dispatch_accepts(x, topk_idx, cumulative_stats, wait_stats, self._index, lay.hidden, tokens,
                                                lay.num_topk, lay.local_experts, lay.num_ranks)
        if not (self._plain(x, torch.bfloat16, 2) and self._plain_topk(topk_idx)
                and self._stats(cumulative_stats, torch.int32, lay.local_experts)
                and self._stats(wait_stats, torch.int64, lay.num_ranks)):
            return False
        n, hidden = x.shape
        rows, cols = topk_idx.shape
        return hidden == lay.hidden and n <= tokens and rows == n and 1 <= cols <= lay.num_topk

    def plain_combine_flags(self, use_logfmt, zero_copy, async_finish, return_recv_hook) -> bool:
        """Whether the combine's flags are the common call's (the first test of ``accepts_combine``)."""
        return (use_logfmt is False and type(zero_copy) is bool and type(async_finish) is bool
                and type(return_recv_hook) is bool and not self.read_values)

    def accepts_combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_logfmt, zero_copy,
                        async_finish, return_recv_hook, out, wait_stats) -> bool:
        """Whether ``combine`` would pass these arguments through unchanged (as ``accepts_dispatch``)."""
        lay = self.layout
        if not self.plain_combine_flags(use_logfmt, zero_copy, async_finish, return_recv_hook):
            return False
        compiled = self._compiled if self._compiled is not None else self._host_steps()
        if compiled:
            return compiled.ll_combine_accepts(x, topk_idx, topk_weights, out, wait_stats, self._index, lay.local_experts,
                                               lay.num_ranks * handle.num_max_dispatch_tokens_per_rank, lay.hidden,
                                               handle.num_tokens, handle.num_topk, lay.num_ranks)
        if not (self._plain(x, torch.bfloat16, 3) and self._plain_topk(topk_idx)
                and self._plain(topk_weights, torch.float32, 2)
                and (out is None or self._plain(out, torch.bfloat16, 2))
                and self._stats(wait_stats, torch.int64, lay.num_ranks)):
            return False
        shape = (handle.num_tokens, handle.num_topk)
        return (x.shape == (lay.local_experts, lay.num_ranks * handle.num_max_dispatch_tokens_per_rank, lay.hidden)
                and topk_idx.shape == shape and topk_weights.shape == shape
                and (out is None or out.shape == (handle.num_tokens, lay.hidden)))

    def tensor(self, func: str, name: str, t, dtypes: tuple, shape: tuple | None = None, dims: int | None = None):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"ep.Buffer.{func}: {name} is a {type(t).__name__}; expected a torch.Tensor")
        if t.dtype not in dtypes:
            raise ConfigError(f"ep.Buffer.{func}: {name}.dtype={t.dtype}; expected {' or '.join(map(str, dtypes))}")
        if t.device != self.device:
            raise ConfigError(f"ep.Buffer.{func}: {name} is on {t.device}; expected {self.device}")
        if shape is not None and tuple(t.shape) != shape:
            raise ConfigError(f"ep.Buffer.{func}: {name}.shape={tuple(t.shape)}; expected {shape}")
        if dims is not None and t.dim() != dims:
            raise ConfigError(f"ep.Buffer.{func}: {name}.shape={tuple(t.shape)}; expected {dims} dimensions")
        return t

    def experts(self, func: str, num_experts) -> None:
        if num_experts != self.layout.num_experts or not isinstance(num_experts, int):
            raise ConfigError(f"ep.Buffer.{func}: num_experts={num_experts!r}; this Buffer was built for "
                              f"num_experts={self.layout.num_experts} (a multiple of num_ranks={self.layout.num_ranks})")

    def max_tokens(self, func: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= self.layout.max_tokens:
            raise ConfigError(f"ep.Buffer.{func}: num_max_dispatch_tokens_per_rank={value!r}; expected an int in "
                              f"[1, {self.layout.max_tokens}] (the Buffer's max_tokens_per_rank)")
        return value

    def topk(self, func: str, topk_idx, num_tokens: int):
        idx = self.tensor(func, "topk_idx", topk_idx, _TOPK_DTYPES, dims=2)
        if idx.shape[0] != num_tokens or not 1 <= idx.shape[1] <= self.layout.num_topk:
            raise ConfigError(f"ep.Buffer.{func}: topk_idx.shape={tuple(idx.shape)}; expected [{num_tokens}, K] with "
                              f"1 <= K <= num_topk={self.layout.num_topk}")
        if idx.numel() and self.read_values:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -1 or hi >= self.layout.num_experts:
                raise ConfigError(f"ep.Buffer.{func}: topk_idx has entries in [{lo}, {hi}]; expected every entry in "
                                  f"[-1, {self.layout.num_experts}) (-1: no expert)")
        return idx.contiguous()

    def stats(self, func: str, name: str, t, dtype, length: int) -> None:
        if t is not None:
            self.tensor(func, name, t, (dtype,), shape=(length,))
            if not t.is_contiguous():  # the kernels add into it element by element
                raise ConfigError(f"ep.Buffer.{func}: {name} must be contiguous")

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                 async_finish, return_recv_hook, cumulative_stats, wait_stats):
        """``(x, topk_idx)`` contiguous, once every argument of ``low_latency_dispatch`` is checked."""
        if self.accepts_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                 use_ue8m0, async_finish, return_recv_hook, cumulative_stats, wait_stats):
            return x, topk_idx
        func, lay = "low_latency_dispatch", self.layout
        for name, value in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0),
                            ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
            _flag(func, name, value)
        if round_scale and not use_fp8:
            raise ConfigError(f"ep.Buffer.{func}: round_scale=True with use_fp8=False; scales exist only with FP8")
        if use_ue8m0 and not round_scale:
            raise ConfigError(f"ep.Buffer.{func}: use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two)")
        self.experts(func, num_experts)
        tokens = self.max_tokens(func, num_max_dispatch_tokens_per_rank)
        x = self.tensor(func, "x", x, (torch.bfloat16,), dims=2)
        if x.shape[1] != lay.hidden:
            raise ConfigError(f"ep.Buffer.{func}: x has {x.shape[1]} channels; the Buffer was built for hidden={lay.hidden}")
        if x.shape[0] > tokens:
            raise ConfigError(f"ep.Buffer.{func}: x has {x.shape[0]} tokens; expected at most "
                              f"num_max_dispatch_tokens_per_rank={tokens}")
        idx = self.topk(func, topk_idx, x.shape[0])
        self.stats(func, "cumulative_local_expert_recv_stats", cumulative_stats, torch.int32, lay.local_experts)
        self.stats(func, "dispatch_wait_recv_cost_stats", wait_stats, torch.int64, lay.num_ranks)
        return x.contiguous(), idx

    def combine_output(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_logfmt, zero_copy,
                       async_finish, return_recv_hook, out, wait_stats) -> torch.Tensor | None:
        """For a call ``accepts_combine`` takes, its output (``out``, or a new BF16 ``[N, H]``), made
        in the same compiled call as the acceptance where there is one; else None."""
        if not self.plain_combine_flags(use_logfmt, zero_copy, async_finish, return_recv_hook):
            return None
        compiled = self._compiled if self._compiled is not None else self._host_steps()
        if compiled:
            lay = self.layout
            rows = lay.num_ranks * handle.num_max_dispatch_tokens_per_rank
            return compiled.ll_combine_output(x, topk_idx, topk_weights, out, wait_stats, self._index,
                                              lay.local_experts, rows, lay.hidden, handle.num_tokens, handle.num_topk,
                                              lay.num_ranks)
        if not self.accepts_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                    return_recv_hook, out, wait_stats):
            return None
        return out if out is not None else self._new_output(handle)

    def _new_output(self, handle: LowLatencyHandle) -> torch.Tensor:
        return torch.empty(handle.num_tokens, self.layout.hidden, dtype=torch.bfloat16, device=self.device)

    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_logfmt, zero_copy, async_finish,
                return_recv_hook, out, wait_stats):
        """``(x, topk_idx, topk_weights, combined)``, the first three contiguous, once every argument
        of ``low_latency_combine`` is checked (``handle`` is one of this Buffer's current ones: the
        runtime checked it first); ``combined``, what the call writes: ``out``, or a new BF16 ``[N, H]``."""
        combined = self.combine_output(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                       return_recv_hook, out, wait_stats)
        if combined is not None:
            return x, topk_idx, topk_weights, combined
        func, lay = "low_latency_combine", self.layout
        for name, value in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy), ("async_finish", async_finish),
                            ("return_recv_hook", return_recv_hook)):
            _flag(func, name, value)
        if use_logfmt:
            raise ConfigError(f"ep.Buffer.{func}: use_logfmt=True is not supported; combine sends BF16 rows")
        rows = lay.num_ranks * handle.num_max_dispatch_tokens_per_rank
        x = self.tensor(func, "x", x, (torch.bfloat16,), shape=(lay.local_experts, rows, lay.hidden))
        shape = (handle.num_tokens, handle.num_topk)
        idx = self.tensor(func, "topk_idx", topk_idx, _TOPK_DTYPES, shape=shape)
        weights = self.tensor(func, "topk_weights", topk_weights, (torch.float32,), shape=shape)
        idx = self.topk(func, idx, handle.num_tokens)
        if self.read_values and bool((idx >= 0).logical_and_(handle.dispatched.logical_not()).any()):
            raise ConfigError(f"ep.Buffer.{func}: topk_idx selects experts where the dispatch's topk_idx held -1; "
                              "pass the dispatch's topk_idx (entries may only be masked to -1)")
        if out is not None:
            self.tensor(func, "out", out, (torch.bfloat16,), shape=(handle.num_tokens, lay.hidden))
            if not out.is_contiguous():
                raise ConfigError(f"ep.Buffer.{func}: out must be contiguous")
        self.stats(func, "combine_wait_recv_cost_stats", wait_stats, torch.int64, lay.num_ranks)
        return x.contiguous(), idx, weights.contiguous(), out if out is not None else self._new_output(handle)


def check_handle(handle, func: str, owner: int, latest: int, clean_round: int) -> None:
    """Refuse a handle that Buffer ``owner`` would not combine: of another Buffer, from before its
    last clean (dispatch round ``clean_round``), outputs reused since (``latest``: its last
    dispatch round), or a receive that did not complete."""
    if not isinstance(handle, LowLatencyHandle):
        raise ConfigError(f"ep.Buffer.{func}: handle is a {type(handle).__name__}; expected the handle "
                          "low_latency_dispatch returned")
    if handle.owner != owner:
        raise ConfigError(f"ep.Buffer.{func}: handle={handle!r} comes from another Buffer; pass the handle this "
                          "Buffer's low_latency_dispatch returned")
    if handle.round <= clean_round:
        raise ConfigError(f"ep.Buffer.{func}: handle of dispatch round {handle.round} predates "
                          f"clean_low_latency_buffer (round {clean_round}), which zeroed its outputs")
    if handle.round < latest - 1:
        raise ConfigError(f"ep.Buffer.{func}: handle of dispatch round {handle.round}; its outputs were reused "
                          f"by dispatch round {handle.round + LL_PARITIES} (a handle serves until the second "
                          "dispatch after it); pass a newer handle")
    if handle.rows_by_source is None:
        raise ConfigError(f"ep.Buffer.{func}: handle of dispatch round {handle.round} whose receive did not "
                          "complete; call its hook first (a refused round has nothing to combine)")
