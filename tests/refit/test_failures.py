"""Fail closed (DESIGN.md invariant 3) on the shm backend.

Bad input raises a typed, explained error before any byte moves, and leaves the receiver's
targets and the publishers' reader counts as they were. A publisher killed mid-pull or one that
never publishes gives a timeout-bounded error, and the targets keep the previous version exactly.
A hypothesis fuzz checks ``Link.prepare`` bounds and that a prepared batch moves exactly the
requested bytes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import re
import signal
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmlink.bench.refit import build_physical
from warmlink.errors import ConfigError, LayoutError, MetadataError, PeerLostError, TransferTimeout
from warmlink.pool import arenas
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm
from warmlink.transport.base import Copy, PeerRef, local_identity
from warmlink.transport.shm import ShmLink

CTX = mp.get_context("spawn")
F32 = "float32"
W = TensorLayout.plain("w", F32, (64, 32))
B = TensorLayout.plain("b", F32, (32,))


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"fail-{uuid.uuid4().hex[:8]}", timeout_s=10) as s:
        yield s


def _publishers(store, layouts_by_rank: list[dict[str, TensorLayout]], seed: int = 1) -> list[Publisher]:
    """In-process publishers (the protocol does not care where they run; the kill test spawns one)."""
    pubs = []
    for rank, layouts in enumerate(layouts_by_rank):
        pub = Publisher(store, rank=rank, world_size=len(layouts_by_rank), backend="shm", timeout_s=5)
        for n, l in layouts.items():
            pub.add(n, build_physical(l, "cpu", seed), l)
        pub.export()
        pubs.append(pub)
    return pubs


def _receiver(store, layouts: dict[str, TensorLayout], num_publishers: int = 1, **kw) -> tuple[Receiver, dict]:
    rec = Receiver(store, num_publishers=num_publishers, timeout_s=kw.pop("timeout_s", 5), **kw)
    targets = {}
    for n, l in layouts.items():
        targets[n] = torch.full(l.local_shape, 42.0, dtype=getattr(torch, l.dtype))
        rec.add(n, l, targets[n])
    return rec, targets


def _snapshot(targets: dict) -> dict:
    return {n: t.clone() for n, t in targets.items()}


def _untouched(targets: dict, snap: dict) -> bool:
    return all(torch.equal(targets[n], snap[n]) for n in snap)


def _no_readers_left(pubs: list[Publisher]) -> None:
    """Every publisher can begin an update at once: the failed refit left no reader count behind."""
    for pub in pubs:
        assert pub.begin_update(timeout_s=1.0) < 0.5
        pub.publish()


def _refit_refused(rec, targets: dict, pubs: list, error: type, match: str, readers_left: bool = True):
    """A refit that must fail closed: the typed error, targets untouched and (by default) no reader
    count left behind on any publisher. Returns the pytest ExceptionInfo."""
    snap = _snapshot(targets)
    with pytest.raises(error, match=match) as info:
        rec.refit(timeout_s=2)
    assert _untouched(targets, snap)
    if readers_left:
        _no_readers_left(pubs)
    return info


def _close(*objs) -> None:
    for o in objs:
        o.close()


# -- typed errors before any byte moves -----------------------------------------------------------
def test_receiver_declares_tensor_publisher_lacks(store) -> None:
    pubs = _publishers(store, [{"w": W}])
    rec, targets = _receiver(store, {"w": W, "missing": TensorLayout.plain("missing", F32, (4, 4))})
    snap = _snapshot(targets)
    try:
        with pytest.raises(LayoutError, match="missing"):
            rec.refit(timeout_s=2)
        assert _untouched(targets, snap) and rec.installed_version == 0
        _no_readers_left(pubs)
    finally:
        _close(rec, *pubs)


def test_shape_mismatch(store) -> None:
    pubs = _publishers(store, [{"w": W}])
    wrong = TensorLayout.plain("w", F32, (64, 16))  # the publisher's w is (64, 32)
    rec, targets = _receiver(store, {"w": wrong})
    try:
        _refit_refused(rec, targets, pubs, LayoutError, "'w'")
        with pytest.raises(LayoutError, match=r"shape=\(64, 16\)"):
            rec.add("w2", TensorLayout.plain("w2", F32, (64, 32)), torch.zeros(64, 16))
    finally:
        _close(rec, *pubs)


def test_target_dtype_mismatch() -> None:
    rec = Receiver(object(), num_publishers=1, timeout_s=1)  # add() validates before touching the store
    with pytest.raises(LayoutError, match="dtype='bfloat16'.*'float32'"):
        rec.add("w", W, torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="name='v' but layout.name='w'"):
        rec.add("v", W)
    rec.add("w", W)
    with pytest.raises(LayoutError, match="twice"):
        rec.add("w", W)


def test_add_in_the_other_class_order_is_a_layout_error() -> None:
    """Publisher.add(name, tensor, layout) and Receiver.add(name, layout, target): swapped
    arguments get a LayoutError naming the order, not an AttributeError from deep inside."""
    t = torch.zeros(64, 32)
    rec = Receiver(object(), num_publishers=1, timeout_s=1)
    with pytest.raises(LayoutError, match=r"layout is a Tensor; expected a TensorLayout \(the order is add\(name, layout, target\)"):
        rec.add("w", t, W)
    pub = Publisher(object(), rank=0, world_size=1, timeout_s=1)
    with pytest.raises(LayoutError, match=r"tensor is a TensorLayout; expected a torch.Tensor \(the order is add\(name, tensor, layout\)"):
        pub.add("w", W, t)
    with pytest.raises(LayoutError, match="layout is a dict; expected a TensorLayout or None"):
        pub.add("w", t, {"name": "w"})
    pub.add("w", t, W)  # the right order still works


def test_uncovered_sharding(store) -> None:
    half = TensorLayout.plain("w", F32, (64, 32), split_dim=0, num_shards=2, shard_idx=0)
    pubs = _publishers(store, [{"w": half}])  # one publisher holding only rows 0..32
    rec, targets = _receiver(store, {"w": W})
    try:
        _refit_refused(rec, targets, pubs, LayoutError, "'w'")
    finally:
        _close(rec, *pubs)


def test_num_publishers_mismatch(store) -> None:
    layouts = [{"w": TensorLayout.plain("w", F32, (64, 32), 0, 2, r)} for r in range(2)]
    pubs = _publishers(store, layouts)
    rec, targets = _receiver(store, {"w": W}, num_publishers=1)
    try:
        _refit_refused(rec, targets, pubs, LayoutError, "world_size=2.*num_publishers=1")
    finally:
        _close(rec, *pubs)


def _edit(raw: bytes, edit) -> bytes:
    m = json.loads(raw)
    edit(m)
    return json.dumps(m).encode()


def _tamper_manifest(store, pub: Publisher, edit) -> None:
    key = protocol.manifest_key(pub.rank, pub.generation)
    m = json.loads(store.get(key))
    edit(m)
    store.set(key, json.dumps(m))


def test_backend_mismatch(store) -> None:
    pubs = _publishers(store, [{"w": W}])
    _tamper_manifest(store, pubs[0], lambda m: m["peer"].update(backend="cuda_ipc"))
    rec, targets = _receiver(store, {"w": W}, backend="shm")
    try:
        _refit_refused(rec, targets, pubs, ConfigError, "backend='cuda_ipc'")
    finally:
        _close(rec, *pubs)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"rank=3 out of range; expected 0 <= rank < world_size=2"):
        Publisher(object(), rank=3, world_size=2)
    with pytest.raises(ConfigError, match="rank=-1"):
        Publisher(object(), rank=-1, world_size=2)
    with pytest.raises(ConfigError, match="num_publishers=0"):
        Receiver(object(), num_publishers=0)
    with pytest.raises(ConfigError, match="install='inplace'"):
        Receiver(object(), num_publishers=1, install="inplace")



@pytest.mark.parametrize("kwargs, says", [
    ({"rank": "0"}, "rank='0'; expected an int"), ({"world_size": 0}, "world_size=0; expected an int >= 1"),
    ({"rank": True}, "rank=True"), ({"timeout_s": -1}, "timeout_s=-1; expected finite seconds > 0"),
    ({"timeout_s": 0}, "timeout_s=0"), ({"timeout_s": float("nan")}, "timeout_s=nan"), ({"timeout_s": "5"}, "timeout_s='5'"),
])
def test_publisher_arguments_of_the_wrong_kind_are_config_errors(kwargs, says) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"Publisher: {says}")):
        Publisher(object(), **kwargs)


@pytest.mark.parametrize("kwargs, says", [
    ({"num_publishers": "2"}, "num_publishers='2'; expected an int >= 1"), ({"num_publishers": 1.0}, "num_publishers=1.0"),
    ({"max_runs_per_tensor": 0}, "max_runs_per_tensor=0; expected an int >= 1"),
    ({"timeout_s": 0}, "timeout_s=0; expected finite seconds > 0"), ({"timeout_s": float("inf")}, "timeout_s=inf"),
])
def test_receiver_arguments_of_the_wrong_kind_are_config_errors(kwargs, says) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"Receiver: {says}")):
        Receiver(object(), **{"num_publishers": 1, **kwargs})


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda raw: b"\x00garbage{", "not valid JSON"),
        (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
        (lambda raw: _edit(raw, lambda m: m["tensors"][0].update(offset=-4)), r"tensors\[0\]\.offset=-4"),
        (lambda raw: _edit(raw, lambda m: m["tensors"][1].update(region=7)), r"tensors\[1\]\.region=7"),
        (lambda raw: raw.replace(b'"world_size":1', b'"world_size":"1"', 1), r"peer\.world_size"),
    ],
    ids=["garbage", "truncated", "negative-offset", "region-out-of-range", "world-size-type"],
)
def test_corrupt_manifest(store, corrupt, match) -> None:
    pubs = _publishers(store, [{"w": W, "b": B}])
    key = protocol.manifest_key(0, pubs[0].generation)
    raw = store.get(key)
    bad = corrupt(raw)
    assert bad != raw
    store.set(key, bad)
    rec, targets = _receiver(store, {"w": W, "b": B})
    try:
        info = _refit_refused(rec, targets, pubs, MetadataError, "publisher/0")
        assert info.match(match)
    finally:
        _close(rec, *pubs)


def test_corrupt_version_state(store) -> None:
    pubs = _publishers(store, [{"w": W}])
    store.set(protocol.state_key(0), b'{"schema_version":1,"kind":"version_state","version":"x"}')
    rec, targets = _receiver(store, {"w": W})
    try:
        _refit_refused(rec, targets, pubs, MetadataError, "publisher/0", readers_left=False)
    finally:
        _close(rec, *pubs)


# -- stalls ----------------------------------------------------------------------------------------
def test_publisher_never_publishes_requested_version(store) -> None:
    pubs = _publishers(store, [{"w": W}])
    rec, targets = _receiver(store, {"w": W})
    try:
        rec.refit(version=1)
        snap = _snapshot(targets)
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="did not agree"):
            rec.refit(version=2, timeout_s=0.5)
        assert 0.5 <= time.monotonic() - start < 2.0
        assert _untouched(targets, snap)
        # Stuck in "updating" (a trainer that began an update and hung): also a bounded wait.
        pubs[0].begin_update()
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="updating"):
            rec.refit(timeout_s=0.5)
        assert time.monotonic() - start < 2.0
        assert _untouched(targets, snap)
    finally:
        _close(rec, *pubs)


def test_dead_reader_makes_begin_update_time_out(store) -> None:
    pubs = _publishers(store, [{"w": W}])
    try:
        state = protocol.read_state(store, 0)
        protocol.count_in(store, 0, state.version)  # a receiver entered and never left
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="version 1 still has 1 reader"):
            pubs[0].begin_update(timeout_s=0.3)
        assert time.monotonic() - start < 1.5
    finally:
        protocol.leave(store, 0, 1)
        _close(*pubs)


# -- swap install: the installed half of the double buffer is never a pull target ---------------
@pytest.mark.parametrize("failure", ["stall", "mid-pull"])
def test_swap_failed_cycle_never_exposes_a_mix(store, monkeypatch, failure: str) -> None:
    """After a failed cycle, the next pull must still write the half the targets do not point at."""
    from warmlink.errors import TransferError

    layout = TensorLayout.plain("w", F32, (128, 64))  # 32 KiB: 8 chunks of 4 KiB
    tensor = build_physical(layout, "cpu", 1)
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=5)
    pub.add("w", tensor, layout)
    pub.export()
    rec, targets = _receiver(store, {"w": layout}, install="swap")
    values = {s: build_physical(layout, "cpu", s) for s in (1, 2)}
    try:
        rec.refit(version=1)
        assert torch.equal(targets["w"], values[1])
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
        if failure == "stall":
            with pytest.raises(TransferTimeout):
                rec.refit(version=2, timeout_s=0.3)
        with pub.update():
            tensor.copy_(values[2])
        if failure == "mid-pull":
            calls: list[int] = []

            def broken(nbytes: int) -> None:
                calls.append(nbytes)
                if len(calls) == 3:
                    raise OSError("link went down")

            monkeypatch.setattr(shm, "fault_hook", broken)
            with pytest.raises(TransferError, match="link went down"):
                rec.refit(version=2)
        assert torch.equal(targets["w"], values[1])
        seen_mid_pull: list[bool] = []

        def watch(nbytes: int) -> None:  # what the model sees while the next pull runs
            seen_mid_pull.append(torch.equal(targets["w"], values[1]))

        monkeypatch.setattr(shm, "fault_hook", watch)
        rec.refit(version=2)
        assert len(seen_mid_pull) >= 8 and all(seen_mid_pull), seen_mid_pull
        assert torch.equal(targets["w"], values[2])
    finally:
        _close(rec, pub)


# -- a publisher killed mid-pull -------------------------------------------------------------------
def _publisher_child(address: str, secret: str, prefix: str, layouts: dict, control, results) -> None:
    try:
        store = Store.connect(address, prefix=prefix, timeout_s=30, secret=secret)
        tensors = {n: build_physical(l, "cpu", 1) for n, l in layouts.items()}
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=30)
        for n, t in tensors.items():
            pub.add(n, t, layouts[n])
        pub.export()
        results.put(("ready", os.getpid()))
        while True:
            msg = control.get(timeout=60)
            if msg is None:
                break
            with pub.update():
                for n, t in tensors.items():
                    t.copy_(build_physical(layouts[n], "cpu", msg))
            results.put(("published", pub.version))
        pub.close()
        store.close()
    except BaseException as exc:
        results.put(("error", repr(exc)))


def _get(results, proc, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tag, value = results.get(timeout=0.25)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"publisher child died (exit code {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError("publisher child gave no answer") from None
            continue
        if tag == "error":
            raise RuntimeError(f"publisher child failed: {value}")
        return value


def test_publisher_killed_mid_pull(store, monkeypatch) -> None:
    layouts = {"w": TensorLayout.plain("w", F32, (128, 64)), "b": B}  # w: 32 KiB = 8 chunks of 4 KiB
    control, results = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_publisher_child, args=(store.address, store.secret, store.prefix, layouts, control, results), daemon=True)
    proc.start()
    rec = None
    try:
        pid = _get(results, proc)
        rec, targets = _receiver(store, layouts, timeout_s=10)
        rec.refit(version=1)
        v1 = {n: build_physical(l, "cpu", 1) for n, l in layouts.items()}
        assert all(torch.equal(targets[n], v1[n]) for n in layouts)
        control.put(2)  # the trainer publishes version 2 ...
        assert _get(results, proc) == 2

        calls: list[int] = []

        def hook(nbytes: int) -> None:  # ... and dies once the first chunk of its pull has landed
            calls.append(nbytes)
            if len(calls) == 2:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

        monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
        monkeypatch.setattr(shm, "fault_hook", hook)
        timeout_s = 5.0
        start = time.monotonic()
        with pytest.raises((PeerLostError, TransferTimeout)) as info:
            rec.refit(version=2, timeout_s=timeout_s)
        elapsed = time.monotonic() - start
        assert elapsed < timeout_s + 2.0, f"took {elapsed:.2f} s"
        assert "publisher/0" in str(info.value)
        assert 2 <= len(calls) < 9, calls  # the kill landed mid-pull
        # Old version exactly, not a mix of old and new.
        assert all(torch.equal(targets[n], v1[n]) for n in layouts)
        assert rec.installed_version == 1
        proc.join(timeout=5)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        monkeypatch.setattr(shm, "fault_hook", None)
        if rec is not None:
            rec.close()
        try:
            control.put(None)
        except (OSError, ValueError):
            pass
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        arenas.reap_orphaned_shm()  # a killed process leaves its files; see Note [Leaked shm files]


# -- Link.prepare fuzz -----------------------------------------------------------------------------
LOCAL_NBYTES, REMOTE_NBYTES, REMOTE_AT = 8192, 4096, 1000


@pytest.fixture(scope="module")
def fuzz_regions():
    link = ShmLink(timeout_s=5)
    local = link.allocate(LOCAL_NBYTES)
    owner = link.allocate(REMOTE_AT + REMOTE_NBYTES)
    gen = torch.Generator().manual_seed(0)
    owner.tensor.copy_(torch.randint(0, 256, (REMOTE_AT + REMOTE_NBYTES,), dtype=torch.uint8, generator=gen))
    host, pid, start = local_identity()
    # Opened at an offset inside its file, as a publisher's in-place tensor is.
    desc = dict(owner.desc, offset=REMOTE_AT, nbytes=REMOTE_NBYTES)
    remote = link.open(PeerRef("fuzz/0", 1, host, pid, start), desc)
    yield link, local, remote, owner.tensor[REMOTE_AT:].clone()
    link.close_region(remote)
    link.release(local)
    link.release(owner)
    link.close()


_FIELDS = ("local_offset", "remote_offset", "row_nbytes", "num_rows", "local_pitch", "remote_pitch")


def _valid(f: dict) -> bool:
    """The contract of Link.prepare, written independently of its code."""
    if any(f[k] < 0 for k in _FIELDS) or f["row_nbytes"] == 0 or f["num_rows"] == 0:
        return False
    rows, row = f["num_rows"], f["row_nbytes"]
    if rows > 1 and (f["local_pitch"] < row or f["remote_pitch"] < row):
        return False
    lend = f["local_offset"] + (rows - 1) * f["local_pitch"] + row if rows > 1 else f["local_offset"] + row
    rend = f["remote_offset"] + (rows - 1) * f["remote_pitch"] + row if rows > 1 else f["remote_offset"] + row
    return lend <= LOCAL_NBYTES and rend <= REMOTE_NBYTES


@st.composite
def copy_fields(draw) -> list[dict]:
    """1..6 copies with disjoint local destinations (some adjacent on both sides, so they merge),
    then maybe one field of one copy set to a bad or out-of-bounds value."""
    out, cursor = [], 0
    for _ in range(draw(st.integers(1, 6))):
        rows = draw(st.integers(1, 4))
        row = draw(st.integers(1, 200))
        prev = out[-1] if out else None
        if prev is not None and rows == 1 and prev["num_rows"] == 1 and draw(st.booleans()):
            lo, ro = cursor, prev["remote_offset"] + prev["row_nbytes"]  # adjacent: coalesces
        else:
            lo = cursor + draw(st.integers(0, 64))
            ro = None
        lp = row + draw(st.integers(0, 64)) if rows > 1 else draw(st.integers(0, 8))
        rp = row + draw(st.integers(0, 300)) if rows > 1 else draw(st.integers(0, 8))
        rspan = (rows - 1) * rp + row
        if ro is None:
            ro = draw(st.integers(0, max(0, REMOTE_NBYTES - rspan)))
        out.append(dict(local_offset=lo, remote_offset=ro, row_nbytes=row, num_rows=rows, local_pitch=lp, remote_pitch=rp))
        cursor = lo + (rows - 1) * lp + row
    if draw(st.booleans()):
        victim = draw(st.sampled_from(out))
        field = draw(st.sampled_from(_FIELDS))
        # Only values that make the copy invalid: a valid offset such as 0 could make two copies
        # write the same bytes, which a batch leaves undefined (its copies are unordered).
        zero = st.just(0) if field in ("row_nbytes", "num_rows") else st.nothing()
        victim[field] = draw(st.one_of(st.integers(-1000, -1), zero, st.integers(REMOTE_NBYTES, 3 * LOCAL_NBYTES)))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=copy_fields())
def test_prepare_fuzz(fuzz_regions, fields: list[dict]) -> None:
    link, local, remote, remote_bytes = fuzz_regions
    copies = [Copy(local, f["local_offset"], remote, f["remote_offset"], f["row_nbytes"], f["num_rows"],
                   f["local_pitch"], f["remote_pitch"]) for f in fields]
    first_bad = next((i for i, f in enumerate(fields) if not _valid(f)), None)
    if first_bad is not None:
        with pytest.raises(ConfigError, match=rf"Link\.prepare: copies\[{first_bad}\]"):
            link.prepare(copies)
        return
    batch = link.prepare(copies)
    requested = sum(f["row_nbytes"] * f["num_rows"] for f in fields)
    assert batch.nbytes == requested == sum(c.nbytes for c in (*batch.flat, *batch.strided))
    assert batch.num_requested == len(copies) and 1 <= batch.num_copies <= len(copies)
    assert all(c.num_rows == 1 for c in batch.flat) and all(c.num_rows > 1 for c in batch.strided)
    # Executing it moves exactly the requested bytes: compare with a plain copy loop.
    sentinel = 0xA5
    local.tensor.fill_(sentinel)
    ref = torch.full((LOCAL_NBYTES,), sentinel, dtype=torch.uint8)
    for f in fields:
        for i in range(f["num_rows"]):
            lo = f["local_offset"] + i * f["local_pitch"]
            ro = f["remote_offset"] + i * f["remote_pitch"]
            ref[lo : lo + f["row_nbytes"]] = remote_bytes[ro : ro + f["row_nbytes"]]
    link.read(batch).wait(5)
    assert torch.equal(local.tensor, ref)


def test_slots_of_dead_processes_are_retired_so_begin_update_stays_cheap(store) -> None:
    """Receiver processes come and go for a whole job: begin_update must not poll every slot ever
    taken (Note [Reader slots]); slots of dead local processes are retired a few per update."""
    import socket
    import subprocess
    import sys

    from warmlink.transport.base import process_start_time

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(done.stdout)
    assert process_start_time(dead_pid) is None
    for _ in range(20):  # twenty receiver processes that read once and are gone
        k = store.add("pub/0/reader_slots", 1, checked=False)
        store.set(f"pub/0/reader_slot/{k}", f"{socket.gethostname()}:{dead_pid}:12345")
    pubs = _publishers(store, [{"w": W}])
    try:
        polled = []
        for _ in range(6):
            pubs[0].begin_update(timeout_s=1.0)
            pubs[0].publish()
            polled.append(20 - len(protocol._retired.get(store, 0) or ()))
        assert polled[-1] <= protocol._SWEEP_ABOVE, polled
        assert polled == sorted(polled, reverse=True), polled
    finally:
        _close(*pubs)
