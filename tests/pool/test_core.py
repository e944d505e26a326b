"""Tests for warmlink.pool.core: FreeList and SharedCache with fake create/reset/destroy.

Every fake records what it made and what it destroyed, so "reused", "never handed out again" and
"destroyed exactly once" are checked on the resources themselves, not only on the counters.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from warmlink import pool
from warmlink.errors import ConfigError, PoolError
from warmlink.pool import core
from warmlink.pool.core import FreeList, SharedCache, counters, stats

_kinds = itertools.count()


class Fake:
    """A resource factory: ``create`` hands out fresh ints, ``reset`` obeys ``bad``/``raising``."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.live: set[int] = set()
        self.destroyed: list[int] = []
        self.bad: set[int] = set()  # reset returns False
        self.raising: set[int] = set()  # reset raises
        self.num_resets = 0

    def create(self, key):
        with self.lock:
            r = next(self.ids)
            self.live.add(r)
        return r

    def reset(self, r) -> bool:
        with self.lock:
            self.num_resets += 1
        if r in self.raising:
            raise RuntimeError(f"reset of {r} exploded")
        return r not in self.bad

    def destroy(self, r) -> None:
        with self.lock:
            assert r in self.live, f"destroy({r}) of a resource not live (double destroy?)"
            self.live.remove(r)
            self.destroyed.append(r)


def _kind(name: str) -> str:
    return f"test-{name}-{next(_kinds)}"  # a fresh counters entry per test


@pytest.fixture
def pool_on():
    pool.set_enabled(True)
    yield
    pool.set_enabled(None)


@pytest.fixture
def fake() -> Fake:
    return Fake()


def _freelist(fake: Fake, name: str = "fl", **kw) -> FreeList:
    return FreeList(_kind(name), fake.create, fake.reset, fake.destroy, **kw)


# -- FreeList ---------------------------------------------------------------------------------------
def test_freelist_reuses_after_reset(pool_on, fake: Fake) -> None:
    fl = _freelist(fake)
    with fl.lease("k") as a:
        pass
    with fl.lease("k") as b:
        assert b == a
    c = counters(fl.kind)
    assert (c.created, c.reused, c.destroyed, c.failed_resets) == (1, 1, 0, 0)
    assert fake.num_resets == 2 and c.live == 1 and c.idle == 1 and fl.num_idle() == 1


def test_lease_release_twice_is_one_release(pool_on, fake: Fake) -> None:
    fl = _freelist(fake)
    lease = fl.lease("k")
    lease.release()
    lease.release()
    assert fl.num_idle() == 1 and fake.num_resets == 1
    assert "released=True" in repr(lease)


@pytest.mark.parametrize("how", ["false", "raise"])
def test_failed_reset_destroys_and_never_hands_out(pool_on, fake: Fake, how: str) -> None:
    fl = _freelist(fake)
    lease = fl.lease("k")
    r = lease.resource
    (fake.bad if how == "false" else fake.raising).add(r)
    lease.release()
    assert r in fake.destroyed and r not in fake.live and fl.num_idle() == 0
    c = counters(fl.kind)
    assert c.failed_resets == 1 and c.destroyed == 1 and c.live == 0 and c.idle == 0
    handed = {fl.lease("k").resource for _ in range(5)}  # five leases held at once
    assert r not in handed


def test_key_mismatch_never_reuses(pool_on, fake: Fake) -> None:
    fl = _freelist(fake)
    with fl.lease(("cpu", 1, 4096)) as a:
        pass
    for other in [("cpu", 1, 8192), ("cpu", 0, 4096), ("gpu", 1, 4096)]:
        with fl.lease(other) as b:
            assert b != a
    with fl.lease(("cpu", 1, 4096)) as again:
        assert again == a
    assert counters(fl.kind).created == 4


