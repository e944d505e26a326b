"""The vLLM backend's trainer-side parts without vLLM: the trainer ranks' liveness and joining
(``integrations.vllm._trainers``, Note [Trainer liveness]) and the records the workers and trainer
exchange (``integrations.vllm._wire``, Note [Update records]), against a real store server and
real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmlink import errors
from warmlink._backoff import wait_until
from warmlink.errors import MetadataError, PeerLostError, TransferError, TransferTimeout
from warmlink.integrations.vllm import _trainers, _wire
from warmlink.integrations.vllm._trainers import TrainerGroup
from warmlink.refit import protocol
from warmlink.refit import PartialLoadError
from warmlink.rendezvous import Store

CTX = mp.get_context("spawn")


@pytest.fixture
def server():
    with Store("127.0.0.1", 0, is_server=True, prefix="trainers", timeout_s=30) as s:
        yield s


def _member(address, secret, rank, world, ready, *, generation=7):
    """A trainer rank in its own process: announces itself, joins, then lives until killed."""
    store = Store.connect(address, prefix="trainers", secret=secret, timeout_s=30)
    protocol.write_state(store, rank, protocol.VersionState(1, "published", generation))
    group = TrainerGroup(store, rank, world, generation)
    try:
        group.join(30)
        ready.put("joined")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        ready.put(f"{type(exc).__name__}: {exc}")
    time.sleep(120)


def _spawn(server, rank, world, secret=None):
    """(process, a queue of its join's outcome); the test kills the process."""
    ready = CTX.Queue()
    proc = CTX.Process(target=_member, args=(server.address, secret or server.secret, rank, world, ready), daemon=True)
    proc.start()
    return proc, ready


def _announced(store, rank: int) -> bool:
    """Whether ``rank``'s record is in the store, under this secret or another."""
    try:
        return store.try_get(f"vllm/trainer/{rank}") is not None
    except MetadataError:
        return True


def _end(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(10)


def _here(server, rank, world, generation=5, secret=None):
    store = Store.connect(server.address, prefix="trainers", secret=secret or server.secret, timeout_s=30)
    protocol.write_state(store, rank, protocol.VersionState(1, "published", generation))
    return store, TrainerGroup(store, rank, world, generation)


def test_ranks_join_and_a_killed_rank_is_known_dead_at_once(server):
    proc, ready = _spawn(server, 1, 2)
    store, group = _here(server, 0, 2)
    try:
        group.join(30)
        assert ready.get(timeout=30) == "joined" and group.generations == {0: 5, 1: 7}
        assert group.lost(1) is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.perf_counter()
        with pytest.raises(PeerLostError, match="trainer rank 1 .* died"):
            group.wait(lambda: False, watch=[1], timeout_s=60, what="waiting for rank 1")
        assert time.perf_counter() - t0 < 5  # its process lock says so, not a timeout
    finally:
        _end(proc)
        group.close()
        store.close()


def test_a_rank_elsewhere_is_dead_when_its_heartbeat_stands_still(server, monkeypatch):
    """A peer whose lock cannot be checked from here (no token: another host) is judged by its
    beat: alive while it beats, gone once the beat stood still for LEASE_S."""
    monkeypatch.setattr(_trainers, "LEASE_S", 1.0)
    far_store, far = _here(server, 1, 2, generation=9)
    far_store.set("vllm/trainer/1", _wire.dumps({"generation": 9, "pid": 1, "token": None}))  # as from another host
    store, group = _here(server, 0, 2)
    try:
        group.join(30)
        time.sleep(1.5)
        assert group.lost(1) is None  # beating
        far.close()
        t0 = time.perf_counter()
        with pytest.raises(PeerLostError, match="heartbeat stood still"):
            group.wait(lambda: False, watch=[1], timeout_s=60, what="waiting for rank 1")
        assert time.perf_counter() - t0 < 1.0 + 5 * _trainers.BEAT_S + 2
    finally:
        far.close()
        group.close()
        store.close()
        far_store.close()


def test_a_rank_with_another_secret_is_named_by_both_sides_at_once(server):
    """Rank 1 was given the wrong secret: each rank sees the other's announcement fail its MAC
    while the other's heartbeat advances, and says so within seconds, not at its timeout."""
    proc, ready = _spawn(server, 1, 2, secret="f" * 64)
    store, group = _here(server, 0, 2)
    try:
        # timed from rank 1's announcement: a process start on a loaded host takes seconds of its own
        wait_until(lambda: _announced(store, 1), timeout_s=120, what="rank 1's announcement")
        t0 = time.perf_counter()
        with pytest.raises(MetadataError, match="different secrets"):
            group.join(30)
        theirs = ready.get(timeout=30)  # the other side refuses too, without waiting for its timeout
        assert theirs.startswith("MetadataError") and "different secrets" in theirs
        assert time.perf_counter() - t0 < 15
    finally:
        _end(proc)
        group.close()
        store.close()


def test_a_key_an_earlier_job_left_under_another_secret_is_explained_not_taken_for_a_peer(server):
    other = Store.connect(server.address, prefix="trainers", secret="e" * 64, timeout_s=30)
    other.set("vllm/trainer/1", _wire.dumps({"generation": 3, "pid": 1, "token": None}))  # an old job's, no beat
    store, group = _here(server, 0, 2)
    try:
        with pytest.raises(MetadataError, match="earlier job .* never joined"):
            group.join(1.5)
    finally:
        group.close()
        store.close()
        other.close()


def test_a_world_size_larger_than_the_job_times_out_naming_the_missing_ranks(server):
    store, group = _here(server, 0, 3)
    proc, ready = _spawn(server, 1, 3)
    try:
        # rank 1 announced before the 3 s join starts: a process start on a loaded host takes longer
        wait_until(lambda: _announced(store, 1), timeout_s=120, what="rank 1's announcement")
        with pytest.raises(TransferTimeout, match=r"ranks \[2\] of world_size=3 did not join .* is world_size right"):
            group.join(3)
    finally:
        _end(proc)
        group.close()
        store.close()


def test_an_announcement_of_an_earlier_generation_is_waited_past(server):
    """A rank's record left by an earlier job (same secret) does not count until the rank's
    version state names the same generation (its export in this job)."""
    store, group = _here(server, 0, 2)
    late = Store.connect(server.address, prefix="trainers", secret=server.secret, timeout_s=30)
    late.set("vllm/trainer/1", _wire.dumps({"generation": 2, "pid": 1, "token": None}))
    protocol.write_state(late, 1, protocol.VersionState(4, "published", 3))  # the rank is at generation 3 now
    try:
        with pytest.raises(TransferTimeout):
            group.join(1.0)
        late.set("vllm/trainer/1", _wire.dumps({"generation": 3, "pid": 1, "token": None}))
        group.join(5)
        assert group.generations[1] == 3
    finally:
        group.close()
        store.close()
        late.close()


# -- records ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [c for c in (getattr(errors, n) for n in errors.__all__)
                                 if isinstance(c, type) and issubclass(c, errors.WarmlinkError)] + [PartialLoadError])
