"""Tests for warmlink.transport.nixl: two processes over NIXL (UCX) on host memory, READ and WRITE,
prepared lists reused, peer loss, malformed descriptors. CPU only; skipped without nixl-cu13."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from tests.transport._child import Child as _Child

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")

from warmlink import pool
from warmlink.errors import (
    BackendUnavailable,
    ConfigError,
    LayoutError,
    MetadataError,
    PeerLostError,
    TransferError,
    TransferTimeout,
)
from warmlink.transport import nixl
from warmlink.transport.base import Copy, PeerRef, local_identity
from warmlink.transport.nixl import NixlLink

SIZES = (64 << 10, 4096, 8192)  # two arena regions (allocate) and one plain tensor (register)
BIG_NBYTES = 256 << 20


def _pattern(n: int, salt: int = 0) -> torch.Tensor:
    """Byte i is (7 i + salt) mod 251: one period tiled, so 256 MiB takes a copy, not 2 GiB of int64
    arithmetic (45 s on a loaded 2-core machine)."""
    period = ((torch.arange(251, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)
    return period.repeat(-(-n // 251))[:n]


# -- the other process ------------------------------------------------------------------------------
def _child_main(control, results, sizes) -> None:
    """Make regions over NixlLink, fill them, send their descriptors; dump one on request."""
    try:
        link = NixlLink(timeout_s=10)
        regions = [link.allocate(n) for n in sizes[:2]]
        regions += [link.register(torch.empty(n, dtype=torch.uint8)) for n in sizes[2:]]
        for i, r in enumerate(regions):
            r.tensor.copy_(_pattern(r.nbytes, salt=i + 1))
        host, pid, start = local_identity()
        results.put({"descs": [dict(r.desc) for r in regions], "host": host, "pid": pid, "start_time": start})
        while True:
            msg = control.get(timeout=120)
            if msg is None:
                break
            if msg[0] == "notification":
                results.put(link.wait_notification(msg[1], timeout_s=10))
            else:
                results.put(regions[msg[1]].tensor.numpy().tobytes())
        for r in regions:
            link.release(r)
        link.close()
    except BaseException as exc:  # noqa: BLE001  reported, never hangs the parent
        results.put({"error": repr(exc)})


class Child(_Child):
    def __init__(self, sizes=SIZES) -> None:
        super().__init__(_child_main, sizes)

    def notification(self, tag: bytes) -> str:
        """The sending agent of the next notification ``tag`` this child's link receives."""
        self.control.put(("notification", tag))
        return self.get()

    def dump(self, idx: int) -> torch.Tensor:
        self.control.put(("dump", idx))
        return torch.frombuffer(bytearray(self.get()), dtype=torch.uint8)


@pytest.fixture(scope="module")
def children():
    """Both start at once so that their imports and agents overlap: one serves, one is killed."""
    pair = (Child(), Child(sizes=(BIG_NBYTES,)))
    yield pair
    for c in pair:
        c.stop()


@pytest.fixture(scope="module")
def child(children):
    return children[0]


@pytest.fixture(scope="module")
def child_info(child):
    return child.get()


@pytest.fixture(scope="module")
def link():
    pool.set_enabled(True)
    lk = NixlLink(timeout_s=10)
    yield lk
    lk.close()
    pool.set_enabled(None)


def _peer(info: dict, key: str = "child/0", generation: int = 1) -> PeerRef:
    return PeerRef(key, generation, info["host"], info["pid"], info["start_time"])


def _created(kind: str) -> int:
    return pool.stats().get(kind, {}).get("created", 0)


