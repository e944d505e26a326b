"""The dispatch and combine config words: every field survives, and no two calls that differ share a word."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from warmlink.ep.wire.words import (
    MAX_HANDLE_ROUND,
    MAX_TOPK,
    MAX_WORST_TOKENS,
    combine_handle_round,
    describe_call,
    describe_combine,
    encode_call,
    encode_combine,
)
from warmlink.ep.wire.regions import MAX_EXPERTS
from warmlink.errors import ConfigError

x_dtypes = st.sampled_from([torch.bfloat16, torch.float16, torch.float8_e4m3fn])
calls = st.tuples(st.integers(1, MAX_EXPERTS), st.integers(0, 1024), x_dtypes, st.booleans(), st.booleans(),
                  st.integers(0, MAX_WORST_TOKENS), st.booleans(), st.integers(0, 1 << 40))
combines = st.tuples(st.integers(0, MAX_HANDLE_ROUND), st.sampled_from([torch.bfloat16, torch.float16]),
                     st.integers(0, MAX_TOPK))


def _fields(call) -> tuple:
    """What a dispatch word holds of ``call``: a cached one's handle round (mod 2**15) in place of
    its top-k width, which it does not send."""
    experts, topk, dtype, cached, sm, worst, weights, handle_round = call
    return experts, handle_round % (MAX_TOPK + 1) if cached else topk, dtype, cached, sm, worst, weights


@given(calls)
def test_describe_reads_back_every_field(call):
    experts, topk, dtype, cached, sm, worst, weights = _fields(call)
    topk = f"handle of dispatch round {topk} (mod {MAX_TOPK + 1})" if cached else f"num_topk={topk}"
    assert describe_call(encode_call(*call[:7], handle_round=call[7])) == (
        f"(num_experts={experts}, {topk}, x_dtype={dtype}, topk_weights={weights}, cached={cached}, "
        f"sm_sends={sm}, num_worst_tokens={worst})")


@given(calls, calls)
def test_different_calls_have_different_words(a, b):
    words = [encode_call(*c[:7], handle_round=c[7]) for c in (a, b)]
    assert (words[0] == words[1]) == (_fields(a) == _fields(b))


@given(combines, combines)
def test_different_combines_have_different_words_and_keep_their_handle_round(a, b):
    assert (encode_combine(*a) == encode_combine(*b)) == (a == b)
    assert combine_handle_round(encode_combine(*a)) == a[0]
    assert 0 <= encode_combine(*a) < 1 << 63


def test_describe_combine_names_the_dtype_and_the_weights():
    assert describe_combine(encode_combine(3, torch.float16, 0)) == "(x_dtype=torch.float16, topk_weights=None)"
    assert describe_combine(encode_combine(3, torch.bfloat16, 8)) == "(x_dtype=torch.bfloat16, topk_weights=8 columns)"


def test_a_word_fits_a_signed_int64_and_out_of_range_fields_are_refused():
    assert 0 <= encode_call(MAX_EXPERTS, MAX_TOPK, torch.float8_e4m3fn, True, True, MAX_WORST_TOKENS, True) < 1 << 63
    with pytest.raises(ConfigError, match="num_worst_tokens"):
        encode_call(8, 2, torch.bfloat16, False, False, MAX_WORST_TOKENS + 1)
    with pytest.raises(ConfigError, match="num_topk"):
        encode_call(8, MAX_TOPK + 1, torch.bfloat16, False)
    with pytest.raises(ConfigError, match="x.dtype=torch.float32"):
        encode_call(8, 2, torch.float32, False)
    with pytest.raises(ConfigError, match="topk_weights columns"):
        encode_combine(1, torch.bfloat16, MAX_TOPK + 1)
