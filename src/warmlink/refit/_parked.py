"""What a receiver holds between cycles, and keeps for the next receiver with the same settings.

A ``ReceiveState`` is a receiver's link lease, its ``SourceSet`` (manifests and opened regions),
its plan and its receive buffers. Every cache in it is a pool ``SharedCache`` (the ``SourceSet``'s
opened regions too) and the states themselves sit in a pool ``FreeList``, so ``WARMLINK_POOL=0``
reaches all of them through ``warmlink.pool.core``: with pooling off each cycle plans, allocates,
opens and prepares again, and each receiver's state is destroyed when it closes. The caches, from
the cheapest lookup down:

* per state, ``(manifest digests, number declared) -> plan``: a warm cycle hashes no layout;
* process-wide, ``(manifest digests, declared layouts, run cap, name map) -> layout signature``:
  equal manifest bytes carry equal source layouts, so a re-created receiver hashes no JSON;
* process-wide, ``signature -> Plan`` (kind ``"plan"`` in ``warmlink.pool.stats()``): plans are pure
  functions of the layouts, so an engine re-created per test plans nothing;
* per state, ``(signature, parity) -> ReceiveBuffers``: one signature's buffers (both halves of a
  swap double buffer), and on each the copy batch prepared for the current manifests.

# Note [Parked receive state]
A test suite that builds an engine per test closes a receiver and creates the same one again a
moment later. Returning its link, receive buffers and opened mappings to their pools and taking
them again costs little each, but together they were most of a warm lifecycle's alloc and
register phases: buffer views, a copy batch validated and coalesced again, regions re-opened.
So a receiver leases its whole state from a free list keyed by its settings, and one whose last
cycle succeeded gives it back on ``close()``: it stays idle (parked) and the next receiver whose
key matches exactly leases it again. The key holds everything those objects depend on: the
``Store`` object, number of publishers, device, backend, install mode, run cap, name map and
every declared layout in order. Targets are not in it: "copy" install copies into the new
receiver's own targets, and a "swap" state (whose targets point into the buffers) and a "direct"
one (whose buffers are its targets) are destroyed on close, never parked (``InstallMode.parks``
in ``refit._install``), as is the state of a receiver whose last cycle failed.

Nothing is trusted more than before: a parked state is reset by ``SourceSet.unverify``, so its
next owner re-reads every manifest on its first sync and anything that changed is rebuilt as for
a new publisher generation. One state is parked per process; parking another, or
``release_parked()``, releases the old one to the pools. Off with pooling off.
"""

from __future__ import annotations

from typing import NamedTuple

from warmlink import _env
from warmlink.pool.core import FreeList, Lease, SharedCache
from warmlink.refit._board import release_parked_boards
from warmlink.refit._install import MODES
from warmlink.refit._receive_buffers import ReceiveBuffers
from warmlink.refit.plan import build_plan, layout_signature
from warmlink.refit.sources import SourceSet
from warmlink.transport import lease_link

__all__ = ["StateKey", "ReceiveState", "lease_state", "release_parked"]

_plans = SharedCache("plan", max_entries=16)  # layout signature -> Plan
_signatures = SharedCache("layout_signature", counted=False, max_entries=64)


class StateKey(NamedTuple):
    """Everything a receive state depends on (Note [Parked receive state])."""

    store: object
    num_publishers: int
    device: int
    backend: str
    install: str  # the install mode's name (refit._install.MODES)
    max_runs_per_tensor: int
    name_map: tuple | None  # sorted (destination name, publisher name) pairs
    layouts: tuple  # (name, TensorLayout) pairs in declaration order


