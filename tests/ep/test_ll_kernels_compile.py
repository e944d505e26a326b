"""Low-latency mode's kernels, and normal mode's unpack, compile for Hopper (sm_90) on a machine
without a GPU, with the arguments their launches pass them: a kernel that only the GPU would
refuse (a type the interpreter forgives, an argument Triton specializes to a constant) fails
here, in CI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from warmlink.ep.low_latency._device import DevicePath  # noqa: E402
from warmlink.ep.low_latency._layout import LowLatencyLayout  # noqa: E402
from warmlink.ep.low_latency._outputs import Outputs  # noqa: E402

_TYPES = {torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1", torch.bfloat16: "*bf16",
          torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8"}


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **constexprs)`` records the call."""

    def __init__(self, calls: list, jit) -> None:
        self.calls, self.jit = calls, jit

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.calls.append((self.jit, args, constexprs))


def _signature(jit, args: tuple, constexprs: dict) -> tuple[dict, dict]:
    """Triton's view of a launch: pointers by dtype, an int of 1 as the constant Triton makes it
    (unless the kernel names it in ``do_not_specialize``)."""
    names = jit.arg_names
    general = {names[i] if isinstance(i, int) else i for i in jit.do_not_specialize}
    sig, consts = {}, dict(constexprs)
    for name, value in zip(names, args, strict=False):
        if isinstance(value, torch.Tensor):
            sig[name] = _TYPES[value.dtype]
        elif isinstance(value, bool) or (value == 1 and name not in general):
            sig[name], consts[name] = "constexpr", value
        else:
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, consts


@pytest.mark.parametrize("rank,fp8,round_scale,ue8m0,stats,shrink", [(0, True, False, False, True, False),
                                                                     (1, True, True, True, False, True),
                                                                     (1, False, False, False, True, False)])
def test_low_latency_kernels_compile_for_sm90_with_the_arguments_the_device_path_passes(rank, fp8, round_scale, ue8m0,
                                                                                      stats, shrink):
    """Every phase of both kernels (send, receive, both in one launch) and the mask buffer's kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warmlink.ep.low_latency._device import BOTH, RECV, SEND, build_kernels

    calls: list = []
    jits = build_kernels(interpreted=True)  # the plain triton.jit functions
    kernels = SimpleNamespace(**{name: _Recorder(calls, jit) for name, jit in vars(jits).items()})
    lay = LowLatencyLayout(2, 128, 7168, 256, 8)
    outputs = Outputs(lay, -1)
    path = DevicePath(lay, rank, {0: 1 << 40, 1: 1 << 41}, torch.device("cpu"), 30.0, outputs, kernels, shrink=shrink)
    out = outputs.views(1, 32, fp8, ue8m0)  # 32 tokens: a tag of 1 with FP8, as Triton then specializes it
    x, idx = torch.zeros(32, 7168, dtype=torch.bfloat16), torch.zeros(32, 8, dtype=torch.int64)
    counts = torch.zeros(lay.local_experts, dtype=torch.int32) if stats else None
    waits = torch.zeros(2, dtype=torch.int64) if stats else None
    handle = SimpleNamespace(layout_range=out.layout_range, comb_slot=out.comb_slot, num_max_dispatch_tokens_per_rank=32,
                             num_tokens=32, num_topk=8, dispatched=out.dispatched[:32])
    y = torch.zeros(lay.local_experts, 64, 7168, dtype=torch.bfloat16)
    for phase in (SEND, RECV, BOTH):
        path.dispatch(phase, 1, x, idx, 32, fp8, round_scale, ue8m0, 1 if fp8 else 0, counts, waits)
        path.combine(phase, 1, y, handle, idx, torch.zeros(32, 8), torch.zeros(32, 7168, dtype=torch.bfloat16), 1,
                     waits)
    path.query_mask(torch.zeros(2, dtype=torch.int32))
    path.update_mask(1, shrink)  # (masking a rank takes shrink)
    path.clean_mask()
    assert len(calls) == 9
    for jit, args, constexprs in calls:
        options = {"num_warps": constexprs.pop("num_warps", 4)}
        assert list(constexprs) == jit.arg_names[len(args):], "FastLaunch takes the constexprs in the kernel's order"
        sig, consts = _signature(jit, args, constexprs)
        compiled = triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        if "PHASE" in constexprs:  # what profilers show, and DeepEP's kineto timing looks for
            name = "dispatch" if "FP8" in constexprs else "combine"
            assert compiled.metadata.name == f"_ZN8warmlink2ep11low_latency{len(name)}{name}Ev"


@pytest.mark.parametrize("padded", [False, True])
def test_the_dispatch_unpack_compiles_for_sm90_padded_or_not(padded):
    """ep.kernels.steps.unpack, with and without a padded dispatch's board (ep.protocol.normal, Note [Padded
    dispatch returns at launch]), as a device run would launch it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warmlink.ep.kernels import steps as _kernels

    from warmlink.ep.kernels import programs as ep_triton

    calls: list = []
    kernels = SimpleNamespace(unpack=_Recorder(calls, ep_triton.unpack_kernel))
    rows, k = 64, 8
    board = _kernels.Padded(torch.zeros(4, 1030, dtype=torch.int64), 9, 2) if padded else None
    _kernels.unpack(torch.zeros(rows, 320, dtype=torch.uint8), k, torch.zeros(rows, k, dtype=torch.int64),
                    torch.zeros(rows, k), torch.zeros(rows, 56), 64, 64, kernels=kernels, padded=board)
    (jit, args, constexprs), = calls
    sig, consts = _signature(jit, args, constexprs)
    triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("stats", [False, True])
