"""Refit between Ray actors: trainer ranks publish, inference engines pull (issue 5, item 3).

Optional: ``pip install warmlink[ray]``. Importing this module does not import Ray; the actor
classes below are plain classes that the driver turns into actors at use time
(``actor_class(RefitTrainer)`` is ``ray.remote(RefitTrainer)``), so Ray is imported only by the
driver functions that need it and inside the actor processes Ray starts.

Shape of a job (``RefitJob`` does all of this)::

    store = start_store(prefix="job")                     # driver: the rendezvous server
    job = {"prefix": "job", "secret": store.secret}       # the store's secret goes to every actor
    Trainer = actor_class(RefitTrainer, num_cpus=1)
    trainers = [Trainer.remote(store.address, rank=r, world_size=tp, **job) for r in range(tp)]
    Engine = actor_class(RefitEngine, num_cpus=1)
    engines = [Engine.remote(store.address, num_publishers=tp, **job) for _ in range(n)]
    get([t.export.remote() for t in trainers], timeout_s=60, what="export")
    for step in range(steps):
        get([e.refit.remote() for e in engines], timeout_s=60, what="refit")  # pull version v
        get([t.step.remote() for t in trainers], timeout_s=60, what="step")   # publish v+1

Backends: on CPU (and in CI) the actors run on one node over ``backend="shm"`` (POSIX shared
memory). On GPUs the same code runs with ``backend="cuda_ipc"`` and ``device="cuda"`` (actors
with ``num_gpus=1``); that path is not run by the tests here. CUDA IPC needs the peer GPU to be
visible to the receiver process, while Ray narrows ``CUDA_VISIBLE_DEVICES`` to each actor's GPU:
set ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` and pick the device per actor, as vLLM
does. Both backends are one-node; trainers and engines on different nodes need the ``nixl``
backend.

Failures: every remote call the driver makes goes through ``get`` with a timeout. A dead actor
becomes ``PeerLostError`` naming the call, a call that does not return in time
``TransferTimeout``; an error raised inside an actor propagates as itself (Ray re-raises it as
an instance of the original class). An engine killed while it pulls leaves its reader count at
the publishers; the next ``Publisher.update`` of each trainer reaps it, since the dead process
ran on the same host (Note [Reader slots] in ``refit/protocol.py``). Ray reports a killed actor
dead while its process may still be exiting (measured: ``ActorDiedError`` at once, the process
still running), and a publisher checks for dead readers once per wait, so an update started in
that window ends in ``TransferTimeout`` after ``timeout_s`` (a retried ``step`` then reaps and
completes). ``RefitJob.kill_engine`` therefore returns only once the process has exited.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from warmlink._backoff import wait_until
from warmlink.errors import ConfigError, LayoutError, PeerLostError, TransferTimeout

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "DEFAULT_MODEL",
    "RefitEngine",
    "RefitJob",
    "RefitTrainer",
    "actor_class",
    "checksum",
    "get",
    "start_store",
]

# name -> (global shape, split dim across trainer ranks). Every split dim is divisible by
# 1, 2, 3, 4, 6, 8, 12 and 24, the TP sizes a small demo may ask for.
DEFAULT_MODEL: dict[str, tuple[tuple[int, ...], int]] = {
    "embed.weight": ((384, 96), 0),
    "layers.0.attn.qkv.weight": ((288, 96), 0),
    "layers.0.attn.o.weight": ((96, 96), 1),
    "layers.0.mlp.up.weight": ((384, 96), 0),
    "layers.0.mlp.down.weight": ((96, 384), 1),
    "norm.weight": ((96,), 0),
}


def _model(model: Mapping[str, Any] | None) -> dict[str, tuple[tuple[int, ...], int]]:
    spec = DEFAULT_MODEL if model is None else model
    out = {}
    for name, (shape, split_dim) in spec.items():
        shape = tuple(int(s) for s in shape)
        if not 0 <= split_dim < len(shape):
            raise ConfigError(f"model: tensor {name!r} split_dim={split_dim!r} out of range for shape {shape}")
        out[name] = (shape, int(split_dim))
    return out


def _device(device: str):
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _digest(tensor) -> str:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def _shard_key(name: str, shard_idx: int, num_shards: int) -> str:
    return f"{name}[{shard_idx}/{num_shards}]"


def checksum(digests: Mapping[str, str]) -> str:
    """One SHA-256 over per-shard digests (``{"name[i/n]": sha256}``), independent of their order.

    The driver merges the trainer ranks' ``digests()`` and compares ``checksum(merged)`` with an
    engine's ``checksum``: equal means the engine holds the trainers' bytes, bit for bit.
    """
    h = hashlib.sha256()
    for key in sorted(digests):
        h.update(f"{key}={digests[key]}\n".encode())
    return h.hexdigest()


def _generator(*parts: object):
    import torch

    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


class RefitTrainer:
    """One trainer rank as a Ray actor: a TP shard of every tensor of ``model``, published.

    Args:
        store_address: ``Store.address`` of the driver's rendezvous server (``start_store``).
        prefix: the store prefix of the job (the same in every actor of one job).
        secret: the store's secret (``store.secret`` of ``start_store``'s server); ``None`` takes
            ``WARMLINK_SECRET`` in the actor's process.
        rank, world_size: this rank among the trainer ranks (the TP size).
        model: ``{name: (global_shape, split_dim)}``; default ``DEFAULT_MODEL``. Each rank holds
            ``TensorLayout.plain(name, dtype, shape, split_dim, world_size, rank)``.
        dtype: ``"bfloat16"`` (default) or any dtype name warmlink knows.
        backend: ``"shm"`` on CPU (default); ``"cuda_ipc"`` with ``device="cuda"`` on GPUs.
        device: ``"cpu"`` (default) or ``"cuda"``.
        timeout_s: the publisher's wait for readers in ``step`` and the store's waits.
        seed: initial weights and updates are a function of ``(seed, name, step, rank)``.

    Use from the driver: ``actor_class(RefitTrainer).remote(...)``.
    """

    def __init__(
        self,
        store_address: str,
        *,
        prefix: str,
        rank: int,
        world_size: int,
        model: Mapping[str, Any] | None = None,
        dtype: str = "bfloat16",
        backend: str = "shm",
        device: str = "cpu",
        timeout_s: float = 30.0,
        seed: int = 0,
        secret: str | None = None,
    ) -> None:
        import torch

        from warmlink.refit import Publisher
        from warmlink.refit.manifest import TensorLayout
        from warmlink.rendezvous import Store

        self.rank, self.world_size, self.seed, self.timeout_s = rank, world_size, seed, timeout_s
        self.model = _model(model)
        self.store = Store.connect(store_address, prefix=prefix, timeout_s=timeout_s, secret=secret)
        dev = _device(device)
        self.tensors: dict[str, Any] = {}
        self.layouts: dict[str, TensorLayout] = {}
        for name, (shape, split_dim) in self.model.items():
            if shape[split_dim] % world_size:
                raise LayoutError(
                    f"RefitTrainer: tensor {name!r} dim {split_dim} of {shape} is not divisible by world_size={world_size}"
                )
            layout = TensorLayout.plain(name, dtype, shape, split_dim=split_dim, num_shards=world_size, shard_idx=rank)
            init = torch.randn(layout.local_shape, generator=_generator(seed, name, 0, rank), device="cpu") * 0.02
            self.layouts[name] = layout
            self.tensors[name] = init.to(dtype=getattr(torch, dtype), device=dev).contiguous()
        self.pub = Publisher(self.store, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s)
        for name, t in self.tensors.items():
            self.pub.add(name, t, self.layouts[name])
        self.steps = 0

    def info(self) -> dict:
        """This actor's host, process and rank."""
        return {"rank": self.rank, "world_size": self.world_size, "host": socket.gethostname(), "pid": os.getpid(),
                "version": self.pub.version}

    def export(self) -> dict:
        """Register every shard once and publish version 1."""
        t0 = time.perf_counter()
        self.pub.export()
        return {"rank": self.rank, "version": self.pub.version, "export_s": time.perf_counter() - t0}

    def step(self, timeout_s: float | None = None) -> dict:
        """One simulated optimizer step inside ``pub.update()``: waits until no engine reads the
        current version (reaping readers of dead local processes), updates in place, publishes v+1.

        Raises:
            TransferTimeout: a live engine still reads after ``timeout_s`` (nothing is published;
                a later ``step`` retries the wait).
        """
        import torch

        t0 = time.perf_counter()
        wait_s = self.pub.begin_update(timeout_s if timeout_s is not None else self.timeout_s)
        self.steps += 1  # after the wait: a step retried after TransferTimeout applies the same update
        for name, t in self.tensors.items():
            noise = torch.randn(t.shape, generator=_generator(self.seed, name, self.steps, self.rank), device="cpu")
            t.add_(noise.to(dtype=t.dtype, device=t.device), alpha=1e-3)
        version = self.pub.publish()
        return {"rank": self.rank, "version": version, "wait_s": wait_s, "step_s": time.perf_counter() - t0}

    def digests(self) -> dict[str, str]:
        """``{"name[rank/world_size]": sha256 of this rank's shard bytes}``."""
        return {_shard_key(n, self.rank, self.world_size): _digest(t) for n, t in self.tensors.items()}

    def close(self) -> None:
        self.pub.close()


