"""Each of ep's mechanisms alone, with nothing else, for ``warmlink bench ep``: the copy engines
moving a dispatch's bytes (``copy_floor``), the push kernel storing them (``push_floor``), and the
combine's sum (``sum_alone``). They are the floors that the full calls' host work and other
kernels add to. Every function takes a Buffer that has run its last ep call: the floors overwrite
the peers' receive areas. Collective where it says so; CUDA only. Not part of ``warmlink.ep``'s
API (its ``__all__``): the measurements follow the internals they measure.
"""

from __future__ import annotations

import statistics

import torch

from warmlink.ep.kernels.call_block import Sources
from warmlink.ep.kernels.reduce import combine_sum
from warmlink.ep.kernels.steps import push
from warmlink.ep.paths.host_mover import as_words
from warmlink.ep.wire.regions import area

__all__ = ["FLOOR_SCHEDULES", "PUSH_SCHEDULES", "copy_floor", "push_floor", "sum_alone"]


FLOOR_SCHEDULES = ("one stream", "per-peer streams", "one stream, halves")


def copy_floor(buf, send_counts: list[int], timed) -> dict:
    """The copy-engine floor of the dispatch's exchange, in the same run: the same x bytes to each
    peer as raw ``cudaMemcpyAsync`` copies from this rank's staging area to the peers' receive
    areas, with nothing else (no plan, gathers, handshake or unpack), under the same timing.

    Schedules: every destination in turn on one stream (rotated, as ep sends), one stream per
    destination, and one stream with each destination's bytes in two halves, all first halves
    first. Collective; it overwrites the peers' receive areas, so it runs after the last ep call.
    """
    from warmlink import _cuda

    lay, me, mover = buf.layout, buf.rank, buf._mover
    row = lay.row_bytes("recv_x.0")
    src = mover.area_address(me, "stage_x")
    streams = [torch.cuda.Stream(buf.device) for _ in range(buf.num_ranks)]
    peers = [(me + i) % buf.num_ranks for i in range(1, buf.num_ranks)]
    jobs = {name: [] for name in FLOOR_SCHEDULES}
    for i, d in enumerate(peers):
        n = send_counts[d] * row
        dst, at = mover.area_address(d, "recv_x.0") + me * lay.max_tokens * row, src + d * lay.max_tokens * row
        jobs["one stream"].append((0, dst, at, n))
        jobs["per-peer streams"].append((i, dst, at, n))
        half = n // 2
        jobs["one stream, halves"].insert(i, (0, dst, at, half))
        jobs["one stream, halves"].append((0, dst + half, at + half, n - half))

    def run(job):
        for s, dst, at, n in job:
            _cuda.memcpy_async(dst, at, n, streams[s].cuda_stream)
        for s in streams:
            s.synchronize()

    return {name: timed(lambda job=job: run(job)) for name, job in jobs.items()}


# the push's schedules: (programs per SM, warps per program); the first is the Buffer's own
# (ep.kernels.steps.push's defaults); more programs or warps measured no faster (benchmarks/history-2026-11-22.md)
PUSH_SCHEDULES = {"a program per SM": (1, 4), "2 per SM": (2, 4), "4 per SM, 8 warps": (4, 8)}


def push_floor(buf, handle, x, timed) -> dict:
    """SM stores instead of copy engines: the push kernel alone (ep.paths.sm_pushes, Note [SM sends]) stores
    every token's row straight into each peer's receive area, with nothing else, same timing.
    Collective; it overwrites the peers' receive areas, so it runs after the last ep call."""
    lay, me, mover = buf.layout, buf.rank, buf._mover
    row = lay.row_bytes("recv_x.0")
    starts = [mover.area_address(d, "recv_x.0") + (handle.dst_rows[d] - d * lay.max_tokens) * row
              for d in range(buf.num_ranks)]
    bases = torch.tensor([0 if d == me else at for d, at in enumerate(starts)], dtype=torch.int64, device=x.device)
    src, no_meta = Sources(as_words(x)), torch.zeros_like(bases)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return {name: timed(lambda n=n, w=w: push(handle.combine_rows, src, bases, no_meta, lay.num_topk, lay.meta_bytes,
                                              programs=n * sms, num_warps=w))
            for name, (n, w) in PUSH_SCHEDULES.items()}


def sum_alone(buf, handle, rows, iterations: int) -> dict:
    """The combine's last step alone (ep.kernels.reduce.combine_sum over this rank's combine area and its
    own rows), device time between CUDA events, median; and the bytes it reads and writes. Local:
    it only reads the area, so it may run after the floors."""
    lay, me = buf.layout, buf.rank
    comb = buf._mover.own_view(area("comb_x", 0), rows.dtype, lay.hidden)
    out = torch.empty(handle.num_tokens, lay.hidden, dtype=rows.dtype, device=rows.device)
    shift = handle.recv_starts[me] - me * lay.max_tokens
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iterations):
        begin.record()
        combine_sum(comb, handle.combine_rows, out, local=(rows, me, shift))
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e-3)
    row = lay.hidden * rows.element_size()
    return {"s": statistics.median(samples), "read": int((handle.combine_rows >= 0).sum()) * row,
            "written": handle.num_tokens * row}
