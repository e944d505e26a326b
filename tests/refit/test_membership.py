"""Membership changes over the shm backend, with real processes: receivers replaced, joining and
leaving, publishers restarting, a receiver killed mid-pull, and corrupt manifests at the refit
boundary. Every received byte is compared with an independently built expectation.

Issue 3, "Reconfigure" and "Validated boundaries": membership changes without re-registering what
survives; mappings of departed peers closed, everyone else's kept; the next refit after a change
works and moves only what it must; bad metadata from a peer raises an error naming the peer and
disturbs nobody. "What must hold" (CPU): 200 reconfigures with zero growth.

Processes are spawned (``multiprocessing`` "spawn"); two long-lived workers serve most tests and
tests that need *new* processes spawn them up front, all at once, so that their torch imports
overlap. Every queue read has a deadline and a dead worker fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _spawned import CTX, SpawnedWorker, serve

from warmlink import pool
from warmlink.bench.refit import build_physical
from warmlink.errors import LayoutError, MetadataError, TransferTimeout, VersionError
from warmlink.pool import arenas, lease_arena, peers
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit._parked import release_parked
from warmlink.refit.manifest import Shard, TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

TIMEOUT_S = 30.0


# -- layouts and expectations ---------------------------------------------------------------------------
def layouts(tp: int, rank: int) -> dict[str, TensorLayout]:
    """A few KB: column- and row-parallel weights, a replicated bias, a fused qkv, a bf16 norm."""
    col = {"split_dim": 0, "num_shards": tp, "shard_idx": rank} if tp > 1 else {}
    row = {"split_dim": 1, "num_shards": tp, "shard_idx": rank} if tp > 1 else {}

    def shard(rows: int) -> Shard:
        return Shard.split((rows, 16), 0, tp, rank) if tp > 1 else Shard((rows, 16))

    return {
        "w": TensorLayout.plain("w", "float32", (64, 32), **col),
        "o": TensorLayout.plain("o", "float32", (32, 48), **row),
        "b": TensorLayout.plain("b", "float32", (32,)),
        "qkv": TensorLayout.fused("qkv", "float32", [("q", shard(32)), ("k", shard(16)), ("v", shard(16))]),
        "n": TensorLayout.plain("n", "bfloat16", (40,)),
    }


def bad_tensors(targets: dict, layouts_: dict, seed: int) -> list[str]:
    """Names whose received values differ from what publishers built from ``seed``."""
    return [n for n, l in layouts_.items() if not torch.equal(targets[n], build_physical(l, "cpu", seed))]


def _new_targets(layouts_: dict) -> dict:
    return {n: torch.full(l.local_shape, -1.0).to(getattr(torch, l.dtype)) for n, l in layouts_.items()}


# -- what could leak ------------------------------------------------------------------------------------
def snapshot() -> dict:
    """This process's pooled objects (live, idle), open mappings, shm files, fds and threads."""
    gc.collect()
    prefix = arenas.shm_prefix()
    return {
        "pool": {k: (c["live"], c["idle"]) for k, c in pool.stats().items() if (c["live"], c["idle"]) != (0, 0)},
        "open_mappings": peers.open_mappings(),
        "shm_files": sum(1 for n in os.listdir(arenas.SHM_DIR) if n.startswith(prefix)),
        "fds": _num_fds(),
        "threads": threading.active_count(),
    }