class RefitEngine:
    """One inference engine (TP=1) as a Ray actor: whole tensors, refit from the trainer ranks.

    Args:
        store_address, prefix, secret: as for ``RefitTrainer``.
        num_publishers: the trainers' TP size.
        model, dtype, backend, device, timeout_s: as for ``RefitTrainer`` (the same ``model``).
        index: this engine's number, reported back.

    Use from the driver: ``actor_class(RefitEngine).remote(...)``.
    """

    def __init__(
        self,
        store_address: str,
        *,
        prefix: str,
        num_publishers: int,
        model: Mapping[str, Any] | None = None,
        dtype: str = "bfloat16",
        backend: str = "shm",
        device: str = "cpu",
        timeout_s: float = 30.0,
        index: int = 0,
        secret: str | None = None,
    ) -> None:
        import torch

        from warmlink.refit import Receiver
        from warmlink.refit.manifest import TensorLayout
        from warmlink.rendezvous import Store

        self.index, self.num_publishers, self.timeout_s = index, num_publishers, timeout_s
        self.model = _model(model)
        self.store = Store.connect(store_address, prefix=prefix, timeout_s=timeout_s, secret=secret)
        dev = _device(device)
        self.targets = {n: torch.zeros(shape, dtype=getattr(torch, dtype), device=dev) for n, (shape, _) in self.model.items()}
        self.rec = Receiver(self.store, num_publishers=num_publishers, backend=backend, timeout_s=timeout_s)
        for name, t in self.targets.items():
            self.rec.add(name, TensorLayout.plain(name, dtype, tuple(t.shape)), t)
        self._handle = None

    def info(self) -> dict:
        """This actor's host and process (what the publishers' reaping of dead readers checks)."""
        return {"index": self.index, "host": socket.gethostname(), "pid": os.getpid(), "version": self.rec.installed_version}

    def _result(self, report) -> dict:
        return {"index": self.index, "version": report.version, "report": report.as_dict(), "checksum": self.checksum()}

    def refit(self, version: int | None = None, timeout_s: float | None = None) -> dict:
        """Pull, join the trainer shards and install ``version`` (default: the newest).

        Returns:
            ``{"index", "version", "report": CycleReport.as_dict(), "checksum"}``; ``checksum`` is
            comparable with ``checksum(merged trainer digests)``.
        """
        report = self.rec.refit(version=version, timeout_s=timeout_s if timeout_s is not None else self.timeout_s)
        return self._result(report)

    def start_refit(self, version: int | None = None, timeout_s: float | None = None) -> dict:
        """Enter ``version`` and issue the pull; ``finish_refit`` installs it. Until then this
        engine counts as a reader, so the trainers' next ``step`` waits for it."""
        self._handle = self.rec.start_refit(version=version, timeout_s=timeout_s if timeout_s is not None else self.timeout_s)
        return {"index": self.index, "version": self._handle.report.version}

    def finish_refit(self) -> dict:
        if self._handle is None:
            raise ConfigError("RefitEngine.finish_refit: no refit in flight; call start_refit() first")
        handle, self._handle = self._handle, None
        return self._result(handle.wait())

    def digests(self, num_shards: int | None = None) -> dict[str, str]:
        """Digests of this engine's tensors cut the way ``num_shards`` trainer ranks hold them."""
        import torch

        n = num_shards or self.num_publishers
        out = {}
        for name, (_, split_dim) in self.model.items():
            for i, part in enumerate(torch.tensor_split(self.targets[name], n, dim=split_dim)):
                out[_shard_key(name, i, n)] = _digest(part)
        return out

    def checksum(self) -> str:
        return checksum(self.digests())

    def close(self) -> None:
        self.rec.close()


