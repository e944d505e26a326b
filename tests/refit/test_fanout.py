"""Fan-out over shm (Note [Fan-out] in ``refit._relay``, Note [Fan-out tree] in ``refit._members``).

Engine replicas take each version from each other: eight receiver processes get each version
bit-exact while the trainer sends the model once; a relay SIGKILLed mid-version leaves every other
replica with a whole version or a typed error; a replica joining a running job takes its first
version from a replica; a relay whose layout differs is refused before any byte moves. Every
received byte is compared with values built independently from the version's seed.

Twelve worker processes start once for the module, forks of a server that imported torch and
warmlink (one import, not twelve); every wait on them is bounded, and a worker that dies fails the test
instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _spawned import SpawnedWorker, preloaded, serve

from warmlink.bench.refit import build_physical
from warmlink.errors import ConfigError, WarmlinkError
from warmlink.pool import arenas
from warmlink.refit import FanOut, Publisher, Receiver, Shard, TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

TIMEOUT_S = 60.0
CHUNK_BYTES = 16 << 10
SENTINEL = -1.0
LAYOUTS = {  # ~520 KiB: ~33 chunks of 16 KiB; a bf16 tensor and a fused one, all staged by the trainer
    "w": TensorLayout.plain("w", "float32", (256, 512)),
    "b": TensorLayout.plain("b", "float32", (1000,)),
    "n": TensorLayout.plain("n", "bfloat16", (300,)),
    "qkv": TensorLayout.fused("qkv", "float32", [("q", Shard((32, 16))), ("k", Shard((16, 16)))]),
}
MODEL_NBYTES = sum(lay.nbytes for lay in LAYOUTS.values())


# -- the trainer, in this process --------------------------------------------------------------------
class Trainer:
    """One publisher rank whose tensors hold the values of seed ``version`` at every version."""

    def __init__(self, store: Store) -> None:
        self.tensors = {n: build_physical(lay, "cpu", 1) for n, lay in LAYOUTS.items()}
        self.pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
        for n, t in self.tensors.items():
            self.pub.add(n, t, LAYOUTS[n])
        self.pub.export()

    def update(self) -> int:
        """Publish the next version, its tensors built from its number; returns it."""
        with self.pub.update(timeout_s=TIMEOUT_S):
            for n, t in self.tensors.items():
                t.copy_(build_physical(LAYOUTS[n], "cpu", self.pub.version + 1))
        return self.pub.version


@pytest.fixture
def job():
    """A store and a trainer at version 1; closed after the test."""
    with Store("127.0.0.1", 0, is_server=True, prefix=f"fanout-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as store:
        trainer = Trainer(store)
        try:
            yield store, trainer
        finally:
            trainer.pub.close()


# -- worker processes --------------------------------------------------------------------------------
def _cmd_start(state, *, address, secret, prefix, group, layouts, chunk_bytes=CHUNK_BYTES, stall_s=30.0, degree=1,
               install="copy"):
    _cmd_close(state)
    if state.get("store_key") != (address, prefix):
        if state.get("store") is not None:
            state["store"].close()
        state["store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
        state["store_key"] = (address, prefix)
    rec = Receiver(state["store"], num_publishers=1, backend="shm", timeout_s=TIMEOUT_S, install=install,
                   fanout=FanOut(group, chunk_bytes=chunk_bytes, stall_s=stall_s, degree=degree))
    state["targets"] = {n: torch.full(lay.shape, SENTINEL, dtype=getattr(torch, lay.dtype)) for n, lay in layouts.items()}
    state["layouts"] = layouts
    for n, lay in layouts.items():
        rec.add(n, lay, state["targets"][n])
    state["rec"] = rec
    return os.getpid()


def _cmd_refit(state, *, timeout_s=TIMEOUT_S):
    """A cycle; its report's facts and the tensors that differ from the version's values, or the
    typed error it raised (with whether the targets still hold a whole earlier version)."""
    rec = state["rec"]
    try:
        rep = rec.refit(timeout_s=timeout_s)
    except WarmlinkError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "installed": rec.installed_version,
                "bad": _bad(state, rec.installed_version)}
    return {"version": rep.version, "replica": rep.replica, "pulled_from": rep.pulled_from, "created": rep.created,
            "bad": _bad(state, rep.version)}


def _bad(state, version) -> list[str]:
    if not version:  # nothing installed yet: the targets must hold what they were made with
        return [n for n, t in state["targets"].items() if not bool((t == SENTINEL).all())]
    return [n for n, lay in state["layouts"].items() if not torch.equal(state["targets"][n], build_physical(lay, "cpu", version))]


def _cmd_arm_kill(state, *, after: int, sleep_s: float):
    """SIGKILL this process once ``after`` chunk copies of its link have landed, each slowed by
    ``sleep_s`` (header reads pass untouched): it dies mid-version, while others pull from it."""
    copied = [0]

    def hook(nbytes: int) -> None:
        if nbytes <= 128:
            return
        copied[0] += 1
        if copied[0] > after:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(sleep_s)

    shm.fault_hook = hook


def _cmd_close(state):
    rec = state.pop("rec", None)
    if rec is not None:
        rec.close()


def _reset(state):
    _cmd_close(state)
    if state.get("store") is not None:
        state["store"].close()
    shm.fault_hook = None


_COMMANDS = {"start": _cmd_start, "refit": _cmd_refit, "arm_kill": _cmd_arm_kill, "close": _cmd_close,
             "ping": lambda state: os.getpid()}


def _worker_main(control, results) -> None:
    serve(control, results, _COMMANDS, {}, _reset)


@pytest.fixture(scope="module")
def workers():
    ctx = preloaded("torch", "warmlink.refit")
    ws = [SpawnedWorker(_worker_main, ctx=ctx) for _ in range(12)]
    try:
        for w in ws:  # started (the server's one import may take long on a loaded machine): tests time only their work
            w.call("ping", timeout_s=300)
        yield ws
    finally:
        for w in ws:
            w.ask_stop()
        for w in ws:
            w.stop()
        arenas.reap_orphaned_shm()  # a killed worker leaves its files: Note [Leaked shm files]


def _start(ws, store, group: str, layouts=LAYOUTS, **kw) -> None:
    for w in ws:
        w.send("start", address=store.address, secret=store.secret, prefix=store.prefix, group=group, layouts=layouts, **kw)
    for w in ws:
        w.result(TIMEOUT_S)


def _refit_all(ws) -> list[dict]:
    """Every worker refits at once; their results in worker order."""
    for w in ws:
        w.send("refit")
    return [w.result(TIMEOUT_S + 10) for w in ws]


def _close(ws) -> None:
    for w in ws:
        if w.proc.is_alive():
            w.call("close", TIMEOUT_S)


# -- fan-out to processes --------------------------------------------------------------------------------
@pytest.mark.parametrize("num_engines,install", [(1, "copy"), (8, "copy"), (8, "swap")])
def test_engines_get_each_version_bit_exact_and_the_trainer_sends_the_model_once(workers, job, num_engines, install):
    """With ``install="swap"`` three versions: each half of every double buffer is served, then
    the first again."""
    store, trainer = job
    ws = workers[:num_engines]
    _start(ws, store, f"versions-{num_engines}-{install}", install=install)
    try:
        for version in (1, 2, 3) if install == "swap" else (1, 2):
            if version > 1:
                assert trainer.update() == version
            got = _refit_all(ws)
            assert [g.get("error") for g in got] == [None] * num_engines, got
            assert [g["version"] for g in got] == [version] * num_engines
            assert [g["bad"] for g in got] == [[]] * num_engines
            from_trainer = sum(g["pulled_from"].get("publishers", 0) for g in got)
            assert from_trainer == MODEL_NBYTES, f"version {version}: the trainer sent {from_trainer} bytes, the model is {MODEL_NBYTES}"
            members = sorted(g["replica"] for g in got)
            assert members == list(range(1, num_engines + 1))
            for g in got:  # one place: a star around member 1 (Note [Fan-out tree])
                source = "publishers" if g["replica"] == 1 else "replica 1"
                assert list(g["pulled_from"]) == [source], g
        assert all(sum(c.values()) == 0 for c in (g["created"] for g in got)), "a warm fan-out cycle created something"
    finally:
        _close(ws)


def test_an_engine_joining_a_running_job_takes_its_first_version_from_a_replica(workers, job):
    store, trainer = job
    trainer.update()
    running, joining = workers[:2], workers[2]
    _start(running, store, "join")
    try:
        assert [g["bad"] for g in _refit_all(running)] == [[], []]
        _start([joining], store, "join")
        (got,) = _refit_all([joining])
        assert got.get("error") is None and got["version"] == 2 and got["bad"] == [], got
        assert got["replica"] == 3 and got["pulled_from"] == {"replica 1": got["pulled_from"]["replica 1"]}, got
        assert got["pulled_from"]["replica 1"] >= MODEL_NBYTES  # the first on its host (Note [Fan-out tree])
    finally:
        _close(running + [joining])


def test_a_relay_with_another_layout_is_refused_before_any_byte_moves(workers, job):
    store, trainer = job
    first, other = workers[3], workers[4]
    _start([first], store, "layouts")
    try:
        assert _refit_all([first])[0]["bad"] == []
        half = dict(LAYOUTS, w=TensorLayout.plain("w", "float32", (256, 512), split_dim=0, num_shards=2, shard_idx=0))
        _start([other], store, "layouts", layouts=half)  # the same group and rank, another layout: a launcher bug
        (got,) = _refit_all([other])
        assert got.get("error") == "LayoutError" and "another layout" in got["message"] and "replica 1" in got["message"], got
        assert got["installed"] == 0 and got["bad"] == [], "targets written before the refusal"
        trainer.pub.begin_update(timeout_s=5.0)  # the refused cycle left no reader behind (else TransferTimeout)
        trainer.pub.publish()
    finally:
        _close([first, other])


@pytest.mark.parametrize("install", ["copy", "swap"])
def test_a_relay_killed_mid_version_leaves_every_replica_whole(workers, job, install):
    """The last tests of this module to use the workers: each kills one of its own four. A tree of
    degree 2 (4 <- 2 <- 1, 3 <- 1): on one host a chain is a star around member 1 (Note [Fan-out
    tree]). With swap the version killed is pulled into the other half of every double buffer."""
    store, trainer = job
    ws = workers[4:8] if install == "copy" else workers[8:12]
    _start(ws, store, f"kill-{install}", degree=2, install=install)
    try:
        first = _refit_all(ws)
        assert [g["bad"] for g in first] == [[]] * 4
        by_member = {g["replica"]: w for g, w in zip(first, ws)}
        victim = by_member[2]
        victim.call("arm_kill", after=6, sleep_s=0.2)
        version = trainer.update()
        for w in ws:
            w.send("refit")
        start = time.monotonic()
        outcomes = {}
        for member, w in sorted(by_member.items()):
            if w is victim:
                with pytest.raises(RuntimeError, match="died"):
                    w.result(TIMEOUT_S)
                continue
            outcomes[member] = w.result(TIMEOUT_S)
        took = time.monotonic() - start
        assert victim.proc.exitcode == -signal.SIGKILL
        assert took < TIMEOUT_S / 2, f"replicas took {took:.1f} s: they waited for a timeout, not routed around"
        for member, got in outcomes.items():
            if got.get("error") is not None:  # a typed error: the whole earlier version stays
                assert got["error"] in ("PeerLostError", "TransferTimeout") and got["bad"] == [], got
            else:
                assert got["version"] == version and got["bad"] == [], got
        assert outcomes[4].get("error") is None, outcomes[4]
        assert outcomes[4]["pulled_from"].get("replica 1", 0) > 0, outcomes[4]  # routed around to the relay's source
        trainer.pub.begin_update(timeout_s=5.0)  # the dead relay holds the trainer no more (else TransferTimeout)
        trainer.pub.publish()
    finally:
        _close([w for w in ws if w is not victim])


# -- in this process --------------------------------------------------------------------------------------
def _receivers(store, n: int, group: str, install: str = "copy", **fanout) -> list[tuple[Receiver, dict]]:
    out = []
    for _ in range(n):
        rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S, install=install,
                       fanout=FanOut(group, **{"chunk_bytes": CHUNK_BYTES, "stall_s": 30.0, **fanout}))
        targets = {n: torch.full(lay.shape, SENTINEL, dtype=getattr(torch, lay.dtype)) for n, lay in LAYOUTS.items()}
        for name, lay in LAYOUTS.items():
            rec.add(name, lay, targets[name])
        out.append((rec, targets))
    return out


def test_a_tree_of_degree_two_started_at_once(job):
    store, trainer = job
    recs = _receivers(store, 5, group="tree", degree=2)
    try:
        for version in (1, 2):
            if version > 1:
                assert trainer.update() == version
            handles = [rec.start_refit() for rec, _ in recs]  # all in flight at once: relays pipeline
            reports = [h.wait() for h in handles]
            for (rec, targets), rep in zip(recs, reports):
                assert rep.version == version
                assert all(torch.equal(targets[n], build_physical(LAYOUTS[n], "cpu", version)) for n in LAYOUTS)
            sources = {rep.replica: set(rep.pulled_from) for rep in reports}
            assert sources == {1: {"publishers"}, 2: {"replica 1"}, 3: {"replica 1"}, 4: {"replica 2"}, 5: {"replica 2"}}
            assert sum(rep.publisher_nbytes for rep in reports) == MODEL_NBYTES
    finally:
        for rec, _ in recs:
            rec.close()


@pytest.fixture
def pooling_off():
    from warmlink import pool

    pool.set_enabled(False)
    try:
        yield
    finally:
        pool.set_enabled(None)


@pytest.mark.parametrize("sync,install", [("store_sync", "copy"), ("pooling_off", "copy"), ("store_sync", "swap"),
                                          ("pooling_off", "swap")])
def test_relays_of_relays_in_flight_at_once(request, job, sync, install):
    """Replicas that count themselves in through the store (another host's, or no board), and
    relays whose buffers are new every cycle (pooling off: each re-announces its region). On one
    host a chain is a star (Note [Fan-out tree]): a tree of degree 2 puts a relay behind a relay.
    With ``install="swap"`` every cycle fills the other half of each double buffer."""
    request.getfixturevalue(sync)
    store, trainer = job
    recs = _receivers(store, 4, group=f"chain-{sync}-{install}", install=install, degree=2)
    try:
        for version in (1, 2, 3):
            if version > 1:
                assert trainer.update() == version
            reports = [h.wait() for h in [rec.start_refit() for rec, _ in recs]]
            assert [rep.version for rep in reports] == [version] * 4
            for rec, targets in recs:
                assert all(torch.equal(targets[n], build_physical(LAYOUTS[n], "cpu", version)) for n in LAYOUTS)
            assert {rep.replica: list(rep.pulled_from) for rep in reports} == {
                1: ["publishers"], 2: ["replica 1"], 3: ["replica 1"], 4: ["replica 2"]}
    finally:
        for rec, _ in recs:
            rec.close()


@pytest.mark.parametrize("install", ["copy", "swap"])
def test_a_relay_pulling_again_while_read_leaves_its_reader_whole(job, install):
    """A relay that starts its next cycle (the same version) while its reader copies bumps its
    epoch first: the reader's copies of that moment are void, and it takes them again (with swap,
    from the other half of the relay's double buffer, which the header names now)."""
    store, trainer = job
    (relay, _), (reader, targets) = _receivers(store, 2, group=f"again-{install}", install=install)
    try:
        relay.refit()
        for version in (2, 3):
            assert trainer.update() == version
            relay.refit()
            for _ in range(5):
                targets["w"].fill_(SENTINEL)
                handle = reader.start_refit()
                relay.refit()  # the same version again, into the region the reader copies from
                rep = handle.wait()
                assert rep.version == version and list(rep.pulled_from) == ["replica 1"]
                assert all(torch.equal(targets[n], build_physical(LAYOUTS[n], "cpu", version)) for n in LAYOUTS)
    finally:
        relay.close()
        reader.close()


@pytest.mark.parametrize("install", ["copy", "swap"])
def test_a_closed_relay_is_routed_around(job, install):
    store, trainer = job
    recs = _receivers(store, 4, group=f"closing-{install}", install=install, degree=2)  # 4 <- 2 <- 1
    try:
        for rec, _ in recs:
            rec.refit()
        recs[1][0].close()  # member 2 leaves
        version = trainer.update()
        first, fourth = recs[0], recs[3]
        assert first[0].refit().version == version
        rep = fourth[0].refit()
        assert rep.pulled_from.keys() == {"replica 1"} and rep.version == version
        assert all(torch.equal(fourth[1][n], build_physical(LAYOUTS[n], "cpu", version)) for n in LAYOUTS)
    finally:
        for rec, _ in recs:
            rec.close()



def test_when_a_stars_first_replica_leaves_the_others_gather_around_the_next_not_the_trainer(job):
    """Degree 1 on one place is a star around member 1 (Note [Fan-out tree]). Once it closed, each
    member that finds it gone works out its tree without it: member 2 pulls from the trainer, 3
    and a member joining later (4, whose records still name member 1 first) from member 2, so the
    trainer still sends each version once."""
    store, trainer = job
    recs = _receivers(store, 3, group="star-left")
    try:
        for rec, _ in recs:
            rec.refit()
        recs[0][0].close()  # member 1 leaves
        recs += _receivers(store, 1, group="star-left")  # member 4 joins
        for _ in range(2):  # the version after it left, and one more
            version = trainer.update()
            reports = [rec.refit() for rec, _ in recs[1:]]
            assert [set(rep.pulled_from) for rep in reports] == [{"publishers"}, {"replica 2"}, {"replica 2"}], \
                [rep.pulled_from for rep in reports]
            for (rec, targets), rep in zip(recs[1:], reports):
                assert rep.version == version
                assert all(torch.equal(targets[n], build_physical(LAYOUTS[n], "cpu", version)) for n in LAYOUTS)
    finally:
        for rec, _ in recs:
            rec.close()

def test_a_replica_whose_source_never_refits_pulls_from_the_trainer_after_stall_s(job):
    store, trainer = job
    recs = _receivers(store, 2, group="stall", stall_s=0.5)
    try:
        for rec, _ in recs:
            rec.refit()
        version = trainer.update()
        start = time.monotonic()
        rep = recs[1][0].refit()  # member 1 does not refit this version
        assert 0.5 <= time.monotonic() - start < TIMEOUT_S / 2  # after stall_s, not at the cycle's timeout
        assert rep.version == version and rep.pulled_from.keys() == {"publishers"}
        assert all(torch.equal(recs[1][1][n], build_physical(LAYOUTS[n], "cpu", version)) for n in LAYOUTS)
    finally:
        for rec, _ in recs:
            rec.close()


def test_bad_fanout_arguments_are_config_errors():
    for kwargs, match in [({"group": "no spaces"}, "group="), ({"group": "g", "degree": 0}, "degree=0"),
                          ({"group": "g", "rank": -1}, "rank=-1"), ({"group": "g", "chunk_bytes": 100}, "chunk_bytes=100"),
                          ({"group": "g", "stall_s": 0}, "stall_s=0")]:
        with pytest.raises(ConfigError, match=match):
            FanOut(**kwargs)
    with pytest.raises(ConfigError, match="install='direct'"):
        Receiver(object(), num_publishers=1, install="direct", fanout=FanOut("g"))
    with pytest.raises(ConfigError, match="expected a warmlink.refit.FanOut"):
        Receiver(object(), num_publishers=1, fanout="g")
    rec = Receiver(object(), num_publishers=1, fanout=FanOut("g"))
    rec.add("w", LAYOUTS["w"])
    with pytest.raises(ConfigError, match="fanout"):
        rec.stream(lambda weights: None, buffer_bytes=1 << 20)


def test_replicas_with_other_chunk_sizes_are_refused(job):
    store, trainer = job
    (a, _), = _receivers(store, 1, group="chunks")
    (b, targets), = _receivers(store, 1, group="chunks", chunk_bytes=2 * CHUNK_BYTES)
    try:
        a.refit()
        with pytest.raises(ConfigError, match="chunk_bytes"):
            b.refit()
        assert all(bool((t == SENTINEL).all()) for t in targets.values())
    finally:
        a.close()
        b.close()


def test_a_chain_pulls_from_its_own_gpu_then_its_own_host_whatever_the_order_of_joining():
    """Note [Fan-out tree]: the places (host, GPU) of the earlier members and of the publishers pick
    a member's parent."""
    from warmlink.refit._members import ancestors, parent

    gpu0, gpu1 = ("node-a", "GPU-0"), ("node-a", "GPU-1")
    places = {1: gpu1, 2: gpu0, 3: gpu1}  # the bench's engines on 2 GPUs, the trainer on GPU0
    assert [parent(m, 1, places) for m in (1, 2, 3)] == [0, 1, 1]  # GPU0 -> GPU1 carries the model once
    assert ancestors(3, 1, places) == [1, 0]
    hosts = {1: ("a", ""), 2: ("b", ""), 3: ("a", ""), 4: ("b", ""), 5: ("c", "")}
    # a star around each host's first member, a chain of first members: each host link crossed once
    assert [parent(m, 1, hosts) for m in range(1, 6)] == [0, 1, 1, 2, 2]
    assert ancestors(5, 1, hosts) == [2, 1, 0]
    blocks = {m: (f"h{(m - 1) // 3}", "") for m in range(1, 9)}  # 8 replicas joining host by host
    assert max(len(ancestors(m, 1, blocks)) for m in blocks) == 4  # one hop per host, then one within
    gpus = {1: ("a", "g1"), 2: ("a", "g1"), 3: ("a", "g2"), 4: ("a", "g3")}
    assert [parent(m, 1, gpus) for m in range(1, 5)] == [0, 1, 1, 3]  # the GPUs' links in a chain
    trainer_gpu0 = {0: gpu0, **places}  # the publishers' regions on GPU0 too: replica 2 copies within GPU0
    assert [parent(m, 1, trainer_gpu0) for m in (1, 2, 3)] == [0, 0, 1]
    gpu0_first = {0: gpu0, 1: gpu0, 2: gpu1, 3: gpu1}  # a replica on the trainer's GPU is no better a source
    assert [parent(m, 1, gpu0_first) for m in (1, 2, 3)] == [0, 0, 2]
    assert [parent(m, 1, {0: gpu0, 1: gpu0, 2: gpu0}) for m in (1, 2)] == [0, 1]  # a replica on its GPU comes first
    assert parent(2, 1, {0: ("a", ""), 1: ("a", ""), 2: ("a", "")}) == 1  # the CPU is no GPU: the chain stays
    unknown = {3: ("a", "")}  # records it could not read: the member before it
    assert parent(3, 1, unknown) == 2 and parent(3, 1, None) == 2
    assert [parent(m, 2, places) for m in (2, 3)] == [1, 1]  # a tree keeps the member numbers' shape
    # members found gone are left out: a star gathers around its next member, a chain skips them
    assert [parent(m, 1, hosts, gone={1}) for m in range(2, 6)] == [0, 2, 2, 2]  # "b"'s first member heads the chain
    assert ancestors(5, 1, hosts, gone={2}) == [4, 1, 0] and ancestors(4, 1, hosts, gone={1, 2}) == [3, 0]
    assert parent(3, 1, None, gone={2}) == 1 and parent(3, 1, None, gone={1, 2}) == 0
    assert ancestors(5, 2, None, gone={2}) == [1, 0]  # a tree routes around to the gone member's parent


def test_a_member_record_with_a_bad_device_host_header_or_regions_is_refused():
    from warmlink.errors import MetadataError
    from warmlink.refit._members import make_record, validate_member

    region = {"kind": "shm", "name": "wl-x", "offset": 0, "nbytes": 64}
    record = make_record(group="g", rank=0, member=1, incarnation=1, identity=("h", 1, 0), device="", token=None,
                         backend="shm", header=region, host_header=region, regions=[])
    assert validate_member(record, "p") is record
    assert validate_member({**record, "host_header": None}, "p")["host_header"] is None
    with pytest.raises(MetadataError, match="device="):
        validate_member({**record, "device": 7}, "p")
    with pytest.raises(MetadataError, match="device="):
        validate_member({**record, "device": "x" * 101}, "p")
    gpu = {"kind": "cuda_ipc", "handle": "ab" * 64, "alloc_nbytes": 1 << 20, "offset": 0, "nbytes": 128, "device": 0,
           "buffer_id": 7, "device_uuid": "0123456789abcdef" * 2}
    assert validate_member({**record, "header": gpu, "backend": "cuda_ipc"}, "p")
    with pytest.raises(MetadataError, match="host_header.kind="):  # shared memory of the host, nothing else
        validate_member({**record, "host_header": gpu}, "p")
    with pytest.raises(MetadataError, match="host_header"):
        validate_member({**record, "host_header": {"kind": "shm"}}, "p")
    assert validate_member({**record, "regions": [region, region]}, "p")  # both halves of a swap double buffer
    with pytest.raises(MetadataError, match="regions"):
        validate_member({**record, "regions": [region] * 3}, "p")
    with pytest.raises(MetadataError, match="regions"):
        validate_member({**record, "regions": region}, "p")
    with pytest.raises(MetadataError, match=r"regions\[1\]"):
        validate_member({**record, "regions": [region, {"kind": "shm"}]}, "p")


@settings(max_examples=60, deadline=None)
@given(at=st.integers(0, 127), flip=st.integers(1, 255), held=st.integers(0, 1 << 40))
def test_a_relay_header_read_in_the_middle_of_a_write_or_damaged_is_no_header(at, flip, held):
    """Note [Relay header in host memory]: a header ends with a checksum of its words, so a read
    that mixes two writes, or any changed byte, parses as no header (read again) and never as
    words nobody wrote."""
    from warmlink.refit._relay_header import FILLING, RelayWords, parse

    old = RelayWords(7, 2, 5, FILLING, held, 32, 1 << 20, 32 << 20, b"l" * 16, b"s" * 16, b"r" * 16)
    new = old._replace(epoch=3, held=0)
    assert parse(old.pack()) == old and parse(new.pack()) == new
    torn = new.pack()[:at] + old.pack()[at:]  # a write of ``new`` over ``old`` seen half done
    assert parse(torn) == ({old.pack(): old, new.pack(): new}.get(torn))
    damaged = bytearray(old.pack())
    damaged[at] ^= flip
    assert parse(bytes(damaged)) is None


def test_the_default_chunk_is_a_32nd_of_the_bytes_over_cuda_ipc_and_a_128th_elsewhere():
    from warmlink.refit.fanout import CUDA_IPC_NUM_CHUNKS, DEFAULT_NUM_CHUNKS

    nbytes = 8 << 30
    assert FanOut("g").chunk_bytes_for(nbytes, "cuda_ipc") == nbytes // CUDA_IPC_NUM_CHUNKS == 256 << 20
    assert FanOut("g").chunk_bytes_for(nbytes, "nixl") == FanOut("g").chunk_bytes_for(nbytes) == nbytes // DEFAULT_NUM_CHUNKS
    assert FanOut("g").chunk_bytes_for(1 << 20, "cuda_ipc") == 64 << 10  # at least 64 KiB
    assert FanOut("g", chunk_bytes=1 << 20).chunk_bytes_for(nbytes, "cuda_ipc") == 1 << 20


class _HostHeaderMember:
    """A member's header in link memory and in this host's shared memory, its record, and a
    replica's ``Upstreams`` with the member opened (Note [Relay header in host memory])."""

    def __init__(self) -> None:
        from warmlink.pool import liveness
        from warmlink.refit._members import make_record
        from warmlink.refit._relay_header import FILLING, RelayHeader, RelayWords
        from warmlink.refit._upstreams import Upstream, Upstreams
        from warmlink.transport import lease_link
        from warmlink.transport.base import PeerRef, local_identity

        self.link, self.host = lease_link("shm", -1, 5.0), lease_link("shm", -1, 5.0)
        self.header = RelayHeader(self.link.resource.allocate(128), self.host.resource.allocate(128))
        self.words = RelayWords(7, 2, 5, FILLING, 3, 32, 1 << 20, 32 << 20, b"l" * 16, b"s" * 16, b"r" * 16)
        self.header.write(self.words)
        self.ups = Upstreams(FanOut("g"), None, self.link.resource, 5.0)
        self.record = make_record(group="g", rank=0, member=1, incarnation=7, identity=local_identity(), device="",
                                  token=liveness.token(), backend="shm", header=self.header.region.desc,
                                  host_header=self.header.host.desc, regions=[])
        self.me = PeerRef("test:fanout/g/0/1", 1, *local_identity(), liveness.token())
        self.up = Upstream(1, self.record, self.me)
        self.up.host_header = self.ups._open_host_header(self.up)

    def close(self) -> None:
        self.ups.close_all()
        self.link.resource.release(self.header.region)
        self.host.resource.release(self.header.host)
        self.link.release()
        self.host.release()


@pytest.fixture
def host_header_member():
    member = _HostHeaderMember()
    try:
        yield member
    finally:
        member.close()


def test_a_replica_on_the_members_host_reads_its_header_from_shared_memory_and_notices_it_die(host_header_member):
    """Note [Relay header in host memory]: a member's record names its header's copy in this host's
    shared memory; a replica here reads it there (the words the relay wrote), one on another host
    (another /dev/shm key in the token) or of a record without it through the link, and a member
    whose process is gone is routed around as gone."""
    from warmlink.refit._upstreams import RouteAround, Upstream
    from warmlink.transport.base import PeerRef, local_identity

    m = host_header_member
    ups, up, record, me = m.ups, m.up, m.record, m.me
    assert up.host_header is not None and ups._read_host(up) == m.words
    m.header.write(m.words._replace(held=9))
    assert ups._read_host(up).held == 9
    ups.close(up)
    elsewhere = Upstream(1, {**record, "token": "another-host/x.lock"}, me)
    assert ups._open_host_header(elsewhere) is None
    assert ups._open_host_header(Upstream(1, {**record, "host_header": None}, me)) is None
    gone = Upstream(1, {**record, "token": ""}, PeerRef("test:gone", 1, local_identity()[0], 2**22 + 12345, 1))
    gone.host_header = m.host.resource.open(me, m.header.host.desc)
    with pytest.raises(RouteAround, match="died") as err:
        ups._read_host(gone)
    assert err.value.gone
    m.host.resource.close_region(gone.host_header)


def test_a_header_left_torn_by_a_stalled_writer_is_read_again_and_never_taken_for_a_closed_relay(host_header_member,
                                                                                                   monkeypatch):
    """Note [Relay header in host memory]: a writer preempted inside its copy leaves the words torn
    for a while. The reader backs off and reads them again, so the write that finishes meanwhile
    is read; words still torn after every reread route around the relay for this cycle only (not
    gone: a relay taken for closed would never be pulled from again)."""
    from warmlink.refit import _upstreams
    from warmlink.refit._upstreams import RouteAround

    m = host_header_member
    old = m.words
    new = old._replace(held=4)

    def tear() -> None:  # the first 44 bytes of ``new`` over ``old``: a write stalled inside its copy
        torn = bytearray(new.pack()[:44] + old.pack()[44:])  # within ``held``; the checksum is old's
        m.header.host.tensor[:128].copy_(torch.frombuffer(torn, dtype=torch.uint8))

    tear()
    pauses = []

    def stalled_writer_resumes(seconds: float) -> None:  # the reader's backoff; the writer ends at the 3rd
        pauses.append(seconds)
        if len(pauses) == 3:
            m.header.write(new)

    monkeypatch.setattr(_upstreams.time, "sleep", stalled_writer_resumes)
    assert m.ups.read(m.up, lambda: 5.0, old) == new
    assert pauses == [50e-6, 100e-6, 200e-6]
    pauses.clear()
    monkeypatch.setattr(_upstreams.time, "sleep", pauses.append)  # the writer never resumes
    tear()
    with pytest.raises(RouteAround, match="stayed torn") as err:
        m.ups.read(m.up, lambda: 5.0, old)
    assert not err.value.gone and len(pauses) == _upstreams._READS - 1 and sum(pauses) > 0.04
    m.header.write(new)
    assert m.ups.read(m.up, lambda: 5.0, old) == new  # the next cycle reads it again