def _num_fds() -> int:
    """Open file descriptors but pipes and sockets. Pipes are multiprocessing's (queues, process
    sentinels, closed when the parent collects a finished child); sockets are the store server's
    connections from worker processes, which live as long as those processes' stores. What the
    pool holds (shm files, the fds ``mmap`` keeps for each mapping) is everything else."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith(("pipe:", "socket:"))
        except OSError:  # the fd listdir itself used, already closed
            pass
    return n


def _files_of(pid: int) -> list[str]:
    return [n for n in os.listdir(arenas.SHM_DIR) if n.startswith(f"wl-{pid}-")]


# -- publishers in this process ---------------------------------------------------------------------------
class LocalPublishers:
    """``tp`` publisher ranks in this process: ``w`` and ``qkv`` in place (one shm arena per rank,
    registered), the rest staged, so that both export paths are under test."""

    INPLACE = ("w", "qkv")

    def __init__(self, store: Store, tp: int, seed: int = 1, timeout_s: float = TIMEOUT_S) -> None:
        self.store, self.tp = store, tp
        self.pubs: list[Publisher] = []
        self.tensors: list[dict] = []
        self.leases = []
        for rank in range(tp):
            ls = layouts(tp, rank)
            offsets, total = {}, 0
            for n in self.INPLACE:
                offsets[n] = total
                total += (ls[n].nbytes + 255) // 256 * 256
            lease = lease_arena("shm", total)
            self.leases.append(lease)
            tensors = {}
            for n, l in ls.items():
                if n in self.INPLACE:
                    buf = lease.resource.tensor[offsets[n] : offsets[n] + l.nbytes]
                    tensors[n] = buf.view(getattr(torch, l.dtype)).view(l.local_shape)
                else:
                    tensors[n] = torch.empty(l.local_shape, dtype=getattr(torch, l.dtype))
                tensors[n].copy_(build_physical(l, "cpu", seed))
            pub = Publisher(store, rank=rank, world_size=tp, backend="shm", timeout_s=timeout_s)
            for n, t in tensors.items():
                pub.add(n, t, ls[n])
            pub.export()
            self.pubs.append(pub)
            self.tensors.append(tensors)

    @property
    def version(self) -> int:
        return self.pubs[0].version

    def update(self, seed: int, timeout_s: float = 5.0) -> list[float]:
        """begin_update on every rank, rewrite from ``seed``, publish; returns the reader waits (s)."""
        waits = [pub.begin_update(timeout_s=timeout_s) for pub in self.pubs]
        for rank, tensors in enumerate(self.tensors):
            ls = layouts(self.tp, rank)
            for n, t in tensors.items():
                t.copy_(build_physical(ls[n], "cpu", seed))
        for pub in self.pubs:
            pub.publish()
        return waits

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        for lease in self.leases:
            lease.release()


# -- worker process ---------------------------------------------------------------------------------------
def _store(state: dict, address: str, secret: str, prefix: str) -> Store:
    key = (address, prefix)
    if state.get("store_key") != key:
        old = state.pop("store", None)
        if old is not None:
            old.close()
        state["store"], state["store_key"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret), key
    return state["store"]


def _cmd_reset(state: dict) -> None:
    for key in ("recv", "pub"):
        obj = state.pop(key, None)
        if obj is not None:
            obj.close()
    for lease in state.pop("leases", []):
        lease.release()
    store = state.pop("store", None)
    state.pop("store_key", None)
    if store is not None:
        store.close()
    shm.fault_hook = None


def _cmd_recv_start(state: dict, *, address, secret, prefix, num_publishers, layouts) -> dict:
    old = state.pop("recv", None)
    if old is not None:
        old.close()
    rec = Receiver(_store(state, address, secret, prefix), num_publishers=num_publishers, backend="shm", timeout_s=TIMEOUT_S)
    state["recv_targets"], state["recv_layouts"] = _new_targets(layouts), layouts
    for n, l in layouts.items():
        rec.add(n, l, state["recv_targets"][n])
    state["recv"] = rec
    return {"pid": os.getpid()}


def _cmd_recv_refit(state: dict, *, version, seed) -> dict:
    report = state["recv"].refit(version=version)
    return {"version": report.version, "bad": bad_tensors(state["recv_targets"], state["recv_layouts"], seed),
            "created": report.created, "pid": os.getpid()}


def _cmd_recv_replace(state: dict, *, version, seed, **start) -> dict:
    """Close this process's Receiver, make a new one, refit once: one reconfigure."""
    _cmd_recv_start(state, **start)
    return _cmd_recv_refit(state, version=version, seed=seed)


def _cmd_recv_close(state: dict) -> None:
    rec = state.pop("recv", None)
    if rec is not None:
        rec.close()


def _cmd_recv_slow_refit(state: dict, *, version, chunk_nbytes, sleep_s) -> dict:
    """Refit with every chunk slowed by ``sleep_s``; sets the worker's ``pulling`` event at the first."""

    def hook(nbytes: int) -> None:
        state["pulling"].set()
        time.sleep(sleep_s)

    shm.CHUNK_NBYTES = chunk_nbytes
    shm.fault_hook = hook
    try:
        return _cmd_recv_refit(state, version=version, seed=0)
    finally:
        shm.fault_hook = None


def _cmd_pub_start(state: dict, *, address, secret, prefix, rank, world_size, seed) -> dict:
    """Publish ``layouts(world_size, rank)`` from ``seed``: ``w`` in place (registered), the rest staged."""
    old = state.pop("pub", None)
    if old is not None:
        old.close()
    for lease in state.pop("leases", []):
        lease.release()
    ls = layouts(world_size, rank)
    lease = lease_arena("shm", ls["w"].nbytes)
    state["leases"] = [lease]
    tensors = {n: torch.empty(l.local_shape, dtype=getattr(torch, l.dtype)) for n, l in ls.items() if n != "w"}
    tensors["w"] = lease.resource.tensor[: ls["w"].nbytes].view(torch.float32).view(ls["w"].local_shape)
    for n, t in tensors.items():
        t.copy_(build_physical(ls[n], "cpu", seed))
    pub = Publisher(_store(state, address, secret, prefix), rank=rank, world_size=world_size, backend="shm", timeout_s=TIMEOUT_S)
    for n, t in tensors.items():
        pub.add(n, t, ls[n])
    pub.export()
    state["pub"], state["pub_tensors"], state["pub_layouts"] = pub, tensors, ls
    return {"pid": os.getpid(), "generation": pub.generation, "version": pub.version}


def _cmd_pub_update(state: dict, *, seed) -> dict:
    pub = state["pub"]
    wait_s = pub.begin_update(timeout_s=5.0)
    for n, t in state["pub_tensors"].items():
        t.copy_(build_physical(state["pub_layouts"][n], "cpu", seed))
    return {"version": pub.publish(), "wait_s": wait_s}


_COMMANDS = {
    "reset": _cmd_reset,
    "recv_start": _cmd_recv_start,
    "recv_refit": _cmd_recv_refit,
    "recv_replace": _cmd_recv_replace,
    "recv_close": _cmd_recv_close,
    "recv_slow_refit": _cmd_recv_slow_refit,
    "pub_start": _cmd_pub_start,
    "pub_update": _cmd_pub_update,
    "snapshot": lambda state: snapshot(),
    "pid": lambda state: os.getpid(),
}


