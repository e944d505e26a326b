"""The inference side of refit: declare the layout you need; each cycle pulls only bytes.

First cycle: read manifests, build the plan, lease receive buffers, open peer mappings, prepare
the copy batch. Later cycles reuse all of it (cached by layout signature and manifest bytes) and
only sync versions, pull, translate and install. ``CycleReport`` shows each phase and what the
cycle created, so "cycle 2 creates nothing" is a number, not a promise. What a receiver holds
between cycles is its ``ReceiveState``, whose caches are the pool's (``refit._parked``); a closed
receiver's state waits for the next receiver with the same settings (Note [Parked receive
state]), so an engine re-created per test plans, allocates and registers nothing either.

Two seams are objects of their own: a cycle's version sync (through the publishers' boards or
the store, chosen at entry: ``refit._version_sync``) and the install mode (``copy``, ``swap``,
``direct``: a strategy chosen once per receiver, ``refit._install``). With ``fanout=`` a third,
the receiver's ``Relay`` (``refit._relay``, Note [Fan-out]), fills the receive buffers from
another replica or the publishers and serves them to the replicas after it.

``stream`` is the other way in, for engines that load through ``load_weights`` (quantized or
checkpoint-format loading): buckets of a version through a bounded buffer (``refit._stream``,
Note [Streaming receive]).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, NamedTuple

from warmlink import _env
from warmlink._backoff import Backoff
from warmlink._closing import Closing
from warmlink._dtypes import dtype_name
from warmlink.errors import ConfigError, LayoutError, TransferTimeout, VersionError, WarmlinkError
from warmlink.pool.core import SharedCache
from warmlink.refit import _parked, _version_sync, translate
from warmlink.refit._cycle import Cycle, CycleReport, RefitHandle, created_counts
from warmlink.refit._declare import module_tensors
from warmlink.refit._install import install_mode
from warmlink.refit._relay import Relay
from warmlink.refit._stream import PartialLoadError, StreamReport, StreamState, bucket_plan, groups_key
from warmlink.refit.dtensor import dtensor_layout, is_dtensor
from warmlink.refit.fanout import FanOut
from warmlink.refit.manifest import TensorLayout
from warmlink.transport import resolve_backend

__all__ = ["Receiver", "RefitHandle", "CycleReport", "StreamReport", "PartialLoadError"]

log = logging.getLogger("warmlink.refit")


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
        install: how a version reaches the targets (Note [Install modes] in ``refit._install``):
            ``"copy"`` (default: pull into receive memory, then copy into the targets, whose
            addresses stay: safe with CUDA graphs and with generation running during the pull),
            ``"swap"`` (targets' ``.data`` point at double-buffered received memory: no install
            pass, memory for two copies of the weights) or ``"direct"`` (pull straight into the
            targets: no install pass and no receive memory; the engine must not read the targets
            while a cycle is in flight, and a cycle that fails after its copies started raises
            ``PartialLoadError``).
        max_runs_per_tensor: above this many copies for one tensor, pull whole shards and slice
            locally.
        name_map: destination logical name -> publisher logical name.
        timeout_s: default for waits and transfers, seconds (default ``WARMLINK_TIMEOUT_S``).
        fanout: a ``FanOut`` naming this receiver's group of engine replicas (every replica of one
            engine gives the same group, and its rank within the engine): it then pulls each
            version from another replica where one holds it, and serves it to the replicas after
            it, so the publishers send each byte about once (Note [Fan-out] in
            ``refit._relay``). ``CycleReport.pulled_from`` says where the bytes came from. Needs
            ``install="copy"`` or ``"swap"``; ``stream`` is refused.

    Raises:
        ConfigError: an unknown install mode, ``num_publishers < 1``, or ``fanout`` that is not a
            ``FanOut`` or comes with ``install="direct"``.

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
        fanout: FanOut | None = None,
    ) -> None:
        _env.count_arg("Receiver", "num_publishers", num_publishers, 1)
        _env.count_arg("Receiver", "max_runs_per_tensor", max_runs_per_tensor, 1)
        self._install_mode = install_mode(install)  # every install-mode decision is this strategy's
        if fanout is not None and not isinstance(fanout, FanOut):
            raise ConfigError(f"Receiver: fanout={fanout!r}; expected a warmlink.refit.FanOut or None")
        if fanout is not None and install not in ("copy", "swap"):
            raise ConfigError(f"Receiver: fanout with install={install!r}; expected install='copy' or 'swap' (a relay "
                              "serves receive memory as pulled, which 'direct' does not keep: Note [Fan-out])")
        self.store = store
        self.num_publishers = num_publishers
        self.install = install
        self.max_runs_per_tensor = max_runs_per_tensor
        self.name_map = dict(name_map) if name_map else None
        self.timeout_s = _env.timeout_arg("Receiver", timeout_s)
        self._relay = Relay(fanout, store, self.timeout_s) if fanout is not None else None
        self._device_arg = device
        self._backend_arg = backend
        self._layouts: dict[str, TensorLayout] = {}
        self._targets: dict[str, object] = {}
        self._state_lease = None
        self._state: _parked.ReceiveState | None = None
        self._link = None  # the state's link while a state is held
        self._cycle: Cycle | None = None  # the cycle in flight, between start_refit and its end
        # The last stream's slots and buckets, by (plan signature, buffer bytes, groups): a pool
        # cache, so with pooling off a stream's memory lives one stream.
        self._streams = SharedCache("receive_stream", destroy=StreamState.close, counted=False, max_entries=1)
        self.cycle = 0
        self.installed_version = 0
        self._last_named: list[tuple[str, object]] = []
        self._installs: dict[int, _InstallWork] = {}
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
            self.add(name, layout, self._install_mode.target(name, tensors[name]))

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

        sync = self._enter(version, timeout)
        token = None
        try:
            t1 = time.perf_counter()
            report.sync_s = t1 - t0 - report.connect_s
            report.version = sync.version

            plan = state.plan(self._layouts)
            t2 = time.perf_counter()
            report.plan_s = t2 - t1

            bufs, token, twin = self._install_mode.buffers(state, plan, self._targets)
            t3 = time.perf_counter()
            report.alloc_s = t3 - t2

            if self._relay is not None:  # Note [Fan-out]: from a replica or the publishers, in chunks
                transfer = self._relay.pull(state, plan, bufs, sync.version, timeout, twin)
                t4 = time.perf_counter()
                report.register_s, report.replica = t4 - t3, self._relay.member
            else:
                batch = bufs.batch(plan, state.sources)
                if twin is not None:
                    twin.batch(plan, state.sources)  # prepared now so that the next cycle prepares nothing
                t4 = time.perf_counter()
                report.register_s = t4 - t3

                transfer = state.link.read(batch)  # pull counts from here: some transports copy while posting
                report.nbytes, report.num_copies = batch.nbytes, batch.num_copies
                report.pulled_from = {"publishers": batch.nbytes}
        except BaseException:
            self._end_failed(sync, token)
            raise
        self._cycle = Cycle(plan, bufs, token, sync, transfer, report, before, t0, t4, timeout)
        return RefitHandle(self, self._cycle)

    def prepare(self, *, timeout_s: float | None = None, generations=None, stream_buffer_bytes: int | None = None,
                groups=None):
        """Do the first cycle's setup now: connect, read every publisher's manifest and plan.

        An engine calls it when it starts, so that what it declared and what the publishers
        export are checked before any update (and the first cycle plans nothing). No version is
        entered: publishers are not held back.

        Args:
            timeout_s: how long to wait for every publisher's manifest, seconds.
            generations: per publisher rank, the generation to plan against (a trainer's
                ``Publisher.generation`` after ``export``): a manifest an earlier job left under
                the same prefix is waited past, not planned against. None: the current ones.
            stream_buffer_bytes, groups: for a receiver that will ``stream``: its ``buffer_bytes``
                and ``groups``, checked now (each group's bucket must fit half the buffer).

        Returns:
            The ``Plan`` (``refit.plan``) the next cycle will use while the manifests stay.

        Raises:
            LayoutError: the publishers' layouts cannot produce what was declared (names the tensor).
            TransferTimeout: a publisher (of ``generations``) had not exported within ``timeout_s``.
            ConfigError: ``stream_buffer_bytes`` too small for a group (names it and the size to ask for).
        """
        self._check_idle("prepare")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        if generations is not None and (len(generations) != self.num_publishers
                                        or any(isinstance(g, bool) or not isinstance(g, int) for g in generations)):
            raise ConfigError(f"Receiver.prepare: generations={generations!r}; expected {self.num_publishers} ints, one "
                              "per publisher rank")
        if self._state is None:
            self._connect()
        backoff = Backoff(timeout)
        while True:
            states = self._state.sources.states(timeout)
            if generations is None or [s.generation for s in states] == list(generations):
                break
            if backoff.expired():
                raise TransferTimeout(f"Receiver.prepare: publishers are at generations {[s.generation for s in states]} "
                                      f"after {timeout:.3g} s; expected {list(generations)} (the trainer's current ones)")
            backoff.sleep()
        self._state.sources.refresh(states)
        plan = self._state.plan(self._layouts)
        if stream_buffer_bytes is not None:
            bucket_plan(plan, stream_buffer_bytes // 2, groups)
        return plan

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
        if self._relay is not None:
            raise ConfigError("Receiver.stream: this receiver has fanout; a relay serves receive memory a stream does not "
                              "keep (Note [Fan-out]); expected refit() or a receiver without fanout")
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
        sync = self._enter(version, timeout)
        stream_token = None
        try:
            t1 = time.perf_counter()
            report.sync_s, report.version = t1 - t0, sync.version
            plan = self._state.plan(self._layouts)
            t2 = time.perf_counter()
            report.plan_s = t2 - t1
            key = (plan.signature, buffer_bytes, groups_key(groups))
            self._streams.evict(lambda k: k != key)  # another stream's memory goes back before this one's is taken
            ss, stream_token = self._streams.acquire(key, lambda _key: StreamState(self._link, plan, buffer_bytes, groups))
            report.alloc_s = time.perf_counter() - t2
            ss.run(plan, self._state.sources, load_weights, report, timeout, t0)
            try:
                sync.check_held(self.timeout_s)
            except VersionError as exc:  # load_weights took every bucket already: it cannot be undone there
                raise PartialLoadError(f"Receiver.stream: {exc}", version=sync.version, bucket_idx=report.num_buckets - 1,
                                       num_buckets=report.num_buckets, handed=list(self._layouts)) from exc
        finally:
            if stream_token is not None:
                self._streams.release(stream_token)  # with pooling off, a stream's memory lives one stream
            try:
                self._state.end_cycle()
            finally:
                sync.leave(self.timeout_s)
        self.installed_version = sync.version
        self._healthy = True
        report.total_s = time.perf_counter() - t0
        report.created = {k: v - before[k] for k, v in created_counts().items()}
        return report

    def _close_stream(self) -> None:
        self._streams.clear()

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

    def _enter(self, version: int | None, timeout_s: float) -> _version_sync.VersionSync:
        """Count in as a reader of every rank's current version (Note [Version protocol]), through
        the publishers' boards or the store (``refit._version_sync`` chooses), every store call within
        ``timeout_s`` of starting. A new receiver's first cycle, or one told which version to pull,
        guesses the states first (Note [Warm metadata] in refit._memo)."""
        return _version_sync.enter(self._state.sources, version, timeout_s, guess=self.cycle == 1 or version is not None)

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
                cycle.sync.check_held(self.timeout_s)
            finally:
                cycle.sync.leave(self.timeout_s)
            if self._relay is not None:
                self._relay.verified()
                rep.pulled_from, rep.num_copies = cycle.transfer.pulled_from, cycle.transfer.num_copies
                rep.nbytes = sum(rep.pulled_from.values())
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
                self._install_mode.install(pairs)
                _sync(state.link.device)
            rep.install_s = time.perf_counter() - t_translated
        except BaseException as exc:
            if self._relay is not None:
                self._relay.failed()  # before its buffers may go back: Note [Fan-out]
            state.release_buffers(cycle.token)
            state.end_cycle()
            partial = self._install_mode.failure(cycle.plan, bufs, rep.version, exc)
            if partial is not None:  # See Note [Install modes]: the pull was the install
                self.installed_version = None
                raise partial from exc
            raise
        if self._relay is not None and not self._install_mode.double_buffered:
            self._relay.keep(state, cycle.token)  # served until the next cycle: Note [Fan-out]
        else:  # swap holds the installed half until the next install, after the next pull moved off it
            self._install_mode.installed(state, cycle.token)
        state.end_cycle()
        self._last_named = named
        self.installed_version = rep.version
        self._healthy = True
        rep.total_s = time.perf_counter() - cycle.t0
        rep.created = cycle.created()
        return rep

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

    def _end_failed(self, sync: _version_sync.VersionSync, token) -> None:
        """End a cycle that installs nothing: its buffers and this cycle's mappings go back first,
        then its versions are left (a lost store raises there, with nothing else held)."""
        try:
            if self._relay is not None:
                self._relay.failed()
            if token is not None:
                self._state.release_buffers(token)
            self._state.end_cycle()
        finally:
            sync.leave(self.timeout_s)

    def _abandon(self, cycle: Cycle) -> None:
        """End ``cycle`` for ``close()``: its bytes stop moving (bounded wait) before its buffers
        go back, then its versions are left. Errors are logged: close() gives everything back."""
        try:
            try:
                cycle.transfer.wait(cycle.timeout_s)
            finally:
                self._end_failed(cycle.sync, cycle.token)
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
        return held + sum(ss.nbytes for ss in self._streams.values())

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
            if self._relay is not None:
                self._relay.close()  # says "closed" before its buffers may go back: Note [Fan-out]
            self._close_stream()
            lease, state = self._state_lease, self._state
            self._state_lease = self._state = self._link = None
            # _healthy is False from a cycle's start until it installs; a declaration added after
            # the state was leased would park it under a key that no longer names it.
            if (self._healthy and not self._finalizing and self._install_mode.parks
                    and state.key.layouts == tuple(self._layouts.items())):
                lease.release()  # parked: see Note [Parked receive state]
            else:
                lease.discard()


def _sync(device: int) -> None:
    if device >= 0:
        import torch

        torch.cuda.current_stream(device).synchronize()
