"""Tests for warmlink.pool.arenas on the shm kind (CPU): reuse, generations, reaping, pool off."""

from __future__ import annotations

import os

import pytest

from warmlink import pool
from warmlink.errors import ConfigError
from warmlink.pool import arenas
from warmlink.pool.arenas import ARENA_ALIGN_BYTES, SHM_DIR, lease_arena, round_up, shm_prefix
from warmlink.pool.core import counters

MiB = 1 << 20


def _own_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(shm_prefix())}


def _dead_pid() -> int:
    """A pid no process has right now (walks down from pid_max)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            top = int(f.read())
    except OSError:
        top = 32768
    for pid in range(top - 1, 1, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    pytest.skip("no free pid found")


@pytest.fixture
def pool_on():
    pool.set_enabled(True)
    yield
    pool.set_enabled(None)


def test_round_up() -> None:
    assert ARENA_ALIGN_BYTES == 2 * MiB
    assert round_up(1) == 2 * MiB
    assert round_up(0) == 2 * MiB  # never a zero-byte arena
    assert round_up(2 * MiB) == 2 * MiB
    assert round_up(2 * MiB + 1) == 4 * MiB
    assert round_up(5, 4) == 8 and round_up(8, 4) == 8 and round_up(9, 4) == 12


def test_lease_release_reuses_same_file_with_new_generation(pool_on) -> None:
    nbytes = 6 * MiB - 100  # its own size class: no other test's idle arena answers
    before = counters("arena").as_dict()
    lease = lease_arena("shm", nbytes)
    arena = lease.resource
    name, gen = arena.name, arena.generation
    assert arena.kind == "shm" and arena.device == -1 and arena.nbytes == 6 * MiB
    assert arena.tensor.numel() == 6 * MiB and arena.ptr == arena.tensor.data_ptr()
    assert name.startswith(shm_prefix()) and os.path.exists(os.path.join(SHM_DIR, name))
    assert arenas.find_shm_arena(arena.ptr + 10, 100) is arena
    assert arenas.find_shm_arena(arena.ptr + 6 * MiB - 10, 100) is not arena  # crosses the end
    arena.tensor[:4].fill_(7)
    lease.release()
    lease2 = lease_arena("shm", 6 * MiB)
    try:
        assert lease2.resource is arena and arena.name == name
        assert arena.generation == gen + 1  # bumped on reset: stale keys are visibly stale
    finally:
        lease2.release()
    after = counters("arena").as_dict()
    assert after["reused"] - before["reused"] >= 1
    assert arena.generation == gen + 2


def test_different_sizes_are_different_arenas(pool_on) -> None:
    with lease_arena("shm", 2 * MiB) as a, lease_arena("shm", 4 * MiB) as b:
        assert a.name != b.name and a.nbytes == 2 * MiB and b.nbytes == 4 * MiB


def test_reap_removes_dead_pid_files_only() -> None:
    dead = _dead_pid()
    dead_name = f"wl-{dead}-deadbeef-0"
    live_name = f"wl-{os.getpid()}-cafe0000-999"
    other_name = f"notwl-{dead}-deadbeef-0"
    paths = [os.path.join(SHM_DIR, n) for n in (dead_name, live_name, other_name)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(b"x")
    try:
        removed = arenas.reap_orphaned_shm()
        assert removed >= 1
        assert not os.path.exists(paths[0])
        assert os.path.exists(paths[1]) and os.path.exists(paths[2])
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def test_pool_off_destroys_file() -> None:
    pool.set_enabled(False)
    try:
        before = counters("arena").as_dict()
        lease = lease_arena("shm", 1000)
        path = os.path.join(SHM_DIR, lease.resource.name)
        assert os.path.exists(path)
        lease.release()
        assert not os.path.exists(path)
        lease2 = lease_arena("shm", 1000)
        assert lease2.resource.name != os.path.basename(path)
        lease2.release()
        after = counters("arena").as_dict()
        assert after["created"] - before["created"] == 2 and after["destroyed"] - before["destroyed"] == 2
        assert after["reused"] == before["reused"]
    finally:
        pool.set_enabled(None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="bogus", nbytes=10), "kind='bogus'"),
        (dict(kind="shm", nbytes=10, device=0), "device=0"),
        (dict(kind="cuda", nbytes=10, device=-1), "device=-1"),
        (dict(kind="shm", nbytes=0), "nbytes=0"),
        (dict(kind="shm", nbytes=-5), "nbytes=-5"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, match) -> None:
    before = set(_own_files())
    with pytest.raises(ConfigError, match=match):
        lease_arena(**kwargs)
    assert _own_files() == before


@pytest.mark.parametrize("pool_enabled", [True, False])
def test_churn_does_not_grow(pool_enabled: bool) -> None:
    pool.set_enabled(pool_enabled)
    try:
        lease_arena("shm", 3 * MiB).release()  # warm: at most one idle arena of this size exists
        files, live = _own_files(), arenas.num_live_shm()
        c0 = counters("arena").as_dict()
        for i in range(200 if pool_enabled else 50):
            with lease_arena("shm", 3 * MiB) as a:
                a.tensor[i % 100] = i % 256
        assert _own_files() == files
        assert arenas.num_live_shm() == live
        c1 = counters("arena").as_dict()
        assert c1["live"] == c0["live"] and c1["idle"] == c0["idle"]
        if pool_enabled:
            assert c1["created"] == c0["created"] and c1["reused"] - c0["reused"] == 200
        else:
            assert c1["created"] - c0["created"] == 50 == c1["destroyed"] - c0["destroyed"]
    finally:
        pool.set_enabled(None)


_VIEW_OUTLIVES = """
import gc, sys, torch
from warmlink import pool
from warmlink.pool.arenas import lease_arena
from warmlink.transport import lease_link

pool.set_enabled(False)  # an arena is destroyed, its file unlinked and its mmap closed, at release
with lease_arena("shm", 4 << 20) as arena:
    name, view = arena.name, arena.tensor[4096:8192]
# What the address may be reused by, were it unmapped: malloc's big blocks and new arenas.
junk = [bytearray(1 << 20) for _ in range(64)] + [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(16)]
with lease_arena("shm", 4 << 20) as other:
    other.tensor.fill_(0x55)
    view.fill_(7)
    assert int(view.sum()) == 7 * 4096 and int(other.tensor.min()) == 0x55, "the view's bytes landed elsewhere"
mapped = lambda: any(name in line for line in open("/proc/self/maps"))
assert mapped(), "the mapping went while a view of it lived"
del view
gc.collect()
assert not mapped(), "the mapping outlived its last view"
print("ok")
"""


def test_a_view_keeps_its_arenas_mapping_after_the_arena_is_destroyed() -> None:
    """Note [Views keep a mapping]: a view of a destroyed shm arena still reads and writes the
    arena's memory (a write did land in whatever reused the address, or crashed), and the memory
    goes with the last view. In a child: a regression may crash the process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _VIEW_OUTLIVES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr[-3000:])
