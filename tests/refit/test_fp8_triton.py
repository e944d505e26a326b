"""The block FP8 kernel (warmlink.refit._fp8_triton).

On CPU, Triton's interpreter runs the kernel's indexing, masks, strides and arithmetic, and its
values and scales equal CUDA's formula bit for bit. One piece of the interpreter is replaced: its
float32 -> e4m3 cast (Triton 3.9's numpy emulation rounds ties up and drops the carry when rounding
overflows the mantissa: 124.5 becomes 64) by torch's, which rounds to nearest even and saturates
as the GPU's ``cvt.rn.satfinite`` does. On a GPU the kernel is the
quantizer's default: bit for bit equal to the torch path and to vLLM's formula run on the same
device, a publisher over CUDA IPC quantizes with it, and ``warmlink bench fp8`` measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is defined
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    emulated = interpreter._convert_float

    def cvt_rn(data, src, dst, rounding):  # the hardware's float32 -> e4m3 cast, as torch rounds it
        if (src, dst) == (tl.float32, tl.float8e4nv):
            return torch.from_numpy(data.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return emulated(data, src, dst, rounding)

    interpreter._convert_float = cvt_rn
    from warmlink.refit._fp8_triton import block_fp8_

    def weight(*shape, seed):
        gen = torch.Generator().manual_seed(seed)
        rows = torch.logspace(-3, 1, shape[-2])[torch.randperm(shape[-2], generator=gen)]
        return (torch.randn(shape, generator=gen) * rows[:, None]).to(torch.bfloat16)

    inv_max = torch.tensor(1.0) / torch.tensor(448.0)  # float32(1 / 448), CUDA's factor for amax / 448.0
    wide = weight(300, 520, seed=3)
    cases = {"partial blocks": weight(300, 260, seed=1), "whole blocks": weight(256, 384, seed=2),
             "experts": weight(2, 200, 136, seed=4), "a strided column part": wide[:, 128:388]}
    bad = []
    for name, x in cases.items():
        *lead, r, c = x.shape
        values = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(*lead, -(-r // 128), -(-c // 128))
        block_fp8_(x, values, scales)
        padded = torch.zeros(*lead, scales.shape[-2] * 128, scales.shape[-1] * 128)
        padded[..., :r, :c] = x.float()
        blocks = padded.view(*lead, scales.shape[-2], 128, scales.shape[-1], 128)
        want = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-4) * inv_max
        if not torch.equal(scales, want):
            bad.append(f"{name}: scales differ at {(scales != want).nonzero()[:3].tolist()}")
        scaled = (blocks * torch.reciprocal(want)[..., :, None, :, None]).reshape(padded.shape)[..., :r, :c]
        off = values.view(torch.uint8) != scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        if off.any():
            bad.append(f"{name}: {int(off.sum())} values differ, e.g. {off.nonzero()[:3].tolist()}")
    print("ok" if not bad else "\\n".join(bad))
""")


def test_the_kernel_in_tritons_interpreter_gives_cudas_values_and_scales():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok", out.stdout


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _weights(device) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 and Qwen3-235B shapes, some with partial blocks, and stacked experts."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"kv_a_proj_with_mqa": (576, 7168), "down_proj": (7168, 2048), "gate_up_proj": (3072, 4096),
              "o_proj": (4096, 8192), "edges": (300, 200), "experts.w13": (8, 1536, 4096)}
    out = {}
    for name, shape in shapes.items():
        rows = torch.logspace(-4, 1, shape[-2])[torch.randperm(shape[-2], generator=gen)]
        out[name] = (torch.randn(shape, generator=gen) * rows[:, None]).to(torch.bfloat16).to(device)
    return out