def test_max_idle_bound(pool_on, fake: Fake) -> None:
    fl = _freelist(fake, max_idle_per_key=2)
    leases = [fl.lease("k") for _ in range(5)]
    for lease in leases:
        lease.release()
    assert fl.num_idle() == 2 and len(fake.live) == 2 and len(fake.destroyed) == 3
    c = counters(fl.kind)
    assert c.idle == 2 and c.live == 2 and c.destroyed == 3 and c.failed_resets == 0
    fl.clear()
    assert fl.num_idle() == 0 and not fake.live and counters(fl.kind).idle == 0


def test_total_idle_bound_evicts_the_oldest_across_keys(pool_on, fake: Fake) -> None:
    """However many distinct keys users ask for, at most max_idle_total resources stay idle, and
    the one destroyed is the oldest idle; keys left without idle resources are dropped."""
    fl = _freelist(fake, max_idle_per_key=4, max_idle_total=3)
    leases = [fl.lease(f"k{i}") for i in range(6)]  # resources 1..6, one per key
    for lease in leases:
        lease.release()
    assert fl.num_idle() == 3 and fake.live == {4, 5, 6} and fake.destroyed == [1, 2, 3]  # oldest first
    assert counters(fl.kind).idle == 3
    again = fl.lease("k5")  # the most recent survives and is reused
    assert again.resource == 6 and counters(fl.kind).reused == 1
    assert fl.lease("k0").resource == 7  # k0's idle resource was evicted: a new one is made
    fl.clear()
    assert fl.num_idle() == 0 and counters(fl.kind).idle == 0 and fake.live == {6, 7}


def test_pool_off_creates_and_destroys_every_time(fake: Fake) -> None:
    fl = _freelist(fake)
    pool.set_enabled(True)
    try:
        fl.lease("k").release()  # one idle resource is left from pool-on times
        pool.set_enabled(False)
        seen = []
        for _ in range(4):
            with fl.lease("k") as r:
                seen.append(r)
        assert len(set(seen)) == 4
        c = counters(fl.kind)
        assert c.created == 5 and c.reused == 0 and c.destroyed == 4
        assert fl.num_idle() == 1  # what was idle stays idle; off changes later leases only
    finally:
        pool.set_enabled(None)


def test_create_failure_is_a_pool_error(pool_on) -> None:
    def create(key):
        raise OSError("no memory")

    fl = FreeList(_kind("boom"), create, lambda r: True, lambda r: None)
    with pytest.raises(PoolError, match=r"create\(key='k'\) failed: no memory"):
        fl.lease("k")
    assert counters(fl.kind).created == 0 and counters(fl.kind).live == 0


def test_create_warmlink_error_passes_through(pool_on) -> None:
    """A typed error from create (e.g. ConfigError for a bad key) reaches the caller as itself."""

    def create(key):
        raise ConfigError(f"create: key={key!r} unknown")

    fl = FreeList(_kind("typed"), create, lambda r: True, lambda r: None)
    with pytest.raises(ConfigError, match="unknown"):
        fl.lease("k")


def test_destroy_failure_is_counted_not_raised(pool_on, fake: Fake) -> None:
    def destroy(r):
        raise RuntimeError("destroy failed")

    fl = FreeList(_kind("nodestroy"), fake.create, lambda r: False, destroy)
    fl.lease("k").release()
    c = counters(fl.kind)
    assert c.destroyed == 1 and c.live == 0 and c.failed_resets == 1


def test_concurrent_leases_never_share(pool_on, fake: Fake) -> None:
    fl = _freelist(fake, max_idle_per_key=4)
    holders: set[int] = set()
    lock = threading.Lock()
    errors: list[str] = []
    num_threads, rounds = 16, 200
    start = threading.Barrier(num_threads)

    def work(t: int) -> None:
        start.wait(timeout=10)
        for i in range(rounds):
            key = ("a", "b")[(t + i) % 2]
            with fl.lease(key) as r:
                with lock:
                    if r in holders:
                        errors.append(f"resource {r} handed to two holders")
                    holders.add(r)
                time.sleep(0) if i % 7 else time.sleep(1e-4)
                with lock:
                    holders.remove(r)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"
    assert not errors, errors[:3]
    c = counters(fl.kind)
    assert c.created + c.reused == num_threads * rounds
    assert c.live == c.created - c.destroyed == len(fake.live)
    assert c.idle == fl.num_idle() <= 2 * 4
    assert c.reused > 0


