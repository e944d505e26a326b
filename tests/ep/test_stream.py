"""The streamed dispatch (ep.kernels.stream, Note [Streamed dispatch]) on a machine without a GPU: its
kernel in Triton's interpreter (``interpreted_stream.py``, in a child pytest), the same kernel
compiled for Hopper, its torch twin against the non-streamed dispatch's steps, and the host
helpers. On GPUs: test_stream_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.ep._stream_workers import group_inputs, same_bits
from tests.ep.test_kernels import _interpreted
from warmlink.ep.kernels import steps
from warmlink.ep.kernels.stream import (COUNTER_WORDS, Failure, Sources, StreamSpace, failures, outputs, recv_offsets,
                                        row_words, stream_dispatch, stream_dispatch_torch, stream_nbytes)
from warmlink.errors import ConfigError


def test_the_streamed_dispatch_kernel_equals_its_torch_twin_and_the_oracle_in_the_interpreter():
    pytest.importorskip("triton")
    _interpreted("interpreted_stream.py")


@pytest.mark.parametrize("fp8", [False, True])
def test_the_torch_twin_gives_the_non_streamed_dispatchs_rows(fp8):
    """The twin's outputs are those of the slot design's steps: ``gather`` of every source's rows
    into this rank's area after the lower sources' rows, then ``unpack`` (ep.kernels.steps)."""
    call = {"tokens": [37, 0, 80], "hidden": 256, "experts": 12, "topk": 3, "seed": 4, "layout": "column",
            "dtype": torch.float8_e4m3fn if fp8 else torch.bfloat16}
    rows_of, sources_of, _ = group_inputs(call, 3)
    for me in range(3):
        want = stream_dispatch_torch(me, rows_of, sources_of, 80, 4)
        offsets, total = recv_offsets([int((r[:, me] >= 0).sum()) for r in rows_of])
        x = torch.zeros(total, sources_of[0].x.shape[1], dtype=torch.int64)
        meta = torch.zeros(total, 64, dtype=torch.uint8)
        for s, (rows, src) in enumerate(zip(rows_of, sources_of)):
            steps.gather(rows, src, x, meta, 3, range(me, me + 1), shift=int(offsets[s]) - me * 80)
        got = outputs(total, sources_of[0])
        steps.unpack(meta, 3, got.idx, got.weights, got.scales, me * 4, 4)
        assert same_bits(x, want.x)
        assert all(same_bits(g, w) for g, w in zip(got[1:], want[1:])), me


def test_the_space_holds_its_counters_on_lines_of_their_own_then_the_rings():
    space = StreamSpace(4, 3, 8, 100)
    assert space.tail(0, 0) == 0 and space.tail(3, 2) == 11 * COUNTER_WORDS
    assert space.head(0, 0) == 12 * COUNTER_WORDS and space.ring(0, 0) == 24 * COUNTER_WORDS
    assert space.ring(1, 0) - space.ring(0, 2) == 8 * 100
    assert stream_nbytes(4, 3, 8, 100) == space.nbytes == (24 * COUNTER_WORDS + 12 * 8 * 100) * 8
    assert row_words(896, 8, 56) == 944  # FP8 7168, top-8: x, ids + weights + scales, the ordinal: 937, in lines
    with pytest.raises(ConfigError, match="channels"):
        StreamSpace(2, 0, 8, 100)


def test_failures_name_each_program_that_did_not_finish_its_wait_and_peer():
    seq = 5
    words = torch.tensor([seq << 32, seq << 32 | 2 << 16 | 1, 4 << 32, seq << 32 | 1 << 24 | 3 << 16 | 2])
    assert failures(words, seq, 2) == [Failure(1, "send", 1, seq, "credit", 1, False),
                                       Failure(2, "recv", 0, 4, "not run", 0, False),
                                       Failure(3, "recv", 1, seq, "rows", 2, True)]


def test_stream_dispatch_refuses_what_the_kernel_cannot_take():
    space = StreamSpace(2, 2, 8, 20)
    src = Sources(torch.zeros(4, 16, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int64))
    rows, out, where = torch.zeros(4, 2, dtype=torch.int64), outputs(3, src), torch.zeros(2, dtype=torch.int64)
    status = torch.zeros(4, dtype=torch.int64)

    def call(**kw):
        args = {"space": space, "rows": rows, "src": src, "out": out, "recv_offset": where, "bases": where,
                "status": status, "me": 0, "seq": 1, "max_tokens": 4, "experts_per_rank": 2, "timeout_s": 1.0,
                "kernel": object()}
        stream_dispatch(**{**args, **kw})

    for kw, match in (({"seq": 0}, "seq=0"), ({"seq": 1 << 31}, "seq="), ({"role": "sideways"}, "role"),
                      ({"space": StreamSpace(2, 2, 8, 18)}, "rows of 20 words; the space holds 18"),
                      ({"rows": rows[:, :1]}, "rows"),
                      ({"out": out._replace(idx=None)}, "out.idx"), ({"status": status[:3]}, "status 3"),
                      ({"src": Sources(src.x, None, torch.zeros(4, 2))}, "weights without"),
                      ({"kernel": None}, "CPU tensors")):
        with pytest.raises(ConfigError, match=match):
            call(**kw)


_TYPES = {torch.int64: "*i64", torch.int32: "*i32", torch.float32: "*fp32", torch.bfloat16: "*bf16"}


def sm90_ptx(jit, args: tuple, constexprs: dict, unspecialized: tuple) -> str:
    """The PTX of ``jit`` compiled for Hopper with a launch's arguments, typed as Triton types them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    warps = constexprs.pop("num_warps", 0)  # a launch option, not an argument
    sig, consts = {}, dict(constexprs)
    for name, value in zip(jit.arg_names, args, strict=False):
        if isinstance(value, torch.Tensor):
            sig[name] = _TYPES[value.dtype]
        elif value == 1 and name not in unspecialized:  # Triton's constant 1
            sig[name], consts[name] = "constexpr", value
        else:
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    compiled = triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps} if warps else {})
    return compiled.asm["ptx"]


