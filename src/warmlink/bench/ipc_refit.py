"""The colocated refit frameworks use today: CUDA IPC handles exported and opened every cycle.

vLLM's ``ipc`` weight-transfer backend (unpacked) and verl's ``update_weights_from_ipc`` do, per
update: the trainer exports every tensor with ``torch.multiprocessing.reductions.reduce_tensor``
(an IPC handle per tensor), sends the handles, and the engine rebuilds each tensor from its
handle (``rebuild_cuda_tensor``: opens it) and copies it into its parameter (``load_weights`` ->
``param.copy_``); after the update the trainer calls ``torch.cuda.ipc_collect``. ``run_ipc_refit``
times exactly that, trainer and engine in two processes, so that ``warmlink bench refit`` prints
it beside warmlink's warm cycle from the same run.

Phases, on the engine's clock (a cycle starts when the engine asks for the next update):
``export_s`` the trainer's handles for every tensor (including the hand-over), ``open_s`` the
engine rebuilding them, ``copy_s`` the copies and a device synchronize, ``total_s`` the cycle.
"""

from __future__ import annotations

import time

from warmlink.bench._proc import Group

__all__ = ["run_ipc_refit"]


def _trainer(*, control, results, spec, device_idx, seed):
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from warmlink.bench.refit import build_physical

    torch.cuda.set_device(device_idx)
    layouts = spec.layouts(1, 0)
    tensors = [build_physical(layout, torch.device("cuda", device_idx), seed) for layout in layouts.values()]
    torch.cuda.synchronize()
    results.put({"tag": "trainer", "event": "ready"})
    while (msg := control.get(timeout=600)) is not None:
        if msg[0] == "export":
            t = time.perf_counter()
            handles = [reduce_tensor(x)[1] for x in tensors]  # a fresh export every update
            results.put({"tag": "trainer", "event": "handles", "handles": handles, "export_s": time.perf_counter() - t})
        elif msg[0] == "collect":
            torch.cuda.ipc_collect()
            results.put({"tag": "trainer", "event": "collected"})


def _engine(*, control, results, spec, device_idx, seed):
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from warmlink.bench.refit import build_physical

    torch.cuda.set_device(device_idx)
    layouts = spec.layouts(1, 0)
    params = [torch.empty(layout.shape, dtype=getattr(torch, layout.dtype), device="cuda") for layout in layouts.values()]
    results.put({"tag": "engine", "event": "ready"})
    while (msg := control.get(timeout=600)) is not None:
        if msg[0] == "load":
            t0 = time.perf_counter()
            weights = []
            for args in msg[1]:
                args = list(args)
                args[6] = device_idx  # the receiver's device index, as vLLM's ipc engine sets it
                weights.append(rebuild_cuda_tensor(*args))
            t1 = time.perf_counter()
            for p, w in zip(params, weights):
                p.copy_(w)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            del weights
            results.put({"tag": "engine", "event": "loaded", "open_s": t1 - t0, "copy_s": t2 - t1})
        elif msg[0] == "verify":
            bad = [n for (n, layout), p in zip(layouts.items(), params)
                   if not torch.equal(p, build_physical(layout, torch.device("cuda", device_idx), seed))]
            results.put({"tag": "engine", "event": "verified", "bad": bad[:5], "num_bad": len(bad)})


def run_ipc_refit(spec, *, cycles: int, device: int, seed: int = 0, timeout_s: float = 300.0) -> dict:
    """``cycles`` updates the ``ipc`` way from a trainer process to an engine process, both on CUDA
    ``device``. Returns ``{"cycles": [{"export_s", "open_s", "copy_s", "total_s"}], "correct"}``."""
    with Group(timeout_s) as group:
        group.start("trainer", _trainer, spec=spec, device_idx=device, seed=seed)
        group.expect("ready", 1)
        group.start("engine", _engine, spec=spec, device_idx=device, seed=seed)
        group.expect("ready", 1)
        rows = []
        for c in range(1, cycles + 1):
            t0 = time.perf_counter()
            group.send("trainer", ("export",))
            (handles,) = group.expect("handles", 1)
            t1 = time.perf_counter()
            group.send("engine", ("load", handles["handles"]))
            (loaded,) = group.expect("loaded", 1)
            group.send("trainer", ("collect",))
            group.expect("collected", 1)
            t2 = time.perf_counter()
            rows.append({"cycle": c, "export_s": t1 - t0, "open_s": loaded["open_s"], "copy_s": loaded["copy_s"],
                         "total_s": t2 - t0})
        group.send("engine", ("verify",))
        (verified,) = group.expect("verified", 1)
    return {"label": "ipc", "nbytes": spec.nbytes, "cycles": rows, "correct": verified["num_bad"] == 0,
            "bad": verified["bad"]}