def _worker_main(control, results, pulling) -> None:
    state: dict = {"pulling": pulling}
    pool.set_enabled(True)
    serve(control, results, _COMMANDS, state, _cmd_reset)


class Worker(SpawnedWorker):
    """A refit test worker; ``pulling`` is set while its receiver's copy runs (fault hook)."""

    def __init__(self) -> None:
        self.pulling = CTX.Event()
        super().__init__(_worker_main, self.pulling)


def spawn(n: int) -> list[Worker]:
    """``n`` new processes started at once (their imports overlap); the first call waits for each."""
    return [Worker() for _ in range(n)]


@pytest.fixture(scope="module")
def workers():
    ws = spawn(2)
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"reconf-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as s:
        yield s


@pytest.fixture
def session(store, workers):
    """A store and both long-lived workers; the workers drop whatever they hosted when the test ends."""
    pool.set_enabled(True)
    yield store, workers
    pool.set_enabled(None)
    for w in workers:
        if w.proc.is_alive():
            try:
                w.call("reset", timeout_s=20)
            except (RuntimeError, TimeoutError):
                pass


def _recv_kwargs(store: Store, num_publishers: int, layouts_: dict) -> dict:
    return {"address": store.address, "secret": store.secret, "prefix": store.prefix, "num_publishers": num_publishers, "layouts": layouts_}


# -- (a) receivers replaced: 200 Receiver objects, 5 processes ------------------------------------------------
NUM_RECONFIGURES = 200
NUM_WARMUP = 10


def test_200_receiver_reconfigures_zero_growth(session) -> None:
    """A worker replaces its Receiver 200 times while the publishers (here) move on a version each
    time; neither side grows, and every new receiver gets the current version bit-exactly."""
    store, (worker, _) = session
    pubs = LocalPublishers(store, tp=2, seed=1)
    recv = _recv_kwargs(store, 2, layouts(1, 0))
    try:
        pub_before = recv_before = None
        for i in range(NUM_RECONFIGURES + NUM_WARMUP):
            seed = i + 1
            if i > 0:
                waits = pubs.update(seed)
                assert max(waits) < 1.0, f"reconfigure {i}: a replaced receiver left a reader count ({waits})"
            out = worker.call("recv_replace", version=pubs.version, seed=seed, **recv)
            assert out["version"] == pubs.version and out["bad"] == [], f"reconfigure {i}: {out}"
            if i >= NUM_WARMUP:  # warm: a new Receiver creates nothing (mappings, arenas, plan)
                assert not any(out["created"].values()), (i, out["created"])
            if i == NUM_WARMUP - 1:
                pub_before, recv_before = snapshot(), worker.call("snapshot")
        assert snapshot() == pub_before, "publisher side grew over 200 receiver reconfigures"
        assert worker.call("snapshot") == recv_before, "receiver process grew over 200 Receiver replacements"
    finally:
        pubs.close()


def test_receiver_process_replaced_5_times(session) -> None:
    """Five receiver processes in turn, each replacing the last: four exit normally, the last is
    SIGKILLed while idle. Publishers notice nothing but the bytes they serve."""
    store, _ = session
    procs = spawn(5)
    pubs = LocalPublishers(store, tp=2, seed=1)
    for proc in procs:  # all imported, and this side's queue threads started, before the snapshot
        assert proc.call("pid") == proc.pid
    recv = _recv_kwargs(store, 2, layouts(2, 1))  # the second inference rank of TP 2
    try:
        before = None
        for k, proc in enumerate(procs):
            seed = k + 1
            if k > 0:
                assert max(pubs.update(seed)) < 1.0, f"process {k - 1} left a reader count behind"
            out = proc.call("recv_replace", version=pubs.version, seed=seed, **recv)
            assert out["version"] == pubs.version and out["bad"] == [], (k, out)
            if before is None:
                before = snapshot()
            if k < len(procs) - 1:
                assert proc.stop() == 0
                assert _files_of(proc.pid) == [], "a receiver that exits normally must not leave shm files"
            else:
                proc.kill()
        assert max(pubs.update(99)) < 1.0  # a receiver killed while idle holds no reader count
        assert snapshot() == before, "publisher side changed while receiver processes came and went"
    finally:
        pubs.close()
        for proc in procs:
            proc.stop(timeout_s=5)
        arenas.reap_orphaned_shm()  # the killed one's files; see Note [Leaked shm files]


