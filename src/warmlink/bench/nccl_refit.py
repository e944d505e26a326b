"""The refit baselines RL frameworks use today: NCCL broadcast, per tensor or in packed buckets.

A "trainer" process (rank 0, ``devices[0]``) holds the weights and an "inference" process (rank 1,
``devices[1]``) receives them. ``run_nccl_refit`` starts both, times every phase on the inference
rank and checks the received bytes, so that ``warmlink bench refit`` can print these baselines
beside warmlink's own cycles from the same run.

# Note [Phase timing]
Every phase is measured on the inference rank with the host clock between
``torch.cuda.synchronize()`` points. A cycle starts after a small collective that aligns both
ranks (not counted). In bucket mode each phase that needs the trainer (alloc, pack) ends with the
same small collective, so that the inference rank's clock covers the trainer's work and the next
phase starts with both ranks ready; that adds one tiny broadcast (tens of microseconds on NVLink)
to a warm bucket cycle, and two to the first. Per-tensor mode has only the transfer phase.
``init_s`` is ``init_process_group`` alone (no ``device_id``: NCCL creates its communicator
lazily), ``first_collective_s`` is the first 1-element broadcast, which pays for communicator
creation; ``group_init_s`` is their sum. Both clocks start after a barrier through the
rendezvous store, once both ranks have built and filled their tensors: otherwise the inference
rank would count the trainer's tensor filling (seconds at full scale, on CPU) as group creation.

# Note [Test pattern]
Trainer tensors are filled from an integer hash of (tensor seed, byte position), computed on the
device in int64 with every intermediate below 2**63. The bytes are the same on any device type or
model, so the inference rank regenerates them and compares bytes with ``torch.equal``: a
bit-exact check that also catches a tensor landing in the wrong place. Bit patterns include NaNs,
which is why the comparison is on bytes, not values.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
import queue
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from warmlink._dtypes import dtype_size, torch_dtype
from warmlink.errors import ConfigError, LayoutError, TransferTimeout

__all__ = ["run_nccl_refit", "TensorSpec", "CHILD_ENV"]

log = logging.getLogger("warmlink.bench")

TensorSpec = tuple[str, tuple[int, ...], str]

# Set for both children: no NVLink SHARP / multicast (see DESIGN.md, KINDS.md on the lent machines).
CHILD_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_TRAINER, _INFERENCE = 0, 1
_ROLE = {_TRAINER: "trainer", _INFERENCE: "inference"}
_ALIGN_BYTES = 256  # byte offset of every tensor inside a bucket
_GEN_CHUNK_BYTES = 1 << 26  # bytes of test pattern generated per step (int64 scratch = 8x)
_MASK31 = 0x7FFFFFFF
_BASE_SEED = 0x2C1B3C6D
_NATIVE_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8"}
_FAULTS = ("raise", "exit", "hang", "corrupt")


def run_nccl_refit(
    tensors_spec: Sequence[TensorSpec],
    *,
    mode: Literal["per_tensor", "bucket"],
    bucket_nbytes: int = 1 << 30,
    cycles: int = 3,
    devices: tuple[int, int] = (0, 1),
    backend: Literal["nccl", "gloo"] = "nccl",
    timeout_s: float = 300.0,
    _fault: dict | None = None,
) -> dict[str, Any]:
    """Broadcast a set of tensors from a trainer process to an inference process, ``cycles`` times.

    Args:
        tensors_spec: ``(name, shape, dtype name)`` per tensor, e.g. ``("w0", (4096, 4096),
            "bfloat16")``; names unique, dtype names as in ``warmlink._dtypes.DTYPE_SIZES``.
            Both processes allocate every tensor on their device (trainer: a deterministic test
            pattern, see Note [Test pattern]; inference: uninitialised).
        mode: ``"per_tensor"``: one ``dist.broadcast`` per tensor. ``"bucket"``: tensors are packed
            (``copy_`` into byte slices, 256-byte aligned) into flat uint8 buckets of at most
            ``bucket_nbytes`` (a larger tensor gets a bucket of its own), each bucket is
            broadcast, and the inference rank unpacks by ``copy_``. Buckets are allocated in cycle
            1 on both ranks and reused.
        bucket_nbytes: capacity of one bucket in bytes (default 1 GiB).
        cycles: number of refit cycles, >= 1.
        devices: CUDA device index of the trainer and of the inference process; ``-1`` means CPU
            tensors (use with ``backend="gloo"``).
        backend: ``"nccl"`` (two distinct CUDA devices) or ``"gloo"`` (CPU, for tests).
        timeout_s: bound in seconds on the whole run, and the process-group / store timeout.
        _fault: test seam, ``{"rank": r, "kind": "raise"|"exit"|"hang"|"corrupt"}``: rank ``r``
            raises, exits, or hangs before cycle 1, or flips one bit of its first non-empty tensor.

    Returns:
        A JSON-able dict owned by the caller: ``mode``, ``backend``, ``devices``, ``num_tensors``,
        ``bytes`` (one cycle's payload), ``bucket_nbytes`` and ``num_buckets`` (bucket mode),
        ``init_s``, ``first_collective_s``, ``group_init_s``, ``cycles`` (one dict per cycle:
        ``cycle``, ``alloc_s``, ``pack_s``, ``transfer_s``, ``unpack_s``, ``total_s``, seconds on
        the inference rank, see Note [Phase timing]), ``correct`` (bytes received in the last
        cycle equal the trainer's, bit for bit) and ``mismatched`` (up to 8 wrong tensor names).

    Raises:
        ConfigError: bad mode, backend, devices, cycles, bucket size or timeout.
        LayoutError: a malformed tensor spec (name, shape or dtype).
        RuntimeError: a child process failed; the message carries its traceback or exit code.
        TransferTimeout: no result within ``timeout_s``.

    Collective? No: call from one process; it spawns the two ranks and waits for them.
    Blocking? Yes, until both children reported or one failed; children are always stopped.
    Warm path? Not applicable (a baseline): the process group is created per call.
    """
    specs = _validate(tensors_spec, mode, bucket_nbytes, cycles, devices, backend, timeout_s, _fault)
    from datetime import timedelta

    import torch.distributed as dist
    import torch.multiprocessing as mp

    cfg = {
        "specs": specs,
        "mode": mode,
        "bucket_nbytes": int(bucket_nbytes),
        "cycles": int(cycles),
        "devices": [int(d) for d in devices],
        "backend": backend,
        "timeout_s": float(timeout_s),
        "fault": _fault,
    }
    ctx = mp.get_context("spawn")
    # The parent serves the store, so no port is guessed and no race for it exists.
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    result_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child_main,
            args=(rank, cfg, store.port, result_q),
            name=f"warmlink-nccl-refit-{_ROLE[rank]}",
            daemon=True,
        )
        for rank in (_TRAINER, _INFERENCE)
    ]
    log.info("run_nccl_refit: starting mode=%s backend=%s devices=%s num_tensors=%d",
             mode, backend, devices, len(specs))
    ok = False
    try:
        with _child_env():
            for p in procs:
                p.start()
        results = _collect(procs, result_q, time.monotonic() + timeout_s, timeout_s)
        ok = True
    finally:
        _stop(procs, grace_s=10.0 if ok else 0.0)
        result_q.cancel_join_thread()
        result_q.close()
        del store
    inf = results[_INFERENCE]
    out: dict[str, Any] = {
        "mode": mode,
        "backend": backend,
        "devices": list(cfg["devices"]),
        "num_tensors": len(specs),
        "bytes": sum(s[3] for s in specs),
    }
    if mode == "bucket":
        out["bucket_nbytes"] = int(bucket_nbytes)
        out["num_buckets"] = len(_bucket_layout([s[3] for s in specs], bucket_nbytes)[0])
    out.update(
        init_s=inf["init_s"],
        first_collective_s=inf["first_collective_s"],
        group_init_s=inf["init_s"] + inf["first_collective_s"],
        cycles=inf["cycles"],
        correct=inf["correct"],
        mismatched=inf["mismatched"],
    )
    return out


def _int_at_least(x: Any, lo: int) -> bool:
    """Whether ``x`` is an integer (``int``, numpy integer; not bool) >= ``lo``."""
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        return False
    return operator.index(x) >= lo


def _validate(tensors_spec, mode, bucket_nbytes, cycles, devices, backend, timeout_s, fault) -> list[list]:
    """Check every argument before a process starts; returns ``[name, shape, dtype, nbytes]`` rows."""
    fn = "run_nccl_refit"
    if mode not in ("per_tensor", "bucket"):
        raise ConfigError(f"{fn}: mode={mode!r} is unknown; expected 'per_tensor' or 'bucket'")
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"{fn}: backend={backend!r} is unknown; expected 'nccl' or 'gloo'")
    if not _int_at_least(cycles, 1):
        raise ConfigError(f"{fn}: cycles={cycles!r} is invalid; expected an int >= 1")
    if not _int_at_least(bucket_nbytes, _ALIGN_BYTES):
        raise ConfigError(f"{fn}: bucket_nbytes={bucket_nbytes!r} is invalid; expected an int >= {_ALIGN_BYTES} bytes")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"{fn}: timeout_s={timeout_s!r} is invalid; expected seconds > 0")
    if not isinstance(devices, (tuple, list)) or len(devices) != 2 or not all(_int_at_least(d, -1) for d in devices):
        raise ConfigError(f"{fn}: devices={devices!r} is invalid; expected (trainer, inference) ints >= -1")
    if backend == "nccl" and (min(devices) < 0 or devices[0] == devices[1]):
        raise ConfigError(
            f"{fn}: devices={tuple(devices)!r} is invalid for backend='nccl'; expected two distinct CUDA device "
            "indices (use backend='gloo' with devices=(-1, -1) on CPU)"
        )
    if fault is not None and (not isinstance(fault, dict) or fault.get("rank") not in (0, 1)
                              or fault.get("kind") not in _FAULTS):
        raise ConfigError(f"{fn}: _fault={fault!r} is invalid; expected {{'rank': 0|1, 'kind': {_FAULTS}}}")
    if not isinstance(tensors_spec, (list, tuple)) or not tensors_spec:
        raise LayoutError(f"{fn}: tensors_spec is empty or not a list; expected (name, shape, dtype) tuples")
    rows: list[list] = []
    seen: set[str] = set()
    for idx, item in enumerate(tensors_spec):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise LayoutError(f"{fn}: tensors_spec[{idx}]={item!r} is malformed; expected (name, shape, dtype)")
        name, shape, dtype = item
        if not isinstance(name, str) or not name or name in seen:
            raise LayoutError(f"{fn}: tensors_spec[{idx}] name={name!r} is empty, not a str or repeated")
        seen.add(name)
        if not isinstance(shape, (tuple, list)) or not all(_int_at_least(d, 0) for d in shape):
            raise LayoutError(f"{fn}: tensor={name!r} shape={shape!r} is invalid; expected ints >= 0")
        try:
            itemsize = dtype_size(dtype)
        except Exception as exc:  # MetadataError: re-raised as a layout problem of this tensor
            raise LayoutError(f"{fn}: tensor={name!r} {exc}") from None
        shape = [operator.index(d) for d in shape]
        rows.append([name, shape, dtype, math.prod(shape) * itemsize])
    return rows


def _bucket_layout(nbytes: Sequence[int], bucket_nbytes: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Greedy packing of tensors into buckets.

    Args:
        nbytes: payload bytes of each tensor, in order.
        bucket_nbytes: capacity of a bucket in bytes; a tensor larger than this gets its own bucket.

    Returns:
        ``(bucket sizes in bytes, trimmed to their content; (bucket index, byte offset) per
        tensor)``. Offsets are multiples of 256 bytes.
    """
    sizes: list[int] = []
    places: list[tuple[int, int]] = []
    open_idx = -1
    for n in nbytes:
        if n > bucket_nbytes:
            sizes.append(n)
            places.append((len(sizes) - 1, 0))
            continue
        off = -(-sizes[open_idx] // _ALIGN_BYTES) * _ALIGN_BYTES if open_idx >= 0 else 0
        if open_idx < 0 or off + n > bucket_nbytes:
            sizes.append(0)
            open_idx, off = len(sizes) - 1, 0
        places.append((open_idx, off))
        sizes[open_idx] = off + n
    return sizes, places


def _tensor_seed(idx: int) -> int:
    return (_BASE_SEED ^ ((idx + 1) * 0x9E3779B1)) & _MASK31


def _fill_pattern(dst_bytes, seed: int, is_bool: bool) -> None:
    """Write the Note [Test pattern] bytes for ``seed`` into the 1-D uint8 tensor ``dst_bytes``."""
    import torch

    n = dst_bytes.numel()
    for start in range(0, n, _GEN_CHUNK_BYTES):
        stop = min(n, start + _GEN_CHUNK_BYTES)
        pos = torch.arange(start, stop, dtype=torch.int64, device=dst_bytes.device)
        x = (pos & _MASK31) * 0x5851F42D + (pos >> 31) * 0x3C6EF372 + seed  # < 2**63
        x.bitwise_and_(_MASK31)
        for _ in range(2):
            x.bitwise_xor_(x >> 16)
            x.mul_(0x45D9F3B).bitwise_and_(_MASK31)  # x < 2**31, factor < 2**27
        x.bitwise_xor_(x >> 16)
        x = (x >> 3) & (1 if is_bool else 0xFF)
        dst_bytes[start:stop].copy_(x.to(torch.uint8))


def _as_bytes(t):
    """1-D uint8 view of a contiguous tensor (shares its memory)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def _child_main(rank: int, cfg: dict, store_port: int, result_q) -> None:
    """Entry point of a spawned rank: runs ``_worker`` and reports a JSON-able dict on the queue."""
    os.environ.update(CHILD_ENV)
    try:
        msg = {"rank": rank, "ok": True, "result": _worker(rank, cfg, store_port)}
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as text
        msg = {"rank": rank, "ok": False, "error": traceback.format_exc()}
    result_q.put(msg)
    result_q.close()
    result_q.join_thread()


def _inject(cfg: dict, rank: int) -> None:
    fault = cfg.get("fault")
    if not fault or fault["rank"] != rank:
        return
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault in rank {rank} ({_ROLE[rank]})")
    if fault["kind"] == "exit":
        os._exit(3)
    if fault["kind"] == "hang":
        time.sleep(1e6)  # the parent's timeout must end it


def _worker(rank: int, cfg: dict, store_port: int) -> dict:
    """One rank's whole run; returns its timings (the inference rank's are the ones reported)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dev_idx = cfg["devices"][rank]
    is_cuda = dev_idx >= 0
    device = torch.device("cuda", dev_idx) if is_cuda else torch.device("cpu")
    if is_cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize(device)

    specs = cfg["specs"]
    tensors = []
    for idx, (_name, shape, dtype, _nbytes) in enumerate(specs):
        t = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        if rank == _TRAINER:
            _fill_pattern(_as_bytes(t), _tensor_seed(idx), dtype == "bool")
        tensors.append(t)
    src_bytes = [_as_bytes(t) for t in tensors]
    if (cfg.get("fault") or {}).get("kind") == "corrupt" and rank == cfg["fault"]["rank"]:
        first = next(b for b in src_bytes if b.numel() > 0)  # one flipped bit the check must catch
        first[:1].bitwise_xor_(1)
    # per_tensor sends each tensor as itself (bytes for dtypes a backend may lack); nothing for empty ones
    wire = [t if spec[2] in _NATIVE_DTYPES else b for t, b, spec in zip(tensors, src_bytes, specs) if spec[3] > 0]
    sync()

    timeout = timedelta(seconds=cfg["timeout_s"])
    store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=timeout)
    store.set(f"filled/{rank}", b"1")  # See Note [Phase timing]: group creation is timed from here
    store.wait([f"filled/{1 - rank}"])
    t0 = time.perf_counter()
    dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=2, timeout=timeout)
    t1 = time.perf_counter()
    flag = torch.ones(1, dtype=torch.float32, device=device)
    dist.broadcast(flag, src=_TRAINER)
    sync()
    t2 = time.perf_counter()

    def align() -> None:  # See Note [Phase timing]
        dist.broadcast(flag, src=_TRAINER)
        sync()

    sizes, places = _bucket_layout([s[3] for s in specs], cfg["bucket_nbytes"])
    buckets: list | None = None
    slots: list = []
    out_cycles = []
    _inject(cfg, rank)
    for cycle in range(1, cfg["cycles"] + 1):
        if cycle == cfg["cycles"] and rank == _INFERENCE:
            for t in tensors:  # the last cycle must deliver every byte itself
                t.zero_()
            for b in buckets or ():
                b.zero_()
        align()
        ph = {"alloc_s": 0.0, "pack_s": 0.0, "transfer_s": 0.0, "unpack_s": 0.0}
        start = tick = time.perf_counter()
        if cfg["mode"] == "per_tensor":
            for t in wire:
                dist.broadcast(t, src=_TRAINER)
            sync()
            ph["transfer_s"] = time.perf_counter() - tick
        else:
            if buckets is None:
                buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
                slots = [buckets[b][off : off + s[3]] for (b, off), s in zip(places, specs)]
                sync()
                align()
                now = time.perf_counter()
                ph["alloc_s"], tick = now - tick, now
            if rank == _TRAINER:
                for slot, src in zip(slots, src_bytes):
                    slot.copy_(src)
            sync()
            align()
            now = time.perf_counter()
            ph["pack_s"], tick = now - tick, now
            for b in buckets:
                if b.numel() > 0:
                    dist.broadcast(b, src=_TRAINER)
            sync()
            now = time.perf_counter()
            ph["transfer_s"], tick = now - tick, now
            if rank == _INFERENCE:
                for dst, slot in zip(src_bytes, slots):
                    dst.copy_(slot)
            sync()
            ph["unpack_s"] = time.perf_counter() - tick
        ph["total_s"] = time.perf_counter() - start
        out_cycles.append({"cycle": cycle, **ph})

    mismatched: list[str] = []
    if rank == _INFERENCE:
        for idx, (name, _shape, dtype, nbytes) in enumerate(specs):
            expected = torch.empty(nbytes, dtype=torch.uint8, device=device)
            _fill_pattern(expected, _tensor_seed(idx), dtype == "bool")
            if not torch.equal(src_bytes[idx], expected):
                mismatched.append(name)
            del expected
    align()  # nobody tears down while the other still uses the group
    dist.destroy_process_group()
    return {
        "init_s": t1 - t0,
        "first_collective_s": t2 - t1,
        "cycles": out_cycles,
        "correct": rank == _INFERENCE and not mismatched,
        "mismatched": mismatched[:8],
    }


