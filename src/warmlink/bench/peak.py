"""Copy-engine reference figures every benchmark is judged against (DESIGN.md hardware table).

All memory is plain ``cudaMalloc`` made and freed here; copies are ``cudaMemcpyAsync`` /
``cudaMemcpyBatchAsync`` on non-blocking streams of the *destination* device (a pull), timed with
CUDA events unless stated. GB = 1e9 bytes. Results are plain JSON-able dicts.
"""

from __future__ import annotations

import statistics
import time

from warmlink import _cuda

__all__ = ["peer_copy_peak", "batched_vs_loop"]

_WARMUP = 2


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


class _Scratch:
    """Allocations, streams and events made for one measurement; all freed on exit."""

    def __init__(self) -> None:
        self.ptrs: list[tuple[int, int]] = []
        self.streams: list[int] = []
        self.events: list[int] = []

    def malloc(self, nbytes: int, device: int) -> int:
        ptr = _cuda.malloc(nbytes, device)
        self.ptrs.append((ptr, device))
        return ptr

    def stream(self, device: int) -> int:
        self.streams.append(_cuda.stream_create(device))
        return self.streams[-1]

    def event(self, device: int) -> int:
        self.events.append(_cuda.event_create(device, timing=True))
        return self.events[-1]

    def __enter__(self) -> "_Scratch":
        return self

    def __exit__(self, *exc) -> None:
        for s in self.streams:
            _cuda.stream_synchronize(s)
            _cuda.stream_destroy(s)
        for e in self.events:
            _cuda.event_destroy(e)
        for ptr, device in self.ptrs:
            _cuda.free(ptr, device)


def _timed(issue, stream: int, start: int, end: int, repeats: int) -> tuple[list[float], list[float]]:
    """Run ``issue(stream)`` ``repeats`` times after warm-up; (device ms, host issue us) lists."""
    device_ms, issue_us = [], []
    for i in range(_WARMUP + repeats):
        _cuda.event_record(start, stream)
        t0 = time.perf_counter()
        issue(stream)
        t1 = time.perf_counter()
        _cuda.event_record(end, stream)
        _cuda.event_synchronize(end)
        if i >= _WARMUP:
            device_ms.append(_cuda.event_elapsed_ms(start, end))
            issue_us.append((t1 - t0) * 1e6)
    return device_ms, issue_us


def flat_copy_peak(device: int, nbytes: int, repeats: int = 10) -> dict:
    """One flat device-to-device copy of ``nbytes`` within ``device``: the colocated refit's ceiling
    (the trainer's and the engine's memory are the same HBM).

    Returns ``one_way_ms`` / ``one_way_gbps`` (median, event-timed) and ``one_way_all_ms``.
    Blocking? Yes; allocates and frees ``2 * nbytes`` on ``device``.
    """
    with _Scratch() as s:
        src, dst = s.malloc(nbytes, device), s.malloc(nbytes, device)
        stream, start, end = s.stream(device), s.event(device), s.event(device)
        ms, _ = _timed(lambda st: _cuda.memcpy_async(dst, src, nbytes, st), stream, start, end, repeats)
    one = statistics.median(ms)
    return {"src_device": device, "dst_device": device, "nbytes": nbytes, "repeats": repeats,
            "method": "cudaMemcpyAsync, one flat copy", "one_way_ms": one, "one_way_gbps": _gbps(nbytes, one),
            "one_way_all_ms": ms}


