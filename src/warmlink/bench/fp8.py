"""``warmlink bench fp8``: quantize on send, as a share of what a flat copy of the same bytes reaches.

The linear weights of a Qwen3-4B-shaped model (``bench.model_spec`` at ``--scale``: fused
``qkv_proj`` and ``gate_up_proj``, ``o_proj``, ``down_proj``; bf16) lie on one device. The quantizer a
publisher runs at every publish (``refit.quantize.Quantizer``) turns them into FP8 values and
128 x 128 block scales (Note [FP8 formats] in ``refit.fp8``); in the same run one flat BF16 buffer
of the same bytes is copied into another (``copy_``: the device's own read-and-write bandwidth, HBM
on a GPU). Each is timed ``--repeats`` times after a warm-up, with CUDA events on a GPU (the host
clock on CPU), and reported as its median.

GB/s counts bytes read plus bytes written, GB = 1e9 bytes: the quantizer reads 2 bytes and writes
1 byte per element plus 4 per block, the copy reads 2 and writes 2. The share is the quantizer's
GB/s over the copy's: 1.0 means quantizing streams the weights as fast as the memory moves bytes.
"""

from __future__ import annotations

import argparse
import time

__all__ = ["linear_weights", "run_fp8", "add_arguments", "run"]


def linear_weights(scale: float, device) -> dict:
    """The linear weights of ``qwen3_4b_like(scale)`` as random BF16 tensors on ``device``, by name
    (its TP-1 vLLM layout: fused QKV and gate/up)."""
    import torch

    from warmlink.bench.model_spec import qwen3_4b_like

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)  # made where they lie: seconds, not minutes, at 8.8 GB
    return {name: torch.randn(lay.shape, generator=gen, dtype=torch.bfloat16, device=device)
            for name, lay in qwen3_4b_like(scale).layouts(1, 0).items()
            if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}


def _timed(fn, device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up: CUDA events on a GPU."""
    import torch

    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def run_fp8(*, scale: float, device: str, repeats: int, kernel: str = "auto", progress=None) -> dict:
    """Time the quantizer and a flat copy of the same BF16 bytes on ``device``.

    Returns:
        A JSON-able dict: ``num_tensors``, ``bf16_nbytes``, ``fp8_nbytes`` (values plus scales),
        ``kernel`` (the quantizer's path: ``"triton"`` or ``"torch"``), and for ``quantize`` and
        ``copy``: ``nbytes_moved`` (read + written), the median ``ms`` and ``gbps``, and every
        repeat's ``all_ms``; ``share_of_copy``.
    """
    import torch

    from warmlink.bench.report import gbps, median
    from warmlink.refit.quantize import Quantizer

    say = progress or (lambda line: None)
    dev = torch.device(device)
    # a kernel that cannot run here is refused before gigabytes are made
    Quantizer.standalone({"probe": torch.zeros(128, 128, dtype=torch.bfloat16, device=dev)}, "block", kernel=kernel)
    weights = linear_weights(scale, dev)
    q = Quantizer.standalone(weights, "block", kernel=kernel)
    used = q.kernel
    numel, num_tensors = sum(t.numel() for t in weights.values()), len(weights)
    scale_nbytes = sum(s.numel() * 4 for _, s in q.outputs.values())
    say(f"{len(weights)} weights, {2 * numel / 1e9:.2f} GB BF16, quantizing with {q.kernel}")
    quant_s = _timed(q.run, dev, repeats)
    del q
    src = torch.empty(numel, dtype=torch.bfloat16, device=dev)
    at = 0
    for t in weights.values():  # the same bytes, flat
        src[at:at + t.numel()].copy_(t.view(-1))
        at += t.numel()
    del weights
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), dev, repeats)
    moved = {"quantize": 3 * numel + scale_nbytes, "copy": 4 * numel}
    rows = {}
    for name, times in (("quantize", quant_s), ("copy", copy_s)):
        mid = median(times)
        rows[name] = {"nbytes_moved": moved[name], "ms": mid * 1e3, "gbps": gbps(moved[name], mid),
                      "all_ms": [t * 1e3 for t in times]}
    return {"num_tensors": num_tensors, "bf16_nbytes": 2 * numel, "fp8_nbytes": numel + scale_nbytes,
            "kernel": used, **rows,
            "share_of_copy": rows["quantize"]["gbps"] / rows["copy"]["gbps"]}


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from warmlink.bench.args import fraction, int_in

    p.add_argument("--scale", type=fraction, default=1.0,
                   help="fraction of the 8.8 GB Qwen3-4B shape, in (0, 1] (default 1.0)")
    p.add_argument("--repeats", type=int_in(1), default=10, help="timed runs of each, after a warm-up (default 10)")
    p.add_argument("--device", default=None, help="where the weights lie: cuda:N or cpu (default cuda:0 if CUDA is "
                                                  "present, else cpu)")
    p.add_argument("--kernel", choices=("auto", "torch", "triton"), default="auto",
                   help="the quantizer's path: auto (Triton on CUDA where it imports), torch, triton (default auto)")
    p.add_argument("--json", dest="json_path", default=None, help="write the JSON record here")


def run(args: argparse.Namespace) -> int:
    """The ``warmlink bench fp8`` command: prints the table and the share, and the record path."""
    import torch

    from warmlink.bench.args import refuse
    from warmlink.bench.report import cycle_table, machine_info, write_record
    from warmlink.errors import ConfigError

    prog = "warmlink bench fp8"
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        return refuse(prog, f"--device={device!r} invalid; expected cuda:N or cpu")
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        return refuse(prog, f"--device={device!r}: no such CUDA device here; expected cpu or one of "
                     f"{[f'cuda:{i}' for i in range(torch.cuda.device_count())]}")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"warmlink bench fp8: Qwen3-4B-shaped linear weights at scale {args.scale} on {device} ({name}), "
          f"{args.repeats} repeats", flush=True)
    t = time.perf_counter()
    try:
        result = run_fp8(scale=args.scale, device=device, repeats=args.repeats, kernel=args.kernel,
                         progress=lambda line: print(f"  {line} ({time.perf_counter() - t:.1f} s)", flush=True))
    except ConfigError as e:  # --kernel triton where it cannot run
        return refuse(prog, str(e))
    kernel = result.pop("kernel")
    rows = [{"path": f"quantize to FP8 ({kernel})", "ms": result["quantize"]["ms"], "GB/s": result["quantize"]["gbps"],
             "GB moved": result["quantize"]["nbytes_moved"] / 1e9},
            {"path": "flat copy, BF16", "ms": result["copy"]["ms"], "GB/s": result["copy"]["gbps"],
             "GB moved": result["copy"]["nbytes_moved"] / 1e9}]
    print()
    print(cycle_table(rows, ["path", "ms", "GB/s", "GB moved"], title="median of the repeats; GB/s = (read + written) / time"))
    print(f"share of a flat copy: {result['share_of_copy']:.2f}  (on the wire: {result['bf16_nbytes'] / 1e9:.2f} GB BF16 "
          f"-> {result['fp8_nbytes'] / 1e9:.2f} GB FP8 with scales)")
    record = {"bench": "fp8", "scale": args.scale, "device": device, "device_name": name, "kernel": kernel,
              "repeats": args.repeats, **result, "machine": machine_info()}
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    return 0
