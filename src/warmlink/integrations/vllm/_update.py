"""One vLLM worker's updates: pull a whole version aside, then install it in one step.

# Note [Whole versions only]
An engine must never generate from a version it did not fully install. Bytes that can only reach
the model through ``load_weights`` (modules vLLM re-packs or quantizes after loading: every linear
layer on CPU, FP8 modules on GPUs) change the model as they are loaded, so a version streamed
straight into them is torn by a trainer that dies between two buckets. Hence two steps:

1. ``stage(v)`` (``update_weights``): the in-place tensors are pulled into receive memory (their
   ``Receiver`` has no install targets) and the streamed ones through the bounded stream buffer
   into *staging*, host memory holding one copy of every streamed tensor (``staging_nbytes``,
   allocated once, reused by every update). The model is not touched: whatever fails here (a
   trainer that dies, a pull that times out, a revoked read) leaves it serving the previous
   version, and ``discard()`` drops what was staged.
2. ``apply()`` (``finish_weight_update``): only a version staged whole is installed: the staged
   tensors go to ``model.load_weights`` under vLLM's layerwise reload (staging stays valid for the
   whole call, so modules vLLM processes only at the end, padded ones, need no copies), then the
   in-place tensors are copied into the live parameters (addresses stay: CUDA graphs keep
   working). Both read local memory only; no peer can fail them.

``apply`` can still fail on its own (vLLM's loader or post-processing raising, memory running
out) after some modules took the new bytes. It is retried once from the same staged bytes;
failing again, the model is *torn*: a forward pre-hook makes every forward raise
``PartialLoadError`` (vLLM's engine core treats a raising forward as fatal, so the engine stops
rather than serve a mix), until a later ``apply`` installs a whole version and removes it.
"""

from __future__ import annotations

import logging
import time

import torch

from warmlink.errors import ConfigError, TransferError, WarmlinkError
from warmlink.integrations.vllm._cpu_moe import repack_after_reload
from warmlink.refit import PartialLoadError

__all__ = ["StagedUpdates", "PartialLoadError", "is_torn"]

log = logging.getLogger("warmlink.integrations.vllm")


