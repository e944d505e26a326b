"""The config words of one dispatch and one combine: what every rank of a round must call with, in one int64.

Each rank publishes its word in its mailbox (ep.wire.mailbox) with "ready for round n"; a rank that
sees another word refuses the round with a ``ConfigError`` naming both, instead of reading counts
or rows laid out for another kind of call. Everything that changes how a receiver reads the bytes
a sender wrote is in the word: rows of another dtype are the same size (bf16 and fp16), and a
weight a sender did not write is whatever an earlier round left there.

Dispatch bits: 0 cached, 1 SM sends, 2 ``topk_weights`` passed, 3-4 x's dtype, 5-19 top-k, 20-32
experts, 33-62 ``num_worst_tokens``. Combine bits: 0-1 x's dtype, 2-16 ``topk_weights`` columns
(0: none passed), 17-62 the round of the dispatch whose handle it uses.

``REFUSED`` (-1, a word ``encode_call`` never makes) is the word of a rank that refused its own
fresh dispatch's arguments and takes part in the round without tokens (``ep.Buffer.refuse_dispatch``;
ep.protocol.normal, Note [Refused dispatch]): every rank that reads it raises ``RefusedRound`` naming that rank.
"""

from __future__ import annotations

import torch

from warmlink.errors import ConfigError

__all__ = ["REFUSED", "RefusedRound", "combine_handle_round", "describe_call", "describe_combine", "encode_call",
           "encode_combine"]

REFUSED = -1  # the config word of a refused fresh dispatch (module docstring)


class RefusedRound(ConfigError):
    """A fresh dispatch round that ``ranks`` refused, raised on every other rank alike (and on every
    rank when the device refused an input): nothing was sent and the round is spent everywhere."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)  # a dtype's code is its index
_TOPK_BITS, _EXPERT_BITS = 15, 13
_WORST_SHIFT = 33
MAX_WORST_TOKENS = (1 << 30) - 1
MAX_TOPK = (1 << _TOPK_BITS) - 1
_COMBINE_ROUND_SHIFT = 17
MAX_HANDLE_ROUND = (1 << (63 - _COMBINE_ROUND_SHIFT)) - 1


def _dtype_code(func: str, dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise ConfigError(f"{func}: x.dtype={dtype}; expected one of {list(_DTYPES)}")
    return _DTYPES.index(dtype)


def _field(func: str, name: str, value: int, most: int) -> int:
    if not 0 <= value <= most:
        raise ConfigError(f"{func}: {name}={value}; expected an int in [0, {most}]")
    return value


def encode_call(num_experts: int, num_topk: int, x_dtype: torch.dtype, cached: bool, sm: bool = False,
                num_worst_tokens: int = 0, weights: bool = False, handle_round: int = 0) -> int:
    """The word of a dispatch (``num_topk`` 0 and ``weights`` False for a cached dispatch, which
    sends no ids). ``x_dtype``: the dtype of the rows sent (``torch.float8_e4m3fn`` for FP8). A
    cached dispatch's word carries its handle's dispatch round (modulo 2**15, in the top-k field it
    has no use for): ranks that re-send the handles of different dispatches are told apart, as
    their combines are."""
    func = "ep.Buffer.dispatch"
    if cached:
        num_topk = handle_round & MAX_TOPK
    return ((_field(func, "num_worst_tokens", num_worst_tokens, MAX_WORST_TOKENS) << _WORST_SHIFT)
            | (_field(func, "num_experts", num_experts, (1 << _EXPERT_BITS) - 1) << 20)
            | (_field(func, "num_topk", num_topk, MAX_TOPK) << 5) | (_dtype_code(func, x_dtype) << 3)
            | (int(weights) << 2) | (int(sm) << 1) | int(cached))


def describe_call(word: int) -> str:
    """The fields of a dispatch word, for errors."""
    topk = (word >> 5) & MAX_TOPK
    topk = f"handle of dispatch round {topk} (mod {MAX_TOPK + 1})" if word & 1 else f"num_topk={topk}"
    return (f"(num_experts={(word >> 20) & ((1 << _EXPERT_BITS) - 1)}, {topk}, "
            f"x_dtype={_DTYPES[(word >> 3) & 3] if (word >> 3) & 3 < len(_DTYPES) else '?'}, "
            f"topk_weights={bool(word & 4)}, cached={bool(word & 1)}, sm_sends={bool(word & 2)}, "
            f"num_worst_tokens={word >> _WORST_SHIFT})")


def encode_combine(handle_round: int, x_dtype: torch.dtype, weight_columns: int) -> int:
    """The word of a combine: its handle's dispatch round, x's dtype and the columns of
    ``topk_weights`` (0 when none are passed)."""
    func = "ep.Buffer.combine"
    return ((_field(func, "handle.round", handle_round, MAX_HANDLE_ROUND) << _COMBINE_ROUND_SHIFT)
            | (_field(func, "topk_weights columns", weight_columns, MAX_TOPK) << 2) | _dtype_code(func, x_dtype))


def combine_handle_round(word: int) -> int:
    """The dispatch round of a combine word's handle."""
    return word >> _COMBINE_ROUND_SHIFT


def describe_combine(word: int) -> str:
    """The dtype and weights of a combine word, for errors."""
    code, columns = word & 3, (word >> 2) & MAX_TOPK
    weights = f"{columns} columns" if columns else "None"
    return f"(x_dtype={_DTYPES[code] if code < len(_DTYPES) else '?'}, topk_weights={weights})"
