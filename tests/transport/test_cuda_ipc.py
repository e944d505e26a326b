"""CudaIpcLink: CPU unit tests (argument checks, descriptors, plans) and GPU tests across real
processes (register in one, open and copy in another, peer death while a transfer is pending).

GPU tests spawn children with ``torch.multiprocessing`` (spawn); every queue read and join has a
timeout and a crashed child fails the test instead of hanging it.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import queue
import subprocess
import sys
import time
import traceback
import types
import warnings
import weakref

import pytest
import torch

from warmlink import _cuda, pool
from warmlink.errors import ConfigError, LayoutError, MetadataError, PeerLostError, TransferError
from warmlink.transport.base import Batch, Copy, PeerRef, local_identity
from warmlink.transport._cuda_ipc_parts import COPY_METHODS, CopyPlan, build_descriptor, check_descriptor, resolve_copy_method
from warmlink.transport.cuda_ipc import CudaIpcLink

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_cuda = pytest.mark.skipif(NUM_GPUS < 1, reason="needs CUDA")
needs_2 = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA devices")
CHILD_TIMEOUT_S = 60.0
HANDLE = bytes(range(64))


# -- CPU ------------------------------------------------------------------------------------------
def test_copy_method_resolution():
    assert COPY_METHODS == ("auto", "batch", "loop", "kernel")
    assert resolve_copy_method("auto", lambda: True) == "batch"  # the copy engines' method beside the kernel
    assert resolve_copy_method("auto", lambda: False) == "loop"
    assert resolve_copy_method("kernel", lambda: True) == "batch"
    assert resolve_copy_method("loop", lambda: True) == "loop"
    assert resolve_copy_method("batch", lambda: True) == "batch"
    with pytest.raises(ConfigError, match="unavailable"):
        resolve_copy_method("batch", lambda: False)
    with pytest.raises(ConfigError, match=r"\['auto', 'batch', 'loop', 'kernel'\]"):
        resolve_copy_method("memcpy", lambda: True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"copy_method": "fast"}, "copy_method"),
        ({"num_streams": 0}, "num_streams"),
        ({"num_streams": 17}, "num_streams"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"device": -1}, "device"),
    ],
)
def test_link_rejects_bad_arguments_before_cuda(kwargs, match):
    args = {"device": 0, "timeout_s": 1.0, **kwargs}
    with pytest.raises(ConfigError, match=match):
        CudaIpcLink(args.pop("device"), args.pop("timeout_s"), **args)


def test_build_descriptor_exact_format():
    desc = build_descriptor(HANDLE, 4 << 20, 4096, 1000, 3, 77, "ab" * 16)
    assert desc == {
        "kind": "cuda_ipc", "handle": HANDLE.hex(), "alloc_nbytes": 4 << 20, "offset": 4096,
        "nbytes": 1000, "device": 3, "buffer_id": 77, "device_uuid": "ab" * 16,
    }
    assert len(desc["handle"]) == 128


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "shm"},
        {"handle": "ab" * 63},
        {"handle": "zz" * 64},
        {"offset": -1},
        {"nbytes": True},
        {"nbytes": 0},
        {"offset": (4 << 20) - 10},
        {"buffer_id": None},
        {"device_uuid": "AB" * 16},
        {"device_uuid": "ab" * 15},
    ],
)
def test_check_descriptor_fails_closed(change):
    desc = {**build_descriptor(HANDLE, 4 << 20, 0, 1000, 0, 1, "ab" * 16), **change}
    with pytest.raises(MetadataError, match="peer='pub/0'"):
        check_descriptor(desc, "pub/0")


def test_plan_directions_and_balance():
    plan = CopyPlan(0, flat=[(100, 900, 10), (200, 800, 30), (300, 700, 20)], strided=[(1, 16, 2, 64, 8, 4)])
    dsts, srcs, sizes, strided = plan.work("read", 1)[0]
    assert (dsts, srcs, sizes) == ([100, 200, 300], [900, 800, 700], [10, 30, 20])
    assert strided == [(1, 16, 2, 64, 8, 4)]
    dsts, srcs, sizes, strided = plan.work("write", 1)[0]
    assert (dsts, srcs) == ([900, 800, 700], [100, 200, 300]) and strided == [(2, 64, 1, 16, 8, 4)]
    two = plan.work("read", 2)
    assert sorted(sum((w[2] for w in two), [])) == [10, 20, 30]
    assert all(w[2] or w[3] for w in two), "both streams get work"
    assert plan.work("read", 2) is two, "cached"


class _HostCuda:
    """A fake ``warmlink._cuda`` over host memory: copies run at once, events may be held pending."""

    def __init__(self) -> None:
        self.ids = iter(range(0x100, 1 << 30))
        self.allocs: dict[int, tuple[int, int]] = {}  # base -> (size, buffer id)
        self.pending: dict[int, int] = {}  # event -> queries left before complete
        self.log: list[tuple] = []
        self.links: list = []  # closed by the fixture even when the test fails

    def alloc(self, nbytes: int, seed: int | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed or 0)
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) if seed else torch.zeros(nbytes, dtype=torch.uint8)
        self.allocs[t.data_ptr()] = (nbytes, next(self.ids))
        return t

    def find(self, ptr: int) -> tuple[int, int, int]:
        for base, (size, bid) in self.allocs.items():
            if base <= ptr < base + size:
                return base, size, bid
        raise AssertionError(f"unknown pointer {ptr:#x}")

    def event_query(self, e: int) -> bool:
        left = self.pending.get(e, 0)
        self.pending[e] = max(0, left - 1)
        return left == 0

    def memcpy_2d(self, d, dp, s, sp, w, h, st) -> None:
        for i in range(h):
            ctypes.memmove(d + i * dp, s + i * sp, w)

    def patch(self, mp) -> None:
        from warmlink import _cuda

        class NoDevice:
            def __init__(self, device): pass
            def __enter__(self): return self
            def __exit__(self, *exc): pass

        new = lambda *a, **k: next(self.ids)  # noqa: E731
        fakes = dict(
            available=lambda: True, batch_supported=lambda: True, use_device=NoDevice,
            stream_priority_range=lambda d: (0, -5), stream_create=new, stream_query=lambda s: True,
            stream_destroy=lambda s, d=None: None, event_create=new, event_destroy=lambda e: None,
            event_query=self.event_query, event_record=lambda e, s: self.log.append(("record", e, s)),
            stream_wait_event=lambda s, e: self.log.append(("wait", s, e)),
            memcpy_async=lambda d, s, n, st: self.log.append(("memcpy", ctypes.memmove(d, s, n) and n, st)),
            memcpy_batch_async=lambda ds, ss, ns, st: self.log.append(
                ("batch", [ctypes.memmove(d, s, n) for d, s, n in zip(ds, ss, ns)] and len(ns), st)),
            memcpy_2d_async=self.memcpy_2d, alloc_range=lambda p: self.find(p)[:2],
            buffer_id=lambda p: self.find(p)[2], is_ipc_exportable=lambda p: True,
            allocation=lambda p: _cuda.Allocation(*self.find(p), True),
            ipc_get_handle=lambda base: base.to_bytes(8, "little") * 8,
            ipc_open_handle=lambda h, d: int.from_bytes(h[:8], "little"),
            ipc_close_handle=lambda p, d: self.log.append(("close", p)), enable_peer_access=lambda a, b: True,
            device_uuid=lambda d: f"{d:032x}", device_of_uuid=lambda u: int(u, 16),
        )
        for name, fn in fakes.items():
            mp.setattr(_cuda, name, fn)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7))
        mp.setattr(CudaIpcLink, "_flat_view", lambda link, t: t.reshape(-1).view(torch.uint8))


@pytest.fixture
def host_cuda(monkeypatch):
    from warmlink.pool import events, streams
    from warmlink.transport import cuda_ipc

    streams.clear_idle()  # real idle streams/events are destroyed before the fakes go in
    events.clear_idle()
    fake = _HostCuda()
    fake.patch(monkeypatch)
    yield fake
    for link in fake.links:  # no fake handle or entry outlives the fakes
        link.close()
    cuda_ipc._registrations.evict(lambda k: k[1] in fake.allocs)
    cuda_ipc._mappings.evict(lambda k: k[0] == "pub/0")
    streams.clear_idle()
    events.clear_idle()


def test_recycle_waits_for_every_copy_stream_then_gives_back_what_the_last_user_held(host_cuda, monkeypatch):
    """A pooled link's recycle (transport.lease_link) queries each of its copy engines' streams, and
    only once they drained releases the regions its last user left."""
    link = CudaIpcLink(0, 5.0, num_streams=2)
    host_cuda.links.append(link)
    region = link.register(host_cuda.alloc(4096, seed=3))
    queried = []
    monkeypatch.setattr(_cuda, "stream_query", lambda s: queried.append(s) or True)
    assert link.recycle()
    assert sorted(queried) == sorted(link.engines.handles) and len(queried) == 2
    assert region._closed


@pytest.mark.parametrize("copy_method, num_streams", [("batch", 1), ("loop", 1), ("batch", 3), ("loop", 2)])
def test_link_logic_over_host_memory(host_cuda, copy_method, num_streams):
    """register/open/prepare/read/write/strided/deferred events/close, with copies on host memory."""
    pub = CudaIpcLink(0, 5.0)
    host_cuda.links.append(pub)
    seg = host_cuda.alloc(1 << 16, seed=1)  # one allocation holding three tensors: one handle
    views = [seg[0:1000], seg[1000:5000], seg[8192:12288]]
    regs = [pub.register(v) for v in views]
    assert len({r.desc["handle"] for r in regs}) == 1 and [r.desc["offset"] for r in regs] == [0, 1000, 8192]
    mat = host_cuda.alloc(64 * 256, seed=2)
    mreg = pub.register(mat)
    recv = CudaIpcLink(1, 5.0, copy_method=copy_method, num_streams=num_streams)
    host_cuda.links.append(recv)
    peer = PeerRef("pub/0", 1, *local_identity())
    opened = _stat("peer_mapping", "created")
    remotes = [recv.open(peer, r.desc) for r in regs]
    assert _stat("peer_mapping", "created") - opened <= 1
    locs = [recv.register(host_cuda.alloc(r.nbytes)) for r in remotes]
    batch = recv.prepare([Copy(loc, 0, rem, 0, rem.nbytes) for loc, rem in zip(locs, remotes)])
    recv.read(batch).wait()
    assert all(torch.equal(loc.tensor, v) for loc, v in zip(locs, views))
    kinds = {entry[0] for entry in host_cuda.log}
    assert ("batch" in kinds) == (copy_method == "batch") and ("memcpy" in kinds) == (copy_method == "loop")
    assert host_cuda.log[0] == ("record", recv.engines._order, 7), "copies wait on the current torch stream first"
    for loc in locs:
        loc.tensor.add_(1)
    recv.write(batch).wait()
    assert all(torch.equal(loc.tensor, v) for loc, v in zip(locs, views))
    col = recv.register(host_cuda.alloc(64 * 32))
    recv.read(recv.prepare([Copy(col, 0, recv.open(peer, mreg.desc), 100, 32, 64, 32, 256)])).wait()
    assert torch.equal(col.tensor.view(64, 32), mat.view(64, 256)[:, 100:132])
    transfer = recv.read(batch)  # pending: not done, stream_wait enqueues, dropped -> deferred
    host_cuda.pending[transfer._event] = 10**6
    assert not transfer.done()
    transfer.stream_wait(types.SimpleNamespace(cuda_stream=9))
    assert host_cuda.log[-1] == ("wait", 9, transfer._event)
    event = transfer._event
    del transfer
    gc.collect()
    assert len(recv._deferred) == 1
    host_cuda.pending[event] = 0
    recv.read(batch).wait()
    assert not recv._deferred
    recv.close()
    recv.close()
    pub.close()
    assert all(r._closed for r in (*remotes, *locs, *regs))


def test_only_a_batch_of_many_copies_from_this_gpu_goes_to_the_copy_kernel(host_cuda):
    """Note [Copy kernel]: the kernel takes a batch whose peers share this GPU once it has
    ``MIN_COPIES`` copies; fewer (a header, a fan-out chunk) stay on the copy engines."""
    from warmlink.transport._copy_kernel import MIN_COPIES

    pub = CudaIpcLink(0, 5.0)
    host_cuda.links.append(pub)
    seg = host_cuda.alloc(MIN_COPIES * 256, seed=4)
    regs = [pub.register(seg[i * 256:(i + 1) * 256]) for i in range(MIN_COPIES)]
    peer = PeerRef("pub/0", 1, *local_identity())
    for device, count, kernel in [(0, MIN_COPIES, True), (0, MIN_COPIES - 1, False), (1, MIN_COPIES, False)]:
        recv = CudaIpcLink(device, 5.0)
        host_cuda.links.append(recv)
        copies = [Copy(recv.register(host_cuda.alloc(256)), 0, recv.open(peer, r.desc), 0, 256) for r in regs[:count]]
        plan = CopyPlan.build(Batch(copies, [], len(copies)), device, kernel=True)
        assert plan.same_device is kernel, (device, count)


def test_import_creates_no_cuda_state():
    code = ("import sys, warmlink.transport.cuda_ipc, warmlink.pool.streams, warmlink.pool.events, "
            "warmlink.bench.peak; assert 'cuda.bindings' not in sys.modules, 'imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# -- GPU: helpers ---------------------------------------------------------------------------------
def _random_tensors(seed: int, count: int = 50) -> list[torch.Tensor]:
    """Deterministic CPU tensors of mixed dtypes and sizes, random bits."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16]
    out = []
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        numel = int(torch.randint(1, 200_000, (1,), generator=g))
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
        out.append(raw.view(dtype))
    return out


