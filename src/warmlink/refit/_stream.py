"""Streaming receive: a version reaches an engine's ``load_weights`` bucket by bucket, through a
receive buffer of bounded size, for engines that cannot take the bytes in place (quantized or
checkpoint-format loading, layerwise reload, a module whose layout is unknown).

# Note [Streaming receive]
``Receiver.stream(load_weights, buffer_bytes=B)`` cuts the plan's tensors into *buckets* of
consecutive groups (``groups``: names that must reach one ``load_weights`` call together, such as
every tensor feeding one engine module, whose loader may keep references until the module is
complete), each at most ``B // 2`` bytes of receive, scratch and cast space. Two *slots* of
``B // 2`` bytes are allocated once from the link's arenas; bucket ``i`` lands in slot ``i % 2``.
The pull of bucket ``i + 1`` is issued before bucket ``i`` is handed over, so bytes move while the
engine loads; slot ``i % 2`` is written again only by bucket ``i + 2``, whose pull is issued after
``load_weights`` returned for bucket ``i``. The tensors handed over are views of a slot: valid
until that ``load_weights`` call returns (the engine copies them, as vLLM's loaders do).

The receiver counts itself in as a reader of the version for the whole stream (Note [Version
protocol]), so no publisher changes a byte of it meanwhile. A failure before the first
``load_weights`` call leaves the engine untouched and propagates as it is. A failure after it
cannot be undone: ``load_weights`` already took part of the version and the engine holds a mix.
That raises ``PartialLoadError`` naming the version, the bucket, how many tensors the engine took
and the cause; the next complete stream (or refit) of every tensor repairs it.

Warm path: slots, per-bucket views and prepared copy batches are kept across streams (keyed by the
plan's signature and the manifests' digests); a warm stream allocates, registers and plans nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from warmlink._dtypes import torch_dtype
from warmlink.errors import ConfigError, TransferError, WarmlinkError
from warmlink.refit import translate
from warmlink.transport.base import Copy

__all__ = ["StreamReport", "PartialLoadError", "StreamState", "bucket_plan", "groups_key"]

_ALIGN = 256


class PartialLoadError(TransferError):
    """A stream failed after ``load_weights`` took part of a version: the engine holds a mix of
    versions until the next complete refit (Note [Streaming receive]).

    Attributes:
        version: the version being streamed.
        bucket_idx: the bucket that failed (0-based), of ``num_buckets``.
        handed: names ``load_weights`` already took, in order.
    """

    def __init__(self, message: str, *, version: int, bucket_idx: int, num_buckets: int, handed: list[str]) -> None:
        super().__init__(message)
        self.version, self.bucket_idx, self.num_buckets, self.handed = version, bucket_idx, num_buckets, handed


@dataclass
class StreamReport:
    """One stream: sizes in bytes, times in seconds (``*_at_s`` since the stream started).

    ``peak_buffer_bytes`` is the receive memory the stream used (both slots); ``nbytes`` what
    moved over the link, ``handed_nbytes`` what ``load_weights`` was handed (padding included).
    ``issued_at_s[i]``, ``arrived_at_s[i]`` and ``handed_at_s[i]``: when bucket ``i``'s pull was
    issued, when its bytes were all there, when it was handed to ``load_weights``.
    """

    cycle: int
    version: int
    buffer_bytes: int
    num_buckets: int = 0
    num_tensors: int = 0
    peak_buffer_bytes: int = 0
    nbytes: int = 0
    handed_nbytes: int = 0
    sync_s: float = 0.0
    plan_s: float = 0.0
    alloc_s: float = 0.0
    pull_wait_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    issued_at_s: list = field(default_factory=list)
    arrived_at_s: list = field(default_factory=list)
    handed_at_s: list = field(default_factory=list)
    created: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _slot_nbytes(tp) -> int:
    """Slot space one tensor needs: receive, scratch for staged pulls, and its cast."""
    cast = tp.recv_nbytes // _itemsize(tp.src_dtype) * _itemsize(tp.dst_dtype) if tp.needs_cast else 0
    return _round(tp.recv_nbytes) + _round(tp.scratch_nbytes) + _round(cast)


def _itemsize(dtype: str) -> int:
    from warmlink._dtypes import dtype_size

    return dtype_size(dtype)


def bucket_plan(plan, slot_bytes: int, groups: Sequence[Sequence[str]] | None) -> list[list[int]]:
    """Indices into ``plan.tensors`` per bucket: consecutive groups, each bucket at most ``slot_bytes``.

    Raises:
        ConfigError: a group needs more than ``slot_bytes`` (names it, with the size to ask for),
            or a group names a tensor twice or one not declared.
    """
    index = {tp.dst: i for i, tp in enumerate(plan.tensors)}
    group_of: dict[int, int] = {}
    for g, names in enumerate(groups or ()):
        for name in names:
            i = index.get(name)
            if i is None:
                raise ConfigError(f"Receiver.stream: groups[{g}] names {name!r}, which is not declared; expected declared names")
            if i in group_of:
                raise ConfigError(f"Receiver.stream: {name!r} is in groups {group_of[i]} and {g}; expected one group per name")
            group_of[i] = g
    ordered: list[list[int]] = []  # groups in order of their first tensor in the plan
    seen: dict[int, list[int]] = {}
    for i in range(len(plan.tensors)):
        g = group_of.get(i)
        if g is None:
            ordered.append([i])
        elif g in seen:
            seen[g].append(i)
        else:
            seen[g] = [i]
            ordered.append(seen[g])
    buckets: list[list[int]] = []
    used = slot_bytes + 1
    for members in ordered:
        need = sum(_slot_nbytes(plan.tensors[i]) for i in members)
        if need > slot_bytes:
            names = [plan.tensors[i].dst for i in members]
            raise ConfigError(
                f"Receiver.stream: group {names[:4]}{'...' if len(names) > 4 else ''} needs {need} bytes of receive space; "
                f"expected at most buffer_bytes // 2 = {slot_bytes} (pass buffer_bytes >= {2 * need})")
        if used + need > slot_bytes:
            buckets.append([])
            used = 0
        buckets[-1].extend(members)
        used += need
    return buckets


class _Bucket:
    """One bucket laid into its slot: typed views, scratch, casts and the prepared copy batch."""

    __slots__ = ("members", "recv", "scratch", "final", "padded", "copies", "batch", "digests", "nbytes")

    def __init__(self, plan, members: list[int], region) -> None:
        buf = region.tensor
        self.members = members
        self.recv, self.scratch, self.final, self.padded, self.copies = [], [], [], [], []
        at = 0
        for i in members:
            tp = plan.tensors[i]
            recv_at, at = at, at + _round(tp.recv_nbytes)
            scratch_at, at = at, at + _round(tp.scratch_nbytes)
            recv = buf[recv_at: recv_at + tp.recv_nbytes].view(torch_dtype(tp.src_dtype)).view(tp.dst_shape)
            self.recv.append(recv)
            self.scratch.append(buf[scratch_at: scratch_at + tp.scratch_nbytes] if tp.staged else None)
            if tp.needs_cast:
                dt = torch_dtype(tp.dst_dtype)
                n = recv.numel() * _itemsize(tp.dst_dtype)
                cast_at, at = at, at + _round(n)
                self.final.append(buf[cast_at: cast_at + n].view(dt).view(tp.dst_shape))
            else:
                self.final.append(recv)
            if tp.padded:
                self.padded.append(recv)
            for run in tp.runs:
                self.copies.append((run.src_rank, run.src_tensor, recv_at + run.dst_offset, run.src_offset, run.row_nbytes,
                                    run.num_rows, run.dst_pitch, run.src_pitch))
            for sp in tp.staged:
                into = scratch_at + sp.scratch_offset
                if sp.runs:  # one box gathered compactly (Note [Transposed parts] in refit.manifest)
                    self.copies.extend((sp.src_rank, sp.src_tensor, into + r.dst_offset, r.src_offset, r.row_nbytes,
                                        r.num_rows, r.dst_pitch, r.src_pitch) for r in sp.runs)
                else:
                    self.copies.append((sp.src_rank, sp.src_tensor, into, 0, sp.src_nbytes, 1, 0, 0))
        self.nbytes = at
        self.batch = None
        self.digests = None

    def prepared(self, link, region, sources):
        """The copy batch filling this bucket from ``sources``' current manifests (prepared once per sources)."""
        digests = sources.opened_key()
        if self.batch is None or self.digests != digests:
            copies = []
            for rank, tensor, dst_at, src_off, row, rows, dst_pitch, src_pitch in self.copies:
                remote, offset = sources.region_of(rank, tensor)
                copies.append(Copy(region, dst_at, remote, offset + src_off, row, rows, dst_pitch, src_pitch))
            self.batch, self.digests = link.prepare(copies), digests
        return self.batch


