"""What both reconfigure benches share (``bench.reconfigure`` and ``bench.reconfigure_nccl``): a
child process's start, its exit, its phases, and the check of the tensors it received."""

from __future__ import annotations

import time

from warmlink.bench._proc import Group
from warmlink.bench.lifecycle import make_tensors

__all__ = ["joined", "new_process", "retire", "wrong_tensors"]


def new_process(device_idx: int) -> tuple[object, dict]:
    """First thing in a fresh child: imports and the CUDA context, timed.

    Returns:
        ``(device, {"t_enter": monotonic stamp at entry, "imports_s", "cuda_s"})``; ``cuda_s`` is
        ``set_device`` + ``torch.empty(1, device)`` + synchronize (0 on the CPU).
    """
    t_enter = time.monotonic()
    import importlib

    import torch

    # torch.distributed (both methods' store is a TCPStore), warmlink, and the backend's module, so
    # that "connect" is the link's own work and not imports.
    backend = "warmlink.transport.shm" if device_idx < 0 else "warmlink.transport.cuda_ipc"
    for name in ("torch.distributed", "warmlink.refit", "warmlink.rendezvous", backend):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a backend that cannot load fails later, in the library, with its own error
    t_imp = time.monotonic()
    if device_idx < 0:
        return torch.device("cpu"), {"t_enter": t_enter, "imports_s": t_imp - t_enter, "cuda_s": 0.0}
    device = torch.device("cuda", device_idx)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    return device, {"t_enter": t_enter, "imports_s": t_imp - t_enter, "cuda_s": time.monotonic() - t_imp}


def retire(group: Group, tag: str, *, kill: bool, timeout_s: float) -> None:
    """Take ``tag`` out of ``group``: SIGKILL it (``kill``) or wait for it to exit; bounded wait.

    Raises:
        RuntimeError: the process is still alive after ``timeout_s`` (it is then killed).
    """
    proc = group.procs.pop(tag)
    group.controls.pop(tag, None)
    if kill:
        proc.kill()
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
        raise RuntimeError(f"bench reconfigure: {tag} did not exit within {timeout_s} s; killed")


def wrong_tensors(model: dict, num_tensors: int, tensor_mib: float, device, seed: int) -> int:
    """How many of ``make_tensors(num_tensors, tensor_mib, device, seed)`` differ in ``model``."""
    import torch

    expected = make_tensors(num_tensors, tensor_mib, device, seed)
    return sum(not torch.equal(model[n].view(torch.int16), expected[n].view(torch.int16)) for n in expected)


def joined(t_from: float, msg: dict) -> dict:
    """Phases of a new process from its ``ready`` message; ``t_from`` is when the stage began."""
    rep = msg.get("report")
    out = {"start_imports_s": msg["t_enter"] - t_from + msg["imports_s"], "cuda_s": msg["cuda_s"],
           "model_s": msg["model_s"], "store_s": msg["store_s"], "create_s": msg.get("create_s")}
    if rep is not None:
        out.update({k: rep[k] for k in ("connect_s", "sync_s", "plan_s", "alloc_s", "register_s", "pull_s")},
                   translate_install_s=rep["translate_s"] + rep["install_s"], refit_s=rep["total_s"], created=msg["created"])
    else:
        out.update(connect_s=msg["init_s"], first_collective_s=msg["first_collective_s"], pull_s=msg["broadcast_s"],
                   refit_s=msg["init_s"] + msg["first_collective_s"] + msg["broadcast_s"])
    out["total_s"] = msg["t_ready"] - t_from
    return out