def test_what_changes_between_two_calls_of_a_kind_is_what_their_prepared_launch_reads_per_call(stats):
    """A prepared launch (ep.kernels.launch) keeps every other parameter as its kind's first launch
    passed it: two calls of one kind (phase, flags, parity, id dtype) with other tensors, sizes and
    tags differ only in the parameters named varying, those are the kernels' own names among the
    call's own arguments (before the parity's), and the ints among them are ones Triton does not
    specialize on."""
    from warmlink.ep.low_latency import _device
    from warmlink.ep.low_latency._device import BOTH, RECV, SEND, build_kernels

    calls: list = []
    jits = build_kernels(interpreted=True)
    kernels = SimpleNamespace(**{name: _Recorder(calls, jit) for name, jit in vars(jits).items()})
    lay = LowLatencyLayout(2, 128, 7168, 256, 8)
    outputs = Outputs(lay, -1)
    path = DevicePath(lay, 0, {0: 1 << 40, 1: 1 << 41}, torch.device("cpu"), 30.0, outputs, kernels)

    def inputs(n: int, k: int, tokens: int):
        out = outputs.views(1, tokens, True, False)
        handle = SimpleNamespace(layout_range=out.layout_range, comb_slot=out.comb_slot,
                                 num_max_dispatch_tokens_per_rank=tokens, num_tokens=n, num_topk=k,
                                 dispatched=outputs.dispatched(1, n, k))
        return (torch.zeros(n, 7168, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.int64), handle,
                torch.zeros(lay.local_experts, 2 * tokens, 7168, dtype=torch.bfloat16), torch.zeros(n, k),
                torch.zeros(n, 7168, dtype=torch.bfloat16),
                torch.zeros(lay.local_experts, dtype=torch.int32) if stats else None,
                torch.zeros(2, dtype=torch.int64) if stats else None)

    for phase in (SEND, RECV, BOTH):
        calls.clear()
        for n, k, tokens, tag in ((32, 8, 64, 3), (17, 5, 128, 9)):
            x, idx, handle, y, w, out, counts, waits = inputs(n, k, tokens)
            path.dispatch(phase, 1, x, idx, tokens, True, False, False, tag, counts, waits)
            path.combine(phase, 1, y, handle, idx, w, out, tag + 1, waits)
        (d1, c1, d2, c2) = calls
        for (jit, first, _), (_, second, _), varying, fixed in (
                (d1, d2, _device._DISPATCH_VARYING[stats, stats], path._fixed[1][0]),
                (c1, c2, _device._COMBINE_VARYING[stats], path._fixed[1][1])):
            names = jit.arg_names
            # a call hands its prepared launch its own arguments alone (the parity's follow them): the
            # varying ones must be among those
            assert all(a is b for a, b in zip(first[len(first) - len(fixed):], fixed, strict=True))
            assert varying <= set(names[:len(first) - len(fixed)])
            changed = {names[i] for i, (a, b) in enumerate(zip(first, second, strict=True))
                       if ((a is not b) if isinstance(a, torch.Tensor) else a != b)}
            assert changed <= varying, f"{changed - varying} change between calls of a kind but are packed once"
            ints = {names[i] for i, a in enumerate(first) if not isinstance(a, torch.Tensor) and names[i] in varying}
            assert ints <= set(jit.do_not_specialize)


def test_a_prepared_launch_refuses_a_varying_name_that_is_not_a_parameter():
    from warmlink.ep.kernels.launch import FastLaunch
    from warmlink.ep.low_latency._device import build_kernels

    launch = FastLaunch(build_kernels(interpreted=True).dispatch)
    with pytest.raises(ValueError, match="not among its runtime parameters"):
        launch.prepare((0,) * 9, {}, 8, frozenset({"x_ptr", "no_such_arg"}))