def test_each_warmlink_error_crosses_as_itself(cls):
    exc = cls("boom") if cls is not PartialLoadError else cls("boom", version=3, bucket_idx=0, num_buckets=1, handed=[])
    back = _wire.decode_error(_wire.encode_error(exc), "vLLM worker 1, update")
    assert type(back) is cls and str(back) == "vLLM worker 1, update: boom"


def test_other_errors_cross_as_transfer_errors_with_their_name():
    back = _wire.decode_error(_wire.encode_error(KeyError("x")), "w")
    assert type(back) is TransferError and "KeyError" in str(back)


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers()),
                 st.dictionaries(st.text(max_size=8), st.one_of(st.text(), st.integers(), st.none()), max_size=4)))
def test_any_error_record_decodes_to_a_warmlink_error(record):
    """Whatever the store holds (it is not trusted), decoding gives a warmlink error, never runs
    or imports anything it names."""
    assert isinstance(_wire.decode_error(record, "w"), errors.WarmlinkError)


@given(st.binary(max_size=64))
def test_any_bytes_load_as_a_record_or_a_metadata_error(raw):
    try:
        record = _wire.loads(raw, "k", {"served": int, "open": bool})
    except MetadataError:
        return
    assert isinstance(record, dict)
    assert record.get("served") is None or type(record["served"]) is int
    assert record.get("open") is None or type(record["open"]) is bool
