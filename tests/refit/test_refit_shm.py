"""Refit end to end over the shm backend: publishers in spawned processes, receivers in this
process (and one in a spawned process), every received byte compared with an independently
built expectation.

Two long-lived worker processes (spawned once per module, so torch is imported twice, not once per
test) host publishers or receivers on command; each test gets its own store server. Every queue
read has a deadline and a dead worker fails the test instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

import pytest
import torch

from _spawned import SpawnedWorker, serve

from warmlink import pool
from warmlink._dtypes import torch_dtype
from warmlink.bench.model_spec import qwen3_4b_like
from warmlink.bench.refit import build_physical
from warmlink.errors import VersionError
from warmlink.refit import Publisher, Receiver
from warmlink.refit.manifest import Part, TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

SPEC = qwen3_4b_like(0.001)  # ~1 MB in 10 tensors, fused qkv / gate_up, bf16
COUNTED = ("arena", "registration", "peer_mapping", "plan")
TIMEOUT_S = 30.0


# -- expectations ------------------------------------------------------------------------------------
def expected(layout: TensorLayout, seed: int, *, src_dtype: str | None = None, name_map: dict | None = None) -> torch.Tensor:
    """What a receiver tensor of ``layout`` holds after a refit of publishers built with ``seed``.

    Publishers hold ``build_physical(their layout, seed)``: seeded values per *publisher* logical
    name, in ``src_dtype``; the receiver casts them to its own dtype.
    """
    name_map = name_map or {}
    parts = tuple(Part(name_map.get(p.logical, p.logical), p.shard, p.offset) for p in layout.parts)
    src = TensorLayout(layout.name, src_dtype or layout.dtype, parts, layout.shape)
    return build_physical(src, "cpu", seed).to(torch_dtype(layout.dtype))


def bad_tensors(targets: dict, layouts: dict, seed: int, **kw) -> list[str]:
    return [n for n, layout in layouts.items() if not torch.equal(targets[n], expected(layout, seed, **kw))]


def unfused_layouts(spec, tp: int, rank: int, rename=lambda s: s) -> dict[str, TensorLayout]:
    """The spec's tensors as separate (unfused) q/k/v and gate/up projections, HF-style."""
    d = spec.dtype
    col = dict(split_dim=0, num_shards=tp, shard_idx=rank) if tp > 1 else {}
    row = dict(split_dim=1, num_shards=tp, shard_idx=rank) if tp > 1 else {}
    q_rows, kv_rows = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"embed_tokens": ((spec.vocab, spec.hidden), col)}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        for n, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows),
                        ("gate_proj", spec.intermediate), ("up_proj", spec.intermediate)):
            shapes[p + n] = ((rows, spec.hidden), col)
        shapes[p + "down_proj"] = ((spec.hidden, spec.intermediate), row)
        shapes[p + "o_proj"] = ((spec.hidden, q_rows), row)
        shapes[p + "input_layernorm"] = ((spec.hidden,), {})
    out = {}
    for logical, (shape, split) in shapes.items():
        name = rename(logical)
        out[name] = TensorLayout.plain(name, d, shape, **split)
    return out


def _targets(layouts: dict[str, TensorLayout], fill: float = 0.0) -> dict[str, torch.Tensor]:
    return {n: torch.full(l.local_shape, fill, dtype=torch_dtype(l.dtype)) for n, l in layouts.items()}


# -- worker process ----------------------------------------------------------------------------------
def _cmd_reset(state: dict) -> None:
    for key in ("recv", "pub"):
        obj = state.pop(key, None)
        if obj is not None:
            obj.close()
    lease = state.pop("lease", None)
    if lease is not None:
        lease.release()
    for key in ("recv_store", "pub_store"):
        store = state.pop(key, None)
        if store is not None:
            store.close()