@pytest.mark.parametrize("_", [None], ids=["cuda"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_kernel_equals_the_torch_path_and_vllms_formula_bit_for_bit(_):
    from _fp8_reference import ref_block

    from warmlink.refit.quantize import Quantizer

    weights = _weights("cuda")
    kernel = Quantizer.standalone(weights, "block", kernel="triton")
    torch_ops = Quantizer.standalone(weights, "block", kernel="torch")
    assert Quantizer.standalone(weights, "block").kernel == "triton"  # the default on CUDA
    kernel.run()
    torch_ops.run()
    torch.cuda.synchronize()
    for name, w in weights.items():
        (v, s), (tv, ts) = kernel.outputs[name], torch_ops.outputs[name]
        rv, rs = ref_block(w)
        assert torch.equal(v.view(torch.uint8), tv.view(torch.uint8)) and torch.equal(s, ts), name
        assert torch.equal(v.view(torch.uint8), rv.view(torch.uint8)) and torch.equal(s, rs), name


def _cmd_publish(state, *, address, secret, prefix):
    from _fp8_world import model, state as model_state

    from warmlink.refit import Publisher
    from warmlink.refit.families import fp8_weights, layouts
    from warmlink.refit.fp8 import Fp8
    from warmlink.rendezvous import Store

    torch.cuda.set_device(0)
    m = model("qwen3")
    weights = fp8_weights(m)
    state["tensors"] = {n: t.cuda() for n, t in model_state(m).items()}
    state["store"] = Store.connect(address, prefix=prefix, timeout_s=120, secret=secret)
    pub = state["pub"] = Publisher(state["store"], backend="cuda_ipc", timeout_s=120)
    for n, lay in layouts(m, convention="hf").items():
        pub.add(n, state["tensors"][n], lay, fp8=Fp8("block") if n in weights else None)
    pub.export()
    return pub.version


def _cmd_step(state, *, seed):
    from _fp8_world import model, state as model_state

    pub = state["pub"]
    with pub.update():
        for n, t in model_state(model("qwen3"), seed).items():
            state["tensors"][n].copy_(t)
    return pub.version


def _worker(control, results):
    from _spawned import close_keys, serve

    serve(control, results, {"publish": _cmd_publish, "step": _cmd_step}, {}, lambda state: close_keys(state, "pub", "store"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_publisher_quantizes_on_its_gpu_and_engine_ranks_receive_bit_exact():
    """A trainer process on GPU 0 publishes Qwen3-shaped BF16 weights quantized by the kernel over
    CUDA IPC; engine ranks here (vLLM layout, TP 1 and 2, on the last GPU) hold vLLM's bytes over
    two versions (the reference run on the GPU: CUDA rounds the block scale its own way)."""
    pytest.importorskip("transformers")
    from _fp8_reference import quantize_state, vllm_fp8
    from _fp8_world import model, state as model_state
    from _spawned import SpawnedWorker

    from warmlink.refit import Receiver
    from warmlink.refit.families import fp8_weights, layouts
    from warmlink.rendezvous import Store

    device = torch.cuda.device_count() - 1
    m = model("qwen3")
    weights = fp8_weights(m)
    server = Store("127.0.0.1", 0, is_server=True, prefix=f"fp8-gpu-{uuid.uuid4().hex[:8]}", timeout_s=120)
    worker = SpawnedWorker(_worker)
    recs = []
    try:
        assert worker.call("publish", timeout_s=300, address=server.address, secret=server.secret,
                           prefix=server.prefix) == 1
        for tp in (1, 2):
            for r in range(tp):
                lays = layouts(m, convention="vllm", tp=tp, rank=r, fp8="block")
                rec = Receiver(server, num_publishers=1, backend="cuda_ipc", device=device, timeout_s=120)
                targets = {n: torch.zeros(lay.shape, dtype=getattr(torch, lay.dtype), device=device)
                           for n, lay in lays.items()}
                for n, lay in lays.items():
                    rec.add(n, lay, targets[n])
                recs.append((tp, r, rec, targets))
        for version, seed in ((1, None), (2, 5)):
            if version > 1:
                assert worker.call("step", timeout_s=120, seed=seed) == 2
            sd = {n: t.to(f"cuda:{device}") for n, t in model_state(m, seed).items()}
            quantized = quantize_state(sd, weights, "block")
            for tp, r, rec, targets in recs:
                assert rec.refit().version == version
                want = vllm_fp8(m.config, sd, weights, "block", tp, r, quantized)
                assert set(want) == set(targets)
                wrong = [n for n, t in targets.items() if not torch.equal(
                    t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                    want[n].view(torch.uint8) if want[n].dtype == torch.float8_e4m3fn else want[n])]
                assert wrong == [], (tp, r, version, wrong)
    finally:
        for _, _, rec, _ in recs:
            rec.close()
        worker.stop()
        server.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_fp8_prints_the_kernels_share_of_a_flat_copy(tmp_path):
    record = tmp_path / "fp8.json"
    out = subprocess.run([sys.executable, "-m", "warmlink.cli.main", "bench", "fp8", "--scale", "0.05", "--repeats", "3",
                          "--json", str(record)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(record.read_text())
    assert rec["kernel"] == "triton" and rec["device"].startswith("cuda")
    assert 0 < rec["quantize"]["gbps"] and 0 < rec["copy"]["gbps"] and 0 < rec["share_of_copy"]
    assert "share of a flat copy" in out.stdout