# -- two processes ----------------------------------------------------------------------------------
def test_read_is_bit_exact_and_second_batch_registers_nothing(link: NixlLink, child_info: dict) -> None:
    peer = _peer(child_info)
    remotes = [link.open(peer, d) for d in child_info["descs"]]
    local = link.allocate(sum(SIZES))
    try:
        local.tensor.zero_()
        copies = [
            Copy(local, 0, remotes[0], 100, 1000),  # flat
            Copy(local, 4096, remotes[0], 8192, 64, num_rows=10, local_pitch=64, remote_pitch=200),  # strided
            Copy(local, 8192, remotes[1], 0, 4096),  # a second arena region
            Copy(local, 16384, remotes[2], 17, 8000),  # a plain registered tensor
        ]
        batch = link.prepare(copies)
        link.read(batch).wait(10)
        got = local.tensor
        expect = [_pattern(n, salt=i + 1) for i, n in enumerate(SIZES)]
        assert torch.equal(got[:1000], expect[0][100:1100])
        for i in range(10):
            assert torch.equal(got[4096 + 64 * i : 4096 + 64 * (i + 1)], expect[0][8192 + 200 * i : 8192 + 200 * i + 64])
        assert torch.equal(got[8192:12288], expect[1])
        assert torch.equal(got[16384:24384], expect[2][17:8017])
        assert int(got[1000:4096].count_nonzero()) == 0

        # Warm: the batch replays, a re-opened peer and a new batch create nothing in the pool.
        before = {k: _created(k) for k in ("registration", "peer_mapping", "arena")}
        local.tensor.zero_()
        link.read(batch).wait(10)
        assert torch.equal(got[8192:12288], expect[1])
        again = [link.open(peer, d) for d in child_info["descs"]]
        batch2 = link.prepare([Copy(local, 0, again[0], 0, 2048), Copy(local, 2048, again[2], 0, 2048)])
        link.read(batch2).wait(10)
        assert torch.equal(got[:2048], expect[0][:2048]) and torch.equal(got[2048:4096], expect[2][:2048])
        assert {k: _created(k) for k in before} == before, pool.stats()
        for r in again:
            link.close_region(r)
    finally:
        for r in remotes:
            link.close_region(r)
        link.release(local)


def test_write_is_seen_by_child(link: NixlLink, child: Child, child_info: dict) -> None:
    remote = link.open(_peer(child_info), child_info["descs"][0])
    local = link.allocate(SIZES[0])
    try:
        src = _pattern(SIZES[0], salt=99)
        local.tensor.copy_(src)
        batch = link.prepare([
            Copy(local, 0, remote, 32768, 512),
            Copy(local, 1024, remote, 40000, 16, num_rows=4, local_pitch=16, remote_pitch=100),
        ])
        for i in range(2):  # the second write reposts the same NIXL request, with another tag
            link.write(batch, notify=b"v%d" % i).wait(10)
        assert child.notification(b"v0") == link.agent_name and child.notification(b"v1") == link.agent_name
        seen = child.dump(0)
        expect = _pattern(SIZES[0], salt=1).clone()
        expect[32768 : 32768 + 512] = src[:512]
        for i in range(4):
            expect[40000 + 100 * i : 40000 + 100 * i + 16] = src[1024 + 16 * i : 1024 + 16 * (i + 1)]
        assert torch.equal(seen, expect)
    finally:
        link.close_region(remote)
        link.release(local)


def test_ucx_threads_split_a_batch_and_stay_bit_exact(child: Child, child_info: dict) -> None:
    """A link with UCX threads hands every batch to them, split in one chunk per thread (Note
    [UCX threads]): READ and WRITE with a notification land exactly as with one worker, and so
    does a batch of one descriptor."""
    lk = NixlLink(timeout_s=10, ucx_threads=2)
    assert lk.ucx_threads == 2
    local = lk.allocate(8192)
    try:
        tensor_region, arena = (lk.open(_peer(child_info), child_info["descs"][i]) for i in (2, 0))
        rows = 32  # 256-byte slices of the child's registered tensor, read in reverse order
        batch = lk.prepare([Copy(local, 256 * i, tensor_region, 256 * (rows - 1 - i), 256) for i in range(rows)])
        for _ in range(2):  # the second read reposts the split request
            local.tensor.zero_()
            lk.read(batch).wait(10)
            expect = _pattern(SIZES[2], salt=3)
            for i in range(rows):
                assert torch.equal(local.tensor[256 * i : 256 * (i + 1)], expect[256 * (rows - 1 - i) : 256 * (rows - i)])

        one = lk.prepare([Copy(local, 0, tensor_region, 100, 1000)])
        local.tensor.zero_()
        lk.read(one).wait(10)
        assert torch.equal(local.tensor[:1000], _pattern(SIZES[2], salt=3)[100:1100])

        local.tensor.copy_(_pattern(8192, salt=42))
        push = lk.prepare([Copy(local, 64 * i, arena, 50000 + 64 * i, 64) for i in range(rows)])
        lk.write(push, notify=b"threads").wait(10)
        assert child.notification(b"threads") == lk.agent_name
        assert torch.equal(child.dump(0)[50000 : 50000 + 64 * rows], local.tensor[: 64 * rows])
    finally:
        lk.close()