class StagedUpdates:
    """The receivers, staging memory and install step of one worker (Note [Whole versions only]).

    Args:
        model, model_config: the worker's model and vLLM's model config (layerwise reload needs it).
        layouts: ``EngineLayouts`` read from the live model.
        in_place, stream: the two ``Receiver``s (None when that part is empty); ``in_place`` has no
            install targets (targets are ``layouts.in_place``), ``stream`` streamed layouts.
        buffer_bytes: the stream's receive memory, bytes.
        timeout_s: waits for a version and each pull, seconds.
    """

    def __init__(self, model, model_config, layouts, in_place, stream, *, buffer_bytes: int, timeout_s: float) -> None:
        self.model, self.model_config, self.layouts = model, model_config, layouts
        self.in_place, self.stream = in_place, stream
        self.buffer_bytes, self.timeout_s = buffer_bytes, timeout_s
        self.staging: dict[str, torch.Tensor] = {}
        self.staged_version: int | None = None
        self.last_report: dict = {}

    @property
    def staging_nbytes(self) -> int:
        """Host memory holding a staged version of the streamed tensors, bytes (0 before ``prepare``)."""
        return sum(t.numel() * t.element_size() for t in self.staging.values())

    def prepare(self, generations: list[int] | None) -> None:
        """Plan against the publishers' current manifests and allocate staging, before any byte moves.

        Raises:
            LayoutError: what this worker needs is not what the trainer publishes (names the tensor).
            ConfigError: ``buffer_bytes`` too small for one module's tensors.
            TransferTimeout: a publisher of ``generations`` did not export within ``timeout_s``.
        """
        if self.in_place is not None:
            self.in_place.prepare(timeout_s=self.timeout_s, generations=generations)
        if self.stream is not None:
            self.stream.prepare(timeout_s=self.timeout_s, generations=generations, stream_buffer_bytes=self.buffer_bytes,
                                groups=self.layouts.groups)
            if not self.staging:
                pin = torch.cuda.is_available() and self.model_device().type == "cuda"
                self.staging = {name: torch.empty(layout.shape, dtype=_dtype(layout.dtype), device="cpu", pin_memory=pin)
                                for name, layout in self.layouts.streamed.items()}

    def model_device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    # -- 1. stage ---------------------------------------------------------------------------------
    def stage(self, version: int) -> dict:
        """Pull version ``version`` whole, beside the model (Note [Whole versions only]). Returns
        the pulls' reports; raises whatever the pulls raise, with the model untouched."""
        self.discard()
        report: dict = {}
        if self.stream is not None:
            try:
                stream = self.stream.stream(self._copy_to_staging, buffer_bytes=self.buffer_bytes,
                                            groups=self.layouts.groups, version=version, timeout_s=self.timeout_s)
            except PartialLoadError as exc:  # what "took" the buckets was staging, not the model: the cause is the error
                cause = exc.__cause__
                raise (cause if isinstance(cause, WarmlinkError) else TransferError(str(exc))) from None
            report["stream"] = dict(stream.as_dict(), staging_nbytes=self.staging_nbytes)
        if self.in_place is not None:
            report["in_place"] = self.in_place.refit(version=version, timeout_s=self.timeout_s).as_dict()
        self.staged_version, self.last_report = version, report
        return report

    def _copy_to_staging(self, weights) -> None:
        for name, tensor in weights:
            self.staging[name].copy_(tensor, non_blocking=False)

    def discard(self) -> None:
        """Forget a staged version (it will not be installed)."""
        self.staged_version = None

    # -- 2. apply ---------------------------------------------------------------------------------
    def apply(self) -> dict:
        """Install the staged version into the live model. Returns its timings.

        Raises:
            ConfigError: nothing is staged.
            PartialLoadError: installing failed twice after modules took new bytes; the model is
                torn and refuses to generate (Note [Whole versions only]).
        """
        version = self.staged_version
        if version is None:
            raise ConfigError("StagedUpdates.apply: no version is staged whole; expected update_weights to have succeeded")
        t0 = time.perf_counter()
        try:
            self._install()
        except Exception as first:  # noqa: BLE001 - local: retried once from the same staged bytes
            log.warning("installing version %d failed (%r); retrying from the staged bytes", version, first)
            try:
                self._install()
            except Exception as exc:
                _refuse_to_generate(self.model, version, exc)
                raise PartialLoadError(
                    f"vLLM worker: installing staged version {version} failed twice after modules took new bytes "
                    f"({type(exc).__name__}: {exc}); the model holds a mix of versions and refuses to generate until "
                    "a complete update is installed", version=version, bucket_idx=0, num_buckets=0, handed=[]) from exc
        _allow_generation(self.model)
        self.staged_version = None
        self.last_report["install_s"] = time.perf_counter() - t0
        return self.last_report

    def _install(self) -> None:
        if self.staging:
            self._load_staged()
        if self.in_place is not None:
            received = self.in_place.tensors()
            with torch.no_grad():
                for name, (_, target) in self.layouts.in_place.items():
                    target.copy_(received[name])
            if self.model_device().type == "cuda":
                torch.cuda.current_stream().synchronize()

    def _load_staged(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        group = _Group(self.layouts.reload_modules)
        initialize_layerwise_reload(group)
        try:
            with _no_mtp_check():
                self.model.load_weights(iter(self.staging.items()))
        finally:
            finalize_layerwise_reload(group, self.model_config)
        repack_after_reload(self.layouts.reload_modules.values())  # Note [CPU MoE after a reload]

    def close(self) -> None:
        for rec in (self.in_place, self.stream):
            if rec is not None:
                rec.close()
        self.in_place = self.stream = None
        self.staging = {}
        self.staged_version = None


def _dtype(name: str) -> torch.dtype:
    from warmlink._dtypes import torch_dtype

    return torch_dtype(name)


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


_TORN_HOOK = "_warmlink_torn_hook"


def _refuse_to_generate(model, version: int, cause: BaseException) -> None:
    """Make every forward of ``model`` raise until ``_allow_generation`` (Note [Whole versions only])."""
    _allow_generation(model)
    message = (f"vLLM worker: the model holds a mix of versions (installing version {version} failed: "
               f"{type(cause).__name__}: {cause}); it refuses to generate until a complete update is installed")

    def refuse(module, args):
        raise PartialLoadError(message, version=version, bucket_idx=0, num_buckets=0, handed=[])

    setattr(model, _TORN_HOOK, model.register_forward_pre_hook(refuse))


def _allow_generation(model) -> None:
    handle = getattr(model, _TORN_HOOK, None)
    if handle is not None:
        handle.remove()
        delattr(model, _TORN_HOOK)


def is_torn(model) -> bool:
    return getattr(model, _TORN_HOOK, None) is not None
