"""Engine churn over ``cuda_ipc`` with real processes on two GPUs: zero growth after a warm-up.

Issue 3, "What must hold" (GPU): "the same churn test on GPU with zero growth of GPU memory and
handles". Two tests, both needing two CUDA devices (skipped otherwise):

* ``test_lifecycles_zero_growth``: a publisher process on cuda:0 and a receiver process on cuda:1
  run a few hundred lifecycles (Publisher create + add + export, Receiver create + add + refit +
  close, Publisher close), new values every time, every received byte compared with values the
  receiver builds itself. After a warm-up, each process's pooled objects (live, idle), open peer
  mappings, ``torch.cuda.memory_allocated`` / ``memory_reserved``, device memory in use (the
  driver's ``mem_get_info``) and open file descriptors must not grow.
* ``test_receiver_process_replacements_zero_growth``: the publisher process stays while a new
  receiver process refits once and exits, again and again; the publisher process's GPU memory,
  mappings, pooled objects and descriptors must not grow. Receiver processes start (import torch,
  create their CUDA context) in batches, while the previous batch refits, and exit in parallel: a
  new process costs seconds, and 48 of them one after another would not fit a minute.

Every wait is bounded (``SpawnedWorker.result``): a crashed or silent child fails the test. Device
memory in use is device-wide: it may only shrink, and after receiver processes exit it is read
again (bounded) until the driver has reclaimed their contexts.
"""

from __future__ import annotations

import gc
import math
import os
import time
import uuid

import pytest
import torch

from _spawned import SpawnedWorker, serve

from tests import _growth
from warmlink import pool
from warmlink._dtypes import dtype_name
from warmlink.pool import peers
from warmlink.refit import Publisher, Receiver
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TIMEOUT_S = 60.0  # any single wait; a CUDA context in a new process takes seconds
NUM_WARMUP = 20
NUM_LIFECYCLES = 300
NUM_REPLACEMENTS = 48
BATCH = 16  # receiver processes started at once
SETTLE_S = 10.0  # how long a departed process's device memory may take to come back

# Small tensors of several dtypes and sizes, one of them odd-sized: name -> (shape, dtype).
SPECS = {
    "embed": ((257, 64), torch.bfloat16),
    "qkv": ((96, 64), torch.bfloat16),
    "o": ((64, 64), torch.float32),
    "norm": ((64,), torch.float32),
    "bias": ((3,), torch.float16),
}
LAYOUTS = {n: TensorLayout.plain(n, dtype_name(dt), shape) for n, (shape, dt) in SPECS.items()}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA devices"),
]


def values(name: str, i: int, device) -> torch.Tensor:
    """What tensor ``name`` holds in lifecycle (or version) ``i``: the same bits in every process."""
    shape, dtype = SPECS[name]
    k = sorted(SPECS).index(name)
    base = torch.arange(math.prod(shape), device=device, dtype=torch.float32) * 0.25
    return (base + (i * 31 + k)).to(dtype).view(shape)


def gpu_snapshot(device: int) -> dict:
    """Everything of this process a lifecycle could leave behind, on ``device``."""
    gc.collect()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {
        "pool": {k: (c["live"], c["idle"]) for k, c in pool.stats().items() if (c["live"], c["idle"]) != (0, 0)},
        "open_mappings": peers.open_mappings(),
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "device_used": total - free,
        "fds": len(os.listdir("/proc/self/fd")),
    }


