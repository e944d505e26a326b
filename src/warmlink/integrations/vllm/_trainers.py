"""The trainer ranks of one job, as the vLLM backend needs them: who is there, and who still lives.

# Note [Trainer liveness]
From ``trainer_init`` until ``shutdown`` every trainer rank announces itself under
``vllm/trainer/{rank}`` (JSON: its publisher generation, pid and process-lock token, Note [Process
locks] in ``pool.liveness``) and beats: a daemon thread adds 1 to ``vllm/trainer/{rank}/beat``
every ``BEAT_S``. A peer is dead when its lock is free (a peer sharing this /dev/shm: known at
once) or when its beat stood still for ``LEASE_S`` (anywhere else). Rank 0 waits for every rank to
publish a version, and every other rank waits for rank 0's end of the update, watching these, so a
dead peer ends the wait within seconds as ``PeerLostError`` rather than after ``update_timeout_s``
(which bounds only a live peer that is slow).

``join`` (at ``trainer_init``) waits for every rank's announcement of its current generation (the
one its version state names), so what a rank checks next is this job's and not a key an earlier
job left on the prefix. An announcement that fails this rank's MAC comes from a process with
another secret: refused at once, naming the rank, when that rank's beat advances (a live process
signing under another secret: one of the two was given the wrong ``secret``; the refusing rank
also bumps that rank's plain ``unverified`` counter, so that it refuses too rather than wait for a
peer that is gone), and at the end of the wait when it does not (a key an earlier job left under
another secret, and that rank never came). The beat and ``unverified`` are plain counters, like
the reader leases' (Note [Reader leases]): forging them can make a dead rank look alive until the
timeout, or a rank refuse to start, an error either way.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from warmlink._backoff import wait_until
from warmlink.errors import MetadataError, TransferTimeout
from warmlink.integrations.vllm import _wire
from warmlink.pool import liveness
from warmlink.refit import protocol
from warmlink.rendezvous import schema

__all__ = ["TrainerGroup", "BEAT_S", "LEASE_S"]

log = logging.getLogger("warmlink.integrations.vllm")

BEAT_S = 0.25
LEASE_S = 5.0
_FIELDS = {"generation": int, "pid": int, "token": str}


def _record_key(rank: int) -> str:
    return f"vllm/trainer/{rank}"


def _beat_key(rank: int) -> str:
    return f"vllm/trainer/{rank}/beat"


def _unverified_key(rank: int) -> str:
    return f"vllm/trainer/{rank}/unverified"  # bumped by a peer that refused rank's announcement


class _Beat:
    """When a peer's beat counter last moved, as seen from here (no clocks compared across hosts)."""

    __slots__ = ("count", "moved_at", "moves")

    def __init__(self, count: int) -> None:
        self.count, self.moved_at, self.moves = count, time.monotonic(), 0

    def see(self, count: int) -> None:
        if count != self.count:
            self.count, self.moved_at, self.moves = count, time.monotonic(), self.moves + 1


