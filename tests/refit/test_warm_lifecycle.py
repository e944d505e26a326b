"""Warm engine lifecycles on the shm backend: what a re-created Publisher or Receiver skips, and
that it still trusts nothing it has not validated.

See Note [Warm metadata] (``refit._memo``) and Note [Parked receive state] (``refit._parked``).
Publisher and receivers share this process; tensors are carved from one shm arena the test
holds, so they are exported in place and every re-export names the same regions.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from warmlink import pool
from warmlink.errors import LayoutError, MetadataError, TransferTimeout
from warmlink.pool import lease_arena
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit._parked import release_parked
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store, schema

W = TensorLayout.plain("w", "float32", (64, 32))
B = TensorLayout.plain("b", "float32", (32,))
LAYOUTS = {"w": W, "b": B}
TIMEOUT_S = 10.0


@pytest.fixture
def store():
    pool.set_enabled(True)
    release_parked()  # nothing parked by earlier tests: each test counts from a clean slot
    with Store("127.0.0.1", 0, is_server=True, prefix=f"warm-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as s:
        try:
            yield s
        finally:
            release_parked()
            pool.set_enabled(None)


@pytest.fixture
def tensors():
    """``LAYOUTS`` as views of one shm arena held for the test: exported in place."""
    lease = lease_arena("shm", 1 << 16)
    buf, out, at = lease.resource.tensor, {}, 0
    for name, layout in LAYOUTS.items():
        out[name] = buf[at : at + layout.nbytes].view(torch.float32).view(layout.local_shape)
        at += (layout.nbytes + 255) // 256 * 256
    fill(out, 1)
    yield out
    lease.release()


def fill(tensors: dict, seed: int) -> None:
    for k, t in enumerate(tensors.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) * (k + 1) + seed)


def export(store, tensors: dict, layouts: dict = LAYOUTS) -> Publisher:
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
    for name, layout in layouts.items():
        pub.add(name, tensors[name], layout)
    pub.export()
    return pub


def receiver(store, layouts: dict = LAYOUTS, **kw) -> tuple[Receiver, dict]:
    rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S, **kw)
    targets = {n: torch.full(l.local_shape, -1.0) for n, l in layouts.items()}
    for name, layout in layouts.items():
        rec.add(name, layout, targets[name])
    return rec, targets


def refit_once(store, tensors: dict, layouts: dict = LAYOUTS, version: int | None = None, **kw):
    rec, targets = receiver(store, layouts, **kw)
    with rec:
        report = rec.refit(version=version, timeout_s=5)
    assert all(torch.equal(targets[n], tensors[n]) for n in layouts), "received bytes differ"
    return report


class Spy:
    """Records the keys a store method is called with (wrapping the instance's method)."""

    def __init__(self, monkeypatch, store, method: str) -> None:
        self.keys: list[str] = []
        real = getattr(store, method)

        def spy(key, *args, **kwargs):
            self.keys.append(key)
            return real(key, *args, **kwargs)

        monkeypatch.setattr(store, method, spy)


def _counter(monkeypatch, module, name: str) -> list:
    calls: list = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _stat(kind: str, field: str) -> int:
    return pool.stats().get(kind, {}).get(field, 0)


# -- publisher: unchanged re-exports -----------------------------------------------------------------
def test_unchanged_reexport_keeps_generation_and_does_not_rewrite_manifest(store, tensors, monkeypatch) -> None:
    pub = export(store, tensors)
    generation = pub.generation
    raw = store.get(protocol.manifest_key(0, generation))
    refit_once(store, tensors)
    pub.close()

    sets, adds = Spy(monkeypatch, store, "set"), Spy(monkeypatch, store, "add")
    fill(tensors, 2)
    pub = export(store, tensors)
    with pub:
        assert pub.generation == generation
        assert sets.keys == [protocol.state_key(0)], "only the state is written"
        assert adds.keys == [], "no generation drawn"
        assert store.get(protocol.manifest_key(0, generation)) == raw
        assert refit_once(store, tensors).version == 1


def test_changed_manifest_takes_a_new_generation(store, tensors, monkeypatch) -> None:
    with export(store, tensors) as pub:
        generation = pub.generation
    sets = Spy(monkeypatch, store, "set")
    with export(store, tensors, {"w": W}) as pub:  # one tensor fewer: another manifest
        assert pub.generation == generation + 1
        assert protocol.manifest_key(0, generation + 1) in sets.keys
        refit_once(store, tensors, {"w": W})
    with export(store, tensors) as pub:  # back to the first content: the memo holds only the last
        assert pub.generation == generation + 2
        refit_once(store, tensors)


def test_overwritten_manifest_is_written_again_under_a_new_generation(store, tensors) -> None:
    with export(store, tensors) as pub:
        generation = pub.generation
    store.set(protocol.manifest_key(0, generation), b'{"not": "the manifest"}')
    with export(store, tensors) as pub:
        assert pub.generation == generation + 1
        refit_once(store, tensors)


def test_reexport_through_another_store_object_or_pool_off_takes_a_new_generation(store, tensors) -> None:
    with export(store, tensors) as pub:
        generation = pub.generation
    with Store.connect(store.address, prefix=store.prefix, timeout_s=TIMEOUT_S, secret=store.secret) as other:
        with export(other, tensors) as pub:
            assert pub.generation == generation + 1  # a generation is reused only by the store object that drew it
    pool.set_enabled(False)
    with export(store, tensors) as pub:
        assert pub.generation == generation + 2
        refit_once(store, tensors)


# -- receiver: manifests validated once per exact bytes ------------------------------------------------
def test_manifest_is_validated_again_whenever_its_bytes_differ(store, tensors, monkeypatch) -> None:
    decodes = _counter(monkeypatch, schema, "decode")
    with export(store, tensors) as pub:
        key = protocol.manifest_key(0, pub.generation)
        raw = store.get(key)
        refit_once(store, tensors)
        manifests = [c for c in decodes if c[1] == "publisher_manifest"]
        assert len(manifests) == 1
        refit_once(store, tensors)  # the same bytes again: not decoded again
        refit_once(store, tensors, {"w": W})  # another receiver layout, the same bytes
        assert len([c for c in decodes if c[1] == "publisher_manifest"]) == 1

        m = json.loads(raw)
        store.set(key, json.dumps(m, indent=1).encode())  # the same content, other bytes: decoded again ...
        rec, targets = receiver(store)
        with rec, pytest.raises(MetadataError, match=r"publisher/0's manifest .* not the one its version header names"):
            rec.refit(timeout_s=2)  # ... and refused: not the bytes the publisher wrote (Note [Version header])
        assert len([c for c in decodes if c[1] == "publisher_manifest"]) == 2

        m["tensors"][0]["offset"] = -4  # bytes never seen: validated, and refused
        store.set(key, json.dumps(m).encode())
        rec, targets = receiver(store)
        with rec, pytest.raises(MetadataError, match=r"publisher/0.*tensors\[0\]\.offset=-4"):
            rec.refit(timeout_s=2)
        assert all((t == -1).all() for t in targets.values()), "targets touched"
        store.set(key, raw)
        refit_once(store, tensors)
        assert pub.begin_update(timeout_s=1) < 0.5  # no reader count left behind
        pub.publish()


# -- receiver: the first sync guesses the last state read -------------------------------------------------
def test_new_receiver_enters_the_last_state_read_and_survives_a_stale_guess(store, tensors, monkeypatch) -> None:
    with export(store, tensors) as pub:
        refit_once(store, tensors)
        reads = Spy(monkeypatch, store, "try_get")
        refit_once(store, tensors)
        state_reads = [k for k in reads.keys if k == protocol.state_key(0)]
        assert state_reads == [], "entered with the guess: no state read (the version header said it was current)"

        with pub.update():  # the guess (version 1) is now stale
            fill(tensors, 3)
        assert refit_once(store, tensors).version == 2
        assert pub.begin_update(timeout_s=1) < 0.5  # the stale guess left no reader count
        pub.publish()
        assert refit_once(store, tensors, version=3).version == 3


# -- receiver: parked state ---------------------------------------------------------------------------
def test_equal_receiver_adopts_parked_state_and_leases_nothing(store, tensors) -> None:
    with export(store, tensors) as pub:
        refit_once(store, tensors)
        links, arenas_ = _stat("link", "reused") + _stat("link", "created"), _stat("arena", "reused")
        for seed in range(4, 8):
            with pub.update():
                fill(tensors, seed)
            report = refit_once(store, tensors)
            assert report.version == seed - 2 and not any(report.created.values()), report.created
        assert _stat("link", "reused") + _stat("link", "created") == links, "a link was leased"
        assert _stat("arena", "reused") == arenas_, "an arena was leased"

        refit_once(store, tensors, {"w": W})  # other settings: leases its own
        assert _stat("link", "reused") + _stat("link", "created") == links + 1


@pytest.mark.parametrize("case", ["swap", "failed", "pool_off"])
def test_receivers_that_must_not_park(store, tensors, case) -> None:
    with export(store, tensors) as pub:
        if case == "swap":
            rec, _ = receiver(store, install="swap")
            with rec:
                rec.refit(timeout_s=5)
        elif case == "failed":
            refit_once(store, tensors)  # parks a good state ...
            pub.begin_update()
            rec, targets = receiver(store)  # ... which this one adopts, then fails with
            with rec, pytest.raises(TransferTimeout):
                rec.refit(timeout_s=0.2)
            assert all((t == -1).all() for t in targets.values())
            pub.publish()
        else:
            pool.set_enabled(False)
            refit_once(store, tensors)
            pool.set_enabled(True)
        links = _stat("link", "reused") + _stat("link", "created")
        refit_once(store, tensors)
        assert _stat("link", "reused") + _stat("link", "created") == links + 1, "adopted a state it must not"


def test_adopter_reads_the_manifest_again(store, tensors) -> None:
    """A parked state holds sources opened for a manifest; the adopter checks the bytes still say so."""
    with export(store, tensors) as pub:
        key = protocol.manifest_key(0, pub.generation)
        raw = store.get(key)
        refit_once(store, tensors)  # parks
        m = json.loads(raw)
        m["regions"][0]["nbytes"] += 1 << 30  # past the end of the peer's file
        store.set(key, json.dumps(m).encode())
        rec, targets = receiver(store)
        with rec, pytest.raises((MetadataError, LayoutError), match="publisher/0"):
            rec.refit(timeout_s=2)
        assert all((t == -1).all() for t in targets.values())
        assert pub.begin_update(timeout_s=1) < 0.5  # no reader count left behind
        pub.publish()
        store.set(key, raw)
        refit_once(store, tensors)


def test_release_parked_gives_everything_back(store, tensors) -> None:
    def leased() -> dict:  # exclusive leases out of the free lists (shared caches keep entries by design)
        return {k: _stat(k, "live") - _stat(k, "idle") for k in ("link", "arena")}

    before = leased()
    with export(store, tensors):
        refit_once(store, tensors)
        # links: publisher + parked receiver; arenas: the publisher's version board and version header
        # (an arena of its own: nothing is staged), the parked receiver's receive buffers
        assert leased() == {"link": before["link"] + 2, "arena": before["arena"] + 3}
        release_parked()
    assert leased() == {"link": before["link"], "arena": before["arena"] + 1}  # the closed publisher parked its board
    release_parked()
    assert leased() == before


# -- the memos are pool kinds ---------------------------------------------------------------------------
def test_memos_are_counted_pool_kinds_and_remember_nothing_with_pooling_off(store, tensors, monkeypatch) -> None:
    """Note [Warm metadata]: each memo is a pool kind in ``pool.stats()``; with pooling off none
    remembers anything (every manifest decoded, no state guessed, every export a new generation)."""
    kinds = ("exported_manifest", "validated_manifest", "read_version_state")
    with export(store, tensors) as pub:
        generation = pub.generation
        refit_once(store, tensors)
        before = {k: _stat(k, "reused") for k in kinds}
        assert protocol.last_state(store, 0) is not None
    with export(store, tensors) as pub:  # a warm lifecycle: each memo answers
        assert pub.generation == generation
        refit_once(store, tensors)
    assert all(_stat(k, "reused") > before[k] for k in kinds), {k: (before[k], _stat(k, "reused")) for k in kinds}

    decodes = _counter(monkeypatch, schema, "decode")
    pool.set_enabled(False)
    with export(store, tensors) as pub:
        assert pub.generation == generation + 1
        refit_once(store, tensors)
        refit_once(store, tensors)
        assert protocol.last_state(store, 0) is None  # read every cycle, remembered by none
        assert len([c for c in decodes if c[1] == "publisher_manifest"]) == 2