class _Recorder:
    """Stands in for the kernel: records the launch's arguments and constexprs."""

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.calls.append((grid, args, constexprs))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 ids+weights", "fp8 column-major scales"])
def test_the_kernel_compiles_for_sm90_with_the_arguments_stream_dispatch_passes(fp8):
    """What only the GPU would refuse (a type the interpreter forgives) fails here, in CI; the
    waits are the acquire, release and fence of the device's memory model."""
    triton = pytest.importorskip("triton")
    if triton.knobs.runtime.interpret:
        pytest.skip("compiles for a GPU: run without TRITON_INTERPRET")
    from warmlink.ep.kernels import stream_programs

    num_ranks, channels, tokens, k = 2, 8, 64, 8
    x_words, scales = (896, torch.zeros(56, tokens).T) if fp8 else (1792, None)
    src = Sources(torch.zeros(tokens, x_words, dtype=torch.int64), torch.zeros(tokens, k, dtype=torch.int64),
                  torch.zeros(tokens, k), scales)
    space = StreamSpace(num_ranks, channels, 8, row_words(1792, k, 56))
    rec = _Recorder()
    stream_dispatch(space, torch.zeros(tokens, num_ranks, dtype=torch.int64), src, outputs(100, src),
                    torch.zeros(num_ranks, dtype=torch.int64), torch.zeros(num_ranks, dtype=torch.int64),
                    torch.zeros(2 * channels, dtype=torch.int64), me=1, seq=3, max_tokens=4096, experts_per_rank=128,
                    timeout_s=10.0, kernel=rec)
    ((grid, args, constexprs),) = rec.calls
    assert grid == (2 * channels,)
    ptx = sm90_ptx(stream_programs.stream_dispatch_kernel, args, constexprs, ("num_tokens", "out_rows", "first_program"))
    assert "fence.acq_rel.sys" in ptx and "st.relaxed.sys.global.b64" in ptx and "sys.acquire" in ptx and "ld.global.cg" in ptx


def test_the_dispatch_spills_no_register_at_its_defaults():
    """A spilled register is a load from local memory that every step waits on (the combine's, at
    its 4 warps, made it latency-bound). tools/kernel_resources.py compiles the kernel for sm_90
    with the launch's arguments and reads the cubin's stack: no GPU needed."""
    pytest.importorskip("triton")
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("compiles for a GPU: run without TRITON_INTERPRET")
    from types import SimpleNamespace

    from tools.kernel_resources import usage

    got = usage("dispatch", {}, SimpleNamespace(channels=20, ring_rows=128, hidden=7168, topk=8))
    assert got["STACK"] == 0 and got["REG"] <= 255 and got["warps"] == 8, got