class TrainerGroup:
    """This rank's membership of the trainer job (Note [Trainer liveness]).

    Args:
        store: the job's ``Store`` (the beat thread shares its connection).
        rank, world_size: this trainer rank and how many there are.
        generation: this rank's publisher generation (``Publisher.generation`` after ``export``).
    """

    def __init__(self, store, rank: int, world_size: int, generation: int) -> None:
        self.store, self.rank, self.world_size, self.generation = store, rank, world_size, generation
        self.generations: dict[int, int] = {rank: generation}
        self._peers: dict[int, dict] = {}
        self._beats: dict[int, _Beat] = {}
        self._stop = threading.Event()
        self._refused_before = store.add(_unverified_key(rank), 0, checked=False)  # before any peer can see this rank
        store.set(_record_key(rank), _wire.dumps({"generation": generation, "pid": os.getpid(), "token": liveness.token()}))
        self._beat_once()
        self._thread = threading.Thread(target=self._run, name="warmlink-trainer-heartbeat", daemon=True)
        self._thread.start()

    # -- this rank -------------------------------------------------------------------------------
    def _beat_once(self) -> None:
        self.store.add(_beat_key(self.rank), 1, checked=False, timeout_s=max(BEAT_S, 1.0))

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat_once()
            except Exception:  # noqa: BLE001 - a missed beat is what a stalled store looks like to peers
                log.debug("trainer heartbeat of rank %d missed", self.rank, exc_info=True)

    def close(self) -> None:
        """Stop beating (peers then take this rank for gone within ``LEASE_S``). Idempotent."""
        self._stop.set()

    # -- peers -----------------------------------------------------------------------------------
    def join(self, timeout_s: float) -> None:
        """Wait for every other rank's announcement of its current generation.

        Raises:
            MetadataError: a rank's announcement fails this rank's MAC (another secret), or is malformed.
            TransferTimeout: a rank did not announce itself within ``timeout_s`` (names the ranks,
                and asks whether ``world_size`` is right).
        """
        missing = [r for r in range(self.world_size) if r != self.rank]
        unsigned: dict[int, MetadataError] = {}
        refused_before = self._refused_before

        def ready() -> bool:
            if self.store.add(_unverified_key(self.rank), 0, checked=False) != refused_before:
                raise MetadataError(
                    f"TrainerGroup: another trainer rank cannot verify rank {self.rank}'s announcement under its secret: "
                    f"the ranks were given different secrets; expected the same secret= (or WARMLINK_SECRET) on every "
                    "trainer rank, the store's own")
            for r in list(missing):
                try:
                    record = self._read(r)
                except MetadataError as exc:
                    if "fails its MAC" not in str(exc):
                        raise
                    unsigned[r] = exc
                    self._see_beat(r)
                    beat = self._beats[r]
                    if beat.moves >= 2:  # a live process, signing under another secret: tell it, then refuse
                        self.store.add(_unverified_key(r), 1, checked=False)
                        raise MetadataError(
                            f"TrainerGroup: trainer rank {r} is running (its heartbeat advances) but its announcement "
                            f"fails the MAC of rank {self.rank}: the two were given different secrets; expected the same "
                            "secret= (or WARMLINK_SECRET) on every trainer rank, the store's own") from None
                    continue
                unsigned.pop(r, None)
                if record is None:
                    continue
                state = self.state(r)
                if state is None or state.generation != record["generation"]:
                    continue  # rank r has not exported yet in this job: its announcement is an earlier job's
                self._peers[r] = record
                self.generations[r] = record["generation"]
                missing.remove(r)
            return not missing

        def what() -> str:
            if unsigned:
                r = min(unsigned)
                return (f"TrainerGroup: trainer rank {r}'s announcement fails the MAC of rank {self.rank} and rank {r} "
                        f"shows no heartbeat within {timeout_s:.3g} s: a key an earlier job left on prefix "
                        f"{self.store.prefix!r} under another secret, and rank {r} never joined; expected every rank of "
                        f"world_size={self.world_size} running (a fresh prefix per job avoids the stale keys)")
            return (f"TrainerGroup: trainer ranks {missing} of world_size={self.world_size} did not join within "
                    f"{timeout_s:.3g} s (rank {self.rank} waited for their export); expected every rank 0..world_size-1 "
                    "to call trainer_init: is world_size right?")

        try:
            wait_until(ready, timeout_s=timeout_s, what=what, first_s=1e-3, cap_s=0.05)
        except TransferTimeout as exc:
            if unsigned:
                raise MetadataError(str(exc)) from None
            raise

    def state(self, rank: int) -> protocol.VersionState | None:
        """Publisher ``rank``'s version state now, or None when it has none yet (no wait)."""
        raw = self.store.try_get(protocol.state_key(rank), peer=f"publisher/{rank}")
        if raw is None:
            return None
        obj = schema.decode(raw, "version_state", f"publisher/{rank}")
        return protocol.VersionState(obj["version"], obj["state"], obj["generation"])

    def _read(self, rank: int) -> dict | None:
        raw = self.store.try_get(_record_key(rank), peer=f"trainer/{rank}")
        return None if raw is None else _wire.loads(raw, _record_key(rank), _FIELDS)

    def _see_beat(self, rank: int) -> None:
        count = self.store.add(_beat_key(rank), 0, checked=False)
        beat = self._beats.get(rank)
        if beat is None:
            self._beats[rank] = _Beat(count)
        else:
            beat.see(count)

    def lost(self, rank: int) -> str | None:
        """None while trainer ``rank`` (joined) lives, else why it is taken for gone."""
        record = self._peers.get(rank)
        if record is not None and record.get("token"):
            alive = liveness.token_alive(record["token"], record.get("pid"))
            if alive is False:
                return f"trainer rank {rank} (pid {record.get('pid')}) died"
            if alive:
                return None
        self._see_beat(rank)
        stood = time.monotonic() - self._beats[rank].moved_at
        if stood > LEASE_S:
            return f"trainer rank {rank}'s heartbeat stood still for {stood:.1f} s (dead, stalled or cut off from the store)"
        return None

    def wait(self, ready, *, watch: list[int], timeout_s: float, what: str) -> None:
        """``ready()`` polled until true, ending early with PeerLostError when a rank of ``watch`` is gone."""
        def lost() -> str | None:
            for r in watch:
                why = self.lost(r)
                if why is not None:
                    return f"{what}: {why}"
            return None

        wait_until(ready, timeout_s=timeout_s, what=lambda: f"{what}: no answer within {timeout_s:.3g} s (update_timeout_s)",
                   lost=lost, first_s=1e-4, cap_s=0.02, every_s=0.2)
