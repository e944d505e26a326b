"""The streamed combine (ep.kernels.stream_combine, Note [Streamed combine]) on a machine without a GPU:
its kernel after the streamed dispatch in Triton's interpreter (``interpreted_stream_combine.py``,
in a child pytest), the same kernel compiled for Hopper, and its argument checks. On GPUs:
test_stream_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.ep.test_kernels import _interpreted
from tests.ep.test_stream import _Recorder, sm90_ptx
from warmlink.ep.kernels.stream import StreamSpace, row_words
from warmlink.ep.kernels.stream_combine import combine_row_words, stream_combine
from warmlink.errors import ConfigError


def test_the_streamed_combine_kernel_after_the_dispatch_equals_its_twin_and_the_oracle_in_the_interpreter():
    pytest.importorskip("triton")
    _interpreted("interpreted_stream_combine.py")


def test_a_combine_row_is_x_then_the_float32_weights_and_fits_a_dispatch_row_of_the_same_x():
    assert combine_row_words(1792, 8) == 1792 + 4 and combine_row_words(720, 3) == 720 + 2
    assert combine_row_words(1792, 0) == 1792 and combine_row_words(1792, 8) <= row_words(1792, 8, 0)


def _args(**kw) -> dict:
    space = StreamSpace(2, 2, 8, 20)
    args = {"space": space, "rows": torch.zeros(4, 2, dtype=torch.int64), "x": torch.zeros(6, 64, dtype=torch.bfloat16),
            "out": torch.zeros(4, 64, dtype=torch.bfloat16), "taken": torch.zeros(2, 2, dtype=torch.int64),
            "recv_offset": torch.zeros(2, dtype=torch.int64), "bases": torch.zeros(2, dtype=torch.int64),
            "status": torch.zeros(4, dtype=torch.int64), "me": 0, "seq": 2, "timeout_s": 1.0, "kernel": object(),
            "weights": torch.zeros(6, 2), "out_weights": torch.zeros(4, 2)}
    return {**args, **kw}


def test_stream_combine_refuses_what_the_kernel_cannot_take():
    for kw, match in (({"seq": 0}, "seq=0"), ({"role": "sideways"}, "role"), ({"publish": 3}, "publish=3"),
                      ({"x": torch.zeros(6, 64)}, "x .* torch.float32"), ({"x": torch.zeros(6, 62, dtype=torch.half)},
                                                                         "multiple of 4"),
                      ({"rows": torch.zeros(4, 3, dtype=torch.int64)}, "rows"),
                      ({"out": torch.zeros(5, 64, dtype=torch.bfloat16)}, "out \\(5, 64\\)"),
                      ({"out": torch.zeros(4, 64, dtype=torch.half)}, "out .*float16"),
                      ({"out_weights": None}, "both or neither"), ({"weights": torch.zeros(6, 2).double()}, "weights"),
                      ({"taken": torch.zeros(2, 3, dtype=torch.int64)}, "taken"),
                      ({"recv_offset": torch.zeros(2, dtype=torch.int32)}, "recv_offset"),
                      ({"status": torch.zeros(3, dtype=torch.int64)}, "status 3"),
                      ({"space": StreamSpace(2, 2, 8, 16)}, "rows of 17 words; the space holds 16"),
                      ({"kernel": None}, "CPU tensors")):
        with pytest.raises(ConfigError, match=match):
            stream_combine(**_args(**kw))


def test_the_kernel_compiles_for_sm90_with_the_arguments_stream_combine_passes():
    """What only the GPU would refuse fails here, in CI: the kernel at DeepSeek's shape (7168 BF16,
    top-8 weights, 8 channels), its waits the acquire, release and fence of the device's memory model."""
    triton = pytest.importorskip("triton")
    if triton.knobs.runtime.interpret:
        pytest.skip("compiles for a GPU: run without TRITON_INTERPRET")
    from warmlink.ep.kernels import stream_combine_programs

    num_ranks, channels, tokens, k = 2, 8, 64, 8
    space = StreamSpace(num_ranks, channels, 8, row_words(1792, k, 56))
    rec = _Recorder()
    bf16 = {"dtype": torch.bfloat16}
    stream_combine(space, torch.zeros(tokens, num_ranks, dtype=torch.int64), torch.zeros(100, 7168, **bf16),
                   torch.zeros(tokens, 7168, **bf16), torch.zeros(num_ranks, channels, dtype=torch.int64),
                   torch.zeros(num_ranks, dtype=torch.int64), torch.zeros(num_ranks, dtype=torch.int64),
                   torch.zeros(2 * channels, dtype=torch.int64), me=1, seq=4, timeout_s=10.0,
                   weights=torch.zeros(100, k), out_weights=torch.zeros(tokens, k), kernel=rec)
    ((grid, args, constexprs),) = rec.calls
    assert grid == (2 * channels,)
    ptx = sm90_ptx(stream_combine_programs.stream_combine_kernel, args, constexprs,
                   ("num_tokens", "x_rows", "first_program"))
    assert "fence.acq_rel.sys" in ptx and "st.relaxed.sys.global.b64" in ptx and "sys.acquire" in ptx and "ld.global.cg" in ptx