def test_stats_keys_and_reset_stats(pool_on, fake: Fake) -> None:
    fl = _freelist(fake)
    fl.lease("k").release()
    s = stats()
    assert fl.kind in s
    assert set(s[fl.kind]) == {"created", "reused", "destroyed", "failed_resets", "create_s", "live", "idle"}
    assert s[fl.kind]["created"] == 1 and s[fl.kind]["create_s"] >= 0.0
    # stats() is a snapshot: mutating it changes nothing.
    s[fl.kind]["created"] = 99
    assert stats()[fl.kind]["created"] == 1
    core.reset_stats()
    after = stats()[fl.kind]
    assert (after["created"], after["reused"], after["destroyed"], after["create_s"]) == (0, 0, 0, 0.0)
    assert after["live"] == 1 and after["idle"] == 1  # live and idle stay


def test_pool_stats_exported() -> None:
    assert pool.stats is core.stats and pool.enabled is core.enabled


# -- SharedCache ------------------------------------------------------------------------------------
def _cache(fake: Fake) -> SharedCache:
    return SharedCache(_kind("cache"), fake.create, fake.destroy)


def test_cache_acquire_shares_and_release_keeps(pool_on, fake: Fake) -> None:
    cache = _cache(fake)
    r1, t1 = cache.acquire("k")
    r2, t2 = cache.acquire("k")
    assert r1 == r2
    cache.release(t1)
    cache.release(t2)
    assert r1 in fake.live and cache.keys() == ["k"]  # cached at zero references until evict
    r3, t3 = cache.acquire("k")
    assert r3 == r1
    cache.release(t3)
    c = counters(cache.kind)
    assert (c.created, c.reused, c.destroyed) == (1, 2, 0)
    other, t4 = cache.acquire("other")
    assert other != r1
    cache.release(t4)


def test_cache_evict_unheld_destroys_now(pool_on, fake: Fake) -> None:
    cache = _cache(fake)
    r, t = cache.acquire(("peer", 1, "x"))
    cache.release(t)
    assert cache.evict(lambda k: k[1] == 1) == 1
    assert r in fake.destroyed and cache.keys() == []
    r2, t2 = cache.acquire(("peer", 1, "x"))
    assert r2 != r  # a fresh one, the evicted one is never handed out again
    cache.release(t2)


def test_cache_evict_held_destroys_on_last_release(pool_on, fake: Fake) -> None:
    cache = _cache(fake)
    r, t1 = cache.acquire("k")
    _, t2 = cache.acquire("k")
    keep, t3 = cache.acquire("keep")
    assert cache.evict(lambda k: k == "k") == 1
    assert r in fake.live  # still held twice
    fresh, t4 = cache.acquire("k")
    assert fresh != r
    cache.release(t1)
    assert r in fake.live
    cache.release(t2)
    assert r in fake.destroyed and fresh in fake.live and keep in fake.live
    assert sorted(cache.keys()) == ["k", "keep"]
    cache.release(t3)
    cache.release(t4)
    cache.clear()
    assert not fake.live and cache.keys() == []
    assert counters(cache.kind).live == 0


def test_cache_pool_off_private_entries(fake: Fake) -> None:
    cache = _cache(fake)
    pool.set_enabled(False)
    try:
        r1, t1 = cache.acquire("k")
        r2, t2 = cache.acquire("k")
        assert r1 != r2 and cache.keys() == []
        cache.release(t1)
        assert r1 in fake.destroyed and r2 in fake.live
        cache.release(t2)
        assert not fake.live
        c = counters(cache.kind)
        assert (c.created, c.destroyed, c.reused, c.live) == (2, 2, 0, 0)
    finally:
        pool.set_enabled(None)


