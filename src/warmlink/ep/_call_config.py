"""The config word of one dispatch: what every rank of a round must call with, in one int64.

Each rank publishes its word in its mailbox (ep._mailbox) with "ready for round n"; a rank that
sees another word refuses the round with a ``ConfigError`` naming both, instead of reading counts
or rows laid out for another kind of call.

Bits: 0 cached, 1 fp8, 2 SM sends, 4-19 top-k, 20-32 experts, 33-62 ``num_worst_tokens``.
"""

from __future__ import annotations

from warmlink.errors import ConfigError

__all__ = ["describe_call", "encode_call"]

_WORST_SHIFT = 33
MAX_WORST_TOKENS = (1 << 30) - 1


def encode_call(num_experts: int, num_topk: int, fp8: bool, cached: bool, sm: bool = False,
                num_worst_tokens: int = 0) -> int:
    """The word of a call (``num_topk`` 0 for a cached dispatch, which sends no ids)."""
    if not 0 <= num_worst_tokens <= MAX_WORST_TOKENS:
        raise ConfigError(f"ep.Buffer.dispatch: num_worst_tokens={num_worst_tokens}; expected at most {MAX_WORST_TOKENS}")
    return ((num_worst_tokens << _WORST_SHIFT) | (num_experts << 20) | (num_topk << 4) | (int(sm) << 2)
            | (int(fp8) << 1) | int(cached))


def describe_call(word: int) -> str:
    """The fields of a word, for errors."""
    return (f"(num_experts={(word >> 20) & 0x1FFF}, num_topk={(word >> 4) & 0xFFFF}, fp8={bool(word & 2)}, "
            f"cached={bool(word & 1)}, sm_sends={bool(word & 4)}, num_worst_tokens={word >> _WORST_SHIFT})")
