"""The trainer side of the ``"warmlink"`` weight-transfer backend: one per trainer rank.

Built through vLLM's factory like any backend::

    engine = WeightTransferTrainerFactory.trainer_init(
        WarmlinkTrainerInitInfo(rank=rank, world_size=world, store_address=address),
        client=client, source=ModuleSource(model))          # on every trainer rank
    for batch in batches:
        loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        engine.send_weights()                                # on every trainer rank

Each rank publishes its local shards with ``warmlink.refit.Publisher``: DTensors (FSDP2, TP) with
layouts read from their placements, Megatron- or vLLM-convention ranks with the layouts given
(``WarmlinkTrainerInitInfo.layouts``, from ``warmlink.refit.families.layouts``), plain tensors whole.
Nothing is gathered; the memory is registered once, at ``trainer_init``.

# Note [vLLM send]
vLLM's loop steps the optimizer *before* ``send_weights``, outside any warmlink update, so the
version protocol (Note [Version protocol]) holds only if no worker reads a version after
``send_weights`` returned. Hence every rank, in ``send_weights``: ``begin_update`` (never waits:
no worker reads between sends), ``publish`` (version ``v``). Rank 0 waits until every rank
published ``v``, then drives the client: ``start_weight_update``, ``update_weights({"version": v})``
(each worker pulls ``v`` whole beside its model), reads every worker's record, and only if every
one staged ``v`` whole ``finish_weight_update(weight_version)`` (each installs it; Note [vLLM
update]), else ``finish_weight_update(None)`` (nothing installed, the session closed). Then it
resets the engine's prefix cache, whose KV the old weights computed (``prefix_cache="reset"``),
and writes ``vllm/done/{r}/{generation_r}/{v}`` for every other rank ``r``: ``ok`` or the error,
which that rank raises as its own. Every wait watches the peers it waits for (Note [Trainer
liveness]): a rank that dies ends its peers' ``send_weights`` within seconds.

The weight version the engine reports is, unless the caller names one, the count of updates the
engine has installed (its ``served``, read from the workers' records): it keeps rising across
trainer jobs, and a failed update does not move it.

# Note [Engine sessions]
vLLM allows one weight-update session at a time and ends one only at ``finish_weight_update``; a
trainer that dies inside one (after ``start_weight_update``) leaves it open, and every later
``start_weight_update`` fails. Each worker tells, at ``init_weight_transfer_engine``, whether a
session is open on it; the next trainer's ``trainer_init`` then closes it with
``finish_weight_update(None)``, which installs nothing (the dead trainer's staged version was
dropped at init). Rank 0 also closes its own session on every failure after opening it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from warmlink.errors import ConfigError, MetadataError, TransferError, TransferTimeout
from warmlink.integrations.vllm import _wire
from warmlink.integrations.vllm._trainers import TrainerGroup
from warmlink.integrations.vllm.clients import prefix_cache_resetter
from warmlink.integrations.vllm.worker import INSTALL

__all__ = ["WarmlinkTrainerInitInfo", "WarmlinkTrainerWeightTransferEngine", "WarmlinkSource"]

log = logging.getLogger("warmlink.integrations.vllm")

PREFIX_CACHE = ("reset", "keep")


@dataclass
class WarmlinkTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings (``rank`` is keyword-only, from ``TrainerInitInfo``).

    Attributes:
        store_address: ``"host:port"`` of a running ``warmlink.rendezvous.Store`` server that
            the trainer ranks and the vLLM workers reach.
        world_size: trainer ranks publishing; ``0 <= rank < world_size``.
        prefix: store prefix of this job's keys.
        timeout_s: waits for peers at init, for a version and for each pull on the workers, seconds.
        update_timeout_s: how long one ``send_weights`` may wait for live peers and the engine,
            seconds (a dead peer ends it within seconds: Note [Trainer liveness]).
        install, buffer_bytes: passed to the workers (``WarmlinkInitInfo``).
        layouts: this rank's physical name -> ``TensorLayout`` for a module without placements
            (a Megatron- or vLLM-convention rank); None: DTensor placements, or tensors whole.
        transport: warmlink backend (None: auto).
        prefix_cache: ``"reset"`` (default): each update ends by resetting the engine's prefix
            cache, whose KV the previous weights computed; ``"keep"``: leave it (the caller resets
            or salts it). Rank 0's client must be able to reset it (``clients.prefix_cache_resetter``).
        secret: the store's secret (``Store.secret`` of the server); ``None`` takes
            ``WARMLINK_SECRET``. Rank 0 hands it to the workers in their init info. Not in the repr.
    """

    backend: ClassVar[str] = "warmlink"
    store_address: str = ""
    world_size: int = 1
    prefix: str = "warmlink"
    timeout_s: float = 60.0
    update_timeout_s: float = 600.0
    install: str = "auto"
    buffer_bytes: int = 256 << 20
    layouts: Mapping[str, Any] | None = None
    transport: str | None = None
    prefix_cache: str = "reset"
    secret: str | None = field(default=None, repr=False)

    def check(self) -> None:
        """Raise ConfigError naming the first invalid setting."""
        def positive(v, integer=False) -> bool:
            kinds = (int,) if integer else (int, float)
            return isinstance(v, kinds) and not isinstance(v, bool) and v > 0

        if not positive(self.world_size, True) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"WarmlinkTrainerInitInfo: rank={self.rank!r}, world_size={self.world_size!r}; expected "
                              "0 <= rank < world_size")
        for name in ("timeout_s", "update_timeout_s"):
            if not positive(getattr(self, name)):
                raise ConfigError(f"WarmlinkTrainerInitInfo: {name}={getattr(self, name)!r}; expected seconds > 0")
        if not positive(self.buffer_bytes, True):
            raise ConfigError(f"WarmlinkTrainerInitInfo: buffer_bytes={self.buffer_bytes!r}; expected an int >= 1 (bytes)")
        if self.install not in INSTALL:
            raise ConfigError(f"WarmlinkTrainerInitInfo: install={self.install!r} is unknown; expected one of {list(INSTALL)}")
        if self.prefix_cache not in PREFIX_CACHE:
            raise ConfigError(f"WarmlinkTrainerInitInfo: prefix_cache={self.prefix_cache!r} is unknown; expected one of "
                              f"{list(PREFIX_CACHE)}")


