"""The inference side of refit: declare the layout you need; each cycle pulls only bytes.

First cycle: read manifests, build the plan, lease receive buffers, open peer mappings, prepare
the copy batch. Later cycles reuse all of it (cached by layout signature and manifest bytes) and
only sync versions, pull, translate and install. ``CycleReport`` shows each phase and what the
cycle created, so "cycle 2 creates nothing" is a number, not a promise. A closed receiver's warm
state waits for the next receiver with the same settings (Note [Parked receive state] in
``refit._parked``), so an engine re-created per test plans, allocates and registers nothing either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

from warmlink import _env, pool
from warmlink._backoff import Backoff
from warmlink._closing import Closing
from warmlink._dtypes import dtype_name, torch_dtype
from warmlink.errors import ConfigError, LayoutError, TransferTimeout, VersionError
from warmlink.pool.core import counters
from warmlink.refit import _parked, protocol, translate
from warmlink.refit._declare import module_tensors
from warmlink.refit._memo import Lru
from warmlink.refit.dtensor import dtensor_layout, is_dtensor, local_tensor
from warmlink.refit.manifest import TensorLayout
from warmlink.refit.plan import build_plan, layout_signature
from warmlink.refit.sources import SourceSet
from warmlink.transport import lease_link, resolve_backend
from warmlink.transport.base import Copy

__all__ = ["Receiver", "RefitHandle", "CycleReport"]

log = logging.getLogger("warmlink.refit")

_ALIGN = 256
_COUNTED = ("arena", "registration", "peer_mapping", "plan")


@dataclass
class CycleReport:
    """Phase timings of one refit cycle, in seconds, and what it created."""

    cycle: int
    version: int
    connect_s: float = 0.0
    sync_s: float = 0.0
    plan_s: float = 0.0
    alloc_s: float = 0.0
    register_s: float = 0.0
    pull_s: float = 0.0
    translate_s: float = 0.0
    install_s: float = 0.0
    total_s: float = 0.0
    nbytes: int = 0
    num_copies: int = 0
    created: dict = field(default_factory=dict)

    @property
    def setup_s(self) -> float:
        """Seconds spent on anything but moving and installing bytes: zero on a warm cycle."""
        return self.connect_s + self.plan_s + self.alloc_s + self.register_s

    def as_dict(self) -> dict:
        return dict(self.__dict__, setup_s=self.setup_s)


class _Buffers:
    """Receive + scratch memory for one plan, in one registered region."""

    def __init__(self, link, plan) -> None:
        import torch

        self.recv_offsets, self.scratch_offsets, total = [], [], 0
        for tp in plan.tensors:
            self.recv_offsets.append(total)
            total += _round(tp.recv_nbytes)
            self.scratch_offsets.append(total)
            total += _round(tp.scratch_nbytes)
        self.region = link.allocate(max(total, _ALIGN))
        buf = self.region.tensor
        # One torch op per tensor (a typed view of the whole buffer per dtype, then as_strided):
        # a re-created receiver builds these views again and slicing costs three ops each.
        # Offsets are multiples of _ALIGN, hence of every itemsize; buf's length is too.
        typed: dict[str, object] = {}
        self.recv = []
        for tp, o in zip(plan.tensors, self.recv_offsets):
            view = typed.get(tp.src_dtype)
            if view is None:
                view = typed[tp.src_dtype] = buf.view(torch_dtype(tp.src_dtype))
            self.recv.append(view.as_strided(tp.dst_shape, _contiguous_strides(tp.dst_shape),
                                             view.storage_offset() + o // view.element_size()))
        # Padding is never written by a pull: zeroed once here, it stays zero (Note [Layout rules]).
        for tp, r in zip(plan.tensors, self.recv):
            if tp.padded:
                r.zero_()
        # Scratch only where staged pulls land (translate.unstage is the only reader).
        self.scratch = [buf[o : o + tp.scratch_nbytes] if tp.staged else None
                        for tp, o in zip(plan.tensors, self.scratch_offsets)]
        # Casts land in plain tensors of the destination dtype, made once with the buffers.
        self.final = [
            torch.zeros(tp.dst_shape, dtype=torch_dtype(tp.dst_dtype), device=buf.device) if tp.needs_cast else r
            for tp, r in zip(plan.tensors, self.recv)
        ]
        self.batch = None
        self.batch_key = None


# Plans are pure functions of the layouts: one process-wide cache, so that a receiver re-created
# with the same layout (an engine per test, a restarted inference worker thread) plans nothing.
_PLAN_CACHE_SIZE = 16
_plan_lock = threading.Lock()
_plan_cache: "OrderedDict[str, object]" = OrderedDict()
_signatures = Lru(64)  # (manifest digests, targets, settings) -> layout signature


def _cached_plan(signature: str):
    with _plan_lock:
        plan = _plan_cache.get(signature)
        if plan is not None:
            _plan_cache.move_to_end(signature)
            counters("plan").reused += 1
        return plan


def _remember_plan(plan) -> None:
    with _plan_lock:
        _plan_cache[plan.signature] = plan
        while len(_plan_cache) > _PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class Receiver(Closing):
    """One inference rank's view of the published weights.

    Args:
        store: the ``warmlink.rendezvous.Store`` the publishers use.
        num_publishers: how many publisher ranks there are (the trainer's TP size).
        device: where received tensors live: a CUDA index / ``torch.device``, or ``"cpu"``.
            Default: the device of the first ``target`` added, else CPU.
        backend: ``"auto"`` (default), ``"shm"`` or ``"cuda_ipc"``; must match the publishers'.
        install: ``"copy"`` (default: copy into targets; their addresses stay, safe with CUDA
            graphs) or ``"swap"`` (targets' ``.data`` point at double-buffered received memory;
            no bytes move at install, memory for two copies of the weights).
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
        self._link = None
        self._sources: SourceSet | None = None
        self._plans: dict[str, object] = {}
        self._buffers: dict[tuple, _Buffers] = {}
        self.cycle = 0
        # swap: the half of the double buffer the next pull writes; the other half is installed.
        # It flips only when an install succeeds, never with a failed cycle (see RefitHandle.wait).
        self._pull_parity = 1
        self.installed_version = 0
        self._in_flight = False
        self._last_named: dict[str, object] = {}
        self._swap_hold: _Buffers | None = None  # pool off + swap: the buffers the model points at
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
                                  "shard; expected install='copy'")
            self.add(name, layout, local_tensor(t) if self.install == "copy" else t)

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

    def start_refit(self, *, version: int | None = None, timeout_s: float | None = None) -> "RefitHandle":
        """Start a cycle and return once the copy engines own the transfer.

        Generation may continue while bytes move; call ``handle.wait()`` (or the handle) to
        translate and install. The publisher cannot begin an update until the pull finishes.
        """
        if self._closed:
            raise VersionError("Receiver.start_refit: receiver is closed")
        if self._in_flight:
            raise VersionError("Receiver.start_refit: a cycle is already in flight; wait() for it first")
        if not self._layouts:
            raise LayoutError("Receiver.start_refit: nothing declared; call add() first")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        self.cycle += 1
        before = {k: counters(k).created for k in _COUNTED}
        report = CycleReport(self.cycle, 0)
        t0 = time.perf_counter()
        if self._link is None:
            # Once per receiver: the backend's imports, its stream and events (reported apart),
            # or the warm state of a closed receiver with the same settings.
            self._connect()
            report.connect_s = time.perf_counter() - t0
        self._healthy = False

        versions = self._enter(version, timeout)
        try:
            t1 = time.perf_counter()
            report.sync_s = t1 - t0 - report.connect_s
            report.version = versions

            plan = self._plan()
            t2 = time.perf_counter()
            report.plan_s = t2 - t1

            bufs = self._buffers_for(plan)
            t3 = time.perf_counter()
            report.alloc_s = t3 - t2

            batch = self._batch_for(plan, bufs)
            twin = self._buffers.get((plan.signature, 1 - self._pull_parity)) if self.install == "swap" else None
            if twin is not None:
                self._batch_for(plan, twin)  # prepared now so that the next cycle prepares nothing
            t4 = time.perf_counter()
            report.register_s = t4 - t3

            transfer = self._link.read(batch)  # pull counts from here: some transports copy while posting
            report.nbytes, report.num_copies = batch.nbytes, batch.num_copies
        except BaseException:
            self._leave(versions)
            self._discard_uncached()
            raise
        self._in_flight = True
        return RefitHandle(self, plan, bufs, transfer, report, before, t0, t4, timeout)

    def _park_key(self, device: int) -> tuple | None:
        """What parked state must match to be adopted (Note [Parked receive state]); None: never park."""
        if self.install != "copy" or not pool.enabled():
            return None
        return (self.store, self.num_publishers, device, resolve_backend(self._backend_arg, device),
                self.max_runs_per_tensor, tuple(sorted(self.name_map.items())) if self.name_map else None,
                tuple(self._layouts.items()))

    def _connect(self) -> None:
        device = self._resolve_device()
        key = self._park_key(device)
        state = _parked.adopt(key) if key is not None else None
        if state is not None:
            self._link_lease, self._sources = state.link_lease, state.sources
            self._plans, self._buffers = state.plans, state.buffers
            self._link = self._link_lease.resource
            self._link.timeout_s = self.timeout_s
            self._sources.unverify()
            return
        self._link_lease = lease_link(self._backend_arg, device, self.timeout_s)
        self._link = self._link_lease.resource
        self._sources = SourceSet(self.store, self._link, self.num_publishers)

    def _enter(self, version: int | None, timeout_s: float) -> int:
        """Count in as a reader of every rank's current version (Note [Version protocol])."""
        if self.cycle == 1 and pool.enabled():
            # A new receiver first tries the states this process last read: when nothing changed
            # since (an engine re-created per test), that saves a round trip per publisher.
            # Entering re-reads each state, so a stale guess only costs a leave. See Note [Warm
            # metadata] in refit._memo.
            guess = [protocol.last_state(self.store, rank) for rank in range(self.num_publishers)]
            if all(g is not None and (version is None or g.version == version) for g in guess):
                entered = self._try_enter(guess, version)
                if entered is not None:
                    return entered
        backoff = Backoff(timeout_s)
        while True:
            states = self._sources.states(timeout_s)
            entered = self._try_enter(states, version)
            if entered is not None:
                return entered
            if backoff.expired():
                raise TransferTimeout(
                    f"Receiver.refit: publishers did not agree on a published version within {timeout_s:.3f} s; "
                    f"states={[(s.version, s.state) for s in states]}"
                )
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
        entered = []
        try:
            for rank, s in enumerate(states):
                if not protocol.enter(self.store, rank, s):
                    break
                entered.append(rank)
            else:
                # A bad manifest fails this refit, not the publishers' next update: the except
                # below leaves every version entered, so no reader count stays behind.
                self._sources.refresh(states)
                return current
        except BaseException:
            for rank in entered:
                protocol.leave(self.store, rank, current)
            raise
        for rank in entered:
            protocol.leave(self.store, rank, current)
        return None

    def _leave(self, version: int) -> None:
        for rank in range(self.num_publishers):
            protocol.leave(self.store, rank, version)

    def _plan(self):
        # The signature is recomputed only when a publisher's manifest or a declaration changed:
        # hashing every layout each cycle would put planning work back on the warm path.
        key = (self._sources.digests(), len(self._layouts))
        cached = self._plans.get(key) if pool.enabled() else None
        if cached is not None:
            return cached
        targets = list(self._layouts.values())
        sources = self._sources.layouts()
        # Hashing layouts is cheaper than the signature (JSON + SHA-256 of every layout), and
        # equal manifest bytes carry equal source layouts: a re-created receiver plans nothing.
        memo_key = (self._sources.digests(), tuple(targets), self.max_runs_per_tensor,
                    tuple(sorted(self.name_map.items())) if self.name_map else None)
        sig = _signatures.get(memo_key) if pool.enabled() else None
        if sig is None:
            sig = layout_signature(sources, targets, max_runs_per_tensor=self.max_runs_per_tensor, name_map=self.name_map)
            if pool.enabled():
                _signatures.put(memo_key, sig)
        plan = _cached_plan(sig) if pool.enabled() else None
        if plan is None:
            start = time.perf_counter()
            plan = build_plan(sources, targets, max_runs_per_tensor=self.max_runs_per_tensor, name_map=self.name_map,
                              _signature=sig)
            c = counters("plan")
            c.created += 1
            c.create_s += time.perf_counter() - start
        if pool.enabled():
            _remember_plan(plan)
            self._plans = {key: plan}  # this receiver's current layout
        return plan

    def _buffers_for(self, plan) -> _Buffers:
        parity = self._pull_parity if self.install == "swap" else 0
        key = (plan.signature, parity)
        bufs = self._buffers.get(key) if pool.enabled() else None
        if bufs is None:
            bufs = _Buffers(self._link, plan)
            if pool.enabled():
                for old_key in [k for k in self._buffers if k[0] != plan.signature]:
                    self._link.release(self._buffers.pop(old_key).region)
                self._buffers[key] = bufs
                if self.install == "swap":
                    # Both halves of the double buffer are leased now, so that cycle 2 allocates nothing.
                    self._buffers[(plan.signature, 1 - parity)] = _Buffers(self._link, plan)
        return bufs

    def _batch_for(self, plan, bufs: _Buffers):
        key = self._sources.digests()
        if bufs.batch is not None and bufs.batch_key == key and pool.enabled():
            return bufs.batch
        copies = []
        for i, tp in enumerate(plan.tensors):
            base, scratch = bufs.recv_offsets[i], bufs.scratch_offsets[i]
            for run in tp.runs:
                remote, offset = self._sources.region_of(run.src_rank, run.src_tensor)
                copies.append(Copy(bufs.region, base + run.dst_offset, remote, offset + run.src_offset,
                                   run.row_nbytes, run.num_rows, run.dst_pitch, run.src_pitch))
            for sp in tp.staged:
                remote, offset = self._sources.region_of(sp.src_rank, sp.src_tensor)
                copies.append(Copy(bufs.region, scratch + sp.scratch_offset, remote, offset, sp.src_nbytes))
        bufs.batch, bufs.batch_key = self._link.prepare(copies), key
        return bufs.batch

    def _discard_uncached(self, bufs: _Buffers | None = None, installed: bool = False) -> None:
        """With pooling off, nothing outlives its cycle (but buffers a swap install points at)."""
        if pool.enabled():
            return
        if bufs is not None:
            if installed and self.install == "swap":
                bufs, self._swap_hold = self._swap_hold, bufs
            if bufs is not None:
                self._link.release(bufs.region)
        self._sources.close_regions()

    def __del__(self) -> None:
        self._finalizing = True  # GC may run anywhere, even inside park(): a collected receiver releases
        super().__del__()

    def tensors(self) -> dict[str, object]:
        """The last installed tensors by name (views of receiver memory, valid until the next cycle)."""
        return dict(self._last_named)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Return buffers, mappings and the link to the pool, or park them for the next receiver
        with the same settings (Note [Parked receive state]). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None and self._healthy and not self._in_flight and not self._finalizing:
            key = self._park_key(self._link.device)
            if key is not None:
                _parked.park(_parked.ParkedState(key, self._link_lease, self._sources, self._plans, self._buffers))
                self._buffers, self._plans, self._link = {}, {}, None
                return
        if self._link is not None:
            for bufs in self._buffers.values():
                self._link.release(bufs.region)
            self._buffers.clear()
            hold = self._swap_hold
            if hold is not None:
                self._link.release(hold.region)
            self._sources.close_regions()
            self._link_lease.release()
            self._link = None