# -- driver side -------------------------------------------------------------------------------


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("warmlink.integrations.ray: Ray is not installed; expected `pip install warmlink[ray]`") from None
    return ray


def actor_class(cls: type, **options: Any):
    """``ray.remote(**options)(cls)``: an actor class of ``RefitTrainer``/``RefitEngine``."""
    ray = _ray()
    return ray.remote(**options)(cls) if options else ray.remote(cls)


def start_store(prefix: str | None = None, *, host: str = "127.0.0.1", timeout_s: float = 60.0,
                secret: str | None = None):
    """Start the rendezvous ``Store`` server in the driver; pass ``store.address``, ``store.prefix``
    and ``store.secret`` to the actors. The server lives as long as the returned object (keep a reference).

    ``host`` is the only address the server listens on, and must be reachable from the actors:
    ``127.0.0.1`` on one node; the node's IP (``ray.util.get_node_ip_address()``) when actors run
    elsewhere. ``secret``: the job's (``None``: ``WARMLINK_SECRET``, else a fresh one).
    """
    from warmlink.rendezvous import Store

    prefix = prefix or f"ray-refit-{uuid.uuid4().hex[:12]}"
    return Store(host, 0, is_server=True, prefix=prefix, timeout_s=timeout_s, secret=secret)


def get(refs, *, timeout_s: float, what: str):
    """``ray.get(refs, timeout=timeout_s)`` with the failures named.

    Raises:
        PeerLostError: an actor of ``what`` died (``ray.exceptions.RayActorError``).
        TransferTimeout: ``what`` did not finish within ``timeout_s``.
        Any warmlink error raised inside the actor, as itself.
    """
    ray = _ray()
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TransferTimeout(f"ray: {what} did not return within {timeout_s:.3g} s") from None
    except ray.exceptions.RayActorError as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise PeerLostError(f"ray: {what}: actor died ({type(e).__name__}: {first})") from e


