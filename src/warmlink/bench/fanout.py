"""N engine replicas take every version: all from the trainer, or with fan-out (Note [Fan-out]).

``run_fanout`` runs one trainer process and ``engines`` receiver processes on this host and, for
each mode, times cycles in which every engine refits at once: ``"trainer"`` (every replica pulls
the whole model from the trainer, N times its bytes through the trainer's link) and ``"fanout"``
(``Receiver(fanout=FanOut(...))``: each byte leaves the trainer once). Each row gives the wall
time from the first engine's start to the last engine's end and the bytes each source sent.

A launcher that places the processes itself (hosts as network namespaces) runs ``trainer_main``
and ``engine_main`` in them with the same messages: see their docstrings.
"""

from __future__ import annotations

import time

from warmlink.bench._devices import device_of
from warmlink.bench._proc import Group
from warmlink.bench.refit import build_physical

__all__ = ["run_fanout", "trainer_main", "engine_main", "MODES"]

MODES = ("trainer", "fanout")


def trainer_main(*, control, results, address, secret, prefix, spec, device_idx, backend, seed):
    """One TP-1 trainer rank: exports ``spec`` (values from ``seed``), says ``ready``, then publishes
    a version (``published``) per ``"update"`` message until ``None``."""
    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    device = device_of(device_idx)
    layouts = spec.layouts(1, 0)
    tensors = {name: build_physical(layout, device, seed) for name, layout in layouts.items()}
    with Store.connect(address, prefix=prefix, secret=secret) as store, Publisher(store, backend=backend) as pub:
        for name, t in tensors.items():
            pub.add(name, t, layouts[name])
        pub.export()
        results.put({"tag": "trainer", "event": "ready", "nbytes": spec.nbytes})
        while control.get(timeout=600) is not None:
            pub.begin_update()  # values stay: the benchmark measures movement, not training
            results.put({"tag": "trainer", "event": "published", "version": pub.publish()})


def engine_main(*, control, results, name, address, secret, prefix, spec, device_idx, backend, seed, chunk_bytes=None,
                degree=1, group="bench", install="copy"):
    """One TP-1 engine replica, ``name`` in its messages. Messages: ``("open", mode)`` makes its receiver (``install=``;
    ``"trainer"``: plain; ``"fanout"``: ``FanOut(group-mode, degree=, chunk_bytes=)``) and says ``opened``;
    ``("refit",)`` runs a cycle and says ``cycle`` with its report and monotonic start and end;
    ``("verify",)`` says ``verified`` with the tensors that differ from ``spec``'s values;
    ``("close",)`` closes the receiver (``closed``); ``None`` ends."""
    import torch

    from warmlink.refit import FanOut, Receiver
    from warmlink.rendezvous import Store

    device = device_of(device_idx)
    layouts = spec.layouts(1, 0)
    targets = {name: torch.empty(lay.local_shape, dtype=getattr(torch, lay.dtype), device=device) for name, lay in layouts.items()}
    rec = None
    with Store.connect(address, prefix=prefix, secret=secret) as store:
        try:
            while (msg := control.get(timeout=600)) is not None:
                if msg[0] == "open":
                    fanout = FanOut(f"{group}-{msg[1]}", degree=degree, chunk_bytes=chunk_bytes) if msg[1] == "fanout" else None
                    rec = Receiver(store, num_publishers=1, backend=backend, install=install, fanout=fanout)
                    for tensor, lay in layouts.items():
                        rec.add(tensor, lay, targets[tensor])
                    results.put({"tag": name, "event": "opened"})
                elif msg[0] == "refit":
                    start = time.monotonic()
                    report = rec.refit()
                    results.put({"tag": name, "event": "cycle", "report": report.as_dict(), "start": start,
                                 "end": time.monotonic()})
                elif msg[0] == "verify":
                    bad = [n for n, lay in layouts.items() if not torch.equal(targets[n], build_physical(lay, device, seed))]
                    results.put({"tag": name, "event": "verified", "bad": bad[:5], "num_bad": len(bad)})
                elif msg[0] == "close":
                    rec.close()
                    rec = None
                    results.put({"tag": name, "event": "closed"})
        finally:
            if rec is not None:
                rec.close()


