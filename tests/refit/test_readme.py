"""The README's refit snippets, run exactly as written: FSDP2 trainer ranks, vLLM-layout receivers.

The trainer snippet runs in each rank of a gloo world of 2 whose model ``fully_shard`` has sharded;
the receiver snippet runs here for both ranks of a TP-2 vLLM layout. After the snippet's training
loop, what the receivers install must be the stepped weights: the trainer's ``full_tensor()`` as
vLLM lays it out (reference from plain torch ops), not the weights before the steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dtensor_world import tiny_model
from _harness import module_of
from _references import ref_vllm
from _spawned import SpawnedWorker, serve

from warmlink.refit.families import layouts
from warmlink.rendezvous import Store

README = Path(__file__).resolve().parents[2] / "README.md"
TIMEOUT_S = 120.0
WORLD, TP, STEPS = 2, 2, 2


def snippet(marker: str, lang: str = "python") -> str:
    """The README's ``lang`` block containing ``marker``, as written."""
    blocks = re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"expected one README {lang} block with {marker!r}, found {len(found)}"
    return found[0]


def _cmd_train(state, *, rank, init_file, address, secret, code):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = tiny_model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(7)  # every rank trains on the same batches
    batches = [torch.randint(0, model.config.vocab_size, (2, 8), generator=gen) for _ in range(STEPS)]
    ns = {"address": address, "secret": secret, "rank": rank, "world": WORLD, "model": model, "batches": batches,
          "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - the README's own snippet
    state["keep"] = (ns["pub"], ns["store"])  # receivers read this memory after the snippet ends
    after = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return ns["pub"].version, before, after


def _reset(state):
    import torch.distributed as dist

    for obj in state.pop("keep", ()):
        obj.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(control, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve(control, results, {"train": _cmd_train}, {}, _reset)


def test_readme_refit_snippets_install_the_stepped_weights(tmp_path):
    train, receive = snippet("pub.add_module(model)"), snippet("rec = Receiver(store, num_publishers=world)")
    config = tiny_model().config
    with Store("127.0.0.1", 0, is_server=True, prefix="job", timeout_s=TIMEOUT_S) as server:
        workers = [SpawnedWorker(_worker) for _ in range(WORLD)]
        try:
            init_file = os.path.join(str(tmp_path), "pg")
            for r, w in enumerate(workers):
                w.send("train", rank=r, init_file=init_file, address=server.address, secret=server.secret, code=train)
            (version, before, after), _ = (w.result(TIMEOUT_S) for w in workers)
            assert version == 1 + STEPS
            assert all(not torch.equal(before[n], after[n]) for n in after), "the steps left a tensor unchanged"
            for tp_rank in range(TP):
                engine = module_of({n: torch.zeros(lay.shape, dtype=getattr(torch, lay.dtype))
                                    for n, lay in layouts(config, convention="vllm", tp=TP, rank=tp_rank).items()})
                ns = {"address": server.address, "secret": server.secret, "world": WORLD, "engine": engine, "config": config, "tp": TP,
                      "tp_rank": tp_rank}
                exec(compile(receive, str(README), "exec"), ns)  # noqa: S102 - the README's own snippet
                try:
                    assert ns["report"].version == version
                    want = ref_vllm(config, after, TP, tp_rank)
                    got = dict(engine.named_parameters())
                    assert set(got) == set(want)
                    wrong = [n for n in want if not torch.equal(got[n], want[n])]
                    assert wrong == [], f"rank {tp_rank}: {wrong}"
                finally:
                    ns["rec"].close()
                    ns["store"].close()
        finally:
            for w in workers:
                w.stop()


def test_readme_refit_job_command_runs_and_checks_the_weights():
    """The README's command for examples/refit_job.py, run as written in a shell whose ``python``
    is this interpreter (the README's install line activates its venv): it exits 0 and its
    launcher's check line says every version reached the engine bit for bit."""
    command = snippet("examples/refit_job.py", "bash")
    root = README.parent
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert re.search(r"^check OK: 1 engine\(s\) held the trainer's weights bit for bit at versions 1\.\.4$",
                     out.stdout, flags=re.M), out.stdout
    assert re.findall(r"^engine 0: installed version (\d+)", out.stdout, flags=re.M) == ["1", "2", "3", "4"]