def test_ucx_threads_come_from_argument_then_environment_then_default(monkeypatch) -> None:
    from warmlink import _env

    for bad in (-1, 65, True, 2.0):
        with pytest.raises(ConfigError, match="ucx_threads"):
            NixlLink(timeout_s=1, ucx_threads=bad)
    assert nixl._ucx_params(0) == {}
    assert nixl._ucx_params(4) == {"num_threads": "4", "split_batch_size": str(nixl._SPLIT_DESCS)}
    try:
        monkeypatch.setenv("WARMLINK_NIXL_THREADS", "3")
        _env.clear_cache()
        assert nixl._resolve_threads(None, 0) == 3 and nixl._resolve_threads(None, -1) == 3
        assert nixl._resolve_threads(1, 0) == 1
        monkeypatch.setenv("WARMLINK_NIXL_THREADS", "many")
        _env.clear_cache()
        with pytest.raises(ConfigError, match="WARMLINK_NIXL_THREADS='many'"):
            nixl._resolve_threads(None, 0)
        monkeypatch.delenv("WARMLINK_NIXL_THREADS")
        _env.clear_cache()
        assert nixl._resolve_threads(None, 0) == nixl.DEFAULT_GPU_UCX_THREADS
        assert nixl._resolve_threads(None, -1) == 0
    finally:
        _env.clear_cache()


def test_peer_killed_mid_wait_raises_within_timeout(link: NixlLink, children) -> None:
    c = children[1]
    info = c.get()
    peer = _peer(info, key="doomed/0")
    remote = link.open(peer, info["descs"][0])
    local = link.allocate(BIG_NBYTES)
    try:
        batch = link.prepare([Copy(local, 0, remote, 0, BIG_NBYTES)])
        link.read(batch).wait(30)  # warm: the connection is up
        # Over UCX on one host a post of 256 MiB runs inline (~0.1 s), so the kill comes from a
        # timer while bytes move; the loop covers a kill that lands between two transfers.
        killer = threading.Timer(0.03, os.kill, (c.proc.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises((PeerLostError, TransferTimeout)):
            for _ in range(100):
                link.read(batch).wait(5)
        assert time.monotonic() - start < 10
        killer.join()
        c.proc.join(timeout=10)
        assert not peer.alive()
        start = time.monotonic()
        with pytest.raises((PeerLostError, TransferTimeout)):
            link.read(batch).wait(5)  # a dead peer never hangs a later transfer either
        assert time.monotonic() - start < 6
    finally:
        link.close_region(remote)
        link.release(local)
        link.forget_peer("doomed/0")


# -- descriptors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("agent", "bad agent/name", "region.agent='bad agent/name' invalid"),
        ("agent_meta", "abc", "region.agent_meta='abc' invalid"),
        ("agent_meta", "ZZ", "region.agent_meta='ZZ' invalid"),
        ("agent_meta", "ab" * (1 << 20), "region.agent_meta="),
        ("addr", -1, "region.addr=-1 out of range"),
        ("nbytes", 0, "region.nbytes=0 out of range"),
        ("mem", "HBM", "region.mem='HBM' is unknown"),
        ("kind", "shm", "region.kind='shm' is wrong"),
        ("device", 0, "region.device=0 does not fit mem='DRAM'"),
        ("agent_meta", "00" * 16, "is not NIXL agent metadata"),  # hex, but not metadata
        ("agent", "someone-else", "describes agent"),  # metadata of another agent
        ("addr", 4096, "is not memory that agent"),  # a range the peer never registered
    ],
)
def test_malformed_descriptor_raises_metadata_error(link: NixlLink, child_info: dict, field, value, needle) -> None:
    desc = dict(child_info["descs"][1], **{field: value})
    with pytest.raises(MetadataError) as e:
        link.open(_peer(child_info, key="bad/7"), desc)
    assert "peer='bad/7'" in str(e.value) and needle in str(e.value), str(e.value)


