"""The inference side of refit: declare the layout you need; each cycle pulls only bytes.

First cycle: read manifests, build the plan, lease receive buffers, open peer mappings, prepare
the copy batch. Later cycles reuse all of it (cached by layout signature and manifest bytes) and
only sync versions, pull, translate and install. ``CycleReport`` shows each phase and what the
cycle created, so "cycle 2 creates nothing" is a number, not a promise. What a receiver holds
between cycles is its ``ReceiveState``, whose caches are the pool's (``refit._parked``); a closed
receiver's state waits for the next receiver with the same settings (Note [Parked receive
state]), so an engine re-created per test plans, allocates and registers nothing either.

``stream`` is the other way in, for engines that load through ``load_weights`` (quantized or
checkpoint-format loading): buckets of a version through a bounded buffer (``refit._stream``,
Note [Streaming receive]).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Mapping, NamedTuple

from warmlink import _env, pool
from warmlink._backoff import Backoff
from warmlink._closing import Closing
from warmlink._dtypes import dtype_name
from warmlink.errors import ConfigError, LayoutError, TransferTimeout, VersionError, WarmlinkError
from warmlink.refit import _parked, protocol, translate
from warmlink.refit._addresses import TargetAddresses
from warmlink.refit._board import CLOSED, PUBLISHED, STATE_NAMES, ReaderBoard
from warmlink.refit._cycle import Cycle, CycleReport, RefitHandle, created_counts
from warmlink.refit._declare import module_tensors
from warmlink.refit._stream import PartialLoadError, StreamReport, StreamState, groups_key
from warmlink.refit.dtensor import dtensor_layout, is_dtensor, local_tensor
from warmlink.refit.manifest import TensorLayout
from warmlink.transport import resolve_backend

__all__ = ["Receiver", "RefitHandle", "CycleReport", "StreamReport", "PartialLoadError"]

log = logging.getLogger("warmlink.refit")

# Note [Install modes]
# A version is installed only once every byte of it arrived, so that the engine holds the old
# version or the new one (DESIGN invariant 3). "copy" and "swap" pull into receive memory the
# engine never reads and install after the pull: generation may run during the pull
# (start_refit). Colocated engines (trainer and engine alternating on one GPU) have no memory for a
# second copy of the weights and generate nothing during a refit, so "direct" pulls straight into
# the targets: no receive memory, no install pass. The pull then *is* the install: the engine must
# not read the targets while a cycle is in flight, and a cycle that fails after its copies started
# leaves them holding a mix, which it says by raising PartialLoadError (installed_version becomes
# None until a cycle completes). On one host the copies read memory the publisher keeps mapped and
# does not write while this receiver reads (Note [Version protocol]), so a publisher dying
# mid-pull still leaves a complete version; what remains is a local failure. Tensors a pull cannot
# land in directly (a cast, a staged re-slice) still go through receive memory and a copy.


class _InstallWork(NamedTuple):
    bufs: object  # the ReceiveBuffers this was worked out for (kept: its id is the cache key)
    translate: list[int]
    named: list[tuple[str, object]]
    pairs: list[tuple[object, object]]


class Receiver(Closing):
    """One inference rank's view of the published weights.

    Args:
        store: the ``warmlink.rendezvous.Store`` the publishers use.
        num_publishers: how many publisher ranks there are (the trainer's TP size).
        device: where received tensors live: a CUDA index / ``torch.device``, or ``"cpu"``.
            Default: the device of the first ``target`` added, else CPU.
        backend: ``"auto"`` (default), ``"shm"`` or ``"cuda_ipc"``; must match the publishers'.
        install: how a version reaches the targets (Note [Install modes]): ``"copy"`` (default:
            pull into receive memory, then copy into the targets, whose addresses stay: safe with
            CUDA graphs and with generation running during the pull), ``"swap"`` (targets'
            ``.data`` point at double-buffered received memory: no install pass, memory for two
            copies of the weights) or ``"direct"`` (pull straight into the targets: no install
            pass and no receive memory; the engine must not read the targets while a cycle is in
            flight, and a cycle that fails after its copies started raises ``PartialLoadError``).
        max_runs_per_tensor: above this many copies for one tensor, pull whole shards and slice
            locally.
        name_map: destination logical name -> publisher logical name.
        timeout_s: default for waits and transfers, seconds (default ``WARMLINK_TIMEOUT_S``).

    Collective? No: each receiver refits on its own schedule.
    """

    def __init__(
        self,
        store,
        *,
        num_publishers: int,
        device=None,
        backend: str | None = None,
        install: str = "copy",
        max_runs_per_tensor: int = 64,
        name_map: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if num_publishers < 1:
            raise ConfigError(f"Receiver: num_publishers={num_publishers!r}; expected >= 1")
        if install not in translate.INSTALL_MODES:
            raise ConfigError(f"Receiver: install={install!r} is unknown; expected one of {list(translate.INSTALL_MODES)}")
        self.store = store
        self.num_publishers = num_publishers
        self.install = install
        self.max_runs_per_tensor = max_runs_per_tensor
        self.name_map = dict(name_map) if name_map else None
        self.timeout_s = timeout_s if timeout_s is not None else _env.default_timeout_s()
        self._device_arg = device
        self._backend_arg = backend
        self._layouts: dict[str, TensorLayout] = {}
        self._targets: dict[str, object] = {}
        self._state_lease = None
        self._state: _parked.ReceiveState | None = None
        self._link = None  # the state's link while a state is held
        self._cycle: Cycle | None = None  # the cycle in flight, between start_refit and its end
        self._stream_state: StreamState | None = None  # slots and buckets of the last stream
        self.cycle = 0
        # swap: the half of the double buffer the next pull writes; the other half is installed.
        # It flips only when an install succeeds, never with a failed cycle (see _finish).
        self._pull_parity = 1
        self.installed_version = 0
        self._last_named: list[tuple[str, object]] = []
        self._installs: dict[int, _InstallWork] = {}
        self._targets_of: tuple | None = None  # (plan, its targets in plan order, their addresses), install "direct"
        self._on_boards: list | None = None  # the boards this cycle entered (Note [Version board]); None: the store
        self._revoked: list | None = None  # per rank, its revocation count at entry (store sync only)
        self._healthy = False  # the last cycle installed: what this receiver holds may be parked
        self._finalizing = False
        self._closed = False

    # -- declaration -------------------------------------------------------------------------
    def add(self, name: str, layout: TensorLayout, target=None) -> None:
        """Declare a tensor this rank needs, and optionally the tensor to install it into.

        Raises:
            LayoutError: ``layout`` is not a TensorLayout (``Publisher.add`` takes the tensor
                second; here it is third), names another tensor, or ``target`` does not fit it.
        """
        if not isinstance(layout, TensorLayout):
            raise LayoutError(f"Receiver.add: name={name!r}: layout is a {type(layout).__name__}; expected a TensorLayout "
                              "(the order is add(name, layout, target), where Publisher.add takes (name, tensor, layout))")
        if name != layout.name:
            raise LayoutError(f"Receiver.add: name={name!r} but layout.name={layout.name!r}")
        if name in self._layouts:
            raise LayoutError(f"Receiver.add: name={name!r} declared twice")
        if target is not None:
            if tuple(target.shape) != layout.local_shape:
                raise LayoutError(f"Receiver.add: target {name!r} shape={tuple(target.shape)}; expected {layout.local_shape}")
            if dtype_name(target.dtype) != layout.dtype:
                raise LayoutError(f"Receiver.add: target {name!r} dtype={dtype_name(target.dtype)!r}; expected {layout.dtype!r}")
            self._targets[name] = target
        self._layouts[name] = layout

    def add_module(self, module, layouts: Mapping[str, TensorLayout] | None = None) -> None:
        """Declare tensors of ``module`` (parameters and persistent buffers) as install targets.

        Args:
            module: the engine's ``torch.nn.Module``.
            layouts: physical name -> layout, each naming a module tensor of its local shape (a
                vLLM-layout rank: ``warmlink.refit.families.layouts``). Default: every tensor,
                DTensors with layouts read from their placements, others whole.

        Raises:
            LayoutError: a layout naming no module tensor, or one of another shape or dtype.
        """
        tensors = module_tensors(module)
        if layouts is None:
            layouts = {name: dtensor_layout(name, t) if is_dtensor(t) else
                       TensorLayout.plain(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}
        for name, layout in layouts.items():
            if name not in tensors:
                raise LayoutError(f"Receiver.add_module: layout {name!r} names no parameter or buffer of {type(module).__name__}")
            t = tensors[name]
            if is_dtensor(t) and self.install == "swap":
                raise ConfigError(f"Receiver.add_module: {name!r} is a DTensor; install='swap' cannot re-point its local "
                                  "shard; expected install='copy' or 'direct'")
            self.add(name, layout, t if self.install == "swap" else local_tensor(t))

    def _resolve_device(self) -> int:
        import torch

        dev = self._device_arg
        if dev is None:
            first = next(iter(self._targets.values()), None)
            dev = first.device if first is not None else "cpu"
        dev = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
        return -1 if dev.type == "cpu" else (dev.index if dev.index is not None else torch.cuda.current_device())

    # -- a cycle -----------------------------------------------------------------------------
    def refit(self, *, version: int | None = None, timeout_s: float | None = None, load_weights: Callable | None = None) -> CycleReport:
        """Pull ``version`` (default: the newest all publishers agree on), translate and install.

        Returns:
            The cycle's ``CycleReport``. Targets hold the new version on return.

        Raises:
            PeerLostError / TransferTimeout: a publisher died or stalled; targets keep the old version.
            LayoutError: the publishers' layouts cannot produce what was declared.

        Blocking? Yes. Warm path? After the first cycle: no allocation, registration, plan or open.
        """
        return self.start_refit(version=version, timeout_s=timeout_s).wait(load_weights=load_weights)

    def start_refit(self, *, version: int | None = None, timeout_s: float | None = None) -> RefitHandle:
        """Start a cycle and return once the copy engines own the transfer.

        Generation may continue while bytes move; call ``handle.wait()`` (or the handle) to
        translate and install. The publisher cannot begin an update until the pull finishes.
        """
        self._check_idle("start_refit")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        self.cycle += 1
        before = created_counts()
        report = CycleReport(self.cycle, 0)
        t0 = time.perf_counter()
        if self._state is None:
            # Once per receiver: the backend's imports, its stream and events (reported apart),
            # or the warm state of a closed receiver with the same settings.
            self._connect()
            report.connect_s = time.perf_counter() - t0
        self._healthy = False
        state = self._state

        versions = self._enter(version, timeout)
        token = None
        try:
            t1 = time.perf_counter()
            report.sync_s = t1 - t0 - report.connect_s
            report.version = versions

            plan = state.plan(self._layouts)
            t2 = time.perf_counter()
            report.plan_s = t2 - t1

            targets, where = self._direct_targets(plan) if self.install == "direct" else (None, None)
            bufs, token, twin = state.buffers(plan, self._pull_parity if self.install == "swap" else 0, targets, where)
            t3 = time.perf_counter()
            report.alloc_s = t3 - t2

            batch = bufs.batch(plan, state.sources)
            if twin is not None:
                twin.batch(plan, state.sources)  # prepared now so that the next cycle prepares nothing
            t4 = time.perf_counter()
            report.register_s = t4 - t3

            transfer = state.link.read(batch)  # pull counts from here: some transports copy while posting
            report.nbytes, report.num_copies = batch.nbytes, batch.num_copies
        except BaseException:
            self._end_failed(versions, token)
            raise
        self._cycle = Cycle(plan, bufs, token, transfer, report, before, t0, t4, timeout)
        return RefitHandle(self, self._cycle)

    def stream(self, load_weights: Callable, *, buffer_bytes: int, groups=None, version: int | None = None,
               timeout_s: float | None = None) -> StreamReport:
        """Hand a version to ``load_weights`` bucket by bucket as it lands, through a bounded buffer.

        For engines that cannot take bytes in place (quantized or checkpoint-format loading,
        layerwise reload). Declared layouts say what this rank pulls: a layout whose physical shape
        is the logical tensor's global shape with only the boxes its loader keeps as parts pulls
        only those rows and hands a full-shape tensor (zeros elsewhere) that the loader narrows.
        See Note [Streaming receive] in ``refit._stream``.

        Args:
            load_weights: called once per bucket with an iterator of ``(name, tensor)``; tensors are
                views of receiver memory, valid until that call returns (the loader copies them).
            buffer_bytes: receive memory for the stream, bytes: two slots of ``buffer_bytes // 2``;
                each bucket (receive, staging and cast space) fits one slot.
            groups: sequences of declared names that must reach one call together (every tensor
                of one engine module); others may be handed in any bucket.
            version: the version to stream (default: the newest all publishers agree on).
            timeout_s: for version agreement and each bucket's pull, seconds.

        Returns:
            A ``StreamReport``: buckets, peak receive memory, bytes pulled and handed, and when
            each bucket was issued, arrived and handed over.

        Raises:
            ConfigError: ``buffer_bytes`` too small for a group (before any byte moves).
            PeerLostError / TransferTimeout: before the first ``load_weights`` call: the engine
                is untouched.
            PartialLoadError: a failure after ``load_weights`` took part of the version (the
                cause chained): the engine holds a mix until a complete version is loaded.

        Blocking? Yes. Warm path? After the first stream of a plan and buffer size: slots, views and
        copy batches are reused; nothing is allocated, registered or planned.
        """
        self._check_idle("stream")
        if not callable(load_weights):
            raise ConfigError(f"Receiver.stream: load_weights={load_weights!r} is not callable; expected the engine's loader")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        self.cycle += 1
        before = created_counts()
        report = StreamReport(self.cycle, 0, buffer_bytes, num_tensors=len(self._layouts))
        t0 = time.perf_counter()
        if self._state is None:
            self._connect()
        self._healthy = False
        versions = self._enter(version, timeout)
        try:
            t1 = time.perf_counter()
            report.sync_s, report.version = t1 - t0, versions
            plan = self._state.plan(self._layouts)
            t2 = time.perf_counter()
            report.plan_s = t2 - t1
            ss = self._stream_state
            if ss is None or ss.key != (plan.signature, buffer_bytes, groups_key(groups)):
                self._close_stream()
                ss = self._stream_state = StreamState(self._link, plan, buffer_bytes, groups)
            report.alloc_s = time.perf_counter() - t2
            ss.run(plan, self._state.sources, load_weights, report, timeout, t0)
            try:
                self._check_held(versions)
            except VersionError as exc:  # load_weights took every bucket already: it cannot be undone there
                raise PartialLoadError(f"Receiver.stream: {exc}", version=versions, bucket_idx=report.num_buckets - 1,
                                       num_buckets=report.num_buckets, handed=list(self._layouts)) from exc
        finally:
            if not pool.enabled():
                self._close_stream()  # with pooling off, a stream's memory lives one stream
            try:
                self._state.end_cycle()
            finally:
                self._leave(versions)
        self.installed_version = versions
        self._healthy = True
        report.total_s = time.perf_counter() - t0
        report.created = {k: v - before[k] for k, v in created_counts().items()}
        return report

    def _close_stream(self) -> None:
        ss, self._stream_state = self._stream_state, None
        if ss is not None:
            ss.close()

    def _check_idle(self, func: str) -> None:
        if self._closed:
            raise VersionError(f"Receiver.{func}: receiver is closed")
        if self._cycle is not None:
            raise VersionError(f"Receiver.{func}: a cycle is already in flight; wait() for it first")
        if not self._layouts:
            raise LayoutError(f"Receiver.{func}: nothing declared; call add() first")

    def _connect(self) -> None:
        device = self._resolve_device()
        key = _parked.StateKey(self.store, self.num_publishers, device, resolve_backend(self._backend_arg, device),
                               self.install, self.max_runs_per_tensor,
                               tuple(sorted(self.name_map.items())) if self.name_map else None, tuple(self._layouts.items()))
        self._state_lease = _parked.lease_state(key, self.timeout_s)
        self._state = self._state_lease.resource
        self._link = self._state.link

    def _enter(self, version: int | None, timeout_s: float) -> int:
        """Count in as a reader of every rank's current version (Note [Version protocol]), every
        store call within ``timeout_s`` of starting (a stalled store ends it, Note [Store deadlines])."""
        deadline = getattr(self.store, "deadline", None)
        if deadline is None:  # a store without deadlines (a test double): the calls' own limits hold
            return self._enter_within(version, timeout_s)
        with deadline(timeout_s):
            return self._enter_within(version, timeout_s)

    def _enter_within(self, version: int | None, timeout_s: float) -> int:
        # Publishers on this host whose manifests are read: their boards, no store round trip.
        boards = self._state.sources.boards()
        if boards is not None:
            entered = self._enter_boards(*boards, version, timeout_s)
            if entered is not None:
                return entered
        # Guess the states instead of reading them first, which saves a round trip per publisher:
        # a new receiver tries the states this process last read (an engine re-created per test:
        # nothing changed since), a receiver told which version to pull tries that version of the
        # generations it last read (the next step of an RL loop). Entering re-reads each state, so
        # a stale guess only costs a leave. See Note [Warm metadata] in refit._memo.
        guess = _parked.guessed_states(self.store, self.num_publishers) if self.cycle == 1 or version is not None else None
        if guess is not None:
            if version is not None:
                guess = [protocol.VersionState(version, "published", g.generation) for g in guess]
            entered = self._try_enter(guess, version)
            if entered is not None:
                return entered
        backoff = Backoff(timeout_s)
        while True:
            states = self._state.sources.states(timeout_s)
            entered = self._try_enter(states, version)
            if entered is not None:
                return entered
            if backoff.expired():
                raise TransferTimeout(
                    f"Receiver.refit: publishers did not agree on a published version within {timeout_s:.3f} s; "
                    f"states={[(s.version, s.state) for s in states]}"
                )
            backoff.sleep()

    def _enter_boards(self, boards: list, generations: list, version: int | None, timeout_s: float) -> int | None:
        """Enter every publisher's current version through its board (Note [Version board] in
        refit._board); None when one moved on (closed, restarted or died): the store says more."""
        backoff = Backoff(timeout_s)
        while True:
            entered, versions, moved = [], set(), False
            for board, generation in zip(boards, generations):
                ok, ver, state = board.enter(generation, version)
                if not ok:
                    moved = state == CLOSED
                    if state == PUBLISHED and version is not None and ver > version:
                        for b in entered:
                            b.leave()
                        raise VersionError(f"Receiver.refit: version={version} was replaced by {ver}; ask for {ver} or None")
                    break
                entered.append(board)
                versions.add(ver)
            else:
                if len(versions) == 1:  # else some ranks published the next version already: wait for the rest
                    self._on_boards, self._revoked = entered, None
                    return versions.pop()
            for b in entered:
                b.leave()
            if moved:
                return None
            if backoff.expired():
                raise TransferTimeout(
                    f"Receiver.refit: publishers did not agree on a published version within {timeout_s:.3f} s; "
                    f"states={[(v, STATE_NAMES.get(st, st)) for _, _, v, st in map(ReaderBoard.read, boards)]} (their boards)")
            backoff.sleep()

    def _try_enter(self, states: list, version: int | None) -> int | None:
        """The version entered on every rank, or None (counted out again) when not ready yet."""
        versions = {s.version for s in states}
        if len(versions) != 1 or any(s.state != "published" for s in states):
            return None
        (current,) = versions
        if version is not None and current > version:
            raise VersionError(f"Receiver.refit: version={version} was replaced by {current}; ask for {current} or None")
        if version is not None and current != version:
            return None
        entered, revoked = [], []
        try:
            for rank, s in enumerate(states):
                r = protocol.enter(self.store, rank, s)
                if r is None:
                    break
                entered.append(rank)
                revoked.append(r)
            else:
                self._revoked = revoked  # checked before anything is installed: Note [Reader leases]
                # A bad manifest fails this refit, not the publishers' next update: the except
                # below leaves every version entered, so no reader count stays behind.
                self._state.sources.refresh(states)
                return current
        except BaseException:
            for rank in entered:
                protocol.leave(self.store, rank, current)
            raise
        for rank in entered:
            protocol.leave(self.store, rank, current)
        return None

    def _check_held(self, version: int) -> None:
        """Raise unless every publisher still counts this receiver in: one that took it for dead
        (no heartbeat, Note [Reader leases]) may have written the tensors while the bytes moved."""
        revoked, self._revoked = self._revoked, None
        if revoked is None:
            return
        deadline = getattr(self.store, "deadline", None)
        with deadline(self.timeout_s) if deadline is not None else contextlib.nullcontext():
            for rank, r in enumerate(revoked):
                if not protocol.still_held(self.store, rank, r):
                    raise VersionError(
                        f"Receiver.refit: publisher/{rank} revoked this receiver's read of version {version} (no "
                        f"heartbeat for {protocol.LEASE_S:.1f} s: a stalled process?) and may have written since; "
                        "nothing from this pull is installed")

    def _leave(self, version: int) -> None:
        """Count out of ``version`` on every rank, within this receiver's timeout: a stalled store
        raises instead of holding the cycle (the counts are then the publisher's to reap)."""
        boards, self._on_boards = self._on_boards, None
        if boards is not None:
            for board in boards:
                board.leave()
            return
        deadline = getattr(self.store, "deadline", None)
        with deadline(self.timeout_s) if deadline is not None else contextlib.nullcontext():
            for rank in range(self.num_publishers):
                protocol.leave(self.store, rank, version)

    def _finish(self, cycle: Cycle, load_weights: Callable | None) -> CycleReport:
        """Wait for ``cycle``'s bytes, leave its versions, translate and install (``RefitHandle.wait``)."""
        if cycle is not self._cycle:
            raise VersionError(f"RefitHandle.wait: cycle {cycle.report.cycle} ended when its receiver was closed; "
                               f"targets keep version {self.installed_version}")
        # From here the cycle ends however wait() ends: a failure (a lost store while leaving
        # too) never leaves the receiver "in flight", refusing every later refit.
        self._cycle = None
        state, rep, bufs = self._state, cycle.report, cycle.bufs
        try:
            try:
                cycle.transfer.wait(cycle.timeout_s)
                self._check_held(rep.version)
            finally:
                self._leave(rep.version)
            t_pulled = time.perf_counter()
            rep.pull_s = t_pulled - cycle.t_issue

            work = self._install_work(cycle.plan, bufs)
            for i in work.translate:
                tp = cycle.plan.tensors[i]
                if tp.staged:
                    translate.unstage(tp, bufs.recv[i], bufs.scratch[i])
                if tp.needs_cast:
                    bufs.final[i].copy_(bufs.recv[i])
            if work.translate:
                _sync(state.link.device)
            t_translated = time.perf_counter()
            rep.translate_s = t_translated - t_pulled

            named = work.named
            if load_weights is not None:
                translate.call_load_weights(load_weights, named)
            pairs = work.pairs
            if pairs:
                (translate.install_swap if self.install == "swap" else translate.install_copy)(pairs)
                _sync(state.link.device)
            rep.install_s = time.perf_counter() - t_translated
        except BaseException as exc:
            state.release_buffers(cycle.token)
            state.end_cycle()
            direct = [tp.dst for tp, d in zip(cycle.plan.tensors, bufs.direct) if d is not None]
            if direct:  # See Note [Install modes]: the pull was the install
                self.installed_version = None
                raise PartialLoadError(
                    f"Receiver.refit: version {rep.version} failed after its copies into {len(direct)} target(s) started "
                    f"(install='direct'); they hold a mix of versions until a refit completes ({exc})",
                    version=rep.version, bucket_idx=0, num_buckets=1, handed=direct) from exc
            raise
        if self.install == "swap":
            state.keep_installed(cycle.token)
            self._pull_parity = 1 - self._pull_parity  # targets now point at what was just pulled
        else:
            state.release_buffers(cycle.token)
        state.end_cycle()
        self._last_named = named
        self.installed_version = rep.version
        self._healthy = True
        rep.total_s = time.perf_counter() - cycle.t0
        rep.created = cycle.created()
        return rep

    def _direct_targets(self, plan) -> tuple[list, int]:
        """Per tensor of ``plan`` its target, in plan order (found once per plan), and a key for
        where the targets' memory is now (asked every cycle: a target whose ``.data`` was replaced
        must never be pulled into at its old address). Install "direct"."""
        cached = self._targets_of
        if cached is None or cached[0] is not plan:
            targets = [self._targets.get(tp.dst) for tp in plan.tensors]
            cached = self._targets_of = (plan, targets, TargetAddresses([t for t in targets if t is not None]))
        return cached[1], cached[2].current_key()

    def _install_work(self, plan, bufs) -> "_InstallWork":
        """What ``_finish`` does after the pull into ``bufs``, worked out once per buffer set (a
        warm cycle walks no list of every tensor): tensors to translate, ``(name, tensor)``
        installed, and ``(target, tensor)`` install pairs (none for a tensor pulled straight into
        its target, install "direct")."""
        work = self._installs.get(id(bufs))
        if work is None or work.bufs is not bufs:
            named = [(tp.dst, bufs.final[i]) for i, tp in enumerate(plan.tensors)]
            work = _InstallWork(
                bufs, [i for i, tp in enumerate(plan.tensors) if tp.staged or tp.needs_cast], named,
                [(self._targets[name], t) for (name, t), d in zip(named, bufs.direct) if name in self._targets and d is None])
            if len(self._installs) >= 2:  # one set of buffers, or the two halves of a swap double buffer
                self._installs.clear()
            self._installs[id(bufs)] = work
        return work

    def _end_failed(self, version: int, token) -> None:
        """End a cycle that installs nothing: its buffers and this cycle's mappings go back first,
        then its versions are left (a lost store raises there, with nothing else held)."""
        try:
            if token is not None:
                self._state.release_buffers(token)
            self._state.end_cycle()
        finally:
            self._leave(version)

    def _abandon(self, cycle: Cycle) -> None:
        """End ``cycle`` for ``close()``: its bytes stop moving (bounded wait) before its buffers
        go back, then its versions are left. Errors are logged: close() gives everything back."""
        try:
            try:
                cycle.transfer.wait(cycle.timeout_s)
            finally:
                self._end_failed(cycle.report.version, cycle.token)
        except WarmlinkError as exc:
            log.warning("receiver closed mid-cycle; the cycle failed", extra={"version": cycle.report.version, "error": str(exc)})

    def __del__(self) -> None:
        self._finalizing = True  # GC may run anywhere, even inside the state pool: a collected receiver parks nothing
        super().__del__()

    @property
    def receive_nbytes(self) -> int:
        """Memory this receiver holds beyond its targets, in bytes: receive buffers (both halves
        of a swap double buffer), staging scratch and a stream's slots. Zero before the first
        cycle; with ``install="direct"`` only what cannot land in a target directly."""
        held = self._state.buffer_nbytes() if self._state is not None else 0
        return held + (self._stream_state.nbytes if self._stream_state is not None else 0)

    def tensors(self) -> dict[str, object]:
        """The last installed tensors by name (views of receiver memory, valid until the next cycle)."""
        return dict(self._last_named)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Return buffers, mappings and the link to the pool, or park them for the next receiver
        with the same settings (Note [Parked receive state]). A cycle still in flight fails: its
        versions are left and its handle's ``wait`` raises VersionError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._state is None:
            return
        cycle, self._cycle = self._cycle, None
        try:
            if cycle is not None:
                self._abandon(cycle)
        finally:
            self._close_stream()
            lease, state = self._state_lease, self._state
            self._state_lease = self._state = self._link = None
            # _healthy is False from a cycle's start until it installs; a declaration added after
            # the state was leased would park it under a key that no longer names it.
            if self._healthy and not self._finalizing and self.install == "copy" and state.key.layouts == tuple(self._layouts.items()):
                lease.release()  # parked: see Note [Parked receive state]
            else:
                lease.discard()


def _sync(device: int) -> None:
    if device >= 0:
        import torch

        torch.cuda.current_stream(device).synchronize()
