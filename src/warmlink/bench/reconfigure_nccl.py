"""The NCCL baseline of ``warmlink bench reconfigure``: the same change done with a new group.

A trainer process (spawned once, holding the tensors) stays; each new inference process and the
trainer create a process group on a fresh store prefix (``init_process_group``, no ``device_id``,
so NCCL creates its communicator at the first collective), run a 1-element broadcast (the
communicator) and broadcast every tensor (the first transfer). A departing process leaves cleanly:
both ranks call ``destroy_process_group`` (a SIGKILLed NCCL peer would leave the trainer's
communicator unusable until aborted, so the baseline gets its best case), then the departing
process is SIGKILLed as warmlink's receivers are. gloo on CPU.

The new process waits, after its own setup (imports, CUDA context, model, store), for the
parent's go, given to both ranks at once, so that the trainer's figures are the group's cost and
not the time the new process takes to start.
"""

from __future__ import annotations

import time

from warmlink.bench._children import joined, new_process, retire, wrong_tensors
from warmlink.bench._proc import Group
from warmlink.bench.lifecycle import make_tensors, tensor_shape

__all__ = ["nccl_repeat", "nccl_trainer"]


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _group(backend: str, tcp, prefix: str, rank: int, tensors: list, device, timeout_s: float) -> dict:
    """Create the 2-rank group, run the first collective and broadcast ``tensors`` from rank 0; timed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, tcp), rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    t1 = time.perf_counter()
    dist.broadcast(torch.ones(1, device=device), src=0)
    _sync(device)
    t2 = time.perf_counter()
    for t in tensors:
        dist.broadcast(t, src=0)
    _sync(device)
    t3 = time.perf_counter()
    return {"init_s": t1 - t0, "first_collective_s": t2 - t1, "broadcast_s": t3 - t2, "t_ready": time.monotonic()}


def _leave(device) -> float:
    import torch.distributed as dist

    _sync(device)
    t0 = time.perf_counter()
    dist.destroy_process_group()
    return time.perf_counter() - t0


def nccl_trainer(*, control, results, me, host, port, backend, device_idx, num_tensors, tensor_mib, seed, timeout_s):
    """The staying rank 0: joins a new group on ``("join", prefix)``, leaves it on ``("leave",)``."""
    from datetime import timedelta

    import torch.distributed as dist

    from warmlink.bench._devices import device_of

    device = device_of(device_idx)
    tensors = list(make_tensors(num_tensors, tensor_mib, device, seed).values())
    _sync(device)
    tcp = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
    results.put({"tag": me, "event": "ready"})
    while (msg := control.get(timeout=timeout_s)) is not None:
        if msg[0] == "join":
            out = _group(backend, tcp, msg[1], 0, tensors, device, timeout_s)
            results.put({"tag": me, "event": "joined", **out, "cpu_end_s": time.process_time()})
        elif msg[0] == "leave":
            cpu_start_s = time.process_time()
            results.put({"tag": me, "event": "left", "destroy_s": _leave(device), "cpu_start_s": cpu_start_s})


def _joiner(*, control, results, me, host, port, prefix, backend, device_idx, num_tensors, tensor_mib, seed, timeout_s,
            verify):
    device, ph = new_process(device_idx)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    model = {f"w{i:03d}": torch.zeros(tensor_shape(tensor_mib), dtype=torch.bfloat16, device=device)
             for i in range(num_tensors)}
    _sync(device)
    t1 = time.perf_counter()
    tcp = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
    t2 = time.perf_counter()
    results.put({"tag": me, "event": "prepared"})
    if control.get(timeout=timeout_s) is None:
        return
    out = _group(backend, tcp, prefix, 1, list(model.values()), device, timeout_s)
    num_bad = wrong_tensors(model, num_tensors, tensor_mib, device, seed) if verify else 0
    results.put({"tag": me, "event": "joined", **ph, **out, "model_s": t1 - t0, "store_s": t2 - t1, "num_bad": num_bad})
    if control.get(timeout=timeout_s) is None:
        return
    results.put({"tag": me, "event": "left", "destroy_s": _leave(device)})


def nccl_repeat(group: Group, stayer: str, r: int, *, last: bool, host: str, port: int, device_idx: int, common: dict,
                timeout_s: float) -> dict:
    """One repeat's init / reconfigure / destroy with new groups; ``stayer`` runs ``nccl_trainer``.

    Returns:
        The same shape as ``warmlink_repeat``; the stayer's ``busy_s`` is the trainer's wall seconds
        inside ``destroy_process_group``, ``init_process_group`` and the collectives, ``cpu_s`` its
        process CPU seconds from the old group's teardown to the new group's first transfer.
    """
    backend = "gloo" if device_idx < 0 else "nccl"
    kw = {k: common[k] for k in ("num_tensors", "tensor_mib", "seed", "timeout_s")}

    def spawn(tag: str) -> tuple[float, dict, dict]:
        t = time.monotonic()
        prefix = f"nccl/{stayer}/{tag}"  # a fresh prefix: a new group
        group.start(tag, _joiner, me=tag, host=host, port=port, prefix=prefix, backend=backend, device_idx=device_idx,
                    verify=last, **kw)
        group.expect("prepared", 1)
        group.send(stayer, ("join", prefix))
        group.send(tag, ("go",))
        msgs = {m["tag"]: m for m in group.expect("joined", 2)}
        return t, msgs[tag], msgs[stayer]

    def leave(tag: str, kill: bool) -> tuple[float, float]:
        group.send(tag, ("leave",))
        group.send(stayer, ("leave",))
        msgs = {m["tag"]: m for m in group.expect("left", 2)}
        retire(group, tag, kill=kill, timeout_s=timeout_s)  # killed once its group is gone, like warmlink's
        return msgs[tag]["destroy_s"], msgs[stayer]

    a, b = f"nccl{r}a", f"nccl{r}b"
    t, msg, _tr = spawn(a)
    init = joined(t, msg)
    correct = msg["num_bad"] == 0
    t_change = time.monotonic()
    _, left = leave(a, kill=True)
    t, msg, tr = spawn(b)
    reconf = {"exit_s": t - t_change, **joined(t, msg), "total_s": msg["t_ready"] - t_change}
    busy = left["destroy_s"] + tr["init_s"] + tr["first_collective_s"] + tr["broadcast_s"]
    reconf["stayer"] = {"busy_s": busy, "cpu_s": tr["cpu_end_s"] - left["cpu_start_s"], "destroy_s": left["destroy_s"],
                        "init_s": tr["init_s"], "first_collective_s": tr["first_collective_s"],
                        "broadcast_s": tr["broadcast_s"], "created": None}
    correct &= msg["num_bad"] == 0
    t = time.monotonic()
    close_s, _ = leave(b, kill=False)
    destroy = {"close_s": close_s, "total_s": time.monotonic() - t}
    destroy["exit_s"] = destroy["total_s"] - close_s
    return {"init": init, "reconfigure": reconf, "destroy": destroy,
            "cycle_s": init["total_s"] + reconf["total_s"] + destroy["total_s"], "correct": correct}