def test_vram_claim_for_host_memory_is_refused(link: NixlLink, child_info: dict) -> None:
    desc = dict(child_info["descs"][1], mem="VRAM", device=0)
    with pytest.raises(MetadataError, match="is not memory that agent"):
        link.open(_peer(child_info), desc)
    with pytest.raises(LayoutError, match="this link registers host memory"):
        link.register(torch.zeros(16, device="cuda") if torch.cuda.is_available() else _FakeCuda())
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="CUDA is unavailable"):
            NixlLink(device=0, timeout_s=1)
    for bad in ({"device": -2}, {"on_slow": "maybe"}, {"min_gbps": -1}):
        with pytest.raises(ConfigError):
            NixlLink(**bad)
    with pytest.raises(ConfigError, match="notify"):
        link.write(None, notify=b"")


class _FakeCuda:
    """Stands for a CUDA tensor on a machine without one: register checks the device first."""

    device = torch.device("cuda", 0)


def test_notification_wait_times_out(link: NixlLink) -> None:
    with pytest.raises(TransferTimeout, match="not received"):
        link.wait_notification(b"never", timeout_s=0.05)


# -- Note [Loud fallbacks] --------------------------------------------------------------------------
@pytest.fixture
def loopback():
    """A second agent in this process serving one region of SPEED_CHECK_BYTES."""
    other = NixlLink(timeout_s=10)
    region = other.allocate(nixl.SPEED_CHECK_BYTES)
    region.tensor.fill_(5)
    yield PeerRef("self/0", 1, *local_identity()), region.desc
    other.release(region)
    other.close()


def _read_once(lk: NixlLink, peer: PeerRef, desc: dict, nbytes: int):
    remote, local = lk.open(peer, desc), lk.allocate(nbytes)
    batch = lk.prepare([Copy(local, 0, remote, 0, nbytes)])
    return batch, local


def test_slow_first_transfer_warns_once_and_names_causes(loopback, monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # read when the warning is written, not by this agent
    lk = NixlLink(timeout_s=10, min_gbps=1e6)  # nothing on this machine reaches a petabyte per second
    try:
        batch, local = _read_once(lk, *loopback, nixl.SPEED_CHECK_BYTES)
        with pytest.warns(nixl.SlowTransportWarning, match="below min_gbps=1e[+]06") as got:
            lk.read(batch).wait(10)
        assert "UCX_TLS='tcp,self' leaves out shared-memory transports" in str(got[0].message)
        assert int(local.tensor.sum()) == 5 * nixl.SPEED_CHECK_BYTES  # the bytes still landed
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same batch is checked once, the link warns once
            lk.read(batch).wait(10)
            lk.read(lk.prepare([b for b in batch.flat])).wait(10)
    finally:
        lk.close()


def test_slow_transfer_raises_when_asked_and_small_batches_are_not_judged(loopback) -> None:
    lk = NixlLink(timeout_s=10, min_gbps=1e6, on_slow="raise")
    try:
        small, _ = _read_once(lk, *loopback, nixl.SPEED_CHECK_BYTES - 1)
        lk.read(small).wait(10)
        batch, _ = _read_once(lk, *loopback, nixl.SPEED_CHECK_BYTES)
        with pytest.raises(nixl.SlowTransportError, match="GB/s, below min_gbps"):
            lk.read(batch).wait(10)
    finally:
        lk.close()


def test_register_refuses_what_it_cannot_share(link: NixlLink) -> None:
    with pytest.raises(LayoutError, match="not contiguous"):
        link.register(torch.zeros(16, 16).t())
    with pytest.raises(LayoutError, match="0 bytes"):
        link.register(torch.zeros(0))


def test_closed_link_refuses_work() -> None:
    lk = NixlLink(timeout_s=2)
    region = lk.allocate(4096)
    lk.close()
    lk.close()
    with pytest.raises(TransferError, match="closed"):
        lk.allocate(4096)
    assert region._closed  # close released it


def test_module_import_does_not_import_nixl_and_missing_nixl_is_backend_unavailable() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['nixl_cu13'] = None; sys.modules['nixl'] = None\n"
        "import warmlink.transport.nixl as m\n"
        "assert 'nixl_cu13._api' not in sys.modules\n"
        "from warmlink.errors import BackendUnavailable\n"
        "from warmlink.transport import open_link\n"
        "try:\n    open_link('nixl', -1, 1.0)\nexcept BackendUnavailable as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK") and "warmlink[nixl]" in out.stdout, out.stderr
    assert issubclass(BackendUnavailable, ImportError) and nixl.NixlLink.backend == "nixl"


