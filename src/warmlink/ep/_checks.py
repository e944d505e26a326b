"""Every check ``ep.Buffer`` runs on its inputs, on the host, before any byte moves.

A bad shape, dtype, device, size or expert id raises ``ConfigError`` naming the argument; expert
ids are checked on the device with one min/max pass whose result rides on the one copy of the
counts to the host that dispatch needs anyway (Note [Round protocol] in ``ep.buffer``).
"""

from __future__ import annotations

import numpy as np
import torch

from warmlink.ep import _mailbox as mb
from warmlink.ep._regions import RegionLayout
from warmlink.ep.layout import dispatch_layout
from warmlink.errors import ConfigError

__all__ = ["X_DTYPES", "Checks"]

X_DTYPES = (torch.bfloat16, torch.float16)


class Checks:
    """The checks of one Buffer: its region layout, group size and device (-1 = host)."""

    def __init__(self, layout: RegionLayout, num_ranks: int, device: int) -> None:
        self._layout = layout
        self._num_ranks = num_ranks
        self._device = device

    def experts(self, num_experts) -> None:
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % self._num_ranks:
            raise ConfigError(f"ep: num_experts={num_experts!r}; expected a positive multiple of num_ranks={self._num_ranks}")
        if num_experts > mb.MAX_EXPERTS:
            raise ConfigError(f"ep: num_experts={num_experts} exceeds {mb.MAX_EXPERTS}")

    def rows(self, t: torch.Tensor, what: str, rows: int | None = None) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ConfigError(f"ep: {what} must be a 2-D tensor; got {type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
        expected = torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)
        if t.device != expected:
            raise ConfigError(f"ep: {what} is on {t.device}; expected {expected}")
        if rows is not None and t.shape[0] != rows:
            raise ConfigError(f"ep: {what} has {t.shape[0]} rows; expected {rows}")
        if t.shape[0] > self._layout.max_tokens and rows is None:
            raise ConfigError(f"ep: {what} has {t.shape[0]} tokens; the buffer holds at most "
                              f"max_tokens_per_rank={self._layout.max_tokens} (build it with a larger size_hint)")
        return t.contiguous()

    def topk(self, topk_idx, what: str, rows: int | None = None) -> torch.Tensor:
        t = self.rows(topk_idx, what, rows)
        if t.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"ep: {what}.dtype={t.dtype}; expected torch.int64 or torch.int32")
        if t.shape[1] > self._layout.num_topk:
            raise ConfigError(f"ep: {what} has {t.shape[1]} experts per token; the buffer holds num_topk={self._layout.num_topk}")
        return t

    def layout(self, per_rank, in_rank, per_expert, num_tokens: int, num_experts: int) -> None:
        shapes = {"num_tokens_per_rank": (per_rank, (self._num_ranks,)), "is_token_in_rank": (in_rank, (num_tokens, self._num_ranks)),
                  "num_tokens_per_expert": (per_expert, (num_experts,))}
        for name, (t, shape) in shapes.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ConfigError(f"ep.Buffer.dispatch: {name} has shape {tuple(getattr(t, 'shape', ()))}; expected {shape} "
                                  "(pass get_dispatch_layout's outputs for this topk_idx)")
        if in_rank.dtype != torch.bool:
            raise ConfigError(f"ep.Buffer.dispatch: is_token_in_rank.dtype={in_rank.dtype}; expected torch.bool")

    def x(self, x):
        """``(tokens, scales or None)``; FP8 comes as ``(float8_e4m3fn [T, H], float32 [T, H // 128])``."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ConfigError(f"ep: FP8 x must be a (tokens, scales) pair; got {len(x)} elements")
            q, s = self.rows(x[0], "x[0]"), self.rows(x[1], "x[1]", x[0].shape[0])
            if q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
                raise ConfigError(f"ep: FP8 x dtypes ({q.dtype}, {s.dtype}); expected (torch.float8_e4m3fn, torch.float32)")
            if q.shape[1] != self._layout.hidden or s.shape[1] != self._layout.hidden // 128:
                raise ConfigError(f"ep: FP8 x shapes {tuple(q.shape)}, {tuple(s.shape)}; expected [T, {self._layout.hidden}] "
                                  f"and [T, {self._layout.hidden // 128}]")
            return q, s
        t = self.rows(x, "x")
        if t.dtype not in X_DTYPES:
            raise ConfigError(f"ep: x.dtype={t.dtype}; expected one of {list(X_DTYPES)} or an FP8 (tokens, scales) pair")
        if t.shape[1] != self._layout.hidden:
            raise ConfigError(f"ep: x has {t.shape[1]} channels; the buffer was built for hidden={self._layout.hidden}")
        return t, None

    def routing_to_host(self, tokens, topk_idx, topk_weights, num_experts, per_rank, in_rank, per_expert):
        """Check the routing and bring the counts to the host: the dispatch's one synchronization.

        Returns ``(topk, weights, num_experts, host counts [R + E] int64 numpy, is_token_in_rank)``.
        """
        num_tokens = tokens.shape[0]
        if topk_idx is None:
            raise ConfigError("ep.Buffer.dispatch: topk_idx is required without a handle")
        topk = self.topk(topk_idx, "topk_idx", num_tokens)
        weights = None
        if topk_weights is not None:
            weights = self.rows(topk_weights, "topk_weights", num_tokens)
            if weights.shape != topk.shape or not weights.is_floating_point():
                raise ConfigError(f"ep: topk_weights {tuple(weights.shape)} {weights.dtype}; expected float of shape {tuple(topk.shape)}")
        if num_experts is None:
            if per_expert is None:
                raise ConfigError("ep.Buffer.dispatch: pass num_tokens_per_expert (from get_dispatch_layout) or num_experts")
            num_experts = int(per_expert.numel())
        self.experts(num_experts)
        if per_rank is None or in_rank is None or per_expert is None:
            lay = dispatch_layout(topk, num_experts, self._num_ranks)
            per_rank, in_rank, per_expert = lay.num_tokens_per_rank, lay.is_token_in_rank, lay.num_tokens_per_expert
        self.layout(per_rank, in_rank, per_expert, num_tokens, num_experts)
        # ids are checked with one min/max pass, read with the counts in the same copy
        lo, hi = (topk.aminmax() if topk.numel() else (topk.new_zeros(()), topk.new_zeros(())))
        ints = (per_rank.reshape(-1), per_expert.reshape(-1), lo.reshape(1), hi.reshape(1))
        # int64 unless everything is int32 already: a narrowing cast could turn a bad id into a good one
        common = torch.int32 if all(t.dtype == torch.int32 for t in ints) else torch.int64
        host = torch.cat([t if t.dtype == common else t.to(common) for t in ints]).cpu().numpy().astype(np.int64)
        if host[-2] < -1 or host[-1] >= num_experts:
            raise ConfigError(f"ep.Buffer.dispatch: topk_idx has entries in [{host[-2]}, {host[-1]}]; expected every "
                              f"entry in [-1, {num_experts}) (outside [-1, {num_experts}); nothing was sent)")
        send_counts = host[:self._num_ranks]
        if (send_counts > num_tokens).any() or (send_counts < 0).any():
            raise ConfigError(f"ep.Buffer.dispatch: num_tokens_per_rank={send_counts.tolist()} does not fit {num_tokens} tokens")
        return topk, weights, num_experts, host[:-2], in_rank