class StreamState:
    """Two slots of receive memory and the buckets laid into them, for one plan and buffer size.

    Owned by one ``Receiver``; ``close`` gives the slots back to the link (idempotent).
    """

    __slots__ = ("link", "key", "slots", "buckets", "slot_bytes")

    def __init__(self, link, plan, buffer_bytes: int, groups) -> None:
        if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 2 * _ALIGN:
            raise ConfigError(f"Receiver.stream: buffer_bytes={buffer_bytes!r} invalid; expected an int >= {2 * _ALIGN}")
        self.link = link
        self.slot_bytes = buffer_bytes // 2
        members = bucket_plan(plan, self.slot_bytes, groups)
        need = max((sum(_slot_nbytes(plan.tensors[i]) for i in m) for m in members), default=_ALIGN)
        self.key = (plan.signature, buffer_bytes, groups_key(groups))
        # Two slots of what the largest bucket needs (at most buffer_bytes // 2 each).
        self.slots = [link.allocate(max(need, _ALIGN)) for _ in range(2 if len(members) > 1 else 1)]
        self.buckets = [_Bucket(plan, m, self.slots[b % len(self.slots)]) for b, m in enumerate(members)]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def run(self, plan, sources, load_weights: Callable, report: StreamReport, timeout_s: float, t0: float) -> None:
        """Pull bucket after bucket into the slots and hand each to ``load_weights`` (Note [Streaming receive])."""
        link, buckets = self.link, self.buckets
        report.num_buckets, report.peak_buffer_bytes = len(buckets), self.nbytes
        handed: list[str] = []
        pending, b = None, 0
        try:
            pending = self._issue(0, sources, report, t0)
            for b, bucket in enumerate(buckets):
                transfer, pending = pending, None
                t_wait = time.perf_counter()
                transfer.wait(timeout_s)
                report.arrived_at_s.append(time.perf_counter() - t0)
                report.pull_wait_s += time.perf_counter() - t_wait
                if b + 1 < len(buckets):  # the next pull moves while this bucket loads
                    pending = self._issue(b + 1, sources, report, t0)
                named = []
                for k, i in enumerate(bucket.members):
                    tp = plan.tensors[i]
                    if tp.staged:
                        translate.unstage(tp, bucket.recv[k], bucket.scratch[k])
                    if tp.needs_cast:
                        bucket.final[k].copy_(bucket.recv[k])
                    named.append((tp.dst, bucket.final[k]))
                _sync(link.device)
                t_load = time.perf_counter()
                report.handed_at_s.append(t_load - t0)
                handed.extend(name for name, _ in named)
                load_weights(iter(named))
                _sync(link.device)
                report.load_s += time.perf_counter() - t_load
                report.handed_nbytes += sum(t.numel() * t.element_size() for _, t in named)
        except BaseException as exc:
            if pending is not None:
                _drain(pending, timeout_s)  # its bytes stop moving before the slot is given back
            if not handed:
                raise
            raise PartialLoadError(
                f"Receiver.stream: version={report.version} failed in bucket {b} of {len(buckets)} after load_weights "
                f"took {len(handed)} of {report.num_tensors} tensors ({type(exc).__name__}: {exc}); what load_weights took "
                "cannot be undone, so the engine holds a mix of versions; expected: stream or refit a complete version "
                "again before serving (Note [Streaming receive])",
                version=report.version, bucket_idx=b, num_buckets=len(buckets), handed=handed) from exc

    def _issue(self, b: int, sources, report: StreamReport, t0: float):
        bucket = self.buckets[b]
        region = self.slots[b % len(self.slots)]
        for r in bucket.padded:  # slots are shared: padding of this bucket may hold another's bytes
            r.zero_()
        batch = bucket.prepared(self.link, region, sources)
        report.issued_at_s.append(time.perf_counter() - t0)
        report.nbytes += batch.nbytes
        return self.link.read(batch)

    def close(self) -> None:
        slots, self.slots, self.buckets = self.slots, [], []
        for region in slots:
            self.link.release(region)


def groups_key(groups) -> tuple | None:
    return None if groups is None else tuple(tuple(g) for g in groups)


def _drain(transfer, timeout_s: float) -> None:
    try:
        transfer.wait(timeout_s)
    except WarmlinkError:
        pass


def _sync(device: int) -> None:
    if device >= 0:
        import torch

        torch.cuda.current_stream(device).synchronize()
