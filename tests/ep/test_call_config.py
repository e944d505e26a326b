"""The dispatch config word: every field survives, and no two calls that differ share a word."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmlink.ep._call_config import MAX_WORST_TOKENS, describe_call, encode_call
from warmlink.ep._regions import MAX_EXPERTS
from warmlink.errors import ConfigError

calls = st.tuples(st.integers(1, MAX_EXPERTS), st.integers(0, 1024), st.booleans(), st.booleans(), st.booleans(),
                  st.integers(0, MAX_WORST_TOKENS))


@given(calls)
def test_describe_reads_back_every_field(call):
    experts, topk, fp8, cached, sm, worst = call
    assert describe_call(encode_call(*call)) == (f"(num_experts={experts}, num_topk={topk}, fp8={fp8}, cached={cached}, "
                                                 f"sm_sends={sm}, num_worst_tokens={worst})")


@given(calls, calls)
def test_different_calls_have_different_words(a, b):
    assert (encode_call(*a) == encode_call(*b)) == (a == b)


def test_a_word_fits_a_signed_int64_and_too_many_worst_tokens_are_refused():
    assert encode_call(MAX_EXPERTS, 1024, True, True, True, MAX_WORST_TOKENS) < 1 << 63
    with pytest.raises(ConfigError, match="num_worst_tokens"):
        encode_call(8, 2, False, False, False, MAX_WORST_TOKENS + 1)