class RefitHandle:
    """A cycle whose bytes are moving. ``wait()`` (or calling the handle) finishes it."""

    def __init__(self, receiver: Receiver, plan, bufs: _Buffers, transfer, report: CycleReport, before: dict, t0: float, t_issue: float, timeout_s: float) -> None:
        self._r = receiver
        self._plan = plan
        self._bufs = bufs
        self._transfer = transfer
        self.report = report
        self._before = before
        self._t0 = t0
        self._t_issue = t_issue
        self._timeout_s = timeout_s
        self._finished = False

    def done(self) -> bool:
        """True once every byte has arrived (installation still needs ``wait``)."""
        return self._transfer.done()

    def __call__(self, load_weights: Callable | None = None) -> CycleReport:
        return self.wait(load_weights=load_weights)

    def wait(self, *, load_weights: Callable | None = None) -> CycleReport:
        """Wait for the bytes, translate, install; returns the cycle's report.

        On any failure the targets keep the previous version and the error propagates.
        """
        if self._finished:
            return self.report
        self._finished = True
        r, rep, bufs = self._r, self.report, self._bufs
        try:
            try:
                self._transfer.wait(self._timeout_s)
            finally:
                r._leave(rep.version)
                r._in_flight = False
            t_pulled = time.perf_counter()
            rep.pull_s = t_pulled - self._t_issue

            for i, tp in enumerate(self._plan.tensors):
                if tp.staged:
                    translate.unstage(tp, bufs.recv[i], bufs.scratch[i])
                if tp.needs_cast:
                    bufs.final[i].copy_(bufs.recv[i])
            _sync(r._link.device)
            t_translated = time.perf_counter()
            rep.translate_s = t_translated - t_pulled

            named = [(tp.dst, bufs.final[i]) for i, tp in enumerate(self._plan.tensors)]
            if load_weights is not None:
                translate.call_load_weights(load_weights, named)
            pairs = [(r._targets[name], t) for name, t in named if name in r._targets]
            (translate.install_swap if r.install == "swap" else translate.install_copy)(pairs)
            _sync(r._link.device)
            rep.install_s = time.perf_counter() - t_translated
            r._last_named = dict(named)
            r.installed_version = rep.version
            r._healthy = True
            if r.install == "swap":
                r._pull_parity = 1 - r._pull_parity  # targets now point at what was just pulled
        except BaseException:
            r._discard_uncached(bufs)
            raise
        r._discard_uncached(bufs, installed=True)
        rep.total_s = time.perf_counter() - self._t0
        rep.created = {k: counters(k).created - self._before[k] for k in _COUNTED}
        return rep


def _sync(device: int) -> None:
    if device >= 0:
        import torch

        torch.cuda.current_stream(device).synchronize()