# -- worker process -------------------------------------------------------------------------------------------
def _cmd_setup(state: dict, *, role: str, device: int, address: str, secret: str, prefix: str) -> int:
    torch.cuda.set_device(device)
    state["device"] = device
    state["store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    # Publisher tensors and receiver targets live for the whole process, as a model does.
    state["tensors"] = {n: torch.zeros(shape, dtype=dt, device=device) for n, (shape, dt) in SPECS.items()}
    torch.cuda.synchronize(device)
    return os.getpid()


def _fill(state: dict, i: int) -> None:
    for n, t in state["tensors"].items():
        t.copy_(values(n, i, state["device"]))
    torch.cuda.synchronize(state["device"])


def _cmd_pub_create(state: dict, *, i: int) -> int:
    _fill(state, i)
    pub = Publisher(state["store"], rank=0, world_size=1, backend="cuda_ipc", timeout_s=TIMEOUT_S)
    for n, t in state["tensors"].items():
        pub.add(n, t, LAYOUTS[n])
    pub.export()
    state["pub"] = pub
    return pub.generation


def _cmd_pub_update(state: dict, *, i: int) -> int:
    pub = state["pub"]
    pub.begin_update(timeout_s=10.0)
    _fill(state, i)
    return pub.publish()


def _cmd_pub_close(state: dict) -> None:
    state.pop("pub").close()


def _cmd_recv_cycle(state: dict, *, i: int, version: int | None = None) -> dict:
    """One receiver lifecycle: create, add, refit, check every byte, close."""
    device, targets = state["device"], state["tensors"]
    for t in targets.values():
        t.fill_(-1)  # every lifecycle must deliver every byte itself
    rec = Receiver(state["store"], num_publishers=1, device=device, backend="cuda_ipc", timeout_s=TIMEOUT_S)
    try:
        for n, t in targets.items():
            rec.add(n, LAYOUTS[n], t)
        report = rec.refit(version=version, timeout_s=TIMEOUT_S)
    finally:
        rec.close()
    bad = [n for n, t in targets.items() if not torch.equal(t, values(n, i, device))]
    return {"version": report.version, "bad": bad, "created": report.created}


def _cmd_reset(state: dict) -> None:
    for key in ("pub", "store"):
        obj = state.pop(key, None)
        if obj is not None:
            obj.close()


_COMMANDS = {
    "setup": _cmd_setup,
    "pub_create": _cmd_pub_create,
    "pub_update": _cmd_pub_update,
    "pub_close": _cmd_pub_close,
    "recv_cycle": _cmd_recv_cycle,
    "snapshot": lambda state: gpu_snapshot(state["device"]),
}


def _worker_main(control, results) -> None:
    state: dict = {}
    pool.set_enabled(True)
    serve(control, results, _COMMANDS, state, _cmd_reset)


# -- harness ------------------------------------------------------------------------------------------------
@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"churn-gpu-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as s:
        yield s


@pytest.fixture
def workers():
    """Spawns workers on demand; every one is stopped (killed if it does not exit) at the end."""
    started: list[SpawnedWorker] = []

    def spawn(n: int) -> list[SpawnedWorker]:
        new = [SpawnedWorker(_worker_main) for _ in range(n)]
        started.extend(new)
        return new

    yield spawn
    for w in started:
        w.stop(timeout_s=10)


def growth(before: dict, after: dict) -> dict:
    """What grew between two snapshots: exact for this process's counts, device memory may only shrink."""
    return _growth.growth(before, after, ("open_mappings", "allocated", "reserved", "fds"), ("device_used",))


def settled_snapshot(worker: SpawnedWorker, baseline: dict | None) -> dict:
    """A snapshot, read again (at most ``SETTLE_S``) while device memory is above ``baseline``'s."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        snap = worker.call("snapshot", timeout_s=TIMEOUT_S)
        if baseline is None or snap["device_used"] <= baseline["device_used"] or time.monotonic() > deadline:
            return snap
        time.sleep(0.2)


def _setup(w: SpawnedWorker, store: Store, role: str, device: int) -> None:
    w.call("setup", role=role, device=device, address=store.address, secret=store.secret, prefix=store.prefix, timeout_s=2 * TIMEOUT_S)


# -- tests --------------------------------------------------------------------------------------------------
def test_lifecycles_zero_growth(store, workers) -> None:
    pub, rec = workers(2)
    _setup(pub, store, "pub", 0)
    _setup(rec, store, "recv", 1)
    before = {}
    start = time.perf_counter()
    for i in range(1, NUM_WARMUP + NUM_LIFECYCLES + 1):
        pub.call("pub_create", i=i, timeout_s=TIMEOUT_S)
        out = rec.call("recv_cycle", i=i, timeout_s=TIMEOUT_S)
        pub.call("pub_close", timeout_s=TIMEOUT_S)
        assert out["version"] == 1 and out["bad"] == [], f"lifecycle {i}: {out}"
        if i > NUM_WARMUP:  # warm: nothing created (arenas, registrations, mappings, plans)
            assert not any(out["created"].values()), f"lifecycle {i} created {out['created']}"
        if i == NUM_WARMUP:
            before = {"pub": pub.call("snapshot"), "recv": rec.call("snapshot")}
            start = time.perf_counter()
    per_ms = (time.perf_counter() - start) / NUM_LIFECYCLES * 1e3
    for side, w in (("pub", pub), ("recv", rec)):
        after = settled_snapshot(w, before[side])
        assert growth(before[side], after) == {}, f"{side} grew over {NUM_LIFECYCLES} lifecycles ({per_ms:.2f} ms each)"


def _start_receivers(workers, store: Store, n: int) -> list[SpawnedWorker]:
    """``n`` receiver processes told to set up at once: imports and CUDA contexts overlap."""
    batch = workers(n)
    for w in batch:
        w.send("setup", role="recv", device=1, address=store.address, secret=store.secret, prefix=store.prefix)
    return batch


def test_receiver_process_replacements_zero_growth(store, workers) -> None:
    (pub,) = workers(1)
    batch = _start_receivers(workers, store, min(BATCH, NUM_REPLACEMENTS))
    _setup(pub, store, "pub", 0)
    pub.call("pub_create", i=1)
    version, done, before = 1, 0, None
    while done < NUM_REPLACEMENTS:
        left = NUM_REPLACEMENTS - done - len(batch)
        upcoming = _start_receivers(workers, store, min(BATCH, left)) if left > 0 else []
        for w in batch:
            i = done + 1
            if done > 0:
                version = pub.call("pub_update", i=i)
            w.result(timeout_s=2 * TIMEOUT_S)  # its setup
            out = w.call("recv_cycle", i=i, version=version)
            assert out["version"] == version and out["bad"] == [], f"replacement {i}: {out}"
            w.control.put(None)  # exit now; joined below, so that exits overlap too
            done += 1
        for k, w in enumerate(batch):
            assert w.stop(timeout_s=TIMEOUT_S) == 0, f"receiver process {done - len(batch) + k + 1} did not exit cleanly"
        if before is None:  # the first batch warmed the publisher up
            before = settled_snapshot(pub, None)
        batch = upcoming
    after = settled_snapshot(pub, before)
    assert growth(before, after) == {}, f"publisher process grew over {NUM_REPLACEMENTS - BATCH} receiver processes"
