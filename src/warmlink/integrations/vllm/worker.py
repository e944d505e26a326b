"""The worker side of the ``"warmlink"`` weight-transfer backend: one per vLLM worker (TP rank).

vLLM creates ``WarmlinkWeightTransferEngine(config, vllm_config, device, model)`` after loading the
model when ``--weight-transfer-config '{"backend": "warmlink"}'`` is set, and calls it through
``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, which the trainer engine (``warmlink.integrations.vllm.trainer``) drives.

# Note [vLLM update]
``init_transfer_engine`` connects to the trainer's store and reads the live model (Note [Live vLLM
layouts] in ``_live``): in-place tensors get a ``Receiver`` whose targets are the live parameters,
streamed modules a second ``Receiver`` whose layouts are the logical tensors their loaders keep.
``update_weights({"version": v})`` then

1. streams the modules that cannot take bytes in place to ``model.load_weights`` under vLLM's
   layerwise reload (each module is re-processed as soon as its last tensor arrived; buckets
   never split a module);
2. pulls the in-place tensors and installs them by copy once all their bytes arrived (addresses
   stay: CUDA graphs keep working).

vLLM runs these calls between engine steps, so generation never sees a half-installed version.
A trainer that dies or stalls before anything was handed over (the version never completes, a
pull fails) leaves the model at the previous version: ``update_weights`` raises
``TransferTimeout`` or ``PeerLostError`` and the next update works (a new trainer calls
``init_weight_transfer_engine`` again). A failure after step 1 handed tensors over cannot be
undone: ``PartialLoadError`` says so, and the next complete update repairs the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from warmlink._dtypes import dtype_name
from warmlink.errors import ConfigError, TransferError
from warmlink.integrations.vllm._live import EngineLayouts, read_engine
from warmlink.refit.receiver import PartialLoadError

__all__ = ["WarmlinkInitInfo", "WarmlinkUpdateInfo", "WarmlinkWeightTransferEngine"]

log = logging.getLogger("warmlink.integrations.vllm")

INSTALL = ("auto", "copy", "stream")


@dataclass
class WarmlinkInitInfo(WeightTransferInitInfo):
    """What the trainer's rank 0 sends each worker (JSON-safe).

    Attributes:
        store_address: ``"host:port"`` of the job's ``warmlink.rendezvous.Store``.
        prefix: the store prefix the publishers use.
        num_publishers: trainer ranks publishing (``world_size`` of the trainer engine).
        timeout_s: how long one update may wait for a version and for each pull, seconds.
        install: ``"auto"`` (in place where the live module allows, else streamed), ``"copy"``
            (in place or refuse at init) or ``"stream"`` (everything through ``load_weights``).
        buffer_bytes: receive memory of the streamed part, bytes (two slots of half).
        transport: warmlink backend, ``None`` for auto (``cuda_ipc`` on GPUs, ``shm`` on CPU).
        session: names this trainer's updates in the store (Note [One error per update]).
        secret: the store's secret (the trainer sends its own); ``None`` takes ``WARMLINK_SECRET``
            in the worker's process. Whoever can call ``init_weight_transfer_engine`` already
            chooses which store the engine installs from, so it may carry the secret. Not in the repr.
    """

    store_address: str = ""
    prefix: str = "warmlink"
    num_publishers: int = 1
    timeout_s: float = 60.0
    install: str = "auto"
    buffer_bytes: int = 256 << 20
    transport: str | None = None
    session: str = ""
    secret: str | None = field(default=None, repr=False)


@dataclass
class WarmlinkUpdateInfo(WeightTransferUpdateInfo):
    """One update: the warmlink version every publisher has published."""

    version: int = 0


class WarmlinkWeightTransferEngine(WeightTransferEngine[WarmlinkInitInfo, WarmlinkUpdateInfo]):
    """Pulls each version straight into the live model (Note [vLLM update]).

    Attributes:
        version: the warmlink version the model holds (0 before the first update).
        layouts: the ``EngineLayouts`` read at init (in place / streamed, and why).
        last_report: ``{"in_place": CycleReport.as_dict(), "stream": StreamReport.as_dict()}`` of
            the last update (``stream`` absent when nothing is streamed); the stream's also has
            ``deferred_nbytes`` and ``peak_extra_bytes`` (its slots plus those copies), bytes.
    """

    init_info_cls = WarmlinkInitInfo
    update_info_cls = WarmlinkUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: WarmlinkInitInfo | None = None
        self.layouts: EngineLayouts | None = None
        self.version = 0
        self.last_report: dict = {}
        self._store = None
        self._in_place = None
        self._stream = None
        self._deferred_nbytes = 0

    # -- vLLM's calls ----------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WarmlinkInitInfo) -> None:
        """Connect to the trainer's store and read the live model's layouts; a second call (a new
        trainer) replaces the first. Raises LayoutError (before any byte moves) on a mismatch."""
        from warmlink.refit import Receiver
        from warmlink.refit.families import layouts as family_layouts
        from warmlink.rendezvous import Store

        if init_info.install not in INSTALL:
            raise ConfigError(f"WarmlinkInitInfo: install={init_info.install!r} is unknown; expected one of {list(INSTALL)}")
        if isinstance(init_info.num_publishers, bool) or not isinstance(init_info.num_publishers, int) or init_info.num_publishers < 1:
            raise ConfigError(f"WarmlinkInitInfo: num_publishers={init_info.num_publishers!r} invalid; expected an int >= 1")
        self.shutdown()
        tp, rank, ep, ep_rank = _ranks(self.model, self.parallel_config)
        family = family_layouts(self.model_config.hf_config, convention="vllm", tp=tp, rank=rank, ep=ep, ep_rank=ep_rank,
                                dtype=dtype_name(self.model_config.dtype))
        found = read_engine(self.model, family, install=init_info.install)
        store = Store.connect(init_info.store_address, prefix=init_info.prefix, timeout_s=init_info.timeout_s,
                              secret=init_info.secret)
        device = "cpu" if self.device.type == "cpu" else self.device
        kw = dict(num_publishers=init_info.num_publishers, device=device, backend=init_info.transport,
                  timeout_s=init_info.timeout_s)
        try:
            in_place = Receiver(store, **kw) if found.in_place else None
            for name, (layout, target) in found.in_place.items():
                in_place.add(name, layout, target.detach())  # the same memory, without autograd's checks
            stream = Receiver(store, **kw) if found.streamed else None
            for name, layout in found.streamed.items():
                stream.add(name, layout)
        except BaseException:
            store.close()
            raise
        self.info, self.layouts, self._store, self._in_place, self._stream = init_info, found, store, in_place, stream
        log.info("warmlink engine ready", extra={"tp_rank": rank, "in_place": len(found.in_place),
                                                  "streamed": len(found.streamed), "why": found.why})

    def start_weight_update(self) -> None:
        """Nothing to prepare: the version is pulled and installed in ``update_weights``."""
        self._check_ready("start_weight_update")

    def receive_weights(self, update_info: WarmlinkUpdateInfo) -> None:
        """Stream, then pull and install, version ``update_info.version`` (Note [vLLM update]);
        failures are raised by the last TP worker for all of them (Note [One error per update])."""
        self._check_ready("update_weights")
        version = int(update_info.version)
        error = None
        try:
            self._receive(version)
        except Exception as exc:  # noqa: BLE001 - reported through the store, raised by the last worker
            error = exc
        self._report_outcome(version, error)

    def _report_outcome(self, version: int, error: BaseException | None) -> None:
        """# Note [One error per update]
        vLLM's ``MultiprocExecutor.collective_rpc`` reads the workers' answers in rank order and
        raises at the first failure, leaving the later workers' answers queued: the next call
        then reads those instead of its own, and every later call one behind. So no worker but
        the last raises. Each writes its outcome to the store under the trainer's session and the
        version; the last TP worker waits for all (bounded by ``timeout_s``) and raises one error
        naming every failed worker, which vLLM reads after every other answer."""
        tp, rank, _, _ = _ranks(self.model, self.parallel_config)
        info, store = self.info, self._store
        outcome = "ok" if error is None else f"{type(error).__name__}: {error}"[:4000]
        try:
            store.set(_outcome_key(info.session, version, rank), outcome)
        except Exception:  # noqa: BLE001 - the store is gone: this worker's own error is all it can give
            if error is not None and rank == tp - 1:
                raise error from None
            log.warning("could not report the outcome of update %d", version, extra={"tp_rank": rank})
            return
        if rank != tp - 1:
            if error is not None:
                log.warning("update %d failed on this worker; the last TP worker raises it", version,
                            extra={"tp_rank": rank, "error": outcome})
            return
        keys = [_outcome_key(info.session, version, r) for r in range(tp)]
        store.wait_until(lambda: all(store.try_get(k) is not None for k in keys), timeout_s=info.timeout_s,
                         what=f"the outcome of update {version} on every TP worker", poll_s=0.01)
        failed = {r: store.try_get(k).decode("utf-8", "replace") for r, k in enumerate(keys)}
        failed = {r: v for r, v in failed.items() if v != "ok"}
        if failed and error is not None and len(failed) == 1:
            raise error
        if failed:
            raise TransferError(f"WarmlinkWeightTransferEngine.update_weights: version={version} failed on TP workers "
                                f"{sorted(failed)}: " + "; ".join(f"worker {r}: {v}" for r, v in sorted(failed.items())))

    def _receive(self, version: int) -> None:
        report: dict = {}
        if self._stream is not None:
            self._deferred_nbytes = 0
            report["stream"] = self._stream_version(version).as_dict()
            # Peak extra memory of the stream: its receive slots, plus the copies handed to padded
            # modules, which vLLM keeps until the end of the update.
            report["stream"]["deferred_nbytes"] = self._deferred_nbytes
            report["stream"]["peak_extra_bytes"] = report["stream"]["peak_buffer_bytes"] + self._deferred_nbytes
        if self._in_place is not None:
            try:
                report["in_place"] = self._in_place.refit(version=version).as_dict()
            except BaseException as exc:
                if self._stream is None:
                    raise  # nothing was handed over: the model keeps the previous version
                raise PartialLoadError(
                    f"WarmlinkWeightTransferEngine.update_weights: version={version}: the streamed modules took it but the "
                    f"in-place tensors failed ({type(exc).__name__}: {exc}); the model holds a mix of versions; expected: "
                    "update again before serving", version=version, bucket_idx=0, num_buckets=0, handed=[]) from exc
        self.version, self.last_report = version, report

    def finish_weight_update(self) -> None:
        """Nothing left: ``update_weights`` installed the whole version."""

    def shutdown(self) -> None:
        """Close the receivers and the store connection (idempotent); the model keeps its weights."""
        for rec in (self._in_place, self._stream):
            if rec is not None:
                rec.close()
        self._in_place = self._stream = None
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- helpers ---------------------------------------------------------------------------------
    def _check_ready(self, func: str) -> None:
        if self._store is None:
            raise ConfigError(f"WarmlinkWeightTransferEngine.{func}: init_weight_transfer_engine was not called; expected "
                              "the trainer engine's trainer_init first")

    def _stream_version(self, version: int):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        modules = self.layouts.reload_modules
        group = _Group(modules)
        owner = {name: mod for mod_name, mod in modules.items() for name in _names_of(self.layouts, mod_name)}
        initialize_layerwise_reload(group)
        try:
            return self._stream.stream(lambda weights: self._load(weights, owner), buffer_bytes=self.info.buffer_bytes,
                                       groups=self.layouts.groups, version=version, timeout_s=self.info.timeout_s)
        finally:
            finalize_layerwise_reload(group, self.model_config)

    def _load(self, weights, owner: dict) -> None:
        """``model.load_weights`` for one bucket; then every module it fed must be processed, since the
        next bucket reuses the memory a pending module would still point at (Note [Streaming receive]).
        Tensors of padded modules, which vLLM processes only at the end, are handed as copies."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        deferred = self.layouts.deferred
        named = [(n, t.clone() if n in deferred else t) for n, t in weights]
        self._deferred_nbytes += sum(t.numel() * t.element_size() for n, t in named if n in deferred)
        with _no_mtp_check():
            self.model.load_weights(iter(named))
        pending = sorted({type(owner[n]).__name__ for n, _ in named
                          if n not in deferred and owner.get(n) is not None and LAYERWISE_INFO.get(owner[n]) is not None
                          and LAYERWISE_INFO[owner[n]].loaded_weights})
        if pending:
            raise ConfigError(f"WarmlinkWeightTransferEngine: modules {pending} still hold tensors after load_weights "
                                  "returned (vLLM deferred their processing); expected every module processed within its "
                                  "bucket (install='copy' for these, or a larger buffer_bytes)")


def _outcome_key(session: str, version: int, rank: int) -> str:
    return f"vllm/outcome/{session}/{version}/{rank}"


def _names_of(found: EngineLayouts, mod_name: str) -> list[str]:
    idx = list(found.reload_modules).index(mod_name)
    return found.groups[idx]


class _Group(torch.nn.Module):
    """The streamed modules under one parent, for vLLM's layerwise reload of just those."""

    def __init__(self, modules: dict) -> None:
        super().__init__()
        for i, module in enumerate(modules.values()):
            self.add_module(f"m{i}", module)


def _no_mtp_check():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # pragma: no cover - older vLLM
        import contextlib

        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def _ranks(model, parallel_config) -> tuple[int, int, int, int]:
    """(tp, tp_rank, ep, ep_rank) of this worker, read from its modules (vLLM's own attributes)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    for module in model.modules():
        mpc = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        if mpc is not None and mpc.use_ep:
            return tp, rank, mpc.ep_size, mpc.ep_rank
    return tp, rank, 1, 0