def test_cache_create_errors(pool_on) -> None:
    def create(key):
        if key == "typed":
            raise ConfigError("bad key")
        raise OSError("boom")

    cache = SharedCache(_kind("cerr"), create, lambda r: None)
    with pytest.raises(ConfigError):
        cache.acquire("typed")
    with pytest.raises(PoolError, match="boom"):
        cache.acquire("other")
    assert cache.keys() == []


def test_cache_concurrent_acquire_one_entry(pool_on, fake: Fake) -> None:
    cache = _cache(fake)
    got: list[int] = []
    tokens: list = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def work() -> None:
        start.wait(timeout=10)
        r, t = cache.acquire("same")
        with lock:
            got.append(r)
            tokens.append(t)

    threads = [threading.Thread(target=work) for _ in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert len(got) == 16 and len(set(got)) == 1
    for t in tokens:
        cache.release(t)
    assert len(fake.live) == 1  # racing creations were destroyed, one entry stays cached
    c = counters(cache.kind)
    assert c.live == 1 and c.created - c.destroyed == 1


def test_cache_max_entries_drops_the_least_recently_acquired(pool_on, fake: Fake) -> None:
    cache = SharedCache(_kind("lru"), fake.create, fake.destroy, max_entries=2)
    a, b = cache.get("a"), cache.get("b")
    assert cache.get("a") == a  # "a" is now the most recently acquired
    c = cache.get("c")
    assert cache.keys() == ["a", "c"] and b in fake.destroyed and a in fake.live and c in fake.live
    assert cache.get("b") != b  # made again, never the destroyed one
    assert counters(cache.kind).live == 2 == len(fake.live)


def test_cache_max_entries_destroys_a_held_entry_at_its_last_release(pool_on, fake: Fake) -> None:
    cache = SharedCache(_kind("lru-held"), fake.create, fake.destroy, max_entries=1)
    held, token = cache.acquire("old")
    new = cache.get("new")
    assert cache.keys() == ["new"] and held in fake.live  # out of the cache, still in use
    cache.release(token)
    assert held in fake.destroyed and new in fake.live


def test_cache_max_entries_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_entries=0"):
        SharedCache(_kind("lru-bad"), max_entries=0)


def test_cache_get_is_a_memo_made_once_with_pooling_on_and_every_time_off(fake: Fake) -> None:
    cache = SharedCache(_kind("memo"), max_entries=4)
    made: list[str] = []

    def compute(key: str) -> str:
        made.append(key)
        return key.upper()

    pool.set_enabled(True)
    try:
        assert [cache.get("x", compute) for _ in range(3)] == ["X"] * 3 and made == ["x"]
        pool.set_enabled(False)
        assert [cache.get("y", compute) for _ in range(2)] == ["Y"] * 2 and made == ["x", "y", "y"]
    finally:
        pool.set_enabled(None)
    c = counters(cache.kind)
    assert (c.created, c.reused, c.destroyed, c.live) == (3, 2, 2, 1)  # "x" stays cached


def test_cache_create_per_call_and_none_at_all(pool_on, fake: Fake) -> None:
    cache = SharedCache(_kind("percall"), fake.create, fake.destroy)
    assert cache.get("k", lambda key: 100) == 100  # the call's factory wins over the cache's
    assert cache.get("k") == 100  # cached: no factory runs
    with pytest.raises(ConfigError, match="no create for key='other'"):
        SharedCache(_kind("nocreate")).acquire("other")


def test_cache_preload_holds_nothing_and_makes_nothing_with_pooling_off(fake: Fake) -> None:
    cache = SharedCache(_kind("preload"), fake.create, fake.destroy)
    pool.set_enabled(True)
    try:
        r = cache.preload("k")
        assert r in fake.live and cache.keys() == ["k"]
        assert cache.preload("k") == r and counters(cache.kind).reused == 0  # cached: counts nothing
        got, token = cache.acquire("k")
        assert got == r and counters(cache.kind).reused == 1
        cache.release(token)
        pool.set_enabled(False)
        assert cache.preload("other") is None and cache.keys() == ["k"] and fake.live == {r}
    finally:
        pool.set_enabled(None)


def test_uncounted_pools_stay_out_of_stats(pool_on, fake: Fake) -> None:
    kind_fl, kind_cache = _kind("quiet-fl"), _kind("quiet-cache")
    FreeList(kind_fl, fake.create, fake.reset, fake.destroy, counted=False).lease("k").release()
    SharedCache(kind_cache, fake.create, fake.destroy, counted=False).get("k")
    assert kind_fl not in stats() and kind_cache not in stats()


def test_lease_discard_destroys_without_reset(pool_on, fake: Fake) -> None:
    fl = _freelist(fake)
    lease = fl.lease("k")
    lease.discard()
    lease.discard()
    lease.release()  # after discard: nothing more happens
    assert fake.destroyed == [lease.resource] and fake.num_resets == 0 and fl.num_idle() == 0
    c = counters(fl.kind)
    assert (c.destroyed, c.failed_resets, c.live, c.idle) == (1, 0, 0, 0)


# -- PerOwner: memos of what was learned through an owner object (Note [Owner memos]) ----------------
class Owner:
    """A stand-in for a store connection: weakly referenceable, compared by identity."""


def _memo_counts(memo) -> tuple:
    c = counters(memo.kind)
    return c.created, c.reused, c.destroyed


def test_owner_memo_remembers_per_owner_and_counts(pool_on, fake: Fake) -> None:
    memo = core.PerOwner(_kind("owner-memo"), destroy=fake.destroy, max_keys_per_owner=2)
    a, b = Owner(), Owner()
    x, y, z, w = (fake.create(None) for _ in range(4))
    memo.put(a, "k", x)
    assert memo.get(a, "k") == x and memo.get(b, "k") is None  # another owner starts empty
    memo.put(a, "k", y)  # replaced: the old value is destroyed, no entry made
    assert memo.get(a, "k") == y and x in fake.destroyed
    memo.put(a, "j", z)
    memo.put(a, "i", w)  # past the bound: the least recently put ("k") goes, destroyed
    assert memo.get(a, "k") is None and y in fake.destroyed
    assert memo.take(a, "j") == z and memo.get(a, "j") is None and z in fake.live  # taken: its taker's now
    assert _memo_counts(memo) == (3, 3, 1)  # made k, j, i; found k, k, j; dropped k past the bound
    assert memo.kind in stats() and (counters(memo.kind).live, counters(memo.kind).idle) == (0, 0)
    memo.clear()
    assert memo.get(a, "i") is None and w in fake.destroyed
    assert _memo_counts(memo)[2] == 2


def test_owner_memo_forgets_an_owner_that_goes(pool_on) -> None:
    import gc
    import weakref

    memo = core.PerOwner(_kind("owner-gone"))
    owner = Owner()
    value = Owner()
    memo.put(owner, 0, value)
    gone = weakref.ref(value)
    del owner, value
    gc.collect()
    assert gone() is None  # the owner's values went with it
    memo.put(1.5, 0, "never")  # an owner that cannot be weakly referenced is never remembered
    assert memo.get(1.5, 0) is None and _memo_counts(memo) == (2, 0, 1)


def test_owner_memo_remembers_nothing_with_pooling_off(fake: Fake) -> None:
    memo = core.PerOwner(_kind("owner-off"), destroy=fake.destroy)
    kept = core.PerOwner(_kind("owner-state"), counted=False, pooled=False)
    owner = Owner()
    pool.set_enabled(True)
    try:
        memo.put(owner, "k", fake.create(None))
        pool.set_enabled(False)
        assert memo.get(owner, "k") is None and memo.take(owner, "k") is None  # remembered while on, hidden while off
        v = fake.create(None)
        memo.put(owner, "j", v)  # dropped at once
        assert v in fake.destroyed
        kept.put(owner, "slot", 7)  # state, not a cache: kept whatever the switch says
        assert kept.get(owner, "slot") == 7 and kept.kind not in stats()
        pool.set_enabled(True)
        assert memo.get(owner, "j") is None and memo.get(owner, "k") is not None
    finally:
        pool.set_enabled(None)
    assert _memo_counts(memo)[:3] == (2, 1, 1)