def run_fanout(
    spec,
    *,
    engines: int,
    modes: tuple[str, ...] = MODES,
    cycles: int = 3,
    devices: tuple[int, ...] = (-1, -1),
    backend: str | None = None,
    chunk_bytes: int | None = None,
    degree: int = 1,
    install: str = "copy",
    seed: int = 0,
    timeout_s: float = 300.0,
    progress=None,
) -> dict:
    """Time ``cycles`` refits of ``engines`` replicas at once in each of ``modes``, in one run.

    Args:
        spec: the model (``bench.model_spec.ModelSpec``), TP 1 on both sides.
        engines: number of engine processes.
        modes: ``"trainer"`` (all pull from the trainer) and/or ``"fanout"``.
        devices: the trainer's device, then the engines' (cycled): -1 is the CPU (shm).
        backend: the link (default: ``cuda_ipc`` on GPUs, ``shm`` on the CPU).
        chunk_bytes, degree: ``FanOut``'s.
        install: the receivers' install mode, ``"copy"`` or ``"swap"``, in both modes.
        progress: called with each step's name as it ends.

    Returns:
        ``{"engines", "nbytes" (the model), "modes": {mode: {"cycles": [{"cycle", "wall_s" (first start
        to last end, seconds), "slowest_s" (the slowest engine's cycle), "trainer_nbytes" (bytes the
        trainer sent), "relay_nbytes" (bytes replicas sent each other), "sources", "engines": [{"engine", "replica",
        "end_s" (its end after the first start), "pull_s", "sources"}]}], "correct"}}}``.
        The first cycle of a mode includes its setup (plans, buffers, mappings).
    """
    from warmlink.errors import ConfigError
    from warmlink.rendezvous import Store

    unknown = [m for m in modes if m not in MODES]
    if unknown or engines < 1 or cycles < 1 or not devices:
        raise ConfigError(f"run_fanout: modes={modes!r}, engines={engines!r}, cycles={cycles!r}, devices={devices!r}; "
                          f"expected modes from {list(MODES)}, engines and cycles >= 1 and at least one device")
    tell = progress or (lambda step: None)
    prefix = f"bench-fanout-{time.monotonic_ns()}"
    tags = [f"engine{i}" for i in range(engines)]
    out = {"engines": engines, "nbytes": spec.nbytes, "degree": degree, "install": install, "modes": {}}
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix) as store, Group(timeout_s) as group:
        common = dict(address=store.address, secret=store.secret, prefix=prefix, spec=spec, backend=backend, seed=seed)
        group.start("trainer", trainer_main, device_idx=devices[0], **common)
        engine_devices = devices[1:] or devices[:1]
        for i, tag in enumerate(tags):
            group.start(tag, engine_main, name=tag, device_idx=engine_devices[i % len(engine_devices)], chunk_bytes=chunk_bytes,
                        degree=degree, group=prefix, install=install, **common)
        group.expect("ready", 1)
        tell("started")
        for m_idx, mode in enumerate(modes):
            _to_all(group, tags, ("open", mode))
            group.expect("opened", engines)
            rows = []
            for c in range(1, cycles + 1):
                if c > 1 or m_idx > 0:
                    group.send("trainer", ("update",))
                    group.expect("published", 1)
                _to_all(group, tags, ("refit",))
                msgs = group.expect("cycle", engines)
                reports = [msg["report"] for msg in msgs]
                sources: dict[str, int] = {}
                for rep in reports:
                    for source, n in rep["pulled_from"].items():
                        sources[source] = sources.get(source, 0) + n
                first = min(msg["start"] for msg in msgs)
                rows.append({"cycle": c, "wall_s": max(msg["end"] for msg in msgs) - first,
                             "slowest_s": max(rep["total_s"] for rep in reports),
                             "trainer_nbytes": sources.get("publishers", 0),
                             "relay_nbytes": sum(n for s, n in sources.items() if s != "publishers"), "sources": sources,
                             # who was late, and what it waited on: a chain's last replica ends last
                             "engines": [{"engine": msg["tag"], "replica": msg["report"]["replica"],
                                          "end_s": msg["end"] - first, "pull_s": msg["report"]["pull_s"],
                                          "sources": msg["report"]["pulled_from"]}
                                         for msg in sorted(msgs, key=lambda m: m["tag"])]})
                tell(f"{mode} cycle {c}")
            _to_all(group, tags, ("verify",))
            verified = group.expect("verified", engines)
            _to_all(group, tags, ("close",))
            group.expect("closed", engines)
            out["modes"][mode] = {"cycles": rows, "correct": all(v["num_bad"] == 0 for v in verified),
                                  "bad": [b for v in verified for b in v["bad"]]}
    return out


def _to_all(group: Group, tags: list[str], msg) -> None:
    for tag in tags:
        group.send(tag, msg)