def _matrix(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (64, 4096), dtype=torch.uint8, generator=g)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _stat(kind: str, field: str) -> int:
    return pool.stats().get(kind, {}).get(field, 0)


def _get(q, what: str):
    try:
        return q.get(timeout=CHILD_TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError(f"no {what} within {CHILD_TIMEOUT_S} s") from None


# -- GPU: child scenarios (run in spawned processes) ----------------------------------------------
def _pub_exchange(device: int, qs: dict) -> dict:
    link = CudaIpcLink(device, 60.0)
    srcs = [t.to(device) for t in _random_tensors(1)]
    dsts = [torch.zeros_like(t).to(device) for t in _random_tensors(2)]  # the receiver writes seed-2 tensors
    mat, wmat = _matrix(3).to(device), torch.zeros(64, 4096, dtype=torch.uint8, device=device)
    created0, reused0 = _stat("registration", "created"), _stat("registration", "reused")
    regs = [link.register(t) for t in srcs]
    created_first = _stat("registration", "created") - created0
    again = link.register(srcs[0])
    out = {
        "created_first": created_first,
        "distinct_handles": len({r.desc["handle"] for r in regs}),
        "created_again": _stat("registration", "created") - created0 - created_first,
        "reused_again": _stat("registration", "reused") - reused0 >= 1,
        "same_desc_again": again.desc == regs[0].desc,
    }
    torch.cuda.synchronize(device)  # the bytes exist before peers read them
    qs["to_recv"].put({
        "identity": local_identity(), "src": [r.desc for r in regs],
        "dst": [link.register(t).desc for t in dsts], "mat": link.register(mat).desc, "wmat": link.register(wmat).desc,
    })
    assert _get(qs["to_pub"], "'written' from the receiver") == "written"
    torch.cuda.synchronize(device)
    expected = _random_tensors(2)
    out["writes_ok"] = all(torch.equal(_bytes(d), _bytes(e)) for d, e in zip(dsts, expected))
    want = torch.zeros(64, 4096, dtype=torch.uint8)
    want[:, 2000:2512] = _matrix(4)[:, :512]
    out["strided_write_ok"] = torch.equal(wmat.cpu(), want)
    link.close()
    return out


def _recv_exchange(device: int, qs: dict) -> dict:
    from warmlink import _cuda

    msg = _get(qs["to_recv"], "descriptors from the publisher")
    peer = PeerRef("publisher/0", 1, *msg["identity"])
    expected = [_bytes(t) for t in _random_tensors(1)]
    handles = {d["handle"] for d in (*msg["src"], *msg["dst"], msg["mat"], msg["wmat"])}
    opened0 = _stat("peer_mapping", "created")
    out: dict = {"digests": {}, "reads_ok": {}}
    methods = ["loop", "batch"] if _cuda.batch_supported() else ["loop"]
    with CudaIpcLink(device, 60.0) as link:  # "auto": one kernel if the peer shares this GPU (Note [Copy kernel])
        remotes = [link.open(peer, d) for d in msg["src"]]
        locals_ = [link.register(torch.empty(e.numel(), dtype=torch.uint8, device=device)) for e in expected]
        batch = link.prepare([Copy(loc, 0, rem, 0, rem.nbytes) for loc, rem in zip(locals_, remotes)])
        link.read(batch).wait()
        out["reads_ok"]["auto"] = all(torch.equal(loc.tensor.cpu(), e) for loc, e in zip(locals_, expected))
        out["kernel"] = (link.kernel_copies, batch.prepared.same_device)
    for method in methods:
        with CudaIpcLink(device, 60.0, copy_method=method) as link:
            remotes = [link.open(peer, d) for d in msg["src"]]
            locals_ = [link.register(torch.empty(e.numel(), dtype=torch.uint8, device=device)) for e in expected]
            copies = [Copy(loc, 0, rem, 0, rem.nbytes) for loc, rem in zip(locals_, remotes)]
            half = len(copies) // 2
            b1, b2 = link.prepare(copies[:half]), link.prepare(copies[half:])
            t1, t2 = link.read(b1), link.read(b2)
            t1.stream_wait()
            t1.wait()
            t2.wait()
            link.read(b1).wait()  # replayed batch
            got = [loc.tensor.cpu() for loc in locals_]
            out["reads_ok"][method] = all(torch.equal(g, e) for g, e in zip(got, expected))
            out["digests"][method] = hashlib.sha256(b"".join(g.numpy().tobytes() for g in got)).hexdigest()
            try:  # a view of peer memory, on the link's device (see the report on cross-device use)
                out["remote_tensor"] = torch.equal(remotes[0].tensor.cpu(), expected[0])
            except Exception as exc:
                out["remote_tensor"] = f"{type(exc).__name__}: {exc}"
            # strided read: 64 rows x 512 bytes from columns [1000, 1512) of the publisher's matrix
            mat = link.open(peer, msg["mat"])
            col = link.allocate(64 * 512)
            link.read(link.prepare([Copy(col, 0, mat, 1000, 512, 64, 512, 4096)])).wait()
            out.setdefault("strided_read_ok", {})[method] = torch.equal(
                col.tensor.cpu().view(64, 512), _matrix(3)[:, 1000:1512])
    with CudaIpcLink(device, 60.0) as link:  # write: push into the publisher's tensors
        writes = [t.to(device) for t in _random_tensors(2)]
        remotes = [link.open(peer, d) for d in msg["dst"]]
        locals_ = [link.register(w) for w in writes]
        link.write(link.prepare([Copy(loc, 0, rem, 0, rem.nbytes) for loc, rem in zip(locals_, remotes)])).wait()
        block = link.register(_matrix(4)[:, :512].contiguous().to(device))
        wmat = link.open(peer, msg["wmat"])
        link.write(link.prepare([Copy(block, 0, wmat, 2000, 512, 64, 512, 4096)])).wait()
    out["mappings_total"] = _stat("peer_mapping", "created") - opened0
    out["distinct_handles"] = len(handles)
    qs["to_pub"].put("written")
    return out


def _sleep_cycles(device: int, seconds: float) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return int(10**7 / (start.elapsed_time(end) * 1e-3) * seconds)


def _pub_idle(device: int, qs: dict) -> dict:
    link = CudaIpcLink(device, 60.0)
    t = torch.ones(64 << 20, dtype=torch.uint8, device=device)
    reg = link.register(t)
    torch.cuda.synchronize(device)
    qs["to_recv"].put({"identity": local_identity(), "desc": reg.desc})
    _get(qs["to_pub"], "a message that never comes")  # the test kills this process first
    return {}


def _recv_peer_lost(device: int, qs: dict) -> dict:
    msg = _get(qs["to_recv"], "descriptor from the publisher")
    peer = PeerRef("publisher/0", 1, *msg["identity"])
    link = CudaIpcLink(device, 60.0)
    remote = link.open(peer, msg["desc"])
    local = link.allocate(remote.nbytes)
    batch = link.prepare([Copy(local, 0, remote, 0, remote.nbytes)])
    torch.cuda._sleep(_sleep_cycles(device, 6.0))  # the copy waits behind this (Note [Copy ordering])
    transfer = link.read(batch)
    qs["to_main"].put("issued")
    t0 = time.perf_counter()
    try:
        transfer.wait(timeout_s=60.0)
        out = {"error": None}
    except PeerLostError as exc:
        out = {"error": "PeerLostError", "message": str(exc)}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["waited_s"] = time.perf_counter() - t0
    out["done_when_raised"] = transfer.done()
    qs["result"].put(("recv", "ok", out))  # report before the GPU drains
    try:
        torch.cuda.synchronize(device)
        link.close()
    except Exception:
        pass
    return out


SCENARIOS = {"pub_exchange": _pub_exchange, "recv_exchange": _recv_exchange, "pub_idle": _pub_idle,
             "recv_peer_lost": _recv_peer_lost}


def _child(scenario: str, role: str, device: int, qs: dict) -> None:
    try:
        torch.cuda.set_device(device)
        out = SCENARIOS[scenario](device, qs)
        qs["result"].put((role, "ok", out))
    except BaseException:
        qs["result"].put((role, "error", traceback.format_exc()))


class _Children:
    """Spawned children plus their queues; ``close`` never hangs."""

    def __init__(self) -> None:
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.qs = {name: self.ctx.Queue() for name in ("to_pub", "to_recv", "to_main", "result")}
        self.procs: dict = {}

    def start(self, role: str, scenario: str, device: int) -> None:
        p = self.ctx.Process(target=_child, args=(scenario, role, device, self.qs), daemon=True)
        p.start()
        self.procs[role] = p

    def results(self, roles: set[str]) -> dict:
        out, deadline = {}, time.monotonic() + CHILD_TIMEOUT_S
        while set(out) < roles:
            if time.monotonic() > deadline:
                raise TimeoutError(f"children {sorted(roles - set(out))} did not report in {CHILD_TIMEOUT_S} s")
            try:
                role, status, payload = self.qs["result"].get(timeout=0.5)
            except queue.Empty:
                dead = [r for r in roles - set(out) if not self.procs[r].is_alive()]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    raise AssertionError(f"children {dead} exited without a result; exit codes {codes}")
                continue
            assert status == "ok", f"{role} failed:\n{payload}"
            out[role] = payload
        return out

    def close(self) -> None:
        for p in self.procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


@pytest.fixture
def children():
    c = _Children()
    yield c
    c.close()


# -- GPU: cross-process tests ---------------------------------------------------------------------
def _run_exchange(children: _Children, pub_device: int, recv_device: int) -> None:
    children.start("pub", "pub_exchange", pub_device)
    children.start("recv", "recv_exchange", recv_device)
    res = children.results({"pub", "recv"})
    pub, recv = res["pub"], res["recv"]
    assert pub["created_first"] == pub["distinct_handles"] >= 1
    assert pub["created_again"] == 0 and pub["reused_again"] and pub["same_desc_again"]
    assert all(recv["reads_ok"].values()), recv["reads_ok"]
    assert all(recv["strided_read_ok"].values()), recv["strided_read_ok"]
    kernel_copies, same_gpu = recv["kernel"]  # SMs copy only within one GPU; across GPUs the copy engines do
    assert same_gpu == (kernel_copies and pub_device == recv_device), recv["kernel"]
    if pub_device == recv_device:
        assert recv["remote_tensor"] is True, recv["remote_tensor"]
    elif recv["remote_tensor"] is not True:
        warnings.warn(f"cross-device RemoteRegion.tensor: {recv['remote_tensor']}")
    assert len(set(recv["digests"].values())) == 1, "batch and loop must give identical bytes"
    assert recv["mappings_total"] == recv["distinct_handles"], "each handle is opened once across links and batches"
    assert pub["writes_ok"] and pub["strided_write_ok"]


@pytest.mark.gpu
@needs_cuda
def test_exchange_same_device(children):
    _run_exchange(children, 0, 0)


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_2
def test_exchange_cross_device(children):
    _run_exchange(children, 0, 1)


@pytest.mark.gpu
@needs_cuda
def test_publisher_killed_while_receiver_waits(children):
    children.start("pub", "pub_idle", 0)
    children.start("recv", "recv_peer_lost", 1 if NUM_GPUS >= 2 else 0)
    assert _get(children.qs["to_main"], "'issued' from the receiver") == "issued"
    children.procs["pub"].kill()
    res = children.results({"recv"})["recv"]
    assert res["error"] == "PeerLostError", res
    assert res["waited_s"] < 5.0 and not res["done_when_raised"], res


# -- GPU: in-process tests ------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_register_cached_and_layout_errors():
    with CudaIpcLink(0, 10.0) as link:
        t = torch.randn(1 << 20, device="cuda:0")
        c0, r0 = _stat("registration", "created"), _stat("registration", "reused")
        a = link.register(t)
        created = _stat("registration", "created") - c0
        b = link.register(t)
        assert _stat("registration", "created") - c0 == created <= 1
        assert _stat("registration", "reused") - r0 >= 1 and a.desc == b.desc
        assert a.ptr == t.data_ptr() and a.nbytes == t.numel() * 4 and a.tensor.dtype == torch.uint8
        with pytest.raises(LayoutError, match="not CUDA|expected cuda:0"):
            link.register(torch.ones(4))
        with pytest.raises(LayoutError, match="contiguous"):
            link.register(torch.ones(8, 8, device="cuda:0").t())
        with pytest.raises(LayoutError, match="0 elements"):
            link.register(torch.empty(0, device="cuda:0"))
        if NUM_GPUS >= 2:
            with pytest.raises(LayoutError, match="expected cuda:0"):
                link.register(torch.ones(4, device="cuda:1"))
        link.release(a)
        link.release(a)  # twice is fine


@pytest.mark.gpu
@needs_cuda
def test_reallocated_address_gets_new_key():
    from warmlink import _cuda
    from warmlink.transport import cuda_ipc

    nbytes = 64 << 20
    with CudaIpcLink(0, 10.0) as link:
        ptr = _cuda.malloc(nbytes, 0)
        region = link.register(_cuda.tensor_from_ptr(ptr, nbytes, 0))
        old_id = region.desc["buffer_id"]
        link.release(region)
        _cuda.free(ptr, 0)
        for _ in range(8):
            ptr2 = _cuda.malloc(nbytes, 0)
            if ptr2 == ptr:
                break
            _cuda.free(ptr2, 0)
        else:
            pytest.skip("the driver never returned the same address")
        region2 = link.register(_cuda.tensor_from_ptr(ptr2, nbytes, 0))
        assert region2.desc["buffer_id"] != old_id
        keys = cuda_ipc._registrations.keys()
        assert (0, ptr, region2.desc["buffer_id"]) in keys and (0, ptr, old_id) not in keys
        link.release(region2)
        _cuda.free(ptr2, 0)


@pytest.mark.gpu
@needs_cuda
def test_cuda_malloc_async_memory_is_not_exportable():
    from cuda.bindings import runtime as rt

    from warmlink import _cuda

    stream = torch.cuda.current_stream(0).cuda_stream
    with _cuda.use_device(0):
        err, ptr = rt.cudaMallocAsync(1 << 20, stream)
    if err:
        pytest.skip(f"cudaMallocAsync unavailable: {err}")
    try:
        with CudaIpcLink(0, 10.0) as link, pytest.raises(LayoutError, match="not IPC-exportable"):
            link.register(_cuda.tensor_from_ptr(int(ptr), 1 << 20, 0))
    finally:
        with _cuda.use_device(0):
            _cuda.check(rt.cudaFreeAsync(ptr, stream), "cudaFreeAsync")
        torch.cuda.synchronize(0)


@pytest.mark.gpu
@needs_cuda
def test_allocation_answers_the_single_queries_and_nested_use_device_enters_nothing():
    from warmlink import _cuda

    t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda:0")
    ptr = t.data_ptr() + 4096  # an interior pointer, as a tensor of a caching-allocator block is
    with _cuda.use_device(0):
        info = _cuda.allocation(ptr)
        base, size = _cuda.alloc_range(ptr)
        assert info == (base, size, _cuda.buffer_id(base), _cuda.is_ipc_exportable(base))
        assert info.ipc_capable and info.base <= ptr < info.base + info.size
        with _cuda.use_device(0) as inner:
            assert inner._guard is None  # same device on this thread: no guard, no context push
        assert _cuda.current_device() == 0
        with pytest.raises(TransferError, match="cuPointerGetAttributes"):
            _cuda.allocation(4096)  # no allocation: the plural query answers NULL


@pytest.mark.gpu
@needs_cuda
def test_tensor_from_ptr_keeps_owner_alive_and_allocate_roundtrip():
    from warmlink import _cuda

    class Owner:
        pass

    owner = Owner()
    ref = weakref.ref(owner)
    ptr = _cuda.malloc(1 << 20, 0)
    t = _cuda.tensor_from_ptr(ptr, 1 << 20, 0, owner=owner)
    del owner
    gc.collect()
    view = t[10:]
    del t
    gc.collect()
    assert ref() is not None, "the view keeps the owner alive"
    view.fill_(7)
    torch.cuda.synchronize(0)
    del view
    gc.collect()
    assert ref() is None, "owner released with the last view"
    _cuda.free(ptr, 0)
    with CudaIpcLink(0, 10.0) as link:
        region = link.allocate(3 << 20)
        assert region.nbytes == 3 << 20 and region.desc["offset"] == 0
        live = _stat("arena", "live")
        link.release(region)
        assert _stat("arena", "live") == live  # back in the pool, not destroyed