# -- (b) a receiver joins and leaves -----------------------------------------------------------------------------
def test_receiver_joins_and_leaves_others_keep_refitting(session) -> None:
    store, (a, b) = session
    pubs = LocalPublishers(store, tp=2, seed=1)
    try:
        a.call("recv_start", **_recv_kwargs(store, 2, layouts(2, 0)))
        assert b.call("pid") == b.pid  # b's queue threads exist before the snapshot
        snap = None
        for cycle in range(1, 9):
            if cycle > 1:
                waits = pubs.update(cycle)
                assert max(waits) < 1.0, f"cycle {cycle}: waits {waits}"
            if cycle == 3:  # B joins: a second inference rank appears
                snap = snapshot()
                b.call("recv_start", **_recv_kwargs(store, 2, layouts(2, 1)))
            if cycle == 6:  # B leaves
                b.call("recv_close")
            a.send("recv_refit", version=cycle, seed=cycle)
            if 3 <= cycle < 6:
                out_b = b.call("recv_refit", version=cycle, seed=cycle)
                assert out_b["bad"] == [] and out_b["version"] == cycle, (cycle, out_b)
            out_a = a.result()
            assert out_a["bad"] == [] and out_a["version"] == cycle, (cycle, out_a)
            if cycle > 1:  # A's warm path is untouched by B's coming and going
                assert not any(out_a["created"].values()), (cycle, out_a["created"])
        assert snapshot() == snap, "the publisher side kept something of the receiver that left"
    finally:
        pubs.close()


# -- (c) a publisher restarts --------------------------------------------------------------------------------------
def _manifest_regions(store: Store, rank: int, generation: int) -> int:
    m = store.get_json(protocol.manifest_key(rank, generation), "publisher_manifest", f"publisher/{rank}")
    return len(m["regions"])


def _receiver_here(store: Store, num_publishers: int, layouts_: dict) -> tuple[Receiver, dict]:
    rec = Receiver(store, num_publishers=num_publishers, backend="shm", timeout_s=TIMEOUT_S)
    targets = _new_targets(layouts_)
    for n, l in layouts_.items():
        rec.add(n, l, targets[n])
    return rec, targets


def test_publisher_process_restart_reopens_only_its_mappings(session) -> None:
    """Publisher rank 0's process exits and a new process takes the slot (new generation) while
    the receiver here keeps its Receiver: the next refit is bit-exact, opens exactly the new
    process's regions, closes the old process's, and leaves rank 1's mappings alone."""
    store, (replacement, pub1) = session
    (pub0,) = spawn(1)
    kw = {"address": store.address, "secret": store.secret, "prefix": store.prefix, "world_size": 2}
    for rank in range(2):  # earlier tests' publishers used these slot names: start from none cached
        peers.forget_peer(f"publisher/{rank}")
    try:
        pub0.send("pub_start", rank=0, seed=1, **kw)
        info1 = pub1.call("pub_start", rank=1, seed=1, **kw)
        info0 = pub0.result()
        ls = layouts(1, 0)
        rec, targets = _receiver_here(store, 2, ls)
        with rec:
            assert rec.refit(version=1).version == 1 and bad_tensors(targets, ls, 1) == []
            old_regions = _manifest_regions(store, 0, info0["generation"])
            rank1_regions = _manifest_regions(store, 1, info1["generation"])
            maps_before = peers.open_mappings()

            assert pub0.stop() == 0  # rank 0's process exits ...
            assert _files_of(info0["pid"]) == []
            info = replacement.call("pub_start", rank=0, seed=2, **kw)  # ... and a new one takes the slot
            assert info["generation"] == info0["generation"] + 1 and info["pid"] != info0["pid"]
            assert replacement.call("pub_update", seed=2)["version"] == 2
            assert pub1.call("pub_update", seed=2)["version"] == 2
            new_regions = _manifest_regions(store, 0, info["generation"])

            destroyed = pool.stats()["peer_mapping"]["destroyed"]
            report = rec.refit(version=2)
            assert report.version == 2 and bad_tensors(targets, ls, 2) == []
            assert report.created["peer_mapping"] == new_regions, report.created  # rank 1's: not re-created
            assert report.created["plan"] == 0 and report.created["arena"] == 0, report.created
            assert pool.stats()["peer_mapping"]["destroyed"] - destroyed == old_regions  # the departed's closed
            assert peers.open_mappings() == maps_before - old_regions + new_regions
            assert rank1_regions >= 1

            assert replacement.call("pub_update", seed=3)["version"] == 3
            assert pub1.call("pub_update", seed=3)["version"] == 3
            assert not any(rec.refit(version=3).created.values())  # warm again
            assert bad_tensors(targets, ls, 3) == []
    finally:
        pub0.stop(timeout_s=5)


def test_departed_publisher_mappings_closed_when_receiver_is_replaced(session) -> None:
    """Receiver R1 refits from publisher process P1 and closes; P1 exits and P2 takes the slot;
    a new Receiver R2 refits from P2. P1's mappings must be closed (issue 3: "Mappings of departed
    peers are closed")."""
    store, _ = session
    p1, p2 = spawn(2)  # fresh processes: nothing of theirs is cached here yet
    kw = {"address": store.address, "secret": store.secret, "prefix": store.prefix, "rank": 0, "world_size": 1}
    ls = layouts(1, 0)
    try:
        assert p2.call("pid") == p2.pid
        peers.forget_peer("publisher/0")  # earlier tests' publishers used this slot name
        base = snapshot()
        info1 = p1.call("pub_start", seed=1, **kw)
        rec, targets = _receiver_here(store, 1, ls)
        with rec:
            assert rec.refit().version == 1 and bad_tensors(targets, ls, 1) == []
        assert p1.stop() == 0
        info2 = p2.call("pub_start", seed=2, **kw)
        assert info2["generation"] == info1["generation"] + 1
        rec, targets = _receiver_here(store, 1, ls)
        with rec:
            report = rec.refit()
            assert report.version == 1 and bad_tensors(targets, ls, 2) == []
        gc.collect()
        p2_regions = _manifest_regions(store, 0, info2["generation"])
        assert report.created["peer_mapping"] == p2_regions
        grown = peers.open_mappings() - base["open_mappings"]
        assert grown == p2_regions, f"{grown} mappings open for a peer with {p2_regions} regions: the departed process's stayed"
        assert _num_fds() - base["fds"] <= p2_regions
    finally:
        p1.stop(timeout_s=5)
        p2.stop(timeout_s=5)