def _cmd_pub_start(state: dict, *, address, secret, prefix, rank, world_size, layouts, seed, inplace=False) -> dict:
    """Publish ``layouts`` built from ``seed``; ``inplace`` carves them from one shm arena (no staging)."""
    from warmlink.pool import lease_arena

    for key in ("pub", "pub_store", "lease"):
        obj = state.pop(key, None)
        if obj is not None:
            (obj.release if key == "lease" else obj.close)()
    before = pool.stats().get("registration", {}).get("created", 0)
    if inplace:
        offsets, total = {}, 0
        for n, l in layouts.items():
            offsets[n] = total
            total += (l.nbytes + 255) // 256 * 256
        lease = state["lease"] = lease_arena("shm", total)
        buf = lease.resource.tensor
        tensors = {}
        for n, l in layouts.items():
            t = buf[offsets[n] : offsets[n] + l.nbytes].view(torch_dtype(l.dtype)).view(l.local_shape)
            t.copy_(build_physical(l, "cpu", seed))
            tensors[n] = t
    else:
        tensors = {n: build_physical(l, "cpu", seed) for n, l in layouts.items()}
    store = state["pub_store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    pub = state["pub"] = Publisher(store, rank=rank, world_size=world_size, timeout_s=TIMEOUT_S)
    for n, t in tensors.items():
        pub.add(n, t, layouts[n])
    pub.export()
    state["tensors"], state["layouts"] = tensors, layouts
    registered = pool.stats().get("registration", {}).get("created", 0) - before
    from warmlink.transport.base import local_identity

    host, pid, start = local_identity()
    return {"pid": os.getpid(), "process_id": f"{host}:{pid}:{start}", "generation": pub.generation,
            "version": pub.version, "registered": registered}


def _cmd_pub_update(state: dict, *, seed) -> dict:
    """begin_update (timed), rewrite every tensor from ``seed`` in place, publish."""
    pub, tensors, layouts = state["pub"], state["tensors"], state["layouts"]
    t_begin_start = time.monotonic()
    wait_s = pub.begin_update()
    t_begin_end = time.monotonic()
    for n, t in tensors.items():
        t.copy_(build_physical(layouts[n], "cpu", seed))
    version = pub.publish()
    return {"version": version, "wait_s": wait_s, "t_begin_start": t_begin_start, "t_begin_end": t_begin_end}


def _cmd_recv_start(state: dict, *, address, secret, prefix, num_publishers, layouts, install="copy") -> None:
    for key in ("recv", "recv_store"):
        obj = state.pop(key, None)
        if obj is not None:
            obj.close()
    store = state["recv_store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    rec = state["recv"] = Receiver(store, num_publishers=num_publishers, install=install, timeout_s=TIMEOUT_S)
    targets = state["recv_targets"] = _targets(layouts)
    state["recv_layouts"] = layouts
    for n, l in layouts.items():
        rec.add(n, l, targets[n])


def _cmd_recv_refit(state: dict, *, version=None) -> dict:
    return state["recv"].refit(version=version).as_dict()


def _cmd_recv_check(state: dict, *, seed) -> list[str]:
    return bad_tensors(state["recv_targets"], state["recv_layouts"], seed)


_COMMANDS = {
    "reset": lambda state: _cmd_reset(state),
    "pub_start": _cmd_pub_start,
    "pub_update": _cmd_pub_update,
    "recv_start": _cmd_recv_start,
    "recv_refit": _cmd_recv_refit,
    "recv_check": _cmd_recv_check,
}


def _worker_main(control, results) -> None:
    state: dict = {}
    serve(control, results, _COMMANDS, state, _cmd_reset)


class Worker(SpawnedWorker):
    """A refit test worker running ``_worker_main``."""

    def __init__(self) -> None:
        super().__init__(_worker_main)


@pytest.fixture(scope="module")
def workers():
    ws = [Worker(), Worker()]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"refit-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as s:
        yield s


@pytest.fixture
def session(store, workers):
    """A store plus both workers; the workers drop whatever they hosted when the test ends."""
    yield store, workers
    for w in workers:
        if w.proc.is_alive():
            try:
                w.call("reset", timeout_s=20)
            except RuntimeError:
                pass


def _start_publishers(store, workers, tp: int, layouts_of, seed: int, **kw) -> list[dict]:
    for r in range(tp):
        workers[r].send("pub_start", address=store.address, secret=store.secret, prefix=store.prefix, rank=r, world_size=tp,
                        layouts=layouts_of(r), seed=seed, **kw)
    return [workers[r].result() for r in range(tp)]


def _update_publishers(workers, tp: int, seed: int) -> list[dict]:
    for r in range(tp):
        workers[r].send("pub_update", seed=seed)
    return [workers[r].result() for r in range(tp)]


def _receiver(store, num_publishers: int, layouts: dict, install: str = "copy", **kw) -> tuple[Receiver, dict]:
    rec = Receiver(store, num_publishers=num_publishers, install=install, timeout_s=TIMEOUT_S, **kw)
    targets = _targets(layouts, fill=-1.0)
    for n, l in layouts.items():
        rec.add(n, l, targets[n])
    return rec, targets


# -- TP x TP, bit-exact ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "src_tp, dst_tp, inplace",
    [(1, 1, False), (2, 1, True), (1, 2, False), (2, 4, False)],
    ids=["1to1-remote-receiver", "2to1-inplace", "1to2-mixed-receivers", "2to4"],
)
def test_refit_tp_bit_exact(session, src_tp: int, dst_tp: int, inplace: bool) -> None:
    store, workers = session
    infos = _start_publishers(store, workers, src_tp, lambda r: SPEC.layouts(src_tp, r), seed=1, inplace=inplace)
    assert all(i["version"] == 1 for i in infos)
    if inplace:  # tensors in shared memory are exported in place, one registration each
        assert all(i["registered"] == len(SPEC.layouts(src_tp, 0)) for i in infos)
    # A worker not publishing hosts the last receiver rank: a receiver in a third process.
    remote = workers[src_tp] if src_tp < len(workers) else None
    remote_rank = dst_tp - 1 if remote is not None else None
    if remote is not None:
        remote.call("recv_start", address=store.address, secret=store.secret, prefix=store.prefix, num_publishers=src_tp,
                    layouts=SPEC.layouts(dst_tp, remote_rank))
    local = {}
    try:
        for r in range(dst_tp):
            if r != remote_rank:
                layouts = SPEC.layouts(dst_tp, r)
                local[r] = (*_receiver(store, src_tp, layouts), layouts)
        for version, seed in ((1, 1), (2, 2)):
            if version > 1:
                assert [u["version"] for u in _update_publishers(workers, src_tp, seed)] == [version] * src_tp
            if remote is not None:
                remote.send("recv_refit", version=version)
            for r, (rec, targets, layouts) in local.items():
                report = rec.refit(version=version)
                assert report.version == version and report.nbytes > 0
                assert bad_tensors(targets, layouts, seed) == [], f"dst rank {r} v{version}"
            if remote is not None:
                assert remote.result()["version"] == version
                assert remote.call("recv_check", seed=seed) == []
    finally:
        for rec, _, _ in local.values():
            rec.close()


def test_unfused_receiver_from_fused_publishers(session) -> None:
    store, workers = session
    _start_publishers(store, workers, 2, lambda r: SPEC.layouts(2, r), seed=3)
    layouts = unfused_layouts(SPEC, 1, 0)
    rec, targets = _receiver(store, 2, layouts)
    with rec:
        rec.refit(version=1)
        assert bad_tensors(targets, layouts, 3) == []
        # q is the first 256 rows of the publishers' fused qkv on every rank: check one directly.
        assert torch.equal(targets["layers.0.q_proj"][:128], expected(SPEC.layouts(2, 0)["layers.0.qkv_proj"], 3)[:128])


# -- the warm path in numbers ------------------------------------------------------------------------
def _cycles(rec, targets, layouts, workers, num_cycles: int, src_tp: int) -> list:
    reports = []
    for c in range(1, num_cycles + 1):
        if c > 1:
            _update_publishers(workers, src_tp, seed=10 + c)
        reports.append(rec.refit(version=c))
        assert bad_tensors(targets, layouts, 10 + c) == [], f"cycle {c}"
    return reports


@pytest.mark.parametrize("install", ["copy", "swap"])
def test_warm_cycles_create_nothing(session, install: str) -> None:
    store, workers = session
    _start_publishers(store, workers, 2, lambda r: SPEC.layouts(2, r), seed=11)
    layouts = SPEC.layouts(1, 0)
    pool.set_enabled(True)
    try:
        rec, targets = _receiver(store, 2, layouts, install=install)
        with rec:
            ptrs = []
            reports = []
            for c in range(1, 5):
                if c > 1:
                    _update_publishers(workers, 2, seed=10 + c)
                reports.append(rec.refit(version=c))
                assert bad_tensors(targets, layouts, 10 + c) == [], f"cycle {c}"
                ptrs.append(targets["embed_tokens"].data_ptr())
    finally:
        pool.set_enabled(None)
    assert set(reports[0].created) == set(COUNTED)
    # Cycle 1 may find its plan, arenas and mappings warm from earlier receivers of this process
    # (plans are cached process-wide by layout signature); it plans at most once.
    assert reports[0].created["plan"] <= 1
    for rep in reports[1:]:
        assert rep.created == {k: 0 for k in COUNTED}, f"cycle {rep.cycle} created {rep.created}"
    if install == "swap":  # double buffer: targets alternate between two receiver buffers
        assert ptrs[0] != ptrs[1] and ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3]
    else:  # copy keeps the targets' addresses
        assert len(set(ptrs)) == 1


