"""The trainer side of refit: declare tensors once, export them once, announce versions.

Where a tensor already sits in shareable memory (a CUDA tensor from PyTorch's default allocator,
which uses plain ``cudaMalloc``), receivers read it in place: zero copies, zero extra memory. Other
tensors (CPU tensors, expandable segments) and layouts the trainer does not hold as one tensor
(fused, cast) are staged: one arena holds them all, and every ``publish`` copies them in from the
live tensors (Note [Live sources] in ``refit._declare``), so no version can carry stale bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Mapping

from warmlink import _env
from warmlink._backoff import Backoff
from warmlink._closing import Closing
from warmlink._dtypes import torch_dtype
from warmlink.errors import (
    ConfigError,
    LayoutError,
    MetadataError,
    PeerLostError,
    PoolError,
    TransferError,
    TransferTimeout,
    VersionError,
)
from warmlink.refit import _board, protocol, quantize
from warmlink.refit._board import LINE_WAIT_S, PublisherBoard
from warmlink.refit._declare import Declared, declare_module, declare_tensor, run_fills
from warmlink.refit._header import CLOSED, HEADER_NBYTES, PUBLISHED, UPDATING, WRITING, PublisherHeader, digest_prefix
from warmlink.refit._memo import exported_manifests
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import schema
from warmlink.transport import lease_link
from warmlink.transport.base import LocalRegion, local_identity

__all__ = ["Publisher"]

log = logging.getLogger("warmlink.refit")

_ALIGN = 256  # staging offsets stay aligned for vector copies
_HEADER_SPACE = (HEADER_NBYTES + _ALIGN - 1) // _ALIGN * _ALIGN  # the version header, ahead of staged tensors


@dataclass
class _Entry:
    declared: Declared
    region_idx: int = -1
    offset: int = 0
    staged: bool = False
    data_ptr: int = 0  # in place and not staged: where its memory was at export
    view: object = None  # staged: this tensor's typed view of the staging arena

    @property
    def layout(self) -> TensorLayout:
        return self.declared.layout


class Publisher(Closing):
    """One trainer rank's published tensors.

    Args:
        store: a ``warmlink.rendezvous.Store`` shared with the receivers.
        rank: this publisher's rank among the publishers, ``0 <= rank < world_size``.
        world_size: number of publisher ranks.
        backend: ``"auto"`` (default: ``cuda_ipc`` for CUDA tensors, else ``shm``), ``"shm"``,
            ``"cuda_ipc"``.
        timeout_s: how long ``begin_update`` waits for readers, seconds (default ``WARMLINK_TIMEOUT_S``).
        line_wait_s: how long ``begin_update`` first holds the published version open for
            receivers standing in line for it (Note [Reader line] in ``refit._board``), seconds; 0 lets a busy trainer
            starve its receivers.

    Usage::

        pub = Publisher(store, rank=r, world_size=world)
        pub.add_module(model)        # DTensor parameters: layouts read from their placements
        pub.export()                 # registers once, publishes version 1
        with pub.update():           # waits until no receiver reads, then publishes v+1 on exit
            optimizer.step()

    Collective? No; with ``Fp8(group=...)`` (``add(..., fp8=)``) ``export`` and ``publish`` are
    collective over that group. Blocking? ``export`` and ``begin_update`` block on the store.
    Warm path? ``update`` does no allocation or registration; staged tensors are copied, FP8 ones
    quantized (Note [Where FP8 is quantized] in ``refit.fp8``).
    """

    def __init__(self, store, *, rank: int = 0, world_size: int = 1, backend: str | None = None, timeout_s: float | None = None,
                 line_wait_s: float = LINE_WAIT_S) -> None:
        _env.count_arg("Publisher", "world_size", world_size, 1)
        if _env.count_arg("Publisher", "rank", rank, 0) >= world_size:
            raise ConfigError(f"Publisher: rank={rank!r} out of range; expected 0 <= rank < world_size={world_size}")
        if isinstance(line_wait_s, bool) or not isinstance(line_wait_s, (int, float)) or not 0 <= line_wait_s < float("inf"):
            raise ConfigError(f"Publisher: line_wait_s={line_wait_s!r}; expected a finite number of seconds >= 0")
        self.line_wait_s = float(line_wait_s)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = _env.timeout_arg("Publisher", timeout_s)
        self._backend_arg = backend
        self._entries: dict[str, _Entry] = {}
        self._link = None
        self._regions: list[LocalRegion] = []
        self._staging: LocalRegion | None = None
        self.generation = 0
        self.version = 0
        self._updating = False
        self._drained = False
        self._closed = False
        self._board: PublisherBoard | None = None
        self._header: PublisherHeader | None = None  # Note [Version header]
        self._digest = b""  # the manifest's digest prefix the header carries
        self._fp8 = None  # the Fp8 every quantized tensor was declared with (one per publisher)
        self._quantizer: quantize.Quantizer | None = None

    # -- declaration -------------------------------------------------------------------------
    def add(self, name: str, tensor, layout: TensorLayout | None = None, *, fp8=None) -> None:
        """Declare one live tensor, published as it is at every ``publish``.

        Args:
            name: physical name, unique on this rank.
            tensor: a contiguous tensor, or a ``DTensor`` (its local shard is published, in place).
            layout: what it holds; default: its placements for a DTensor, else the whole tensor as
                logical tensor ``name``. A layout of another dtype casts at every publish.
            fp8: a ``refit.fp8.Fp8``: publish the tensor quantized, as FP8 values named ``name`` and
                float32 scales named ``fp8.scale_name(name, scheme)`` (Note [FP8 formats] in
                ``refit.fp8``), both rebuilt from the live tensor at every ``publish``.

        Raises:
            LayoutError: the tensor's shape differs from ``layout``, a DTensor holds other boxes than
                ``layout`` says, ``layout`` is transposed (receivers only), ``name`` repeats, or an
                FP8 layout whose scales this rank cannot compute (Note [Where FP8 is quantized]).
            ConfigError: ``fp8`` of another scheme or group than an earlier one of this publisher.
            VersionError: after ``export``.
        """
        _refuse_transposed([layout] if layout is not None else [], "add")
        declared = [declare_tensor(name, tensor, layout)]
        if fp8 is not None:
            self._check_fp8(fp8, "add")
            declared = quantize.declare(declared[0], fp8, "Publisher.add")
        self._declare(declared, "add")
        self._fp8 = fp8 if fp8 is not None else self._fp8

    def add_module(self, module, layouts: Mapping[str, TensorLayout] | None = None, *, dtype: str | None = None,
                   fp8=None) -> None:
        """Declare a module's parameters and persistent buffers, read live at every ``publish``.

        Args:
            module: the trainer's ``torch.nn.Module``. DTensor parameters (FSDP2, TP through
                ``parallelize_module``, 2-D meshes) publish their local shards in place, with
                layouts read from their placements: no gather and no copy.
            layouts: physical name -> layout, for a module whose tensors carry no placements (a
                Megatron or vLLM-layout rank: ``warmlink.refit.families.layouts``). A layout named
                after a module tensor of its shape publishes that tensor; any other must be
                buildable from whole logical tensors of the module (a fused ``qkv`` cut from a TP-1
                model) and is rebuilt at every publish. Default: every tensor, as it is.
            dtype: wire dtype for every tensor when ``layouts`` is None (``"bfloat16"`` for fp32
                master weights); a cast is rebuilt at every publish.
            fp8: a ``refit.fp8.Fp8`` whose ``logical`` names the weights to publish quantized (e.g.
                ``families.fp8_weights(config)``); each tensor holding them is published as FP8
                values and float32 scales (``add``'s ``fp8``).

        Raises:
            LayoutError: a layout that names no module tensor of its shape and cannot be built from
                whole ones (the message names the layout and the logical tensor), a transposed
                one (receivers only: vLLM's GPT-OSS experts; publish another convention), or an
                ``fp8.logical`` name no declared tensor holds, or a tensor holding some of them.
            ConfigError: ``fp8`` without ``logical``.

        **Collective?** No. **Warm path?** No: declare once, before ``export``.
        """
        _refuse_transposed(list((layouts or {}).values()), "add_module")
        declared = declare_module(module, layouts, dtype)
        if fp8 is not None:
            self._check_fp8(fp8, "add_module")
            declared = quantize.declare_module(declared, fp8, "Publisher.add_module")
        self._declare(declared, "add_module")
        self._fp8 = fp8 if fp8 is not None else self._fp8

    def _check_fp8(self, fp8, func: str) -> None:
        """One ``Fp8`` per publisher: its Quantizer runs one scheme and one reduction."""
        if self._fp8 is not None and (fp8.scheme, fp8.group) != (self._fp8.scheme, self._fp8.group):
            raise ConfigError(f"Publisher.{func}: fp8 scheme={fp8.scheme!r} differs from scheme={self._fp8.scheme!r} "
                              "(or group) of an earlier declaration; expected one Fp8 per publisher")

    @property
    def staging_nbytes(self) -> int:
        """Memory this publisher holds beyond the tensors it was given, in bytes: the staging arena
        of tensors it cannot publish in place (0 when every tensor is read where it lies)."""
        return self._staging.nbytes - _HEADER_SPACE if self._staging is not None else 0

    def layouts(self) -> dict[str, TensorLayout]:
        """Every declared tensor's layout by name (what the manifest announces), a new dict."""
        return {name: e.layout for name, e in self._entries.items()}

    def _declare(self, declared: list[Declared], func: str) -> None:
        if self._link is not None:
            raise VersionError(f"Publisher.{func}: called after export(); declare every tensor first")
        new: dict[str, _Entry] = {}
        for d in declared:
            if d.name in self._entries or d.name in new:
                raise LayoutError(f"Publisher.{func}: name={d.name!r} declared twice")
            new[d.name] = _Entry(d)
        self._entries.update(new)  # all or nothing: a refused call declares none

    # -- export ------------------------------------------------------------------------------
    def export(self) -> None:
        """Register every tensor once, write the manifest and publish version 1.

        A publisher re-created in this process over the same memory, whose manifest equals the
        last one written for its rank through the same store object, keeps that manifest and its
        ``generation`` (receivers then find nothing changed); otherwise it takes a new generation.
        See Note [Warm metadata] in ``refit._memo``.
        """
        if self._link is not None:
            raise VersionError("Publisher.export: called twice")
        if not self._entries:
            raise LayoutError("Publisher.export: no tensors declared; call add() first")
        devices: dict[int, str] = {}  # device -> the first tensor on it, to name in an error
        for name, e in self._entries.items():
            d = e.declared.device()
            devices.setdefault(-1 if d.type == "cpu" else d.index, name)
        if len(devices) != 1:
            found = ", ".join(f"tensor {n!r} on device {d}" for d, n in sorted(devices.items()))
            raise LayoutError(f"Publisher.export: tensors on several devices ({found}); expected one device")
        (device,) = devices
        self._link_lease = lease_link(self._backend_arg, device, self.timeout_s)
        self._link = self._link_lease.resource
        self.device = device

        to_stage: list[_Entry] = []
        with self._link.device_scope():
            for e in self._entries.values():
                # Built tensors and empty ones (an empty region is no region) are staged.
                if not e.declared.in_place or e.layout.nbytes == 0:
                    to_stage.append(e)
                    continue
                try:
                    region = self._link.register(e.declared.memory())
                except LayoutError:
                    to_stage.append(e)
                    continue
                e.region_idx, e.data_ptr = len(self._regions), e.declared.data_ptr()
                self._regions.append(region)
        # The version header (Note [Version header]) leads the staging arena; with nothing to stage
        # it has a region of its own.
        offsets, total = [], _HEADER_SPACE
        for e in to_stage:
            offsets.append(total)
            total += (e.layout.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self._staging = self._link.allocate(total)
        self._staging.tensor.zero_()  # padding of built tensors is never written again
        header_idx = len(self._regions)
        self._regions.append(self._staging)
        self._header = PublisherHeader(self._staging, 0)
        for e, off in zip(to_stage, offsets):
            e.region_idx, e.offset, e.staged = header_idx, off, True
            e.view = self._staging.tensor[off : off + e.layout.nbytes].view(torch_dtype(e.layout.dtype)).view(e.layout.shape)
        if to_stage:
            log.info("publisher stages tensors", extra={"rank": self.rank, "num_staged": len(to_stage), "nbytes": total})
        weights = {id(e.declared.quantized): e.declared.quantized for e in self._entries.values() if e.declared.quantized}
        if weights:
            self._quantizer = quantize.Quantizer(
                [(w, self._entries[w.name].view, self._entries[w.scale_name].view) for w in weights.values()],
                self._fp8.scheme, self._fp8.group)
            self._quantizer.check_group()

        self._board = self._take_board()
        host, pid, start = local_identity()
        manifest = {
            "schema_version": schema.MANIFEST_SCHEMA_VERSION,
            "kind": "publisher_manifest",
            "peer": {
                "schema_version": 1, "kind": "peer_info", "role": "publisher", "rank": self.rank,
                "world_size": self.world_size, "generation": 0, "host": host, "pid": pid,
                "start_time": start, "device": device, "backend": self._link.backend,
            },
            "regions": [r.desc for r in self._regions],
            "tensors": [
                {**e.layout.to_json(), "region": e.region_idx, "offset": e.offset} for e in self._entries.values()
            ],
            "board": self._board.desc if self._board is not None else None,
            "header": {"region": header_idx, "offset": 0},
        }
        with self.store.deadline(self.timeout_s):  # Note [Store deadlines] in rendezvous.store
            self.generation, raw = self._write_manifest(manifest)
            self._digest = digest_prefix(hashlib.sha256(raw).hexdigest())
            self._refresh()
            self.version = 1
            self._say(PUBLISHED)
            protocol.write_state(self.store, self.rank, protocol.VersionState(1, "published", self.generation))
        if self._board is not None:
            self._board.publish(self.generation, 1, self.timeout_s)

    def _take_board(self) -> PublisherBoard | None:
        """The board local receivers sync on (Note [Version board] in refit._board): the one a
        publisher of this rank closed in this process (pooling on), or a new one. None when /dev/shm
        cannot hold one: receivers then count themselves in through the store."""
        board = _board.take_parked(self.store, self.rank)
        if board is not None:
            return board
        try:
            return PublisherBoard()
        except PoolError as exc:
            log.warning("publisher has no version board; local receivers sync through the store",
                        extra={"rank": self.rank, "error": str(exc)})
            return None

    def _write_manifest(self, manifest: dict) -> tuple[int, bytes]:
        """Store ``manifest`` under a new generation, or keep the generation of an equal manifest
        this process wrote before (Note [Warm metadata] in refit._memo); returns the generation and
        the manifest's bytes."""
        last = exported_manifests.get(self.store, self.rank)
        if last is not None:
            generation, body, raw = last
            manifest["peer"]["generation"] = generation
            # Read back: a key overwritten since (a bad peer, a test) gets a fresh generation.
            if manifest == body and self._stored(protocol.manifest_key(self.rank, generation)) == raw:
                return generation, raw
        generation = self.store.next_generation(f"pub/{self.rank}")
        manifest["peer"]["generation"] = generation
        raw = schema.encode(manifest)  # validated: a bad manifest is refused before it is published
        # A blob: manifests of large models pass one store value (Note [Blobs] in rendezvous._blobs).
        self.store.set_blob(protocol.manifest_key(self.rank, generation), raw)
        exported_manifests.put(self.store, self.rank, (generation, manifest, raw))
        return generation, raw

    def _stored(self, key: str) -> bytes | None:
        """The manifest bytes under ``key`` now; None when absent or no longer a whole blob."""
        try:
            return self.store.try_get_blob(key)
        except MetadataError:
            return None

    def _refresh(self) -> None:
        """Make the published bytes those of the live tensors now (Note [Live sources])."""
        import torch

        for e in self._entries.values():
            if e.staged:
                if e.declared.quantized is None:  # FP8 values and scales: the quantizer's, below
                    run_fills(e.declared.staging_fills(), e.view)
            elif e.declared.data_ptr() != e.data_ptr:
                raise LayoutError(
                    f"Publisher.publish: tensor {e.declared.name!r} moved since export (data_ptr "
                    f"{e.data_ptr:#x} -> {e.declared.data_ptr():#x}; was its .data replaced?); receivers would read "
                    "memory it no longer uses: re-create the publisher after re-allocating parameters"
                )
        if self._quantizer is not None:
            self._quantizer.run()
        if self.device >= 0:
            torch.cuda.current_stream(self.device).synchronize()

    # -- versions ----------------------------------------------------------------------------
    def begin_update(self, timeout_s: float | None = None) -> float:
        """Stop new readers and wait until current ones finish; then tensors may be written.

        Returns:
            Seconds spent waiting for readers.

        Raises:
            TransferTimeout: readers still inside after ``timeout_s`` (a receiver died mid-pull).
        """
        self._check_exported("begin_update")
        if self._updating and self._drained:
            # Readers are already out (an update body that raised left us here): the tensors may be
            # half written, so nothing is published until publish() is called.
            return 0.0
        start = time.perf_counter()
        limit_s = timeout_s if timeout_s is not None else self.timeout_s
        with self.store.deadline(limit_s):  # Note [Store deadlines] in rendezvous.store
            if not self._updating:
                self._let_line_in(min(self.line_wait_s, limit_s / 2))
                # The header first: a store-synced reader that counts in after this drain's read of its
                # count reads the header after this, and backs off (Note [Version header]).
                self._say(UPDATING)
                protocol.write_state(self.store, self.rank, protocol.VersionState(self.version, "updating", self.generation))
                self._updating, self._drained = True, False
            # A retry after a timeout waits again: the slow reader may still be inside. Readers on
            # this host hold the board's lock, the others count in the store: both must be out.
            self._wait_no_readers(limit_s, start)
        # Before the trainer may write a byte: a store-synced reader whose pull overlaps the writes
        # (its count forged or revoked) finds "writing" after its pull (Note [Version header]).
        self._say(WRITING)
        self._drained = True
        return time.perf_counter() - start

    def publish(self) -> int:
        """Announce the tensors' current contents as the next version; returns it.

        On CUDA the caller's pending kernels are waited for first (the current stream is
        synchronized), so receivers never read bytes still being written.
        """
        self._check_exported("publish")
        if not self._updating:
            raise VersionError("Publisher.publish: begin_update() was not called since the last publish (or that "
                               "publish raised once its version was out); tensors may be in use by receivers")
        if not self._drained:
            # (publishing refreshes the published bytes: a reader still inside would read a mix)
            raise VersionError("Publisher.publish: begin_update() raised before every reader was out; call it again "
                               "until it returns, then write the tensors and publish")
        if self.device >= 0:
            import torch

            torch.cuda.current_stream(self.device).synchronize()
        self._refresh()
        self.version += 1
        self._say(PUBLISHED)
        # From here receivers may enter the new version, whatever happens next: if the store or the
        # board fails below, the next begin_update drains them from the start, as after any publish.
        self._updating = False
        with self.store.deadline(self.timeout_s):
            protocol.write_state(self.store, self.rank, protocol.VersionState(self.version, "published", self.generation))
        if self._board is not None:
            self._board.publish(self.generation, self.version, self.timeout_s)
        return self.version

    def _say(self, state: int) -> None:
        """Write this publisher's version header (Note [Version header])."""
        self._header.write(self.generation, self.version, state, self._digest)

    def _let_line_in(self, limit_s: float) -> None:
        """Keep this version published while receivers stand in line for it, up to ``limit_s``
        (Note [Reader line] in refit._board): each enters it within one of its backoff steps."""
        backoff = Backoff(limit_s, first_s=200e-6, cap_s=2e-3)
        while (self._board is not None and self._board.line_waiting()) or protocol.line_waiting(self.store, self.rank):
            if backoff.expired():
                log.info("publisher goes on with receivers still in line", extra={"rank": self.rank, "waited_s": limit_s})
                return
            backoff.sleep()

    def _wait_no_readers(self, limit_s: float, start: float) -> None:
        """Wait until no receiver reads this version, on the board and in the store, both within
        ``limit_s`` of ``start``."""
        if self._board is not None:
            self._board.begin(self.version, limit_s)
        left = max(limit_s - (time.perf_counter() - start), 1e-3)
        protocol.wait_no_readers(self.store, self.rank, self.version, left)

    @contextlib.contextmanager
    def update(self, timeout_s: float | None = None):
        """``begin_update()`` on entry, ``publish()`` on a clean exit.

        If the body raises, nothing is published and receivers keep waiting (they time out rather
        than read half-written tensors); a later ``update()`` or ``publish()`` resumes.
        """
        self.begin_update(timeout_s)
        yield self
        self.publish()

    def _check_exported(self, func: str) -> None:
        if self._closed:
            raise VersionError(f"Publisher.{func}: publisher is closed")
        if self._link is None:
            raise VersionError(f"Publisher.{func}: export() was not called")

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Withdraw the published version, wait (up to the timeout) for readers still inside,
        then release registrations and staging. Idempotent.

        New receivers see ``updating`` and wait for a successor instead of reading memory this
        publisher gives back. If readers stay past the timeout, the memory is kept (never handed
        to another user while a peer may read it) and a warning is logged.
        """
        if self._closed:
            return
        self._closed = True
        if self._link is None:
            return
        # An export that failed before announcing a version has nothing to withdraw.
        if self.version > 0 and not self._withdraw():
            log.warning("publisher closed with readers inside; its regions are kept until the process exits",
                        extra={"rank": self.rank, "version": self.version})
            return
        board, self._board = self._board, None
        if board is not None:
            _board.park(self.store, self.rank, board)  # with pooling off, closed there
        if self._header is not None:  # before its memory goes back: a reader still planning sees it (Note [Version header])
            self._say(CLOSED)
        for region in self._regions:
            self._link.release(region)
        self._regions.clear()
        self._link_lease.release()
        self._link = None

    def _withdraw(self) -> bool:
        """Set ``updating`` and wait for readers (Note [Version protocol]); False if some stayed.
        A store that cannot be reached cannot let anyone in either: that counts as withdrawn."""
        start = time.perf_counter()
        try:
            with self.store.deadline(self.timeout_s):
                if not self._updating:
                    self._say(UPDATING)
                    protocol.write_state(self.store, self.rank, protocol.VersionState(self.version, "updating", self.generation))
                    self._updating, self._drained = True, False
                if not self._drained:
                    self._wait_no_readers(self.timeout_s, start)
                    self._say(WRITING)
                    self._drained = True
        except TransferTimeout:
            return False
        except MetadataError as exc:  # the store's reader counts are forged: readers elsewhere cannot be ruled out
            log.warning("publisher close found forged reader counts", extra={"rank": self.rank, "error": str(exc)})
            return False
        except (PeerLostError, TransferError) as exc:  # the store's server is gone (shutdown order)
            log.warning("publisher close could not reach the store", extra={"rank": self.rank, "error": repr(exc)})
        if self._board is not None:
            try:  # local receivers may still hold the board even when the store could not be reached
                self._board.withdraw(self.version, max(self.timeout_s - (time.perf_counter() - start), 1e-3))
            except TransferTimeout:
                return False
        return True

    def __repr__(self) -> str:
        return f"Publisher(rank={self.rank}/{self.world_size}, tensors={len(self._entries)}, version={self.version}, generation={self.generation})"


def _refuse_transposed(layouts, func: str) -> None:
    """Transposed layouts are receivers' only (Note [Transposed parts] in ``refit.manifest``)."""
    for lay in layouts:
        if isinstance(lay, TensorLayout) and lay.transposed:
            p = next(p for p in lay.parts if p.perm is not None)
            raise LayoutError(f"Publisher.{func}: layout {lay.name!r} holds logical={p.logical!r} transposed (perm={p.perm}); "
                              "expected a layout without perm (transposed parts are receiver-only: publish this tensor in "
                              "another convention, e.g. families.layouts(..., convention='hf'))")