class WarmlinkSource(WeightSource):
    """A ``WeightSource`` over a module whose shards warmlink publishes in place.

    ``metadata()`` and iteration describe what this rank holds (local shards, never gathered);
    ``trainer_init`` reads the module itself. vLLM's ``ModuleSource(model)`` works as well.
    """

    def __init__(self, module) -> None:
        self.module = module

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self):
        from warmlink.refit.dtensor import local_tensor

        for name, p in self.module.named_parameters():
            yield name, local_tensor(p)


def _module_of(source) -> Any:
    module = getattr(source, "module", None)
    if module is None:
        module = getattr(source, "_module", None)  # vLLM's ModuleSource
    if module is None:
        raise ConfigError(f"warmlink trainer_init: source={type(source).__name__} holds no module; expected "
                          "WarmlinkSource(model) or vLLM's ModuleSource(model) (warmlink publishes shards in place)")
    return module


class WarmlinkTrainerWeightTransferEngine(TrainerWeightTransferEngine[WarmlinkTrainerInitInfo]):
    """Publishes this rank's shards and drives the workers (Note [vLLM send]).

    Attributes:
        served: the engine's update count after this rank's last successful ``send_weights``
            (rank 0; Note [vLLM send]).
    """

    init_info_cls = WarmlinkTrainerInitInfo

    def __init__(self, *, client, source, info: WarmlinkTrainerInitInfo, store, publisher, group) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info, self.store, self.publisher, self.group = info, store, publisher, group
        self.session = ""
        self.num_workers = 0
        self.served = 0
        self._reset_prefix = None
        self._client_error: tuple[str, Exception] | None = None

    @classmethod
    def trainer_init(cls, init_info: WarmlinkTrainerInitInfo, *, client, source=None):
        """Declare and export this rank's tensors (version 1), wait for every other rank, and
        (rank 0) initialise the workers, which plan against every rank's manifest.

        Raises:
            ConfigError: a bad setting, a source without a module, no client on rank 0, a client
                that cannot reset the prefix cache (``prefix_cache="reset"``), a ``buffer_bytes``
                too small for one engine module (from the workers).
            LayoutError: layouts that do not fit the module, or what the engine needs that the
                trainer ranks do not publish (from the workers, naming the tensor).
            MetadataError: a peer rank or the store's values under another secret.
            TransferTimeout: no store at ``store_address``, or ranks of ``world_size`` that never
                joined (is ``world_size`` right?).

        **Collective?** Every trainer rank calls it (no process group is used).
        """
        info = init_info
        info.check()
        if source is None:
            raise ConfigError("warmlink trainer_init: source=None; expected WarmlinkSource(model) or ModuleSource(model)")
        module = _module_of(source)
        reset_prefix = None
        if info.is_sender:
            if client is None:
                raise ConfigError("warmlink trainer_init: client=None on rank 0, which drives the engine; expected a "
                                  "VLLMWeightSyncClient (vLLM's RayVLLMWeightSyncClient or HTTPVLLMWeightSyncClient, or "
                                  "warmlink's ConnectionClient)")
            reset_prefix = prefix_cache_resetter(client, info.prefix_cache)
        from warmlink.refit import Publisher
        from warmlink.rendezvous import Store

        store = Store.connect(info.store_address, prefix=info.prefix, timeout_s=info.timeout_s, secret=info.secret)
        pub = Publisher(store, rank=info.rank, world_size=info.world_size, backend=info.transport, timeout_s=info.timeout_s)
        group = None
        try:
            pub.add_module(module, dict(info.layouts) if info.layouts is not None else None)
            pub.export()
            group = TrainerGroup(store, info.rank, info.world_size, pub.generation)
            group.join(info.timeout_s)
            engine = cls(client=client, source=source, info=info, store=store, publisher=pub, group=group)
            engine._reset_prefix = reset_prefix
            if engine.is_sender:
                engine._init_workers()
        except BaseException:
            if group is not None:
                group.close()
            pub.close()
            store.close()
            raise
        return engine

    def _init_workers(self) -> None:
        info, pub = self.info, self.publisher
        self.session = f"{pub.generation}-{uuid.uuid4().hex[:12]}"
        self._call("init_weight_transfer_engine", {
            "store_address": info.store_address, "prefix": info.prefix, "num_publishers": info.world_size,
            "timeout_s": info.timeout_s, "install": info.install, "buffer_bytes": info.buffer_bytes,
            "transport": info.transport, "session": self.session,
            "generations": [self.group.generations[r] for r in range(info.world_size)], "secret": self.store.secret})
        self.num_workers = self.store.add(_wire.session_key(self.session, "workers"), 0, checked=False)
        records = self._records("init", {"served": int, "open": bool, "torn": bool, "tp": int, "tp_rank": int})
        self.served = max(r.get("served") or 0 for r in records)
        if any(r.get("open") for r in records):  # Note [Engine sessions]: a dead trainer's
            log.warning("closing the weight-update session an earlier trainer left open on the engine")
            self._call("finish_weight_update", None)

    # -- send ------------------------------------------------------------------------------------
    def send_weights(self, weight_version: str | None = None) -> None:
        """Publish the live weights as the next version and return once the engine installed it.

        Args:
            weight_version: what the engine reports (``LLM.get_weight_version``); default the
                count of updates the engine has installed, across trainer jobs.

        Raises:
            PeerLostError: a trainer rank died during the update (within seconds: Note [Trainer
                liveness]); the engine keeps the previous version (or, when rank 0 died after the
                workers installed it, this one).
            The workers' own errors, as they raised them (Note [Update records]): TransferTimeout
            or PeerLostError of a pull (the engine keeps the previous version), PartialLoadError
            (installing failed on the engine, which refuses to generate until a complete update).
            TransferTimeout: no answer within ``update_timeout_s``.

        **Collective?** Every trainer rank calls it, after its optimizer step.
        **Blocking?** Until the engine installed the version (Note [vLLM send]).
        **Warm path?** Publishes in place: nothing is allocated or registered.
        """
        pub = self.publisher
        pub.begin_update(self.info.timeout_s)
        version = pub.publish()
        if self.is_sender:
            self._send(version, weight_version)
            return
        key = _wire.done_key(self.info.rank, pub.generation, version)
        self.group.wait(lambda: self.store.try_get(key) is not None, watch=[0], timeout_s=self.info.update_timeout_s,
                        what=f"trainer rank {self.info.rank}: waiting for rank 0's end of update {version}")
        answer = _wire.loads(self.store.try_get(key), key, {"served": int})
        if answer.get("error") is not None:
            raise _wire.decode_error(answer["error"], f"send_weights (version {version}, from trainer rank 0)")
        self.served = answer.get("served") or self.served

    def _send(self, version: int, weight_version: str | None) -> None:
        outcome: dict = {"served": self.served}
        try:
            others = [r for r in range(self.info.world_size) if r != 0]
            self.group.wait(lambda: self._published(others, version), watch=others, timeout_s=self.info.update_timeout_s,
                            what=f"trainer rank 0: waiting for every rank to publish version {version}")
            self._drive(version, weight_version)
            outcome["served"] = self.served
        except BaseException as exc:
            outcome["error"] = _wire.encode_error(exc)
            raise
        finally:
            self._tell_others(version, outcome)

    def _published(self, ranks: list[int], version: int) -> bool:
        for r in ranks:
            state = self.group.state(r)
            if state is None or state.generation != self.group.generations[r]:
                raise MetadataError(f"trainer rank 0: rank {r}'s publisher is no longer generation "
                                    f"{self.group.generations[r]} (state {state}): it was re-created; expected one "
                                    "publisher per rank for the whole job")
            if state.version < version or state.state != "published":
                return False
        return True

    def _drive(self, version: int, weight_version: str | None) -> None:
        self._call("start_weight_update")
        try:
            self._call("update_weights", {"version": version})
            staged = self._records(f"update/{version}", {"serves": int})
        except BaseException:
            self._call("finish_weight_update", None, closing=True)  # Note [Engine sessions]
            raise
        serves = max(r.get("serves") or 0 for r in staged)
        self._call("finish_weight_update", weight_version if weight_version is not None else str(serves))
        finished = self._records(f"finish/{version}", {"served": int})
        self.served = max(r.get("served") or 0 for r in finished)
        if self._reset_prefix is not None:
            self._reset_prefix()

    def _tell_others(self, version: int, outcome: dict) -> None:
        for r in range(1, self.info.world_size):
            try:
                self.store.set(_wire.done_key(r, self.group.generations[r], version), _wire.dumps(outcome))
            except Exception as exc:  # noqa: BLE001 - that rank then sees rank 0 alive but silent: its timeout
                log.warning("could not tell trainer rank %d the end of update %d: %r", r, version, exc)

    # -- the client and the workers' records -------------------------------------------------------
    def _call(self, method: str, *args, closing: bool = False) -> None:
        """``client.<method>(*args)``; a failure is kept for ``_records``, which prefers the
        workers' own error (Note [Update records]). A closing call's failure is only logged."""
        try:
            getattr(self.client, method)(*args)
            self._client_error = None
        except Exception as exc:  # noqa: BLE001
            if closing:
                log.warning("closing the weight-update session failed: %r", exc)
                return
            self._client_error = (method, exc)
            if method in ("start_weight_update", "finish_weight_update"):
                raise TransferError(f"WarmlinkTrainerWeightTransferEngine: client.{method} failed: {_first_line(exc)}") from None

    def _records(self, what: str, fields: dict) -> list[dict]:
        """Every worker's record of ``what``; raises the first worker's error (Note [Update records])."""
        failed, self._client_error = self._client_error, None
        if self.num_workers == 0 and what == "init":
            self.num_workers = self.store.add(_wire.session_key(self.session, "workers"), 0, checked=False)
        keys = [_wire.session_key(self.session, what, w) for w in range(self.num_workers)]
        if failed is None and self.num_workers:
            try:  # the client's call returned, so every worker wrote its record already
                self.store.wait_until(lambda: all(self.store.try_get(k) is not None for k in keys), timeout_s=self.info.timeout_s,
                                      what=f"every vLLM worker's record of {what}", poll_s=0.01)
            except TransferTimeout:
                pass
        raws = {w: self.store.try_get(k) for w, k in enumerate(keys)}
        records = {w: _wire.loads(raw, keys[w], fields) for w, raw in raws.items() if raw is not None}
        for w, record in sorted(records.items()):
            if record.get("error") is not None:
                where = f"vLLM worker {w} (TP rank {record.get('tp_rank', '?')})" if what == "init" else f"vLLM worker {w}"
                raise _wire.decode_error(record["error"], f"{where}, {what.split('/')[0]}") from None
        if failed is not None:
            method, exc = failed
            raise TransferError(f"WarmlinkTrainerWeightTransferEngine: client.{method} failed and no vLLM worker recorded "
                                f"why: {_first_line(exc)}") from exc
        missing = sorted(set(range(self.num_workers)) - set(records))
        if not self.num_workers or missing:
            raise TransferTimeout(f"WarmlinkTrainerWeightTransferEngine: no record of {what} from vLLM workers "
                                  f"{missing or 'at all'} within {self.info.timeout_s:.3g} s; expected every worker of the "
                                  "engine to run the 'warmlink' backend (weight_transfer_config={'backend': 'warmlink'})")
        return [records[w] for w in range(self.num_workers)]

    def shutdown(self) -> None:
        """Stop beating, withdraw the published version and close the store connection (idempotent)."""
        self.group.close()
        self.publisher.close()
        self.store.close()


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:500] if text else type(exc).__name__