def peer_copy_peak(src_device: int = 0, dst_device: int = 1, nbytes: int = 1 << 30, repeats: int = 10) -> dict:
    """One large peer copy, one way and both ways at once.

    Args:
        src_device, dst_device: CUDA device indices (equal gives a same-GPU copy).
        nbytes: bytes per copy (default 1 GiB); 4 buffers of this size are allocated.
        repeats: timed repetitions after 2 warm-ups.

    Returns:
        ``one_way_ms`` / ``one_way_gbps``: median of one ``cudaMemcpyAsync`` src -> dst on a stream
        of ``dst_device`` (event-timed). ``both_ways_ms`` / ``both_ways_total_gbps``: median host
        wall time of src -> dst and dst -> src issued together on a stream of each device, and
        the bytes of both copies over it. Also ``one_way_all_ms``, the raw samples.

    Blocking? Yes, host-synchronous; allocates and frees ``4 * nbytes``.
    """
    _cuda.enable_peer_access(dst_device, src_device)
    _cuda.enable_peer_access(src_device, dst_device)
    with _Scratch() as s:
        a_src, a_dst = s.malloc(nbytes, src_device), s.malloc(nbytes, dst_device)
        b_src, b_dst = s.malloc(nbytes, dst_device), s.malloc(nbytes, src_device)
        pull, push = s.stream(dst_device), s.stream(src_device)
        start, end = s.event(dst_device), s.event(dst_device)
        one_ms, _ = _timed(lambda st: _cuda.memcpy_async(a_dst, a_src, nbytes, st), pull, start, end, repeats)
        both_ms = []
        for i in range(_WARMUP + repeats):
            _cuda.stream_synchronize(pull)
            _cuda.stream_synchronize(push)
            t0 = time.perf_counter()
            _cuda.memcpy_async(a_dst, a_src, nbytes, pull)
            _cuda.memcpy_async(b_dst, b_src, nbytes, push)
            _cuda.stream_synchronize(pull)
            _cuda.stream_synchronize(push)
            if i >= _WARMUP:
                both_ms.append((time.perf_counter() - t0) * 1e3)
    one, both = statistics.median(one_ms), statistics.median(both_ms)
    return {
        "src_device": src_device, "dst_device": dst_device, "nbytes": nbytes, "repeats": repeats,
        "method": "cudaMemcpyAsync", "copy_stream_device": dst_device,
        "one_way_ms": one, "one_way_gbps": _gbps(nbytes, one), "one_way_all_ms": one_ms,
        "both_ways_ms": both, "both_ways_total_gbps": _gbps(2 * nbytes, both),
        "both_ways_timing": "host wall clock",
    }


def batched_vs_loop(
    num_tensors: int = 290, total_nbytes: int = 8 * 10**9, src_device: int = 0, dst_device: int = 1, repeats: int = 5
) -> dict:
    """Separately allocated tensors copied src -> dst: a loop of ``cudaMemcpyAsync`` against one
    ``cudaMemcpyBatchAsync``.

    Args:
        num_tensors: separate ``cudaMalloc`` allocations on each side.
        total_nbytes: bytes over all tensors (split evenly, each rounded down to 256 bytes).
        src_device, dst_device: CUDA device indices; copies run on a stream of ``dst_device``.
        repeats: timed repetitions after 2 warm-ups.

    Returns:
        Medians: ``loop_ms``, ``loop_gbps``, ``loop_issue_us`` (host time to enqueue), and the same
        for ``batch_*`` (None when ``cudaMemcpyBatchAsync`` is unavailable), plus the sizes.

    Blocking? Yes; allocates and frees ``2 * total_nbytes``.
    """
    if num_tensors < 1:
        raise ValueError(f"batched_vs_loop: num_tensors={num_tensors}; expected >= 1")
    each = (total_nbytes // num_tensors) // 256 * 256
    if each <= 0:
        raise ValueError(f"batched_vs_loop: total_nbytes={total_nbytes} too small for {num_tensors} tensors")
    total = each * num_tensors
    _cuda.enable_peer_access(dst_device, src_device)
    result: dict = {"num_tensors": num_tensors, "nbytes_each": each, "total_nbytes": total,
                    "src_device": src_device, "dst_device": dst_device, "repeats": repeats,
                    "batch_supported": _cuda.batch_supported()}
    with _Scratch() as s:
        srcs = [s.malloc(each, src_device) for _ in range(num_tensors)]
        dsts = [s.malloc(each, dst_device) for _ in range(num_tensors)]
        sizes = [each] * num_tensors
        stream = s.stream(dst_device)
        start, end = s.event(dst_device), s.event(dst_device)

        def loop(st: int) -> None:
            for d, src in zip(dsts, srcs):
                _cuda.memcpy_async(d, src, each, st)

        ms, us = _timed(loop, stream, start, end, repeats)
        result.update(loop_ms=statistics.median(ms), loop_gbps=_gbps(total, statistics.median(ms)),
                      loop_issue_us=statistics.median(us))
        result.update(batch_ms=None, batch_gbps=None, batch_issue_us=None)
        if result["batch_supported"]:
            ms, us = _timed(lambda st: _cuda.memcpy_batch_async(dsts, srcs, sizes, st), stream, start, end, repeats)
            result.update(batch_ms=statistics.median(ms), batch_gbps=_gbps(total, statistics.median(ms)),
                          batch_issue_us=statistics.median(us))
    return result