class ReceiveState:
    """A receiver's link, sources, plans and buffers; ``close`` gives them all back (idempotent)."""

    __slots__ = ("key", "link", "sources", "_link_lease", "_plan_of", "_buffers", "_installed", "_closed")

    def __init__(self, key: StateKey) -> None:
        # The timeout is the lease's, set by lease_state: the same state serves receivers of any.
        self._link_lease = lease_link(key.backend, key.device, _env.default_timeout_s())
        self.key = key
        self.link = self._link_lease.resource
        self.sources = SourceSet(key.store, self.link, key.num_publishers)
        self._plan_of = SharedCache("receiver_plan", counted=False, max_entries=1)
        # One signature's buffers: both halves of the double buffer for swap, one set otherwise.
        self._buffers = SharedCache("receive_buffers", destroy=ReceiveBuffers.close, counted=False,
                                    max_entries=2 if MODES[key.install].double_buffered else 1)
        self._installed = None  # swap: the token of the buffers the targets point at
        self._closed = False

    def plan(self, declared: dict):
        """The plan from the publishers' current manifests to ``declared`` (name -> TensorLayout,
        only ever added to by its receiver, so its length names it)."""
        digests = self.sources.digests()
        return self._plan_of.get((digests, len(declared)), lambda _key: self._plan(digests, tuple(declared.values())))

    def _plan(self, digests: tuple, targets: tuple):
        key = self.key
        name_map = dict(key.name_map) if key.name_map else None
        sources = self.sources.layouts()
        sig = _signatures.get((digests, targets, key.max_runs_per_tensor, key.name_map),
                              lambda _key: layout_signature(sources, list(targets), max_runs_per_tensor=key.max_runs_per_tensor,
                                                            name_map=name_map))
        return _plans.get(sig, lambda _sig: build_plan(sources, list(targets), max_runs_per_tensor=key.max_runs_per_tensor,
                                                       name_map=name_map, _signature=sig))

    def buffers(self, plan, parity: int = 0, targets=None, where: int | None = None) -> tuple[ReceiveBuffers, object]:
        """Buffers for ``plan`` to pull into and their token for ``release_buffers`` or
        ``keep_installed``. ``parity``: the half of a swap double buffer the pull writes.
        ``targets`` (install ``"direct"``): per plan tensor, the tensor to pull straight into or
        None, and ``where`` a key for their addresses now (``TargetAddresses.current_key``): part
        of the cache key, so that a target whose memory was replaced gets new buffers instead of
        a pull into memory it no longer uses."""
        return self._buffers.acquire((plan.signature, parity, where), lambda _key: ReceiveBuffers(self.link, plan, targets))

    def preload_buffers(self, plan, parity: int) -> ReceiveBuffers | None:
        """The ``parity`` half of ``plan``'s swap double buffer, made now (pooling on) so that the
        next cycle allocates nothing; None with pooling off."""
        return self._buffers.preload((plan.signature, parity, None), lambda _key: ReceiveBuffers(self.link, plan, None))

    def buffer_nbytes(self) -> int:
        """Bytes of receive memory this state holds now (every buffer set it caches)."""
        return sum(bufs.region.nbytes for bufs in self._buffers.values())

    def release_buffers(self, token) -> None:
        """End a cycle's hold on its buffers (with pooling off, they go back to the arenas)."""
        self._buffers.release(token)

    def keep_installed(self, token) -> None:
        """Swap install: the targets now point into ``token``'s buffers; hold them (even with
        pooling off, or after their signature was replaced) and let the previous half go."""
        old, self._installed = self._installed, token
        if old is not None:
            self._buffers.release(old)

    def end_cycle(self) -> None:
        """The cycle lets go of the regions it opened: kept for the next (pooling on), or closed."""
        self.sources.end_cycle()

    def reset(self) -> bool:
        """Ready for the next owner (Note [Parked receive state]): it re-reads every manifest.
        Only a mode that parks hands its state on: a ``"direct"`` state's buffers are its owner's
        targets, a ``"swap"`` state's installed half is pointed at by them."""
        self.sources.unverify()
        return self._installed is None and MODES[self.key.install].parks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.keep_installed(None)
        self._buffers.clear()
        self._plan_of.clear()
        self.sources.close()
        self._link_lease.release()

    def __repr__(self) -> str:
        return f"ReceiveState(backend={self.key.backend!r}, device={self.key.device}, closed={self._closed})"


# One idle state per process: parking another destroys the older one.
_states: FreeList[StateKey, ReceiveState] = FreeList("receive_state", ReceiveState, ReceiveState.reset, ReceiveState.close,
                                                      max_idle_per_key=1, max_idle_total=1, counted=False)


def lease_state(key: StateKey, timeout_s: float) -> Lease[ReceiveState]:
    """The parked state for ``key``, or a new one. ``release()`` parks it (pooling on), ``discard()``
    destroys it. ``timeout_s``: the link's default transfer timeout for this owner, seconds."""
    lease = _states.lease(key)
    lease.resource.link.timeout_s = timeout_s
    return lease


def release_parked() -> None:
    """Release the parked receive state and publishers' parked version boards, if any, to the
    pools (tests; processes trimming memory)."""
    _states.clear()
    release_parked_boards()
