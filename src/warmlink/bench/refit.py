"""Refit benchmark scenarios on warmlink: publishers and receivers as separate processes.

Tensor values are generated from a seed per logical tensor, so each side builds its own shards
and the receivers check every received byte against an independently built expectation after the
last cycle.
"""

from __future__ import annotations

import time
import zlib

from warmlink.bench._devices import device_of
from warmlink.bench._proc import Group

__all__ = ["run_warmlink_refit", "global_tensor", "build_physical", "warmlink_refit_need"]


def global_tensor(logical: str, shape, dtype: str, device, seed: int):
    """The benchmark's value of a logical tensor: seeded normal values, same on every process."""
    import torch

    from warmlink._dtypes import torch_dtype

    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003) ^ zlib.crc32(logical.encode()))
    out = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    return out.to(torch_dtype(dtype))


def build_physical(layout, device, seed: int):
    """The physical tensor ``layout`` describes, sliced from seeded globals."""
    import torch

    from warmlink._dtypes import torch_dtype

    out = torch.zeros(layout.shape, dtype=torch_dtype(layout.dtype), device=device)
    for part in layout.parts:
        full = global_tensor(part.logical, part.shard.global_shape, layout.dtype, device, seed)
        target = out[tuple(slice(a, b) for a, b in part.local_box())]
        target.copy_(full[tuple(slice(a, b) for a, b in part.shard.bounds)].reshape(target.shape))
        del full
    return out


def _publisher(*, control, results, address, secret, prefix, spec, tp, rank, device_idx, pool_on, backend, seed):
    from warmlink import pool
    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    pool.set_enabled(pool_on)
    device = device_of(device_idx)
    layouts = spec.layouts(tp, rank)
    tensors = {name: build_physical(layout, device, seed) for name, layout in layouts.items()}
    with Store.connect(address, prefix=prefix, secret=secret) as store, Publisher(store, rank=rank, world_size=tp, backend=backend) as pub:
        for name, t in tensors.items():
            pub.add(name, t, layouts[name])
        t0 = time.perf_counter()
        pub.export()
        results.put({"tag": f"pub{rank}", "event": "ready", "export_s": time.perf_counter() - t0,
                     "staged": pub.staging_nbytes > 0, "staging_nbytes": pub.staging_nbytes})
        while control.get(timeout=600) is not None:
            wait_s = pub.begin_update()  # values stay: the benchmark measures movement, not training
            version = pub.publish()
            results.put({"tag": f"pub{rank}", "event": "published", "version": version, "wait_s": wait_s})


def _receiver(*, control, results, address, secret, prefix, spec, src_tp, dst_tp, rank, device_idx, pool_on, backend, install, seed):
    import torch

    from warmlink import pool
    from warmlink.refit import Receiver
    from warmlink.rendezvous import Store

    pool.set_enabled(pool_on)
    device = device_of(device_idx)
    layouts = spec.layouts(dst_tp, rank)
    with Store.connect(address, prefix=prefix, secret=secret) as store, Receiver(store, num_publishers=src_tp, backend=backend, install=install) as rec:
        targets = {}
        for name, layout in layouts.items():
            targets[name] = torch.empty(layout.local_shape, dtype=getattr(torch, layout.dtype), device=device)
            rec.add(name, layout, targets[name])
        results.put({"tag": f"rec{rank}", "event": "ready"})
        while (msg := control.get(timeout=600)) is not None:
            if msg[0] == "refit":
                report = rec.refit(version=msg[1])
                results.put({"tag": f"rec{rank}", "event": "cycle", "report": report.as_dict(),
                             "receive_nbytes": rec.receive_nbytes})
            elif msg[0] == "verify":
                bad = [n for n, layout in layouts.items() if not torch.equal(targets[n], build_physical(layout, device, seed))]
                results.put({"tag": f"rec{rank}", "event": "verified", "bad": bad[:5], "num_bad": len(bad)})