@contextlib.contextmanager
def _child_env() -> Iterator[None]:
    """Set ``CHILD_ENV`` while the children are started (spawn copies the environment), then restore."""
    saved = {k: os.environ.get(k) for k in CHILD_ENV}
    os.environ.update(CHILD_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _collect(procs: list, result_q, deadline: float, timeout_s: float) -> dict[int, dict]:
    """Wait for one result per rank; raise on the first failure, a silent death or the deadline."""
    results: dict[int, dict] = {}
    while len(results) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [f"{r} ({_ROLE[r]})" for r in range(len(procs)) if r not in results]
            raise TransferTimeout(
                f"run_nccl_refit: rank(s) {', '.join(missing)} reported no result within timeout_s={timeout_s}; "
                "expected both ranks to finish (raise timeout_s for large specs, check the GPUs with warmlink doctor)"
            )
        try:
            msg = result_q.get(timeout=min(0.5, remaining))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
            if not dead:
                continue
            try:  # a message may still be in the pipe of a process that just exited
                msg = result_q.get(timeout=1.0)
            except queue.Empty:
                r = dead[0]
                raise RuntimeError(
                    f"run_nccl_refit: rank {r} ({_ROLE[r]}) exited with code {procs[r].exitcode} "
                    "without reporting a result (killed, or crashed in native code)"
                ) from None
        rank = msg["rank"]
        if not msg["ok"]:
            # A peer that died first is the cause; this rank's error is then only its symptom.
            for r, p in enumerate(procs):
                if r != rank and r not in results:
                    p.join(timeout=0.5)
            dead = [f"rank {r} ({_ROLE[r]}) exited with code {p.exitcode}; " for r, p in enumerate(procs)
                    if r != rank and p.exitcode not in (None, 0)]
            raise RuntimeError(f"run_nccl_refit: {''.join(dead)}rank {rank} ({_ROLE[rank]}) failed:\n{msg['error']}")
        results[rank] = msg["result"]
    return results


def _stop(procs: list, grace_s: float) -> None:
    """Join each child for ``grace_s`` seconds, then terminate, then kill; never waits unbounded."""
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=grace_s)
        if p.is_alive():
            log.warning("run_nccl_refit: terminating %s (pid %d)", p.name, p.pid)
            p.terminate()
            p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
