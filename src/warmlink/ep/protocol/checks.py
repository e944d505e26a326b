"""Every check ``ep.Buffer`` runs on its inputs, on the host, before any byte moves.

A bad shape, dtype, device, size or expert id raises ``ConfigError`` naming the argument; expert
ids are checked on the device by the plan kernel, whose min/max rides on the one copy of the
counts to the host that dispatch needs anyway (Note [Round protocol] in ep.protocol.rounds).

On GPUs a fresh dispatch's tensors are first offered to the compiled ``fresh_accepts``
(ep.kernels.host): the common kind (contiguous rows, ids and weights, get_dispatch_layout's
outputs, one device), which these checks would pass through unchanged, is accepted there in a
few microseconds, where the checks below cost tens on a GPU machine's host while the GPUs wait
for the count exchange's launch. Anything else comes here, to be accepted or named.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.launch import capturing
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.kernels.steps import words_layout
from warmlink.ep.wire import mailbox as mb
from warmlink.ep.wire.fp8 import num_scales
from warmlink.ep.wire.handle import Handle
from warmlink.ep.wire.regions import RegionLayout
from warmlink.ep.wire.words import encode_call
from warmlink.errors import ConfigError

__all__ = ["X_DTYPES", "Checks", "DispatchArgs"]


class DispatchArgs(NamedTuple):
    """A dispatch's checked arguments; the routing ones (from ``topk``) are None for a cached dispatch."""

    tokens: torch.Tensor
    scales: torch.Tensor | None
    topk: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    num_experts: int | None = None
    per_rank: torch.Tensor | None = None
    in_rank: torch.Tensor | None = None
    per_expert: torch.Tensor | None = None
    config: int = 0  # a fresh dispatch's word (ep.wire.words), which the ranks compare
    kind: int = 0  # the compiled check's kind of call (KIND_EXPERTS...), 0 where the Python checks ran

X_DTYPES = (torch.bfloat16, torch.float16)
KIND_EXPERTS = (1 << 13) - 1  # a kind's num_experts (host.cpp fresh_accepts: the rest names K, dtypes, weights)


@functools.lru_cache(maxsize=64)
def _config_word(num_experts: int, num_topk: int, dtype: torch.dtype, by_sm: bool, num_worst_tokens: int,
                 weights: bool) -> int:
    return encode_call(num_experts, num_topk, dtype, False, by_sm, num_worst_tokens, weights)