# -- (d) a receiver killed mid-pull ---------------------------------------------------------------------------------
BIG = {"w": TensorLayout.plain("w", "float32", (128, 128))}  # 64 KiB: 16 chunks of 4 KiB


def _threads() -> int:
    """Live threads but the process's shm reaper, which lives as long as the process does."""
    return sum(t.name != "warmlink-shm-reaper" for t in threading.enumerate())


def _local_publisher(store: Store, layouts_: dict, seed: int, timeout_s: float) -> tuple[Publisher, dict]:
    tensors = {n: build_physical(l, "cpu", seed) for n, l in layouts_.items()}
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=timeout_s)
    for n, t in tensors.items():
        pub.add(n, t, layouts_[n])
    pub.export()
    return pub, tensors


def test_receiver_killed_mid_pull_is_reaped_by_begin_update(session, caplog) -> None:
    """A receiver process SIGKILLed inside a version leaves its count; the publisher finds its
    process gone and reaps the count (Note [Reader slots]) instead of waiting out its timeout."""
    store, _ = session
    (victim,) = spawn(1)
    assert victim.call("pid") == victim.pid  # its queue thread here exists before the count
    release_parked()  # what earlier tests parked is not this test's to count
    threads_before, links_before = _threads(), pool.stats().get("link", {}).get("live", 0)
    leased_before = {k: c["live"] - c["idle"] for k, c in pool.stats().items()}
    pub, _ = _local_publisher(store, BIG, seed=1, timeout_s=TIMEOUT_S)
    try:
        victim.call("recv_start", address=store.address, secret=store.secret, prefix=store.prefix, num_publishers=1, layouts=BIG)
        victim.send("recv_slow_refit", version=1, chunk_nbytes=4096, sleep_s=0.2)  # 16 chunks: >= 3 s
        assert victim.pulling.wait(timeout=60), "the receiver never started pulling"
        assert protocol.reader_count(store, 0, 1) == 1
        victim.kill()
        assert victim.proc.exitcode == -signal.SIGKILL

        start = time.monotonic()
        with caplog.at_level("WARNING", logger="warmlink.refit"):
            pub.begin_update(timeout_s=2.0)
        elapsed = time.monotonic() - start
        assert elapsed < 1.0, f"begin_update took {elapsed:.2f} s"
        assert protocol.reader_count(store, 0, 1) == 0
        assert any("reaped 1 reader(s) of publisher/0 version 1" in r.getMessage() for r in caplog.records)
        pub.publish()
    finally:
        start = time.monotonic()
        pub.close()
        close_s = time.monotonic() - start
        victim.stop(timeout_s=5)
        arenas.reap_orphaned_shm()
    assert close_s < 5.0, f"Publisher.close took {close_s:.2f} s after the timeout"
    release_parked()  # the closed publisher's version board waits there for a successor
    # The publisher's link went back to the pool (its copy thread with it) or was destroyed.
    links_after = pool.stats().get("link", {}).get("live", 0)
    assert _threads() - threads_before == links_after - links_before, "a thread outlived close()"
    leased_after = {k: c["live"] - c["idle"] for k, c in pool.stats().items()}
    assert {k: v for k, v in leased_after.items() if v != leased_before.get(k, 0)} == {}, "close() kept a lease"


@pytest.mark.parametrize("then", ["begin_update", "publish"])
def test_after_begin_update_timed_out_on_a_stalled_reader_nothing_is_written_under_it(store, monkeypatch, then) -> None:
    """A reader that is slow, not dead, and a trainer that goes on after begin_update raised: a
    retried begin_update waits (and times out) again; a publish() is refused, as it would refresh
    the published bytes under the reader. The reader installs the old version whole (DESIGN
    invariant 3: the old version or the new, never a mix); once a begin_update returns, the new
    version goes out."""
    layout = BIG["w"]
    pub, tensors = _local_publisher(store, BIG, seed=1, timeout_s=5)
    rec, targets = _receiver_here(store, 1, BIG)
    old, new = build_physical(layout, "cpu", 1), build_physical(layout, "cpu", 2)
    try:
        rec.refit(version=1)
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
        monkeypatch.setattr(shm, "fault_hook", lambda n: time.sleep(0.1))  # 16 chunks: ~1.6 s
        handle = rec.start_refit(version=1)
        with pytest.raises(TransferTimeout):
            pub.begin_update(timeout_s=0.3)
        if then == "begin_update":
            with pytest.raises(TransferTimeout):
                pub.begin_update(timeout_s=0.3)  # the reader is still inside: it waits (and times out) again
        else:
            tensors["w"].copy_(new)  # the trainer's own memory: readers read what publish refreshes
            with pytest.raises(VersionError, match="begin_update\\(\\) raised before every reader was out"):
                pub.publish()
        assert handle.wait().version == 1
        assert torch.equal(targets["w"], old), "the reader installed a mix of two versions"
        monkeypatch.setattr(shm, "fault_hook", None)
        pub.begin_update(timeout_s=10)
        tensors["w"].copy_(new)
        assert pub.publish() == 2
        assert rec.refit(version=2).version == 2 and torch.equal(targets["w"], new)
    finally:
        monkeypatch.setattr(shm, "fault_hook", None)
        rec.close()
        pub.close()


