"""Registers, stack (spills) and shared memory of ep's streamed kernels compiled for sm_90 on this
machine, GPU or not (Triton's bundled ptxas and cuobjdump), with the launch arguments ep passes:
what a tile or a warp count costs a program before any device time is spent on it.

    python tools/kernel_resources.py [--configs dispatch combine combine/w8 combine/p8/b8/w8]
        [--channels 20] [--ring-rows 128] [--hidden 7168] [--topk 8]

A config is ``dispatch`` or ``combine``, optionally with /pN (publish), /bN (batch), /wN (warps),
and for the dispatch /tN (tokens a step) and /xN (words a step): stream_sweep.py's knobs, so that
a config found cheap here can be timed there. A kernel with a stack (STACK > 0) spills registers
to local memory: every step of it then waits on loads it made itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import torch

_KNOBS = {"p": "publish", "b": "batch", "w": "num_warps", "t": "tokens", "x": "x_block"}


class _Recorder:
    """Stands in for a kernel: keeps the launch's arguments and constexprs."""

    def __init__(self) -> None:
        self.launch = None

    def __getitem__(self, grid):
        def keep(*args, **constexprs):
            self.launch = (args, constexprs)
        return keep


def _launch(kind: str, knobs: dict, args) -> tuple:
    from warmlink.ep.kernels.stream import Sources, StreamSpace, outputs, row_words, stream_dispatch
    from warmlink.ep.kernels.stream_combine import stream_combine

    r, c, k, tokens, words = 2, args.channels, args.topk, 64, args.hidden // 4
    space = StreamSpace(r, c, args.ring_rows, row_words(words, k, 0))
    rec = _Recorder()
    zeros = torch.zeros
    if kind == "dispatch":
        src = Sources(zeros(tokens, words, dtype=torch.int64), zeros(tokens, k, dtype=torch.int64), zeros(tokens, k))
        stream_dispatch(space, zeros(tokens, r, dtype=torch.int64), src, outputs(100, src), zeros(r, dtype=torch.int64),
                        zeros(r, dtype=torch.int64), zeros(2 * c, dtype=torch.int64), me=1, seq=3, max_tokens=4096,
                        experts_per_rank=128, timeout_s=10.0, kernel=rec, **knobs)
    else:
        bf16 = torch.bfloat16
        stream_combine(space, zeros(tokens, r, dtype=torch.int64), zeros(100, args.hidden, dtype=bf16),
                       zeros(tokens, args.hidden, dtype=bf16), zeros(r, c, dtype=torch.int64), zeros(r, dtype=torch.int64),
                       zeros(r, dtype=torch.int64), zeros(2 * c, dtype=torch.int64), me=1, seq=4, timeout_s=10.0,
                       weights=zeros(100, k), out_weights=zeros(tokens, k), kernel=rec, **knobs)
    return rec.launch


def _signature(jit, args: tuple, constexprs: dict, unspecialized: tuple) -> tuple[dict, dict]:
    """Triton's types for the launch's arguments, as a launch specializes them (1 a constant)."""
    pointer = {torch.int64: "*i64", torch.int32: "*i32", torch.float32: "*fp32", torch.bfloat16: "*bf16"}
    sig, consts = dict.fromkeys(constexprs, "constexpr"), dict(constexprs)
    for name, value in zip(jit.arg_names, args, strict=False):
        if isinstance(value, torch.Tensor):
            sig[name] = pointer[value.dtype]
        elif value == 1 and name not in unspecialized:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32" if abs(value) < 2**31 else "i64"
    return sig, consts


def usage(kind: str, knobs: dict, args) -> dict:
    """``{"warps", "REG", "STACK", "SHARED", ...}`` (ints) of ``kind`` at ``knobs``, as cuobjdump reads the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warmlink.ep.kernels import stream_combine_programs, stream_programs

    jit, unspecialized = ((stream_programs.stream_dispatch_kernel, ("num_tokens", "out_rows", "first_program"))
                          if kind == "dispatch" else
                          (stream_combine_programs.stream_combine_kernel, ("num_tokens", "x_rows", "first_program")))
    launch_args, constexprs = _launch(kind, knobs, args)
    constexprs = dict(constexprs)
    warps = constexprs.pop("num_warps", 0) or 4  # 0: Triton's default
    sig, consts = _signature(jit, launch_args, constexprs, unspecialized)
    compiled = triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    line = next(line.strip() for line in out.splitlines() if "REG:" in line)
    fields = {key: int(value) for key, value in (part.split(":", 1) for part in line.split() if ":" in part)
              if value.isdigit()}
    return {"warps": warps, **fields}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["dispatch", "combine", "combine/w8", "combine/p8/b8/w8"])
    ap.add_argument("--channels", type=int, default=20)
    ap.add_argument("--ring-rows", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168, help="BF16 elements a token (a multiple of 4)")
    ap.add_argument("--topk", type=int, default=8)
    args = ap.parse_args()
    print(f"sm_90, 2 ranks, {args.channels} channels x {args.ring_rows} rows, hidden {args.hidden} BF16, top-{args.topk}")
    print(f"{'config':<22}{'warps':>5}  {'regs':>4}  {'stack':>6}  {'shared':>6}  (bytes a thread / a program)")
    for config in args.configs:
        kind, *knobs = config.split("/")
        if kind not in ("dispatch", "combine"):
            ap.error(f"config {config!r}: expected dispatch or combine first")
        got = usage(kind, {_KNOBS[k[0]]: int(k[1:]) for k in knobs}, args)
        print(f"{config:<22}{got['warps']:>5}  {got['REG']:>4}  {got['STACK']:>6}  {got['SHARED']:>6}", flush=True)


if __name__ == "__main__":
    main()