@pytest.mark.parametrize("install", ["copy", "swap"])
def test_pool_off_every_cycle_creates(session, install: str) -> None:
    store, workers = session
    _start_publishers(store, workers, 2, lambda r: SPEC.layouts(2, r), seed=11)
    layouts = SPEC.layouts(1, 0)
    pool.set_enabled(False)
    try:
        rec, targets = _receiver(store, 2, layouts, install=install)
        with rec:
            reports = _cycles(rec, targets, layouts, workers, 3, 2)
    finally:
        pool.set_enabled(None)
    for rep in reports:
        assert rep.created["arena"] >= 1 and rep.created["peer_mapping"] >= 2 and rep.created["plan"] == 1, rep.created


def test_publisher_recreated_in_its_process_reuses_mappings(session) -> None:
    """A publisher object re-created in the same process gets a new generation but exports the same
    memory (its staging arena comes back from the pool): no mapping is re-opened, none closed, and
    the plan (same layouts) is not rebuilt. A new *process* is tested in test_reconfigure.py."""
    store, workers = session
    infos = _start_publishers(store, workers, 2, lambda r: SPEC.layouts(2, r), seed=1)
    layouts = SPEC.layouts(1, 0)
    rec, targets = _receiver(store, 2, layouts)
    with rec:
        rec.refit(version=1)
        assert bad_tensors(targets, layouts, 1) == []
        restarted = workers[0].call("pub_start", address=store.address, secret=store.secret, prefix=store.prefix, rank=0, world_size=2,
                                    layouts=SPEC.layouts(2, 0), seed=1)
        assert restarted["generation"] == infos[0]["generation"] + 1
        _update_publishers(workers, 2, seed=2)  # both ranks at version 2 again
        from warmlink.transport import shm

        ids = [i["process_id"] for i in infos]  # (a mapping's key adds the process lock token the board names)
        live_before = {k for k in shm._mappings.keys() if any(k[1] == p or k[1].startswith(p + ":") for p in ids)}
        report = rec.refit(version=2)
        assert bad_tensors(targets, layouts, 2) == []
        assert report.created["plan"] == 0 and report.created["arena"] == 0
        assert report.created["peer_mapping"] == 0
        # Both ranks' mappings stay open (stale ones of earlier, dead processes may be dropped).
        assert live_before and live_before <= set(shm._mappings.keys())
        _update_publishers(workers, 2, seed=3)
        assert rec.refit(version=3).created == {k: 0 for k in COUNTED}  # warm again
        assert bad_tensors(targets, layouts, 3) == []