def test_a_publish_that_failed_once_its_version_was_out_drains_its_readers_before_the_next_write(
        store, monkeypatch) -> None:
    """publish() announced version 2 in its header, then the store failed to take its state: a
    receiver may already be reading version 2, so the next begin_update waits for it like any
    update's, and the receiver installs version 2 whole, never bytes of version 3."""
    layout = BIG["w"]
    pub, tensors = _local_publisher(store, BIG, seed=1, timeout_s=5)
    v2, v3 = build_physical(layout, "cpu", 2), build_physical(layout, "cpu", 3)
    real = protocol.write_state

    def stalled(store_, rank, state):
        if state.state == "published":
            raise TransferTimeout("the store stalled (injected)")
        return real(store_, rank, state)

    rec = None
    try:
        pub.begin_update(timeout_s=10)
        tensors["w"].copy_(v2)
        monkeypatch.setattr(protocol, "write_state", stalled)
        with pytest.raises(TransferTimeout, match="injected"):
            pub.publish()
        monkeypatch.setattr(protocol, "write_state", real)
        with pytest.raises(VersionError, match="begin_update\\(\\) was not called"):
            pub.publish()  # nothing is written without a drain first
        rec, targets = _receiver_here(store, 1, BIG)
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
        monkeypatch.setattr(shm, "fault_hook", lambda n: time.sleep(0.1))  # 16 chunks: ~1.6 s
        handle = rec.start_refit()
        assert handle.report.version == 2  # the header's version, though the store still says "updating"
        with pytest.raises(TransferTimeout):
            pub.begin_update(timeout_s=0.3)  # the reader of version 2 is inside
        assert handle.wait().version == 2
        assert torch.equal(targets["w"], v2), "the reader installed a mix of two versions"
        monkeypatch.setattr(shm, "fault_hook", None)
        pub.begin_update(timeout_s=10)
        tensors["w"].copy_(v3)
        assert pub.publish() == 3
        assert rec.refit(version=3).version == 3 and torch.equal(targets["w"], v3)
    finally:
        monkeypatch.setattr(shm, "fault_hook", None)
        if rec is not None:
            rec.close()
        pub.close()