class Checks:
    """The checks of one Buffer: its region layout, group size and device (-1 = host)."""

    def __init__(self, layout: RegionLayout, num_ranks: int, device: int) -> None:
        self._layout = layout
        self._num_ranks = num_ranks
        self._device = device
        self._on = torch.device("cpu") if device < 0 else torch.device("cuda", device)  # (made once: every check reads it)
        self._worst = num_ranks * layout.max_tokens  # the most rows num_worst_tokens may ask for
        self._accepts = None  # the compiled fresh_accepts, looked up at the first CUDA dispatch (module docstring)

    def compiled(self, accepts) -> None:
        """Offer fresh dispatches to ``accepts`` (``host.cpp``'s ``fresh_accepts``, or a stand-in
        in tests) before the checks; None: the checks alone."""
        self._accepts = accepts

    def experts(self, num_experts) -> None:
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % self._num_ranks:
            raise ConfigError(f"ep: num_experts={num_experts!r}; expected a positive multiple of num_ranks={self._num_ranks}")
        if num_experts > mb.MAX_EXPERTS:
            raise ConfigError(f"ep: num_experts={num_experts} exceeds {mb.MAX_EXPERTS}")

    def rows(self, t: torch.Tensor, what: str, rows: int | None = None) -> torch.Tensor:
        """``t`` checked (``checked``) and contiguous."""
        return self.checked(t, what, rows).contiguous()

    def checked(self, t: torch.Tensor, what: str, rows: int | None = None) -> torch.Tensor:
        """``t`` itself once it is a 2-D tensor on this Buffer's device with ``rows`` rows (or at
        most ``max_tokens`` without ``rows``)."""
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ConfigError(f"ep: {what} must be a 2-D tensor; got {type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
        if t.device != self._on:
            raise ConfigError(f"ep: {what} is on {t.device}; expected {self._on}")
        if rows is not None and t.shape[0] != rows:
            raise ConfigError(f"ep: {what} has {t.shape[0]} rows; expected {rows}")
        if t.shape[0] > self._layout.max_tokens and rows is None:
            raise ConfigError(f"ep: {what} has {t.shape[0]} tokens; the buffer holds at most "
                              f"max_tokens_per_rank={self._layout.max_tokens} (build it with a larger size_hint)")
        return t

    def topk(self, topk_idx, what: str, rows: int | None = None) -> torch.Tensor:
        t = self.rows(topk_idx, what, rows)
        if t.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"ep: {what}.dtype={t.dtype}; expected torch.int64 or torch.int32")
        if t.shape[1] > self._layout.num_topk:
            raise ConfigError(f"ep: {what} has {t.shape[1]} experts per token; the buffer holds num_topk={self._layout.num_topk}")
        return t

    def padding(self, expert_alignment, num_worst_tokens) -> None:
        """DeepEP's ``expert_alignment`` (an int >= 1) and ``num_worst_tokens`` (0, or the rows of
        padded outputs: at most the receive area's ``num_ranks * max_tokens_per_rank``)."""
        if not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool) or expert_alignment < 1:
            raise ConfigError(f"ep.Buffer.dispatch: expert_alignment={expert_alignment!r}; expected an int >= 1")
        rows = self._num_ranks * self._layout.max_tokens
        if (not isinstance(num_worst_tokens, int) or isinstance(num_worst_tokens, bool)
                or not 0 <= num_worst_tokens <= rows):
            raise ConfigError(f"ep.Buffer.dispatch: num_worst_tokens={num_worst_tokens!r}; expected an int in [0, {rows}] "
                              f"(num_ranks * max_tokens_per_rank rows of the receive area)")

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
        """``(tokens, scales or None)``; FP8 comes as ``(float8_e4m3fn [T, H], float32 [T, ceil(H / 128)])``,
        the scales with any strides: they are not copied (ep.kernels.steps, Note [Scales in place])."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ConfigError(f"ep: FP8 x must be a (tokens, scales) pair; got {len(x)} elements")
            q, s = self.rows(x[0], "x[0]"), self.checked(x[1], "x[1]", x[0].shape[0])
            if q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
                raise ConfigError(f"ep: FP8 x dtypes ({q.dtype}, {s.dtype}); expected (torch.float8_e4m3fn, torch.float32)")
            if q.shape[1] != self._layout.hidden or s.shape[1] != num_scales(self._layout.hidden):
                raise ConfigError(f"ep: FP8 x shapes {tuple(q.shape)}, {tuple(s.shape)}; expected [T, {self._layout.hidden}] "
                                  f"and [T, {num_scales(self._layout.hidden)}]")
            return q, s
        t = self.rows(x, "x")
        if t.dtype not in X_DTYPES:
            raise ConfigError(f"ep: x.dtype={t.dtype}; expected one of {list(X_DTYPES)} or an FP8 (tokens, scales) pair")
        if t.shape[1] != self._layout.hidden:
            raise ConfigError(f"ep: x has {t.shape[1]} channels; the buffer was built for hidden={self._layout.hidden}")
        return t, None

    def dispatch(self, x, cached: bool, expert_alignment, num_worst_tokens, topk_idx, topk_weights, num_experts,
                 per_rank, in_rank, per_expert, by_sm: bool) -> DispatchArgs:
        """Every argument of ``ep.Buffer.dispatch`` (``by_sm``: whether the device trades the counts,
        part of the config word: a rank that meets in the mailbox while another trades counts on the
        device would read counts that were never published)."""
        if not cached:
            accepted = self._fresh_accepted(x, expert_alignment, num_worst_tokens, topk_idx, topk_weights, num_experts,
                                            per_rank, in_rank, per_expert, by_sm)
            if accepted is not None:
                return accepted
        self.padding(expert_alignment, num_worst_tokens)
        tokens, scales = self.x(x)
        if cached:
            return DispatchArgs(tokens, scales)
        routing = self.routing(tokens, topk_idx, topk_weights, num_experts, per_rank, in_rank, per_expert)
        topk, weights, num_experts = routing[:3]
        config = encode_call(num_experts, topk.shape[1], tokens.dtype, False, by_sm, num_worst_tokens, weights is not None)
        return DispatchArgs(tokens, scales, *routing, config)

    def _fresh_accepted(self, x, expert_alignment, num_worst_tokens, topk_idx, topk_weights, num_experts, per_rank,
                        in_rank, per_expert, by_sm: bool) -> DispatchArgs | None:
        """``dispatch``'s value when ``fresh_accepts`` takes the tensors as they are (the same value
        the checks would give), else None."""
        accepts = self._accepts
        if accepts is None:
            if self._device < 0 or host.module() is None:
                return None
            accepts = self._accepts = host.module().fresh_accepts
        if (type(expert_alignment) is not int or expert_alignment < 1 or type(num_worst_tokens) is not int
                or not 0 <= num_worst_tokens <= self._worst or (num_experts is not None and type(num_experts) is not int)):
            return None
        tokens, scales = x, None
        if isinstance(x, tuple):
            if len(x) != 2 or x[1] is None:  # not an FP8 pair: the checks name what it is
                return None
            tokens, scales = x
        lay = self._layout
        kind = accepts(tokens, scales, topk_idx, topk_weights, per_rank, in_rank, per_expert,
                       -1 if num_experts is None else num_experts, self._device, lay.hidden, num_scales(lay.hidden),
                       lay.max_tokens, lay.num_topk, self._num_ranks, mb.MAX_EXPERTS)
        if not kind:
            return None
        experts = kind & KIND_EXPERTS
        config = _config_word(experts, topk_idx.shape[1], tokens.dtype, by_sm, num_worst_tokens, topk_weights is not None)
        return DispatchArgs(tokens, scales, topk_idx, topk_weights, experts, per_rank, in_rank, per_expert, config, kind)

    def routing(self, tokens, topk_idx, topk_weights, num_experts, per_rank, in_rank, per_expert):
        """Check the routing arguments' shapes and types (host only; the layout is computed here
        when not given). Returns ``(topk, weights, num_experts, per_rank, in_rank, per_expert)``."""
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
            if not isinstance(per_expert, torch.Tensor):
                raise ConfigError(f"ep.Buffer.dispatch: num_tokens_per_expert is a {type(per_expert).__name__}; expected "
                                  "get_dispatch_layout's [num_experts] tensor")
            num_experts = int(per_expert.numel())
        self.experts(num_experts)
        if per_rank is None or in_rank is None or per_expert is None:
            lay = dispatch_layout(topk, num_experts, self._num_ranks)
            per_rank, in_rank, per_expert = lay.num_tokens_per_rank, lay.is_token_in_rank, lay.num_tokens_per_expert
        self.layout(per_rank, in_rank, per_expert, num_tokens, num_experts)
        for name, t in (("num_tokens_per_rank", per_rank), ("num_tokens_per_expert", per_expert)):
            if t.dtype not in (torch.int32, torch.int64) or t.device != in_rank.device or in_rank.device != topk.device:
                raise ConfigError(f"ep.Buffer.dispatch: {name} is {t.dtype} on {t.device}; expected int32 or int64 on "
                                  f"{topk.device} (get_dispatch_layout's outputs)")
        return topk, weights, num_experts, per_rank, in_rank, per_expert

    def counts(self, words: np.ndarray, num_tokens: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """Check the plan's words (ep.kernels.steps.plan) on the host: ``(send counts [R], per-expert [E])``.

        Raises ``ConfigError`` for expert ids outside ``[-1, num_experts)`` and for counts per rank
        that differ from ``is_token_in_rank``: nothing was sent yet.
        """
        parts = words_layout(self._num_ranks, num_experts)
        lo, hi = int(words[parts["lo"]].min()), int(words[parts["hi"]].max())
        if num_tokens and (lo < -1 or hi >= num_experts):
            raise ConfigError(f"ep.Buffer.dispatch: topk_idx has entries in [{lo}, {hi}]; expected every "
                              f"entry in [-1, {num_experts}) (outside [-1, {num_experts}); nothing was sent)")
        sent, given = words[parts["sent"]], words[parts["per_rank"]]
        if not np.array_equal(sent, given):
            raise ConfigError(f"ep.Buffer.dispatch: num_tokens_per_rank={given.tolist()} but is_token_in_rank holds "
                              f"{sent.tolist()} tokens per rank; pass get_dispatch_layout's outputs for this topk_idx")
        return sent, words[parts["per_expert"]]

    def combine_args(self, x, topk_weights, handle, owner: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``combine``'s, after ``handle``'s: one of this Buffer's dispatches (``owner``: the serial
        its mode stamps), whose refusal, if any, it raises."""
        if not isinstance(handle, Handle) or handle.owner != owner:
            raise ConfigError(f"ep.Buffer.combine: handle (a {type(handle).__name__}) is not from this Buffer's dispatch")
        if not capturing():  # (a captured call cannot wait for the device)
            handle.resolve()  # a refused padded dispatch's handle raises its refusal at every use
        return self.combine(x, topk_weights, handle)

    def combine(self, x, topk_weights, handle) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rows, weights or None)`` of a combine: ``x`` and ``topk_weights`` cut to the rows that
        ``handle``'s dispatch received (its padding rows are not combined; a streamed handle's are
        not cut: its kernel reads the received rows alone), weights as float32."""
        lay = self._layout
        padded = handle.num_worst_tokens or handle.num_recv_tokens  # the rows of that dispatch's outputs
        rows = self.rows(x, "x", padded)
        # a streamed combine reads only the received rows itself (and a captured one cannot ask how many)
        cut = handle.num_worst_tokens and handle.taken is None
        if cut:
            rows = rows[:handle.num_recv_tokens]
        if rows.dtype not in X_DTYPES or rows.shape[1] != lay.hidden:
            raise ConfigError(f"ep.Buffer.combine: x is {rows.dtype} with {rows.shape[1]} channels; expected one of "
                              f"{list(X_DTYPES)} with hidden={lay.hidden}")
        if topk_weights is None:
            return rows, None
        weights = self.rows(topk_weights, "topk_weights", padded)
        weights = (weights[:handle.num_recv_tokens] if cut else weights).float()
        if weights.shape[1] > lay.num_topk:
            raise ConfigError(f"ep.Buffer.combine: topk_weights has {weights.shape[1]} columns; at most {lay.num_topk}")
        return rows, weights