# -- dtype cast, hook, callback ----------------------------------------------------------------------
def test_cast_bf16_to_float32_is_exact(session) -> None:
    store, workers = session
    _start_publishers(store, workers, 1, lambda r: SPEC.layouts(1, 0), seed=5)
    layouts = {n: dataclasses.replace(l, dtype="float32") for n, l in SPEC.layouts(2, 1).items()}
    rec, targets = _receiver(store, 1, layouts)
    with rec:
        rec.refit(version=1)
        assert all(t.dtype == torch.float32 for t in targets.values())
        assert bad_tensors(targets, layouts, 5, src_dtype="bfloat16") == []
        # Not trivially equal: float32 values that bf16 could not hold would differ.
        t = targets["layers.0.down_proj"]
        assert torch.equal(t, t.to(torch.bfloat16).float()) and t.abs().sum() > 0


SMALL = {
    "w": TensorLayout.plain("w", "float32", (64, 64)),
    "b": TensorLayout.plain("b", "float32", (64,)),
}


def _slow_pull(monkeypatch, sleep_s: float, chunk_nbytes: int = 4096) -> list[float]:
    """Make this process's shm copies slow: ``sleep_s`` before each chunk. Returns the call times."""
    times: list[float] = []

    def hook(nbytes: int) -> None:
        times.append(time.monotonic())
        time.sleep(sleep_s)

    monkeypatch.setattr(shm, "CHUNK_NBYTES", chunk_nbytes)
    monkeypatch.setattr(shm, "fault_hook", hook)
    return times


