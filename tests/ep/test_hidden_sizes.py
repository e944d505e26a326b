"""Hidden sizes that are not a multiple of 128 (gpt-oss: 2880): rows move as 8-byte words, and FP8
carries one scale per 128 channels with the last block partial, as DeepEP's cast pads it."""

from __future__ import annotations

import pytest
import torch

from tests.ep._group import run_ranks
from tests.ep._workers import dispatch_combine
from tests.ep.test_buffer import check_against_reference
from warmlink.ep import size_hint
from warmlink.ep.wire.fp8 import num_scales
from warmlink.ep.wire.regions import RegionLayout
from warmlink.errors import ConfigError


def test_fp8_scales_cover_a_partial_last_block():
    assert [num_scales(h) for h in (128, 2880, 7168, 8)] == [1, 23, 56, 1]


def test_a_layout_of_2880_channels_holds_23_scales_per_meta_row():
    lay = RegionLayout(2, 16, 2880, 4)
    assert lay.meta_bytes >= 4 * 12 + 23 * 4 and lay.meta_bytes % 16 == 0
    assert size_hint(16, 2880, num_ranks=2, num_topk=4) == lay.nbytes


@pytest.mark.parametrize("hidden", [2884, 100, 7])
def test_a_hidden_size_that_is_not_whole_8_byte_words_is_refused(hidden):
    with pytest.raises(ConfigError, match=f"hidden={hidden}; expected a multiple of 8"):
        RegionLayout(2, 16, hidden, 4)


def test_gpt_oss_hidden_size_dispatches_and_combines_exactly():
    case = {"tokens": [11, 7], "hidden": 2880, "experts": 8, "topk": 4, "seed": 9, "cached": True, "rounds": 2}
    check_against_reference(case, run_ranks(dispatch_combine, 2, case=case))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gpt_oss_hidden_size_dispatches_and_combines_exactly(dtype):
    case = {"tokens": [300, 77], "hidden": 2880, "experts": 16, "topk": 4, "seed": 9, "cached": True, "rounds": 2,
            "dtype": dtype, "backend": "cuda_ipc"}
    check_against_reference(case, run_ranks(dispatch_combine, 2, case=case, timeout_s=180))