def test_open_checks_match_the_schema() -> None:
    from warmlink.rendezvous import schema
    from warmlink.transport import _nixl_desc

    assert _nixl_desc.AGENT_NAME.pattern == schema.NIXL_AGENT_NAME.pattern
    assert _nixl_desc.MAX_META_HEX == schema.MAX_NIXL_META_HEX
    with pytest.raises(MetadataError, match="missing|expected keys"):
        _nixl_desc.check_desc({"kind": "nixl"}, "p/0")
    good = {"kind": "nixl", "agent": "a-1", "addr": 4096, "nbytes": 8, "device": -1, "mem": "DRAM", "agent_meta": "00ff"}
    assert _nixl_desc.check_desc(good, "p/0") is good and schema.validate_region(good, "p/0") is good


def test_lease_link_keeps_the_agent() -> None:
    from warmlink.transport import BACKENDS, lease_link

    assert "nixl" in BACKENDS
    pool.set_enabled(True)
    try:
        first = lease_link("nixl", -1, 5.0)
        link, name = first.resource, first.resource.agent_name
        first.release()  # recycled, kept idle with its agent
        second = lease_link("nixl", -1, 7.0)
        assert second.resource is link and link.agent_name == name and link.timeout_s == 7.0
        threaded = lease_link("nixl", -1, 7.0, ucx_threads=1)  # another setting never gets that agent
        assert threaded.resource is not link and threaded.resource.ucx_threads == 1
        threaded.release()
        second.release()
    finally:
        pool.set_enabled(None)


def test_an_idle_agent_leaves_the_cores_alone():
    """NIXL's Python API makes its progress thread poll without pause; warmlink's agents wake on
    UCX's events and every ``PROGRESS_WAKEUP_US`` (Note [NIXL's progress thread]). Spinning, an
    idle agent took the whole of a core; load on this machine can only lower what it takes."""
    from warmlink.transport._nixl_agent import Agent, make_agent_name

    agent = Agent(make_agent_name())
    try:
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(1.0)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        agent.close()
    assert cpu < 0.3 * wall, f"an idle NIXL agent took {cpu:.2f} s of CPU in {wall:.2f} s"


def test_an_agent_made_meanwhile_by_another_thread_is_nixls_own():
    """The amended config reaches warmlink's agent only: an agent another thread makes while
    warmlink's is being made (a vLLM connector's, say) gets NIXL's own, and NIXL's module is as it
    was after."""
    from warmlink.transport import _nixl_agent

    api = _nixl_agent.load_nixl()
    real = api.nixlBind
    made = []  # (thread, the config's pthrDelay)

    def other_agent():
        api.nixl_agent(_nixl_agent.make_agent_name(), api.nixl_agent_config(backends=[]))

    class Spy:
        def __getattr__(self, attr):
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(name, config):  # noqa: N802 - NIXL's name
            made.append((threading.current_thread().name, config.pthrDelay))
            if threading.current_thread() is threading.main_thread():  # inside warmlink's making
                other = threading.Thread(target=other_agent, name="other")
                other.start()
                other.join(timeout=60)
                assert not other.is_alive()
            return real.nixlAgent(name, config)

    api.nixlBind = Spy()
    try:
        _nixl_agent._agent_with_wakeup(api, _nixl_agent.make_agent_name(), 12345)
        assert isinstance(api.nixlBind, Spy)  # put back as it was found
    finally:
        api.nixlBind = real
    assert made == [("MainThread", 12345), ("other", 0)]
