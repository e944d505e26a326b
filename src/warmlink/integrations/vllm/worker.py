"""The worker side of the ``"warmlink"`` weight-transfer backend: one per vLLM worker (TP rank).

vLLM creates ``WarmlinkWeightTransferEngine(config, vllm_config, device, model)`` after loading the
model when ``--weight-transfer-config '{"backend": "warmlink"}'`` is set, and calls it through
``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, which the trainer engine (``warmlink.integrations.vllm.trainer``) drives.

# Note [vLLM update]
``init_transfer_engine`` connects to the trainer's store, reads the live model (Note [Live vLLM
layouts] in ``_live``) and plans against the publishers' manifests, so that a layout the trainer
does not publish, a world size that leaves rows uncovered or a ``buffer_bytes`` too small for one
module fails there, before any update, and not at the first one. In-place tensors get a
``Receiver`` with no install targets, streamed modules a second ``Receiver`` whose layouts are the
logical tensors their loaders keep. Then (Note [Whole versions only] in ``_update``):

1. ``update_weights({"version": v})`` pulls version ``v`` whole beside the model: the model is not
   touched, so a trainer that dies or stalls mid-update leaves it serving the previous version;
2. ``finish_weight_update`` installs a version staged whole, in one step of local copies and
   ``load_weights`` calls, between engine steps; only then does vLLM set its weight version.

Nothing here raises for a failure it can write down (Note [Update records] in ``_wire``): the
trainer reads every worker's record after each call and raises the worker's own warmlink error.
``served`` counts the updates installed on this engine and never goes back, whichever trainer job
sent them: the trainer reports it as the engine's weight version.

# Note [One error per update]
vLLM's ``MultiprocExecutor.collective_rpc`` reads the workers' answers in rank order and raises at
the first failure, leaving the later workers' answers queued: the next call then reads those
instead of its own, and every later call one behind. So a failure a worker cannot record (the
store itself unreachable) is raised by the last TP worker only, which vLLM reads after every
other answer; the others log it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from warmlink._dtypes import dtype_name
from warmlink.errors import ConfigError, VersionError
from warmlink.integrations.vllm import _wire
from warmlink.integrations.vllm._live import EngineLayouts, read_engine
from warmlink.integrations.vllm._update import StagedUpdates, is_torn

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
        session: names this trainer's updates in the store (Note [Update records]).
        generations: each publisher's generation (index: trainer rank) as the trainer saw them
            at init: the manifests planned against at init are those, not an earlier job's.
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
    generations: list | None = None
    secret: str | None = field(default=None, repr=False)


@dataclass
class WarmlinkUpdateInfo(WeightTransferUpdateInfo):
    """One update: the warmlink version every publisher has published."""

    version: int = 0


class WarmlinkWeightTransferEngine(WeightTransferEngine[WarmlinkInitInfo, WarmlinkUpdateInfo]):
    """Pulls each version whole beside the live model, installs it at finish (Note [vLLM update]).

    Attributes:
        served: updates installed on this engine so far, by every trainer job (never goes back).
        version: the warmlink version of the last installed update (0 before the first).
        layouts: the ``EngineLayouts`` read at init (in place / streamed, and why).
        last_report: the last update's pulls (``{"in_place": CycleReport.as_dict(), "stream":
            StreamReport.as_dict()}``, ``stream`` with ``staging_nbytes``) and ``install_s``.
    """

    init_info_cls = WarmlinkInitInfo
    update_info_cls = WarmlinkUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: WarmlinkInitInfo | None = None
        self.layouts: EngineLayouts | None = None
        self.served = 0
        self.version = 0
        self.last_report: dict = {}
        self.session_open = False  # between vLLM's start_weight_update and finish_weight_update
        self._store = None
        self._updates: StagedUpdates | None = None
        self._worker: int | None = None  # this worker's index in the trainer's session

    # -- vLLM's calls ----------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WarmlinkInitInfo) -> None:
        """Connect to the trainer's store, read the live model's layouts and plan against the
        publishers' manifests; a second call (a new trainer) replaces the first. The outcome is
        the ``init`` record (Note [Update records])."""
        self.shutdown()
        self.info = init_info
        store = self._connect(init_info)
        if store is None:  # raised on the last TP worker (Note [One error per update])
            return
        error = None
        try:
            self._worker = store.add(_wire.session_key(init_info.session, "workers"), 1, checked=False) - 1
            self._open(init_info, store)
        except Exception as exc:  # noqa: BLE001 - recorded for the trainer, which raises it
            error = exc
            self.shutdown_receivers()
        tp, rank = self._tp()
        self._record(store, "init", error, tp=tp, tp_rank=rank, served=self.served, open=self.session_open,
                     torn=is_torn(self.model), staging_nbytes=self._updates.staging_nbytes if self._updates else 0)

    def start_weight_update(self) -> None:
        """Open a session (vLLM allows one at a time); a version left staged is dropped."""
        self.session_open = True
        if self._updates is not None:
            self._updates.discard()

    def receive_weights(self, update_info: WarmlinkUpdateInfo) -> None:
        """Pull version ``update_info.version`` whole beside the model; the ``update`` record says
        whether it is staged (Note [vLLM update])."""
        version = int(update_info.version)
        error = None
        try:
            self._ready("update_weights").stage(version)
        except Exception as exc:  # noqa: BLE001 - recorded; the model was not touched
            error = exc
            if self._updates is not None:
                self._updates.discard()
        self._record(self._store, f"update/{version}", error, serves=self.served + 1)

    def update_weights(self, update_info) -> None:
        """vLLM's entry: as the base class, without its device synchronisation (the pulls end
        synchronised; nothing is installed until ``finish_weight_update``)."""
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        """Install the version staged whole, if any (a session that staged nothing, a failed or
        abandoned one, installs nothing); the ``finish`` record says which."""
        self.session_open = False
        updates = self._updates
        version = updates.staged_version if updates is not None else None
        if version is None:
            if self._store is not None and self.info is not None:
                self._record(self._store, "finish/none", None, served=self.served)
            return
        error = None
        try:
            missing = self._staged_everywhere(version)
            if missing is not None:  # TP workers install one version or none (Note [vLLM update])
                updates.discard()
                raise VersionError(f"vLLM worker: version {version} is not installed: {missing}")
            self.last_report = updates.apply()
            self.served += 1
            self.version = version
        except Exception as exc:  # noqa: BLE001 - recorded (PartialLoadError: the model refuses to generate)
            error = exc
        self._record(self._store, f"finish/{version}", error, served=self.served)

    def shutdown(self) -> None:
        """Close the receivers and the store connection (idempotent); the model keeps its weights."""
        self.shutdown_receivers()
        if self._store is not None:
            self._store.close()
            self._store = None

    def shutdown_receivers(self) -> None:
        if self._updates is not None:
            self._updates.close()
            self._updates = None

    # -- helpers ---------------------------------------------------------------------------------
    def _connect(self, info: WarmlinkInitInfo):
        from warmlink.rendezvous import Store

        try:
            for name, value, ok in (("install", info.install, info.install in INSTALL),
                                    ("num_publishers", info.num_publishers, _positive(info.num_publishers)),
                                    ("buffer_bytes", info.buffer_bytes, _positive(info.buffer_bytes)),
                                    ("session", info.session, isinstance(info.session, str) and bool(info.session))):
                if not ok:
                    raise ConfigError(f"WarmlinkInitInfo: {name}={value!r} invalid; expected "
                                      + (f"one of {list(INSTALL)}" if name == "install" else
                                         "a non-empty str" if name == "session" else "an int >= 1"))
            self._store = Store.connect(info.store_address, prefix=info.prefix, timeout_s=info.timeout_s,
                                        secret=info.secret)
        except Exception as exc:
            self._raise_once(exc)  # nothing to record it in
        return self._store

    def _open(self, info: WarmlinkInitInfo, store) -> None:
        from warmlink.refit import Receiver
        from warmlink.refit.families import layouts as family_layouts

        tp, rank, ep, ep_rank = _ranks(self.model, self.parallel_config)
        family = family_layouts(self.model_config.hf_config, convention="vllm", tp=tp, rank=rank, ep=ep, ep_rank=ep_rank,
                                dtype=dtype_name(self.model_config.dtype))
        found = read_engine(self.model, family, install=info.install)
        device = "cpu" if self.device.type == "cpu" else self.device
        kw = dict(num_publishers=info.num_publishers, device=device, backend=info.transport, timeout_s=info.timeout_s)
        in_place = Receiver(store, **kw) if found.in_place else None
        stream = Receiver(store, **kw) if found.streamed else None
        updates = StagedUpdates(self.model, self.model_config, found, in_place, stream, buffer_bytes=info.buffer_bytes,
                                timeout_s=info.timeout_s)
        try:
            for name, (layout, _) in found.in_place.items():
                in_place.add(name, layout)  # installed from its receive memory at finish
            for name, layout in found.streamed.items():
                stream.add(name, layout)
            updates.prepare(info.generations)
        except BaseException:
            updates.close()
            raise
        self.layouts, self._updates = found, updates
        log.info("warmlink engine ready", extra={"tp_rank": rank, "in_place": len(found.in_place),
                                                  "streamed": len(found.streamed), "why": found.why,
                                                  "staging_nbytes": updates.staging_nbytes})

    def _staged_everywhere(self, version: int) -> str | None:
        """None when every worker of the session staged ``version`` whole, else why not."""
        store, session = self._store, self.info.session
        for w in range(store.add(_wire.session_key(session, "workers"), 0, checked=False)):
            key = _wire.session_key(session, f"update/{version}", w)
            raw = store.try_get(key)
            if raw is None:
                return f"worker {w} has not staged it"
            if _wire.loads(raw, key, {"serves": int}).get("error") is not None:
                return f"worker {w} failed to stage it"
        return None

    def _ready(self, func: str) -> StagedUpdates:
        if self._updates is None:
            raise ConfigError(f"WarmlinkWeightTransferEngine.{func}: the engine is not initialised (init_weight_transfer_engine "
                              "was not called, or failed); expected the trainer engine's trainer_init first")
        return self._updates

    def _tp(self) -> tuple[int, int]:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()

    def _record(self, store, what: str, error: BaseException | None, **fields) -> None:
        """Write this worker's record of ``what`` under the session (Note [Update records])."""
        if error is not None:
            tp, rank = self._tp()
            log.warning("warmlink %s failed on this worker: %s", what, error, extra={"tp_rank": rank})
        if store is None or self._worker is None:
            if error is not None:
                self._raise_once(error)
            return
        record = dict(fields, error=None if error is None else _wire.encode_error(error))
        try:
            store.set(_wire.session_key(self.info.session, what, self._worker), _wire.dumps(record))
        except Exception as exc:  # noqa: BLE001 - the store is gone: raise what can be raised, once
            self._raise_once(error if error is not None else exc)

    def _raise_once(self, error: BaseException) -> None:
        """Raise ``error`` on the last TP worker only (Note [One error per update])."""
        tp, rank = self._tp()
        if rank == tp - 1:
            raise error
        log.warning("warmlink: %s (the last TP worker raises it)", error, extra={"tp_rank": rank})


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _ranks(model, parallel_config) -> tuple[int, int, int, int]:
    """(tp, tp_rank, ep, ep_rank) of this worker, read from its modules (vLLM's own attributes)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    for module in model.modules():
        mpc = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        if mpc is not None and mpc.use_ep:
            return tp, rank, mpc.ep_size, mpc.ep_rank
    return tp, rank, 1, 0