def warmlink_refit_need(spec, *, src_tp: int, dst_tp: int, devices: tuple[int, int], install: str):
    """The peak memory of ``run_warmlink_refit`` with these arguments (a ``bench._memory.Need``).

    Publishers hold the model and, on the CPU, stage it into /dev/shm; receivers hold their
    targets and receive buffers (two sets with ``install="swap"``, plus staging scratch when a
    TP 1 -> 2 re-cut pulls whole shards). Building a tensor makes a float32 copy of its global
    shape for a moment.
    """
    from warmlink.bench._memory import Need

    nbytes = spec.nbytes
    largest = max(layout.nbytes for layout in spec.layouts(1, 0).values())
    buffers = nbytes * {"swap": 2, "copy": 1, "direct": 0}.get(install, 1) + (nbytes if dst_tp > src_tp else 0)
    need = Need()
    need.on(devices[0], nbytes + 3 * largest)  # the model, and one tensor being built
    need.on(devices[1], nbytes + 3 * largest)  # the targets, and the check's expectation
    if devices[0] < 0:
        need.shm_bytes += nbytes  # staging: host tensors are shared through /dev/shm
    if devices[1] < 0:
        need.shm_bytes += buffers
    else:
        need.on(devices[1], buffers)
    need.host_bytes += need.shm_bytes  # /dev/shm is host memory too
    need.processes([devices[0]] * src_tp + [devices[1]] * dst_tp)
    return need


_PHASES = ("connect_s", "sync_s", "plan_s", "alloc_s", "register_s", "pull_s", "translate_s", "install_s", "total_s")


def run_warmlink_refit(
    spec,
    *,
    src_tp: int = 1,
    dst_tp: int = 1,
    cycles: int = 3,
    pool_on: bool = True,
    backend: str | None = None,
    devices: tuple[int, int] = (0, 1),
    install: str = "swap",
    seed: int = 0,
    timeout_s: float = 300.0,
    label: str = "",
    progress=None,
) -> dict:
    """Run ``cycles`` refits from ``src_tp`` publisher processes on ``devices[0]`` into ``dst_tp``
    receiver processes on ``devices[1]`` (-1 = CPU, shm); ``progress(step)``, when given, hears
    each step as it ends ("exported", "cycle 1", ..., "verified").

    Returns:
        ``{"label", "src_tp", "dst_tp", "pool", "install", "nbytes", "cycles": [phase seconds per
        cycle, the slowest receiver's], "created": [...], "correct": bool}``.
    """
    from warmlink.rendezvous import Store

    prefix = f"bench-{label or 'refit'}-{time.monotonic_ns()}"
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix) as store, Group(timeout_s) as group:
        common = dict(address=store.address, secret=store.secret, prefix=prefix, spec=spec, pool_on=pool_on, backend=backend, seed=seed)
        for r in range(src_tp):
            group.start(f"pub{r}", _publisher, tp=src_tp, rank=r, device_idx=devices[0], **common)
        ready = group.expect("ready", src_tp)
        tell = progress or (lambda step: None)
        tell("exported")
        for r in range(dst_tp):
            group.start(f"rec{r}", _receiver, src_tp=src_tp, dst_tp=dst_tp, rank=r, device_idx=devices[1], install=install, **common)
        group.expect("ready", dst_tp)
        rows = []
        for c in range(1, cycles + 1):
            if c > 1:
                for r in range(src_tp):
                    group.send(f"pub{r}", ("update",))
                group.expect("published", src_tp)
            for r in range(dst_tp):
                group.send(f"rec{r}", ("refit", c))
            msgs = group.expect("cycle", dst_tp)
            reports = [m["report"] for m in msgs]
            receive_nbytes = max(m["receive_nbytes"] for m in msgs)
            row = {"cycle": c, **{p: max(rep[p] for rep in reports) for p in _PHASES}}
            row["nbytes"] = sum(rep["nbytes"] for rep in reports)
            row["num_copies"] = sum(rep["num_copies"] for rep in reports)
            row["created"] = {k: sum(rep["created"].get(k, 0) for rep in reports) for k in reports[0]["created"]}
            rows.append(row)
            tell(f"cycle {c}")
        for r in range(dst_tp):
            group.send(f"rec{r}", ("verify",))
        verified = group.expect("verified", dst_tp)
        tell("verified")
    return {
        "label": label, "src_tp": src_tp, "dst_tp": dst_tp, "pool": pool_on, "install": install,
        "backend": backend or "auto", "nbytes": spec.nbytes, "staged": any(m["staged"] for m in ready),
        "export_s": max(m["export_s"] for m in ready), "cycles": rows,
        # memory beyond the model on each side, per process (the largest): See Note [Install modes]
        "receive_nbytes": receive_nbytes, "staging_nbytes": max(m["staging_nbytes"] for m in ready),
        "correct": all(v["num_bad"] == 0 for v in verified), "bad": [b for v in verified for b in v["bad"]],
    }
