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
no worker reads between sends), ``publish`` (version ``v``); rank 0 then drives the client
(``start_weight_update``, ``update_weights({"version": v})``, ``finish_weight_update``) and
writes ``vllm/done/{r}/{generation_r}/{v}`` for each rank ``r`` once the workers left (``ok`` or
the error); every other rank waits for its own key, bounded by ``update_timeout_s``. Keys carry
each publisher's generation, so a restarted trainer never reads an earlier one's answer.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from warmlink.errors import ConfigError, TransferError
from warmlink.integrations.vllm.worker import INSTALL

__all__ = ["WarmlinkTrainerInitInfo", "WarmlinkTrainerWeightTransferEngine", "WarmlinkSource"]

log = logging.getLogger("warmlink.integrations.vllm")


@dataclass
class WarmlinkTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings (``rank`` is keyword-only, from ``TrainerInitInfo``).

    Attributes:
        store_address: ``"host:port"`` of a running ``warmlink.rendezvous.Store`` server that
            the trainer ranks and the vLLM workers reach.
        world_size: trainer ranks publishing; ``0 <= rank < world_size``.
        prefix: store prefix of this job's keys.
        timeout_s: the workers' wait for a version and for each pull, seconds.
        update_timeout_s: how long a rank waits for the workers to finish one update, seconds.
        install, buffer_bytes: passed to the workers (``WarmlinkInitInfo``).
        layouts: this rank's physical name -> ``TensorLayout`` for a module without placements
            (a Megatron- or vLLM-convention rank); None: DTensor placements, or tensors whole.
        transport: warmlink backend (None: auto).
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
    secret: str | None = field(default=None, repr=False)


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
    """Publishes this rank's shards and drives the workers (Note [vLLM send])."""

    init_info_cls = WarmlinkTrainerInitInfo

    def __init__(self, *, client, source, info: WarmlinkTrainerInitInfo, store, publisher) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info, self.store, self.publisher = info, store, publisher

    @classmethod
    def trainer_init(cls, init_info: WarmlinkTrainerInitInfo, *, client, source=None):
        """Declare and export this rank's tensors (version 1); rank 0 initialises the workers.

        Raises:
            ConfigError: a bad setting or a source without a module. LayoutError: layouts that do
                not fit the module. TransferTimeout: no store at ``store_address``.

        **Collective?** Every trainer rank calls it (no process group is used).
        """
        info = init_info
        if isinstance(info.world_size, bool) or not isinstance(info.world_size, int) or not 0 <= info.rank < info.world_size:
            raise ConfigError(f"WarmlinkTrainerInitInfo: rank={info.rank!r}, world_size={info.world_size!r}; expected "
                              "0 <= rank < world_size")
        if info.install not in INSTALL:
            raise ConfigError(f"WarmlinkTrainerInitInfo: install={info.install!r} is unknown; expected one of {list(INSTALL)}")
        if source is None:
            raise ConfigError("warmlink trainer_init: source=None; expected WarmlinkSource(model) or ModuleSource(model)")
        module = _module_of(source)
        from warmlink.refit import Publisher
        from warmlink.rendezvous import Store

        store = Store.connect(info.store_address, prefix=info.prefix, timeout_s=info.timeout_s, secret=info.secret)
        pub = Publisher(store, rank=info.rank, world_size=info.world_size, backend=info.transport, timeout_s=info.timeout_s)
        try:
            pub.add_module(module, dict(info.layouts) if info.layouts is not None else None)
            pub.export()
            engine = cls(client=client, source=source, info=info, store=store, publisher=pub)
            if engine.is_sender:
                client.init_weight_transfer_engine({
                    "store_address": info.store_address, "prefix": info.prefix, "num_publishers": info.world_size,
                    "timeout_s": info.timeout_s, "install": info.install, "buffer_bytes": info.buffer_bytes,
                    "transport": info.transport, "session": f"{pub.generation}-{uuid.uuid4().hex[:12]}",
                    "secret": store.secret})
        except BaseException:
            pub.close()
            store.close()
            raise
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """Publish the live weights as the next version and return once the workers installed it.

        Args:
            weight_version: what the engine reports (``LLM.get_weight_version``); default the
                warmlink version number.

        Raises:
            TransferError: the update failed on the workers (rank 0: the client's error chained;
                other ranks: rank 0's message). TransferTimeout: no answer in ``update_timeout_s``.

        **Collective?** Every trainer rank calls it, after its optimizer step.
        **Blocking?** Until the workers finished reading the version (Note [vLLM send]).
        **Warm path?** Publishes in place: nothing is allocated or registered.
        """
        pub = self.publisher
        pub.begin_update(self.info.timeout_s)
        version = pub.publish()
        if self.is_sender:
            self._drive(version, weight_version)
            return
        key = _done_key(self.info.rank, pub.generation, version)
        self.store.wait_until(lambda: self.store.try_get(key) is not None, timeout_s=self.info.update_timeout_s,
                              what=f"rank 0's end of update {version} ({key})", poll_s=0.01)
        answer = self.store.try_get(key).decode("utf-8", "replace")
        if answer != "ok":
            raise TransferError(f"WarmlinkTrainerWeightTransferEngine.send_weights: version={version} failed on the "
                                f"workers ({answer}); the engine keeps an earlier version")

    def _drive(self, version: int, weight_version: str | None) -> None:
        from warmlink.refit import protocol

        answer, started = "ok", False
        try:
            self.client.start_weight_update()
            started = True
            self.client.update_weights({"version": version})
            started = False
            self.client.finish_weight_update(weight_version if weight_version is not None else str(version))
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"[:2000]
            if started:  # close the session on the workers that did not raise (Note [One error per update])
                try:
                    self.client.finish_weight_update(None)
                except Exception:  # noqa: BLE001 - those that raised closed theirs already
                    pass
            raise TransferError(f"WarmlinkTrainerWeightTransferEngine.send_weights: version={version}: the workers "
                                f"failed ({answer})") from exc
        finally:
            for r in range(1, self.info.world_size):
                try:
                    generation = protocol.read_state(self.store, r, timeout_s=self.info.timeout_s).generation
                    self.store.set(_done_key(r, generation, version), answer)
                except Exception as exc:  # noqa: BLE001 - a lost rank times out waiting; log and go on
                    log.warning("could not tell trainer rank %d the end of update %d: %r", r, version, exc)

    def shutdown(self) -> None:
        """Withdraw the published version and close the store connection (idempotent)."""
        self.publisher.close()
        self.store.close()


def _done_key(rank: int, generation: int, version: int) -> str:
    return f"vllm/done/{rank}/{generation}/{version}"
