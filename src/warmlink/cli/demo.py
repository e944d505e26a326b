"""``warmlink demo``: a trainer and an inference engine, refit after every optimizer step.

Processes (spawned, all on this machine):

* two trainer ranks (tensor parallel 2), each holding the Llama model and publishing its rank's
  tensors in vLLM's layout (fused ``qkv_proj`` and ``gate_up_proj``, vocabulary padded to 64);
* one inference rank (TP 1) with its own, differently initialised copy of the model in the plain
  Hugging Face layout.

Each step: both trainer ranks take the same optimizer step inside ``publisher.update()`` (the
publisher rebuilds the fused tensors from the live parameters when it publishes), and the inference
rank refits (un-fusing QKV and gate/up and joining the two shards on the way) and checks that its
logits equal the trainer's bit for bit.

The trainer ranks run the full model replicated (the same seed and batches give the same weights)
and publish slices of it: the refit sees exactly what a real TP trainer exposes, without the demo
needing a tensor-parallel training implementation. See Note [Demo determinism] in
``warmlink.refit._demo_model``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import tempfile
import time
import traceback

__all__ = ["run_demo"]

_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_TP = 2


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _device_for(role: str) -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    n = torch.cuda.device_count()
    return "cuda:0" if role == "trainer" else f"cuda:{n - 1}"


def _trainer(address: str, secret: str, rank: int, steps: int, seed: int, control, results, workdir: str) -> None:
    try:
        os.environ.update(_SAFE_ENV)
        import torch

        from warmlink.refit import Publisher
        from warmlink.refit._demo_model import build_model, configure_determinism, make_optimizer, probe_logits, tiny_llama_config, train_step
        from warmlink.refit.families import layouts
        from warmlink.rendezvous import Store

        configure_determinism()
        device = _device_for("trainer")
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        model = build_model(tiny_llama_config(), seed, device)
        optimizer = make_optimizer(model)
        rank_layouts = layouts(model, convention="vllm", tp=_TP, rank=rank)
        with Store.connect(address, prefix="demo", secret=secret) as store, Publisher(store, rank=rank, world_size=_TP) as pub:
            pub.add_module(model, rank_layouts)  # built from the live parameters at every publish
            pub.export()
            results.put({"role": "trainer", "rank": rank, "event": "exported", "num_tensors": len(rank_layouts)})
            for step in range(1, steps + 1):
                control.get(timeout=120)  # the launcher paces steps so the table stays in order
                with pub.update():
                    loss = train_step(model, optimizer, step, seed)
                msg = {"role": "trainer", "rank": rank, "event": "published", "step": step, "version": pub.version, "loss": loss}
                if rank == 0:
                    logits = probe_logits(model, seed)
                    torch.save(logits.cpu(), os.path.join(workdir, f"logits_{step}.pt"))
                    msg["digest"] = _digest(logits)
                results.put(msg)
            control.get(timeout=120)
    except BaseException:
        results.put({"role": "trainer", "rank": rank, "event": "error", "traceback": traceback.format_exc()})


def _inference(address: str, secret: str, steps: int, seed: int, control, results, workdir: str) -> None:
    try:
        os.environ.update(_SAFE_ENV)
        import torch

        from warmlink.refit import Receiver
        from warmlink.refit._demo_model import build_model, configure_determinism, probe_logits, tiny_llama_config
        from warmlink.rendezvous import Store

        configure_determinism()
        device = _device_for("inference")
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        model = build_model(tiny_llama_config(), seed + 1, device)  # deliberately different weights
        with Store.connect(address, prefix="demo", secret=secret) as store, Receiver(store, num_publishers=_TP) as rec:
            rec.add_module(model)  # every tensor whole, by its HF name
            for step in range(1, steps + 1):
                version = control.get(timeout=120)
                report = rec.refit(version=version)
                logits = probe_logits(model, seed)
                expected = torch.load(os.path.join(workdir, f"logits_{step}.pt"), weights_only=True)
                max_diff = float((logits.cpu() - expected).abs().max())
                results.put({
                    "role": "inference", "event": "refit", "step": step, "report": report.as_dict(),
                    "digest": _digest(logits), "max_abs_diff": max_diff,
                })
    except BaseException:
        results.put({"role": "inference", "event": "error", "traceback": traceback.format_exc()})


def run_demo(steps: int = 5, seed: int = 0, timeout_s: float = 120.0, echo=print) -> bool:
    """Run the demo; returns True when every refit reproduced the trainer's logits exactly.

    Args:
        steps: optimizer steps, each followed by a refit.
        seed: run seed.
        timeout_s: limit for any single wait on a child process, seconds.
        echo: where progress lines go (``print`` in the CLI).
    """
    import multiprocessing as mp

    from warmlink.bench.report import cycle_table
    from warmlink.rendezvous import Store

    os.environ.update(_SAFE_ENV)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    controls = [ctx.Queue() for _ in range(_TP + 1)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="warmlink-demo-") as workdir, Store("127.0.0.1", 0, is_server=True, prefix="demo") as store:
        procs = [ctx.Process(target=_trainer, args=(store.address, store.secret, r, steps, seed, controls[r], results, workdir), daemon=True) for r in range(_TP)]
        procs.append(ctx.Process(target=_inference, args=(store.address, store.secret, steps, seed, controls[_TP], results, workdir), daemon=True))
        for p in procs:
            p.start()
        echo(f"warmlink demo: 2 trainer ranks (TP=2, vLLM layout) -> 1 inference rank (TP=1, HF layout), device {_device_for('trainer')} -> {_device_for('inference')}")

        def next_msg(want: str):
            deadline = time.perf_counter() + timeout_s
            while True:
                try:
                    msg = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead or time.perf_counter() > deadline:
                        raise RuntimeError(f"warmlink demo: a process died or stalled (exit codes {[p.exitcode for p in procs]})")
                    continue
                if msg["event"] == "error":
                    raise RuntimeError(f"warmlink demo: {msg['role']} failed:\n{msg['traceback']}")
                if msg["event"] == want:
                    return msg

        rows, all_equal = [], True
        try:
            for _ in range(_TP):
                exported = next_msg("exported")
            echo(f"  trainer ranks exported {exported['num_tensors']} tensors each")
            for step in range(1, steps + 1):
                for r in range(_TP):
                    controls[r].put(step)
                published = [next_msg("published") for _ in range(_TP)]
                trainer = next(m for m in published if m["rank"] == 0)
                controls[_TP].put(trainer["version"])
                got = next_msg("refit")
                equal = got["digest"] == trainer["digest"]
                all_equal &= equal
                rep = got["report"]
                rows.append({
                    "cycle": step, "loss": trainer["loss"], "connect": rep["connect_s"], "alloc": rep["alloc_s"], "register": rep["register_s"],
                    "plan": rep["plan_s"], "pull": rep["pull_s"], "translate": rep["translate_s"],
                    "install": rep["install_s"], "total": rep["total_s"],
                    "created": sum(rep["created"].values()), "logits": "equal" if equal else f"DIFF {got['max_abs_diff']:.2e}",
                })
                echo(f"  step {step}: loss {trainer['loss']:.4f}, refit v{rep['version']} in {rep['total_s'] * 1e3:.2f} ms, logits {rows[-1]['logits']}")
            for c in controls[:_TP]:
                c.put(None)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
    echo("")
    echo(cycle_table(rows, ["cycle", "loss", "connect", "alloc", "register", "plan", "pull", "translate", "install", "total", "created", "logits"],
                     title="refit cycles (ms; 'created' = allocations + registrations + plans + opens in that cycle)"))
    echo(f"\n{'OK' if all_equal else 'FAILED'}: {steps} refits, inference logits {'equal' if all_equal else 'differ from'} the trainer's; {time.perf_counter() - start:.1f} s")
    return all_equal