# -- (e) corrupt manifests at the refit boundary ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_env():
    """Two publisher ranks in this process and the valid manifests they exported."""
    pool.set_enabled(True)
    with Store("127.0.0.1", 0, is_server=True, prefix=f"fuzz-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as store:
        pubs = LocalPublishers(store, tp=2, seed=7)
        raws, sizes = [], []
        for pub in pubs.pubs:
            raw = store.get(protocol.manifest_key(pub.rank, pub.generation))
            raws.append(raw)
            sizes.append([os.stat(os.path.join(arenas.SHM_DIR, r["name"])).st_size for r in json.loads(raw)["regions"]])
        try:
            yield store, pubs, raws, sizes
        finally:
            pubs.close()
            pool.set_enabled(None)


_INT = ("schema_version", "rank", "world_size", "generation", "pid", "start_time", "device", "nbytes", "offset",
        "region")
_STR = ("kind", "role", "host", "backend", "name", "dtype", "logical")
_LIST = ("regions", "tensors", "parts", "global_shape", "bounds", "shape")
_NOT_INT = ["1", 1.5, True, None, [], {}, [1], "x"]
_NOT_STR = [1, 1.5, True, None, [], {}, ["x"], "", "a\x00b"]
_NOT_LIST = [1, "x", None, {}, True]
_NOT_OBJ = [1, "x", None, [], True, [{}]]
_BAD_KINDS = ["tcp", "", "SHM", "cuda", None, 7, "nixl "]
_BAD_HANDLES = ["ab" * 63, "ab" * 65, "", "zz" * 64, "AB" * 63 + "G0"]


def _nodes(m: dict):
    """Every (container, key, path) in a manifest, objects and arrays alike."""
    stack = [(m, "")]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            p = f"{path}.{k}" if isinstance(node, dict) else f"{path}[{k}]"
            yield node, k, p
            if isinstance(v, (dict, list)):
                stack.append((v, p))


def _bad_int(m: dict, node: dict, key: str, path: str, file_sizes: list[int], draw) -> int:
    """An int the receiver must refuse for this field (never a merely different valid value)."""
    ws = m["peer"]["world_size"]
    huge = st.sampled_from([-1, -(2**40), 2**63, 2**63 + 5])
    if key == "schema_version":
        # any version but the one this node was written with (the manifest and the peer differ)
        return draw(st.sampled_from([v for v in (0, 1, 2, 3, 4, -1, 10**50) if v != node[key]]))
    if path.startswith(".peer"):
        choices = {
            "rank": [ws, ws + 3, -1],
            "world_size": [0, 1 if m["peer"]["rank"] >= 1 else 3, 3, 7, 2**20 + 1],  # != 2
            "generation": [0, -1, node["generation"] + 1, node["generation"] + 100],
            "pid": [0, -1, 2**31],
            "start_time": [-1, 2**63],
        }
        if key == "device":  # -1 names the CPU, a valid device for these publishers
            return draw(st.sampled_from([-2, 2**16, -(2**40), 2**63]))
        return draw(st.sampled_from(choices[key]) | huge)
    if path.startswith(".regions"):
        idx = int(path.split("[")[1].split("]")[0])
        size = file_sizes[idx]
        if key == "nbytes":  # 0, negative, or past the end of the peer's file
            return draw(st.sampled_from([0, -1, size + 1, size * 2, 2**62]) | huge)
        return draw(st.sampled_from([-1, size, size - node["nbytes"] + 1, 2**62]) | huge)  # offset
    if path.startswith(".header"):  # Note [Version header]: a region of this manifest, room for the header
        if key == "region":
            return draw(st.sampled_from([-1, len(m["regions"]), len(m["regions"]) + 5]) | huge)
        extent = m["regions"][node["region"]]["nbytes"]  # offset
        return draw(st.sampled_from([-1, extent - 63, extent]) | huge)
    if path.startswith(".tensors") and ".parts" not in path:
        if key == "region":
            return draw(st.sampled_from([-1, len(m["regions"]), len(m["regions"]) + 5]) | huge)
        extent = m["regions"][node["region"]]["nbytes"]  # offset
        return draw(st.sampled_from([-1, extent, extent + 4096]) | huge)
    raise AssertionError(f"no bad value for {path}")


def _bad_element(m: dict, path: str, node: list, idx: int, draw) -> int:
    """An int the receiver must refuse for element ``idx`` of a list in a tensor entry."""
    huge = st.sampled_from([-1, -(2**40), 2**63])
    tensor = m["tensors"][int(path.split("[")[1].split("]")[0])]
    if ".bounds[" in path:  # [start, stop] of one dim: negative, past the dim, or start past stop
        part = tensor["parts"][int(path.split(".parts[")[1].split("]")[0])]
        size = part["global_shape"][int(path.rsplit("[", 1)[1].rstrip("]"))]
        return draw(st.sampled_from([size + 1, -1]) if idx == 1 else st.sampled_from([node[1] + 1, -1]))
    if path.endswith(".offset"):  # a part's offset: negative, or past the physical tensor
        return draw(st.sampled_from([-1, tensor["shape"][idx] + 1]) | huge)
    return draw(huge)  # shape or global_shape: out of the schema's range


@st.composite
def corruptions(draw, raw: bytes, file_sizes: list[int]) -> tuple[str, bytes]:
    """A description and the corrupt bytes of one manifest: each certainly invalid."""
    m = json.loads(raw)
    op = draw(st.sampled_from(["drop", "extra", "type", "range", "semantic", "region_kind", "handle", "raw", "list"]))
    if op == "semantic":  # schema-valid values that still contradict the slot or the peer's files
        i = draw(st.integers(0, len(m["regions"]) - 1))
        r, size = m["regions"][i], file_sizes[i]
        field, value = draw(st.sampled_from([
            ("peer.rank", 1 - m["peer"]["rank"]),
            ("peer.generation", m["peer"]["generation"] + 1),
            ("peer.world_size", 3),
            (f"regions[{i}].nbytes", size + 1),
            (f"regions[{i}].nbytes", size - r["offset"] + 256),
            (f"regions[{i}].offset", size - r["nbytes"] + 1),
            (f"regions[{i}].offset", size),
        ]))
        obj, leaf = (m["peer"], field[5:]) if field.startswith("peer.") else (r, field.split(".")[1])
        obj[leaf] = value
        return f"semantic {field}={value}", json.dumps(m).encode()
    if op == "raw":
        cut = draw(st.integers(1, len(raw) - 1))
        how = draw(st.sampled_from(["truncate", "append", "non-utf8", "nan"]))
        bad = {"truncate": raw[:cut], "append": raw + b"}", "non-utf8": b"\xff" + raw,
               "nan": raw.replace(b'"schema_version":1', b'"schema_version":NaN', 1)}[how]
        return f"raw {how}", bad
    if op == "region_kind":
        i = draw(st.integers(0, len(m["regions"]) - 1))
        m["regions"][i]["kind"] = draw(st.sampled_from(_BAD_KINDS))
        return f"region-kind regions[{i}].kind={m['regions'][i]['kind']!r}", json.dumps(m).encode()
    if op == "handle":
        i = draw(st.integers(0, len(m["regions"]) - 1))
        r = m["regions"][i]
        m["regions"][i] = {"kind": "cuda_ipc", "handle": draw(st.sampled_from(_BAD_HANDLES)), "alloc_nbytes": 1 << 21,
                           "offset": r["offset"], "nbytes": r["nbytes"], "device": 0, "buffer_id": 1, "device_uuid": "0123456789abcdef" * 2}
        return f"handle regions[{i}] cuda_ipc handle of {len(m['regions'][i]['handle'])} chars", json.dumps(m).encode()
    if op == "list":
        what = draw(st.sampled_from(["no-regions", "no-parts", "duplicate-tensor"]))
        if what == "no-regions":
            m["regions"] = []
        elif what == "no-parts":
            m["tensors"][draw(st.integers(0, len(m["tensors"]) - 1))]["parts"] = []
        else:
            m["tensors"].append(dict(m["tensors"][draw(st.integers(0, len(m["tensors"]) - 1))]))
        return f"list {what}", json.dumps(m).encode()
    nodes = [(n, k, p) for n, k, p in _nodes(m)]
    if op == "extra":
        objs = [m] + [n[k] for n, k, p in nodes if isinstance(n[k], dict)]
        obj = draw(st.sampled_from(objs))
        obj[draw(st.sampled_from(["extra", "Kind", "__proto__", "nbytes2"]))] = 1
        return "extra key", json.dumps(m).encode()
    if op == "drop":
        node, key, path = draw(st.sampled_from([(n, k, p) for n, k, p in nodes if isinstance(n, dict)]))
        del node[key]
        return f"drop {path}", json.dumps(m).encode()
    if op == "type":
        node, key, path = draw(st.sampled_from(nodes))
        if isinstance(node, list):
            pool_ = _NOT_INT if type(node[key]) is int else (_NOT_LIST if type(node[key]) is list else _NOT_OBJ)
        elif key == "offset" and ".parts[" in path:
            pool_ = _NOT_LIST
        elif key in _INT:
            pool_ = _NOT_INT
        elif key in _STR:
            pool_ = _NOT_STR
        elif key in _LIST:
            pool_ = _NOT_LIST
        elif key == "board":
            pool_ = [v for v in _NOT_OBJ if v is not None]  # null is a valid board: sync through the store
        else:
            pool_ = _NOT_OBJ  # peer
        node[key] = draw(st.sampled_from(pool_))
        return f"type {path}={node[key]!r}", json.dumps(m).encode()
    # range: an int field of an object, or an int inside a shape, bounds or offset list
    sites = [(n, k, p) for n, k, p in nodes if isinstance(n, dict) and k in _INT and type(n[k]) is int]
    sites += [(n, k, p) for n, k, p in nodes
              if isinstance(n, list) and type(n[k]) is int and p.startswith(".tensors") and ".parts[" in p or
              isinstance(n, list) and type(n[k]) is int and p.startswith(".tensors") and ".shape[" in p]
    node, key, path = draw(st.sampled_from(sites))
    if isinstance(node, list):
        node[key] = _bad_element(m, path.rsplit("[", 1)[0], node, key, draw)
    else:
        node[key] = _bad_int(m, node, key, path, file_sizes, draw)
    return f"range {path}={node[key]!r}", json.dumps(m).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_manifest_fails_closed(fuzz_env, data) -> None:
    store, pubs, raws, file_sizes = fuzz_env
    rank = data.draw(st.integers(0, 1), label="rank")
    what, bad = data.draw(corruptions(raws[rank], file_sizes[rank]), label="corruption")
    key = protocol.manifest_key(rank, pubs.pubs[rank].generation)
    ls = layouts(1, 0)
    version = pubs.version
    assert bad != raws[rank], what
    store.set(key, bad)
    try:
        rec, targets = _receiver_here(store, 2, ls)
        snap = {n: t.clone() for n, t in targets.items()}
        with rec, pytest.raises((MetadataError, LayoutError)) as info:
            rec.refit(timeout_s=2)
        event(f"{what.split()[0]} -> {type(info.value).__name__}")
        assert f"publisher/{rank}" in str(info.value), f"{what}: the error does not name the peer: {info.value}"
        assert all(torch.equal(targets[n], snap[n]) for n in targets), f"{what}: targets touched"
        for r in range(2):
            count = protocol.reader_count(store, r, version)
            assert count == 0, f"{what}: publisher/{r} version {version} keeps {count} reader(s)"
    finally:
        store.set(key, raws[rank])
    rec, targets = _receiver_here(store, 2, ls)  # a valid refit right after still works
    with rec:
        assert rec.refit(timeout_s=5).version == version
    assert bad_tensors(targets, ls, 7) == [], what


@pytest.mark.parametrize("kind", ["cuda_ipc", "nixl"])
def test_region_of_another_backend_is_a_metadata_error(fuzz_env, kind: str) -> None:
    store, pubs, raws, _ = fuzz_env
    m = json.loads(raws[1])
    r = m["regions"][0]
    m["regions"][0] = (
        {"kind": "cuda_ipc", "handle": "ab" * 64, "alloc_nbytes": 1 << 21, "offset": r["offset"], "nbytes": r["nbytes"],
         "device": 0, "buffer_id": 1, "device_uuid": "0123456789abcdef" * 2}
        if kind == "cuda_ipc"
        else {"kind": "nixl", "agent": "agent-1", "addr": 1 << 20, "nbytes": r["nbytes"], "device": -1, "mem": "DRAM"}
    )
    key = protocol.manifest_key(1, pubs.pubs[1].generation)
    store.set(key, json.dumps(m))
    try:
        rec, _ = _receiver_here(store, 2, layouts(1, 0))
        with rec, pytest.raises(MetadataError, match="publisher/1"):
            rec.refit(timeout_s=2)
        assert protocol.reader_count(store, 1, pubs.version) == 0
    finally:
        store.set(key, raws[1])