class RefitJob:
    """Trainer ranks and engines as Ray actors on one node, and the refit cycles between them.

    Args:
        trainers: trainer ranks (TP size). engines: inference engines (TP=1 each).
        model, dtype, backend, device: passed to every actor (``backend="shm"`` on CPU).
        timeout_s: each actor's warmlink timeout; the driver waits ``timeout_s + call_margin_s``
            for any remote call but the first.
        start_timeout_s: how long the driver waits for every engine to start (a process that
            imports torch and builds its model: seconds, more on a loaded host), apart from the
            protocol's timeouts.
        actor_options: ``ray.remote`` options of every actor (default ``num_cpus=0``, so a
            small machine fits them all; on GPUs pass ``num_gpus=1``).

    Ray must already be initialized (``ray.init``). Use as a context manager or call ``shutdown``.
    """

    def __init__(
        self,
        trainers: int = 2,
        engines: int = 1,
        *,
        model: Mapping[str, Any] | None = None,
        dtype: str = "bfloat16",
        backend: str = "shm",
        device: str = "cpu",
        timeout_s: float = 30.0,
        call_margin_s: float = 30.0,
        start_timeout_s: float = 120.0,
        actor_options: Mapping[str, Any] | None = None,
        prefix: str | None = None,
    ) -> None:
        if trainers < 1 or engines < 1:
            raise ConfigError(f"RefitJob: trainers={trainers!r} engines={engines!r}; expected >= 1 each")
        self.timeout_s = timeout_s
        self.call_timeout_s = timeout_s + call_margin_s
        self.store = start_store(prefix, timeout_s=timeout_s)
        options = dict(actor_options) if actor_options is not None else {"num_cpus": 0}
        common = {"prefix": self.store.prefix, "model": model, "dtype": dtype, "backend": backend,
                  "device": device, "timeout_s": timeout_s, "secret": self.store.secret}
        trainer_cls, engine_cls = actor_class(RefitTrainer, **options), actor_class(RefitEngine, **options)
        self.trainers = [trainer_cls.remote(self.store.address, rank=r, world_size=trainers, **common)
                         for r in range(trainers)]
        self.engines: list[Any | None] = [
            engine_cls.remote(self.store.address, num_publishers=trainers, index=i, **common) for i in range(engines)
        ]
        self.version = 0
        # Where each engine runs: kill_engine waits for the process itself to exit (see the module doc).
        self.engine_info = get([e.info.remote() for e in self.engines], timeout_s=start_timeout_s, what="engine start")

    def _get(self, refs, what: str):
        return get(refs, timeout_s=self.call_timeout_s, what=what)

    def _live_engines(self) -> list[Any]:
        return [e for e in self.engines if e is not None]

    def export(self) -> list[dict]:
        """Every trainer rank exports (version 1)."""
        out = self._get([t.export.remote() for t in self.trainers], "trainer export")
        self.version = out[0]["version"]
        return out

    def step(self) -> list[dict]:
        """Every trainer rank takes a step and publishes the next version."""
        out = self._get([t.step.remote() for t in self.trainers], "trainer step")
        self.version = out[0]["version"]
        return out

    def trainer_checksum(self) -> str:
        digests: dict[str, str] = {}
        for d in self._get([t.digests.remote() for t in self.trainers], "trainer digests"):
            digests.update(d)
        return checksum(digests)

    def refit(self, engines: Iterable[int] | None = None) -> list[dict]:
        """The given engines (default: all alive) pull the current version, concurrently.

        Returns each engine's ``RefitEngine.refit`` result with ``"exact"`` added: its checksum
        equals the trainers' checksum of the same version.
        """
        chosen = [self.engines[i] for i in engines] if engines is not None else self._live_engines()
        if any(e is None for e in chosen):
            raise ConfigError("RefitJob.refit: an engine asked for was killed")
        results = self._get([e.refit.remote(version=self.version) for e in chosen], "engine refit")
        expected = self.trainer_checksum()
        for r in results:
            r["exact"] = r["checksum"] == expected
        return results

    def kill_engine(self, index: int, *, timeout_s: float | None = None) -> None:
        """``ray.kill`` engine ``index`` and return once its process is gone.

        Ray reports an actor dead (``ActorDiedError``) while its process may still be exiting;
        a trainer update that starts then finds the reader alive, and since a publisher checks
        for dead readers once per wait, it ends in ``TransferTimeout``. So this waits for Ray's
        verdict and, when the engine ran on this host, for its process to leave ``/proc``.
        """
        from warmlink.transport.base import process_start_time

        ray = _ray()
        engine = self.engines[index]
        if engine is None:
            return
        self.engines[index] = None
        info = self.engine_info[index]
        ray.kill(engine, no_restart=True)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.call_timeout_s)

        def dead() -> bool:
            try:
                get(engine.info.remote(), timeout_s=max(deadline - time.monotonic(), 0.1), what=f"engine {index} info")
            except PeerLostError:
                return True
            return False

        wait_until(dead, timeout_s=max(deadline - time.monotonic(), 0.0), first_s=0.02, cap_s=0.02,
                   what=f"RefitJob.kill_engine: engine {index} still answers after ray.kill")
        if info["host"] != socket.gethostname():
            return
        wait_until(lambda: process_start_time(info["pid"]) is None, timeout_s=max(deadline - time.monotonic(), 0.0),
                   first_s=0.02, cap_s=0.02,
                   what=f"RefitJob.kill_engine: engine {index} process {info['pid']} still runs after ray.kill")

    def shutdown(self) -> None:
        """Kill every actor of the job and stop the store server. Idempotent."""
        ray = _ray()
        for actor in [*self.trainers, *self._live_engines()]:
            with contextlib.suppress(Exception):  # best effort: already dead, or Ray shut down
                ray.kill(actor, no_restart=True)
        self.trainers, self.engines = [], []
        if self.store is not None:
            self.store.close()
            self.store = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def run(steps: int, trainers: int = 2, engines: int = 1, **job_options: Any) -> Sequence[dict]:
    """Export, then ``steps`` times: every engine refits and is checked, the trainers step.

    Returns one record per refit: ``{"step", "version", "engines": [...]}`` (a final refit after
    the last step is included). Ray must be initialized.
    """
    records = []
    with RefitJob(trainers, engines, **job_options) as job:
        job.export()
        for step in range(steps + 1):
            records.append({"step": step, "version": job.version, "engines": job.refit()})
            if step < steps:
                job.step()
    return records