def test_start_refit_returns_before_install(session, monkeypatch) -> None:
    store, workers = session
    _start_publishers(store, workers, 1, lambda r: SMALL, seed=1)
    rec, targets = _receiver(store, 1, SMALL)
    with rec:
        rec.refit(version=1)
        old = {n: t.clone() for n, t in targets.items()}
        _update_publishers(workers, 1, seed=2)
        times = _slow_pull(monkeypatch, 0.1)
        t0 = time.monotonic()
        handle = rec.start_refit(version=2)
        returned_s = time.monotonic() - t0
        assert returned_s < 0.25, f"start_refit blocked {returned_s:.3f} s"  # the pull takes >= 0.5 s
        assert not handle.done()
        with pytest.raises(VersionError, match="in flight"):
            rec.start_refit()
        assert all(torch.equal(targets[n], old[n]) for n in targets)  # nothing installed yet
        report = handle.wait()
        assert len(times) >= 4 and report.pull_s >= 0.3
        assert report.version == 2 and bad_tensors(targets, SMALL, 2) == []
        assert handle.wait() is report and handle() is report  # finishing twice is a no-op
        monkeypatch.setattr(shm, "fault_hook", None)
        assert rec.refit(version=2).version == 2  # the receiver is free again


def test_load_weights_and_name_map(session) -> None:
    store, workers = session
    _start_publishers(store, workers, 1, lambda r: SPEC.layouts(1, 0), seed=7)
    rename = lambda logical: f"model.{logical}.weight"  # noqa: E731
    layouts = unfused_layouts(SPEC, 2, 1, rename)
    name_map = {l.parts[0].logical: l.parts[0].logical[len("model."):-len(".weight")] for l in layouts.values()}
    rec = Receiver(store, num_publishers=1, name_map=name_map, timeout_s=TIMEOUT_S)
    for n, l in layouts.items():
        rec.add(n, l)  # no targets: the engine's load_weights copies
    got: dict[str, torch.Tensor] = {}

    def load_weights(weights) -> None:
        for name, tensor in weights:
            assert name not in got, f"{name} handed twice"
            got[name] = tensor.clone()

    with rec:
        report = rec.refit(load_weights=load_weights)
        assert report.version == 1
    assert set(got) == set(layouts)
    assert bad_tensors(got, layouts, 7, name_map=name_map) == []
    assert "model.layers.0.k_proj.weight" in got and got["model.layers.0.k_proj.weight"].shape == (32, SPEC.hidden)


# -- the version protocol ----------------------------------------------------------------------------
def test_begin_update_waits_for_pull(session, monkeypatch) -> None:
    store, workers = session
    _start_publishers(store, workers, 1, lambda r: SMALL, seed=1)
    rec, targets = _receiver(store, 1, SMALL)
    with rec:
        times = _slow_pull(monkeypatch, 0.15)
        handle = rec.start_refit(version=1)
        workers[0].send("pub_update", seed=2)  # the trainer wants to write while we read
        report = handle.wait()
        t_pulled = time.monotonic()
        upd = workers[0].result()
        assert len(times) >= 4
        # The publisher asked while bytes moved, and got the tensors only after the last chunk.
        assert upd["t_begin_start"] < times[-1], "precondition: the update began mid-pull"
        assert upd["t_begin_end"] >= times[-1] + 0.1, (upd, times[-1])
        assert upd["t_begin_end"] <= t_pulled + 1.0
        assert upd["wait_s"] >= 0.2 and upd["version"] == 2
        # The receiver holds the old version, intact: not one byte of the new one.
        assert report.version == 1 and bad_tensors(targets, SMALL, 1) == []
        monkeypatch.setattr(shm, "fault_hook", None)
        with pytest.raises(VersionError, match="version=1 was replaced by 2"):
            rec.refit(version=1)
        assert all(torch.equal(targets[n], expected(l, 1)) for n, l in SMALL.items())  # untouched
        assert rec.refit().version == 2 and bad_tensors(targets, SMALL, 2) == []


def test_publisher_protocol_misuse(store) -> None:
    with Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=5) as pub:
        pub.add("w", torch.ones(8, 8))
        with pytest.raises(VersionError, match="export"):
            pub.publish()
        pub.export()
        with pytest.raises(VersionError, match="begin_update"):
            pub.publish()
        with pytest.raises(VersionError, match="after export"):
            pub.add("late", torch.ones(2))
        pub.begin_update()
        assert pub.begin_update() == 0.0  # already updating: readers are out, nothing to wait for
        assert pub.publish() == 2
        with pytest.raises(VersionError, match="begin_update"):
            pub.publish()
        with pytest.raises(RuntimeError):
            with pub.update():
                raise RuntimeError("training step failed")
        assert pub.version == 2  # the failed step published nothing
        with pub.update():  # a retry resumes the update the failed step left open
            pass
        assert pub.version == 3
    with pytest.raises(VersionError, match="closed"):
        pub.begin_update()
