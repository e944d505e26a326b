"""NIXL READ against WRITE on the refit's shape: which direction the nixl backend should move.

Two processes, the *initiator* on ``devices[0]`` and the *target* on ``devices[1]``, each hold one
region from ``NixlLink.allocate``. The initiator prepares one batch of the model's tensors (one
descriptor each; a 4 KiB gap between neighbours keeps them from coalescing, like tensors of
separate allocations) and moves it by READ (pull), by WRITE (push), and by WRITE with a
notification, which the target waits for: the time from the initiator's post to the target
seeing the notification is what a push-based refit's receiver would wait. Clocks are
``time.perf_counter`` (CLOCK_MONOTONIC, one clock for the processes of a host).
"""

from __future__ import annotations

import statistics
import time

from warmlink.bench._proc import Group

__all__ = ["run_nixl_rw"]

_GAP = 4096


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + _GAP
    return offsets, at


def _target(*, control, results, device_idx, sizes, ucx_threads, timeout_s):
    import torch

    from warmlink.transport.base import local_identity
    from warmlink.transport.nixl import NixlLink

    if device_idx >= 0:
        torch.cuda.set_device(device_idx)
    link = NixlLink(device_idx, timeout_s=timeout_s, ucx_threads=ucx_threads)
    region = link.allocate(_offsets(sizes)[1])
    region.tensor.fill_(3)
    results.put({"tag": "target", "event": "ready", "desc": dict(region.desc), "identity": local_identity(),
                 "ucx_threads": link.ucx_threads})
    while (msg := control.get(timeout=timeout_s)) is not None:
        link.wait_notification(msg[1], timeout_s=timeout_s)
        results.put({"tag": "target", "event": "notified", "at": time.perf_counter()})
    link.release(region)
    link.close()


def _initiator(*, control, results, device_idx, sizes, desc, identity, repeats, ucx_threads, timeout_s):
    import torch

    from warmlink.transport.base import Copy, PeerRef
    from warmlink.transport.nixl import NixlLink

    if device_idx >= 0:
        torch.cuda.set_device(device_idx)
    link = NixlLink(device_idx, timeout_s=timeout_s, ucx_threads=ucx_threads)
    offsets, total = _offsets(sizes)
    local = link.allocate(total)
    local.tensor.fill_(5)
    t = time.perf_counter()
    remote = link.open(PeerRef("target/0", 1, *identity), desc)
    open_s = time.perf_counter() - t
    t = time.perf_counter()
    batch = link.prepare([Copy(local, o, remote, o, n) for o, n in zip(offsets, sizes)])
    prepare_s = time.perf_counter() - t
    out = {"tag": "initiator", "event": "done", "open_s": open_s, "prepare_s": prepare_s,
           "num_descs": sum(c.num_rows for c in (*batch.flat, *batch.strided)), "nbytes": batch.nbytes}
    for key, op in (("read", "READ"), ("write", "WRITE")):
        times = []
        for r in range(repeats + 1):  # the first run makes the NIXL request and warms UCX
            t = time.perf_counter()
            (link.read if op == "READ" else link.write)(batch).wait(timeout_s)
            if r:
                times.append(time.perf_counter() - t)
        out[key] = times
    posts = []
    while (msg := control.get(timeout=timeout_s)) is not None:
        posts.append(time.perf_counter())
        link.write(batch, notify=msg[1]).wait(timeout_s)
        results.put({"tag": "initiator", "event": "pushed"})
    out["notify_posts"] = posts
    results.put(out)
    link.release(local)
    link.close_region(remote)
    link.close()


def run_nixl_rw(sizes: list[int], *, devices: tuple[int, int] = (0, 1), repeats: int = 5,
                ucx_threads: int | None = None, timeout_s: float = 300.0) -> dict:
    """Median times of READ, WRITE and WRITE + target notification for ``sizes`` (one descriptor
    each), in fresh processes, both links made with ``ucx_threads`` (None: their default).
    Returns seconds and GB/s (10^9 bytes) per direction."""
    with Group(timeout_s) as group:
        group.start("target", _target, device_idx=devices[1], sizes=sizes, ucx_threads=ucx_threads, timeout_s=timeout_s)
        ready = group.expect("ready", 1)[0]
        group.start("initiator", _initiator, device_idx=devices[0], sizes=sizes, desc=ready["desc"],
                    identity=ready["identity"], repeats=repeats, ucx_threads=ucx_threads, timeout_s=timeout_s)
        seen = []
        for i in range(repeats + 1):
            tag = b"rw-%d" % i
            group.send("target", ("wait", tag))
            group.send("initiator", ("push", tag))
            group.expect("pushed", 1)
            seen.append(group.expect("notified", 1)[0]["at"])
        group.send("initiator", None)
        group.send("target", None)
        done = group.expect("done", 1)[0]
    nbytes = done["nbytes"]
    notify = [s - p for s, p in zip(seen[1:], done["notify_posts"][1:])]
    out = {"nbytes": nbytes, "num_descs": done["num_descs"], "open_s": done["open_s"], "prepare_s": done["prepare_s"],
           "devices": list(devices), "ucx_threads": ready["ucx_threads"]}
    for name, times in (("read", done["read"]), ("write", done["write"]), ("write_notify", notify)):
        med = statistics.median(times)
        out[name] = {"median_s": med, "min_s": min(times), "gbps": nbytes / med / 1e9, "runs": len(times)}
    return out
