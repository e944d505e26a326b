"""``warmlink bench ep``: MoE dispatch and combine, warmlink beside torch + NCCL, in one run.

One process per GPU (or per CPU rank over shm when there is no GPU). Every rank draws a random
routing (top-K of E experts, distinct per token), builds a ``warmlink.ep.Buffer`` (and one per
other choice of its arguments that it times) and one torch.distributed group, and times, each as
the median over ``--iterations``:

- warmlink dispatch BF16 and FP8, combine BF16, in normal mode and in hook mode (send phase, then
  the hook right away), and a cached-handle dispatch; on GPUs normal mode sends with the SMs
  (ep.paths.sm_pushes, Note [SM sends]), and the "copy" rows time it through the copy engines instead
  (a Buffer built with ``send="copy"``), in the same run; an SM dispatch replays CUDA graphs
  (Note [Fresh send graph]), and the "eager" rows (``graphs=False``) launch its kernels one by one;
- the same dispatch and combine done with torch + NCCL (``bench.ep_nccl``: count exchange,
  permutation, ``all_to_all_single``, ``index_add_``) and a bare ``all_to_all_single`` of the same
  bytes;
- overlap: a GEMM alone, a hook-mode dispatch alone, and send -> GEMM -> hook together, for a
  fresh dispatch and for a cached one; and a combine and a cached dispatch followed by the GEMM
  on the caller's stream, made without and with ``async_finish`` (which runs the call on the
  Buffer's communication stream, so the GEMM does not wait for it);
- the host time until a call returns: a fresh dispatch, the same with ``num_worst_tokens`` (which
  returns at launch on GPUs), a cached dispatch and a combine, on an idle device, (GPUs) behind
  about 1 ms of queued device work, and (two or more ranks) while every peer of rank 0 calls about
  1 ms after it;
- on GPUs, the copy engines alone moving the dispatch's bytes, and the push kernel alone storing
  them (``ep.api.diagnostics``): the floors that the exchange's host work and other kernels add to;
  and the combine's sum alone on the device.

Bytes per rank are the x bytes this rank sends to other ranks (rows it keeps are not counted; FP8
counts values and scales), as in ``bench.ep_nccl`` Note [EP baseline bytes and time]. A second
column counts as DeepEP's tests do (``recv_x.numel() * 2``): every row a rank receives, its own
rows included, so it reads 1.14x higher at 8 ranks and 1.33x at 4 on this routing. Time is the
host clock around the operation, after an untimed alignment (one-element all-reduce and a device
synchronization), stopped after a device synchronization. The received outputs of warmlink are
checked against the NCCL path's in the same run (dispatch bit-exact, combine to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from warmlink.bench._ep_routing import routing
from warmlink.bench._proc import Group, free_port
from warmlink.bench.args import int_in, positive_float, refuse
from warmlink.bench.ep_table import table

__all__ = ["add_arguments", "run"]

_MAX_RANKS, _MAX_EXPERTS = 1024, 4096  # ep.Buffer's limits (ep.wire.info, ep.wire.regions)
_BUSY_CYCLES = 2_000_000  # torch.cuda._sleep's spin: about 1 ms at an H100's or H200's 1.98 GHz
_LATE_S = 1e-3  # how late a late peer calls (bench rows "returns_late_s")


def _spin(seconds: float) -> None:
    """Busy-wait ``seconds`` on the host (a sleep would wake up to ~0.1 ms later than asked)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_in(1, _MAX_RANKS), default=None,
                   help="ranks (default: every visible GPU, at most 8; 4 on CPU)")
    p.add_argument("--tokens", type=int_in(1), default=None, help="tokens per rank (default 4096 on GPU, 128 on CPU)")
    p.add_argument("--hidden", type=int_in(8, multiple=8), default=None,
                   help="channels per token, a multiple of 8, e.g. gpt-oss's 2880 (default 7168 on GPU, 512 on CPU)")
    p.add_argument("--experts", type=int_in(1, _MAX_EXPERTS), default=None,
                   help="experts in total, a multiple of --ranks (default 256 on GPU, 16 on CPU)")
    p.add_argument("--topk", type=int_in(1), default=8, help="experts per token, at most --experts (default 8)")
    p.add_argument("--iterations", type=int_in(1), default=20, help="timed runs of each operation (default 20)")
    p.add_argument("--warmup", type=int_in(0), default=5, help="untimed runs before them (default 5)")
    p.add_argument("--gemm", type=int_in(0), default=6144, help="M=N=K of the overlap GEMM (default 6144; 0 skips overlap)")
    p.add_argument("--lifecycles", type=int_in(0), default=0,
                   help="instead: N Buffer lifecycles (create, first dispatch + combine, close) per rank, pool on vs "
                   "WARMLINK_POOL=0 (seed 002 for the ep buffer); --max-tokens sizes the buffer")
    p.add_argument("--max-tokens", type=int_in(1), default=None,
                   help="with --lifecycles: Buffer capacity per rank, at least --tokens (default --tokens); no other "
                   "run uses it")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write a torch profiler trace and table of rank 0's dispatches and combines to DIR (diagnosis)")
    p.add_argument("--low-latency", action="store_true",
                   help="instead: DeepEP's low-latency dispatch (FP8) and combine (BF16), per call and per "
                   "dispatch + combine, eager and replayed from CUDA graphs, beside DeepEP V1 on the same inputs "
                   "where `import deep_ep` finds it and each rank has a GPU, and DeepEP's published figures "
                   "(bench.ep_low_latency): on GPUs one rank per GPU (two sharing one GPU), 128 tokens x 7168, "
                   "top-8 of 256 by default; without CUDA on the host over shm, 2 ranks, 32 tokens x 1024, 32 experts")
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds before a stalled run fails (default 300)")
    p.add_argument("--pin", action="store_true",
                   help="pin each rank process to its own share of the CPU cores (when there are at least two per "
                   "rank); off by default: on 4 x H200 it did not make the runs faster or steadier")
    p.add_argument("--shuffle", type=int_in(0), default=None, metavar="SEED",
                   help="time the dispatch rows in an order drawn from SEED, the same on every rank (default: the "
                        "table's order); comparing codes over runs with different seeds ties no row to a place in the run")
    p.add_argument("--deep-ep", action="store_true",
                   help="also time DeepEP's calls (fresh, padded and cached dispatch in BF16 and FP8, combine) through "
                   "the drop-in (warmlink.ep.deep_ep) and, on GPUs where `import deep_ep` finds DeepEP itself, through "
                   "DeepEP on the same inputs, their samples taken in turn, with DeepEP's hint-sized budget and with "
                   "2e9 bytes; both clocks (CUDA events on the caller's stream, and the host) and the ratio; on GPUs "
                   "also a GEMM queued before an async combine given a previous_event from before it")


def _overlap_parts(send, gemm, flag, iterations: int) -> dict:
    """Where send -> GEMM -> hook spends its time on one rank, medians over ``iterations``: host ms
    of the send phase and of the hook, and the GEMM's device ms between CUDA events around it,
    alone and between send and hook (a GEMM slowed by the transfer, or a hook waiting on it)."""
    import torch
    import torch.distributed as dist

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    parts: dict[str, list[float]] = {"send": [], "hook": [], "gemm_alone": [], "gemm_between": []}

    def timed_gemm() -> None:
        begin.record()
        gemm()
        end.record()

    for _ in range(iterations):
        dist.all_reduce(flag)
        torch.cuda.synchronize()
        timed_gemm()
        torch.cuda.synchronize()
        parts["gemm_alone"].append(begin.elapsed_time(end) * 1e-3)
        dist.all_reduce(flag)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hook = send()[-1]
        t1 = time.perf_counter()
        timed_gemm()
        t2 = time.perf_counter()
        hook()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        parts["send"].append(t1 - t0)
        parts["hook"].append(t3 - t2)
        parts["gemm_between"].append(begin.elapsed_time(end) * 1e-3)
    return {k: statistics.median(v) for k, v in parts.items()}


def _pin(rank: int, num_ranks: int) -> list[int] | None:
    """Pin this process to its own contiguous share of the usable cores; the cores, or None."""
    import os

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cores) // num_ranks
    if share < 2:
        return None
    mine = cores[rank * share:(rank + 1) * share]
    os.sched_setaffinity(0, mine)
    return mine


def clocks_of(fn, flag, sync, cuda: bool, iterations: int, warmup: int):
    """Median seconds of ``fn`` on two clocks from the same calls: the host's, from the call until
    the device finished (``sync``), and CUDA events on the caller's stream around the call
    (DeepEP's tests' clock; None on CPU); every rank starts each call together (an all-reduce of
    ``flag``). ``fn`` may be a list of functions (one call kind of several codes): their samples
    are taken in turn, the order rotated each iteration, so that a machine whose speed drifts
    during the run moves each alike; then a list of results."""
    import torch
    import torch.distributed as dist

    fns = list(fn) if isinstance(fn, list) else [fn]
    host, events = [[] for _ in fns], [[] for _ in fns]
    begin, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    for i in range(warmup + iterations):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            dist.all_reduce(flag)
            sync()
            t0 = time.perf_counter()
            if cuda:
                begin.record()
            fns[k]()
            if cuda:
                end.record()
            sync()
            if i >= warmup:
                host[k].append(time.perf_counter() - t0)
                if cuda:
                    events[k].append(begin.elapsed_time(end) * 1e-3)
    out = [{"host": statistics.median(h), "events": statistics.median(e) if e else None} for h, e in zip(host, events)]
    return out if isinstance(fn, list) else out[0]


def _rank_main(control, results, rank: int, num_ranks: int, store_address: str, secret: str, dist_port: int,
               cfg: dict) -> None:
    import os

    pinned = _pin(rank, num_ranks) if cfg["pin"] else None
    import torch
    import torch.distributed as dist

    # a share of the cores each: R ranks of the default (every core) thread pool spin against
    # each other on a small host (CPU combine: 33 ms instead of 2.4 with 4 ranks on 2 cores)
    threads = len(pinned) if pinned else max(1, (os.cpu_count() or 1) // num_ranks)
    torch.set_num_threads(threads)

    from warmlink.bench.ep_nccl import nccl_combine, nccl_dispatch, time_nccl_ep
    from warmlink.ep import Buffer
    from warmlink.ep.api.diagnostics import copy_floor, push_floor, sum_alone
    from warmlink.ep.wire.fp8 import num_scales, quantize
    from warmlink.rendezvous import Store

    cuda = cfg["cuda"]
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    import datetime

    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=num_ranks, timeout=datetime.timedelta(seconds=cfg["timeout"]),
                            **({"device_id": device} if cuda else {}))
    flag = torch.zeros(1, device=device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn, iterations=cfg["iterations"], warmup=cfg["warmup"]):
        samples = []
        for i in range(warmup + iterations):
            dist.all_reduce(flag)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def clocks(fn, iterations=cfg["iterations"], warmup=cfg["warmup"]):
        return clocks_of(fn, flag, sync, cuda, iterations, warmup)

    T, H, E, K = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    x, topk_idx, weights = routing(rank, T, E, K, H, device)
    x8 = quantize(x)
    store = Store.connect(store_address, prefix="bench-ep", timeout_s=cfg["timeout"], secret=secret)
    t0 = time.perf_counter()

    def make_buffer(**options):  # collective: every rank builds the same Buffers in the same order
        return Buffer(store, rank, num_ranks, max_tokens_per_rank=T, hidden=H, num_topk=K,
                      device=device.index if cuda else -1, backend="cuda_ipc" if cuda else "shm",
                      timeout_s=cfg["timeout"], **options)

    buf = make_buffer()
    init_s = time.perf_counter() - t0
    out: dict = {"rank": rank, "init_s": init_s, "cores": pinned, "threads": threads}

    # Correctness against the NCCL path, same inputs, same run.
    layout = buf.get_dispatch_layout(topk_idx, E)
    kwargs = {"num_tokens_per_rank": layout[0], "is_token_in_rank": layout[3], "num_tokens_per_expert": layout[2],
                  "topk_idx": topk_idx, "topk_weights": weights}
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(x, **kwargs)
    ref = nccl_dispatch(x, topk_idx, weights, E)
    checks = {
        "dispatch_x": bool(torch.equal(recv_x, ref.recv_x)),
        "dispatch_idx": bool(torch.equal(recv_idx, ref.recv_topk_idx)),
        "dispatch_w": bool(torch.equal(recv_w, ref.recv_topk_weights)),
        "tokens_per_expert": per_expert == ref.num_recv_tokens_per_expert_list,
    }
    y = recv_x.clone()
    combined, _, _ = buf.combine(y, handle)
    ref_combined = nccl_combine(y, ref.handle)[0]
    checks["combine"] = bool(torch.allclose(combined.float(), ref_combined.float(), rtol=1e-2, atol=1e-2))
    r8 = buf.dispatch(x8, **kwargs)
    ref8 = nccl_dispatch(x8, topk_idx, weights, E)
    checks["dispatch_fp8"] = bool(torch.equal(r8[0][0].view(torch.uint8), ref8.recv_x[0].view(torch.uint8))
                                  and torch.equal(r8[0][1], ref8.recv_x[1]))
    out["checks"] = checks
    cross = sum(n for d, n in enumerate(handle.send_counts) if d != rank)
    out["cross_rows"] = cross
    out["bytes"] = {"bf16": cross * H * 2, "fp8": cross * (H + num_scales(H) * 4)}
    out["combine_bytes"] = sum(n for s, n in enumerate(handle.recv_counts) if s != rank) * H * 2
    out["recv_rows"] = sum(handle.recv_counts)  # own rows included: DeepEP's count

    def dispatch(xx, hook=False):
        r = buf.dispatch(xx, **kwargs, return_recv_hook=hook)
        if hook:
            r[-1]()
        return r

    # The Buffer's other choices, each a Buffer of its own built with that argument (on shm there is
    # one send path and no graphs: the default Buffer stands in): the copy engines instead of the
    # SM sends (send="copy"), the SM sends launched one kernel at a time (graphs=False), and the
    # combine's sum after the last byte or in parts (combine_parts; ep.kernels.reduce, Note [Pipelined combine])
    copy_engines = make_buffer(send="copy") if cuda else buf
    eager = make_buffer(graphs=False) if cuda else buf
    streamed = make_buffer(send="stream") if cuda else buf  # the fixed streamed space (ep.paths.streamed)
    in_parts = {n: buf if n == buf.combine_parts else make_buffer(combine_parts=n) for n in (1, 2, 4)}
    variants = {id(b): b for b in (copy_engines, eager, streamed, *in_parts.values()) if b is not buf}.values()

    def dispatch_on(b, xx):
        return b.dispatch(xx, **kwargs)

    if cuda:
        checks["dispatch_x_copy"] = bool(torch.equal(dispatch_on(copy_engines, x)[0], ref.recv_x))
        for _ in range(3):  # past the eager calls of both parities: graphs replay from here on
            buf.dispatch(x, **kwargs)
        checks["dispatch_x_graph"] = bool(torch.equal(buf.dispatch(x, **kwargs)[0], ref.recv_x))
        checks["dispatch_x_eager"] = bool(torch.equal(dispatch_on(eager, x)[0], ref.recv_x))
        checks["dispatch_x_stream"] = bool(torch.equal(dispatch_on(streamed, x)[0], ref.recv_x))
        for _ in range(3):  # the cached copy-engine send, past its eager gathers of both parities
            cached = buf.dispatch(x, handle=handle, return_recv_hook=True)
            cached[-1]()
        checks["dispatch_cached_hook"] = bool(torch.equal(cached[0], ref.recv_x))
        # summed in parts (ep.kernels.reduce, Note [Pipelined combine]) or after the last byte: the same bits
        for n, name in ((1, "combine_one_part"), (4, "combine_four_parts")):
            same = in_parts[n].dispatch(x, **kwargs)[4]  # the same routing as handle's
            checks[name] = bool(torch.equal(in_parts[n].combine(y, same)[0], combined))
        checks["combine_stream"] = bool(torch.equal(streamed.combine(y, dispatch_on(streamed, x)[4])[0], combined))

    y_keep = buf.dispatch(x, **kwargs)[0].clone()
    h_keep = buf.dispatch(x, **kwargs)[4]

    # each variant's own handle of the same routing (a handle holds addresses of its Buffer's mappings)
    handles = {id(b): b.dispatch(x, **kwargs)[4] for b in variants}
    handles[id(buf)] = h_keep

    def combine(hook=False, on=buf):
        r = on.combine(y_keep, handles[id(on)], return_recv_hook=hook)
        if hook:
            r[-1]()

    dispatches = [
        ("dispatch_bf16", lambda: dispatch(x)),
        ("dispatch_bf16_eager", lambda: dispatch_on(eager, x)),
        ("dispatch_bf16_hook", lambda: dispatch(x, True)),
        ("dispatch_bf16_copy", lambda: dispatch_on(copy_engines, x)),
        ("dispatch_fp8", lambda: dispatch(x8)),
        ("dispatch_fp8_hook", lambda: dispatch(x8, True)),
        ("dispatch_cached", lambda: buf.dispatch(x, handle=h_keep)),
        ("dispatch_cached_eager", lambda: eager.dispatch(x, handle=handles[id(eager)])),
        ("dispatch_cached_copy", lambda: copy_engines.dispatch(x, handle=handles[id(copy_engines)])),
        ("dispatch_bf16_stream", lambda: dispatch_on(streamed, x)),
        ("dispatch_fp8_stream", lambda: dispatch_on(streamed, x8)),
        ("dispatch_cached_stream", lambda: streamed.dispatch(x, handle=handles[id(streamed)])),
    ]
    if cfg["shuffle"] is not None:  # the same order on every rank: the calls are collective
        random.Random(cfg["shuffle"]).shuffle(dispatches)
    out["dispatch_order"] = [name for name, _ in dispatches]
    times = {name: timed(fn) for name, fn in dispatches}

    def phases_of(fn, marks=None) -> dict:
        """Median host time of each phase ``fn``'s call reports in ``buf.last_phases``."""
        samples: dict = {}
        for _ in range(cfg["iterations"]):
            dist.all_reduce(flag)
            sync()
            fn()
            for k, v in buf.last_phases.items():
                samples.setdefault(k, []).append(v)
            if marks is not None:
                marks.append(dict(buf.last_marks))
        return {k: statistics.median(v) for k, v in samples.items()}

    marks: list = []
    out["dispatch_phases_s"] = phases_of(lambda: dispatch(x), marks)
    out["dispatch_marks"] = marks
    out["cached_phases_s"] = phases_of(lambda: buf.dispatch(x, handle=h_keep))

    def returned(fn, busy: bool = False, late: bool = False) -> float:
        """Median host time until ``fn``'s call returns (its device work may still be running);
        with ``busy``, behind about 1 ms of device work queued on the caller's stream (GPUs only);
        with ``late``, every rank but rank 0 calls about 1 ms after it (a late peer)."""
        samples = []
        for _ in range(cfg["iterations"]):
            dist.all_reduce(flag)
            sync()
            if busy and cuda:
                torch.cuda._sleep(_BUSY_CYCLES)
            if late and rank != 0:
                _spin(_LATE_S)
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        sync()
        return statistics.median(samples)

    # a padded fresh dispatch returns at launch on GPUs (ep.protocol.normal, Note [Padded dispatch returns
    # at launch]); each call first resolves the one before, whose device work the sync has ended
    padded = {**kwargs, "num_worst_tokens": num_ranks * T}
    calls = {"fresh": lambda: buf.dispatch(x, **kwargs), "fresh_padded": lambda: buf.dispatch(x, **padded),
             "cached": lambda: buf.dispatch(x, handle=h_keep), "combine": combine}
    out["returns_s"] = {name: returned(fn) for name, fn in calls.items()}
    if cuda:
        out["returns_busy_s"] = {name: returned(fn, busy=True) for name, fn in calls.items()}
    if num_ranks > 1:
        out["returns_late_s"] = {name: returned(fn, late=True) for name, fn in calls.items()}
    checks["dispatch_x_padded"] = bool(torch.equal(buf.dispatch(x, **padded)[0][:ref.recv_x.shape[0]], ref.recv_x))
    profile_dir = cfg["profile"]
    if profile_dir and rank == 0 and cuda:  # a kernel/copy timeline of a few dispatches, for diagnosis
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dispatch(x)
                sync()
            for _ in range(3):
                buf.dispatch(x, handle=h_keep)
                sync()
            for _ in range(3):
                combine()
                sync()
        prof.export_chrome_trace(os.path.join(profile_dir, "ep_rank0_trace.json"))
        with open(os.path.join(profile_dir, "ep_rank0_profile.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    elif profile_dir:
        for _ in range(3):
            dispatch(x)
        for _ in range(3):
            buf.dispatch(x, handle=h_keep)
        for _ in range(3):
            combine()
    # combine reuses the routing of h_keep: dispatch once more so the receive area matches it
    buf.dispatch(x, handle=h_keep)
    times["combine_bf16"] = timed(lambda: combine())
    times["combine_bf16_hook"] = timed(lambda: combine(True))
    times["combine_bf16_stream"] = timed(lambda: combine(on=streamed))
    # the sum after the last byte, in one part, or part by part (ep.kernels.reduce, Note [Pipelined combine])
    for parts, name in ((1, "one"), (2, "two"), (4, "four")):
        times[f"combine_bf16_{name}_part{'s' if parts > 1 else ''}"] = timed(lambda b=in_parts[parts]: combine(on=b))
    dist.all_reduce(flag)  # every rank is past its last call on the variants: closing them is safe
    sync()
    for other in variants:
        other.close()
    out["combine_phases_s"] = phases_of(combine)
    out["times_s"] = times
    out["nccl"] = time_nccl_ep(x, topk_idx, weights, E, cfg["iterations"], cfg["warmup"])
    if cfg["deep_ep"]:
        import warmlink.ep.deep_ep as drop_in
        from warmlink.bench.ep_deep_ep import real_deep_ep, time_deep_ep

        real = real_deep_ep() if cuda else None  # DeepEP's kernels are CUDA only
        timed_codes = time_deep_ep([drop_in] + ([real] if real is not None else []), x, topk_idx, weights, E, clocks,
                                   cfg["gemm"] if cuda else 0)
        out["deep_ep_s"] = timed_codes[0]
        if real is not None:  # its samples taken in turn with the drop-in's, call by call
            out["deepep_v1_s"] = timed_codes[1]
    if cuda and cfg["gemm"]:
        m = cfg["gemm"]
        a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=device, dtype=torch.bfloat16)

        def overlapped(cached: bool = False):
            r = buf.dispatch(x, handle=h_keep, return_recv_hook=True) if cached else buf.dispatch(
                x, **kwargs, return_recv_hook=True)
            a @ b
            r[-1]()

        def cached_hook():
            buf.dispatch(x, handle=h_keep, return_recv_hook=True)[-1]()

        out["overlap_s"] = {"gemm": timed(lambda: a @ b), "dispatch_hook": times["dispatch_bf16_hook"],
                            "send_gemm_hook": timed(overlapped), "cached_hook": timed(cached_hook),
                            "send_gemm_hook_cached": timed(lambda: overlapped(True))}
        # async_finish: the call runs on the communication stream and the GEMM queued after it
        # on the caller's stream overlaps it (ep.paths.comm_stream); without it the GEMM waits
        calls = {"combine": (lambda **kw: buf.combine(y_keep, h_keep, **kw), 2),
                 "cached": (lambda **kw: buf.dispatch(x, handle=h_keep, **kw), 5)}

        def async_then_gemm(call, at: int) -> None:
            event = call(async_finish=True)[at]
            a @ b
            event.current_stream_wait()

        for name, (call, at) in calls.items():
            out["overlap_s"][f"{name}_alone"] = timed(call)
            out["overlap_s"][f"{name}_gemm"] = timed(lambda c=call: (c(), a @ b))
            out["overlap_s"][f"{name}_async_gemm"] = timed(lambda c=call, i=at: async_then_gemm(c, i))
        out["overlap_parts_s"] = {kind: _overlap_parts(lambda c=cached: buf.dispatch(
            x, handle=h_keep, return_recv_hook=True) if c else buf.dispatch(x, **kwargs, return_recv_hook=True),
            lambda: a @ b, flag, cfg["iterations"]) for kind, cached in (("fresh", False), ("cached", True))}
    if cuda:  # last: it overwrites the peers' receive areas
        out["floor_s"] = copy_floor(buf, handle.send_counts, timed)
        out["push_s"] = push_floor(buf, handle, x, timed)
        out["sum_alone"] = sum_alone(buf, h_keep, y_keep, cfg["iterations"])
    buf.close()
    store.close()
    dist.destroy_process_group()
    results.put({"event": "result", "tag": f"rank{rank}", "value": out})


def _defaults(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()

    def pick(given, default):  # argument > default, never ``given or default``: 0 and False are answers
        return given if given is not None else default

    return {
        "cuda": cuda, "ranks": pick(args.ranks, min(torch.cuda.device_count(), 8) if cuda else 4),
        "tokens": pick(args.tokens, 4096 if cuda else 128), "hidden": pick(args.hidden, 7168 if cuda else 512),
        "experts": pick(args.experts, 256 if cuda else 16), "topk": args.topk, "iterations": args.iterations,
        "warmup": args.warmup, "gemm": args.gemm, "timeout": args.timeout,
        "lifecycles": args.lifecycles, "profile": args.profile, "pin": args.pin, "deep_ep": args.deep_ep, "shuffle": args.shuffle,
    }


def _refusal(cfg: dict, args) -> str | None:
    """What makes the resolved values unrunnable together (each flag alone was checked by argparse), or None."""
    import torch

    ranks, experts = cfg["ranks"], cfg["experts"]
    if cfg["cuda"] and ranks > torch.cuda.device_count():
        return f"--ranks={ranks} out of range; expected at most {torch.cuda.device_count()} (a rank per visible GPU)"
    if experts % ranks:
        return f"--experts={experts} is not a multiple of --ranks={ranks}; expected every rank to hold as many experts"
    if cfg["topk"] > experts:
        return f"--topk={cfg['topk']} exceeds --experts={experts}; expected at most {experts} distinct experts per token"
    if args.max_tokens is not None and args.max_tokens < cfg["tokens"]:
        return f"--max-tokens={args.max_tokens} is below --tokens={cfg['tokens']}; expected a Buffer that holds every batch"
    return None


def _run_lifecycles(cfg: dict, args) -> int:
    from warmlink.bench.ep_lifecycle import lifecycle_table, run_ep_lifecycles

    cfg["max_tokens"] = args.max_tokens or cfg["tokens"]
    print(f"ep Buffer lifecycles: {cfg['ranks']} ranks, {cfg['lifecycles']} x (create -> dispatch + combine of "
          f"{cfg['tokens']} tokens x {cfg['hidden']} -> close), buffer for {cfg['max_tokens']} tokens")
    on = run_ep_lifecycles(cfg, pool_on=True)
    off = run_ep_lifecycles(cfg, pool_on=False)
    lines, summary = lifecycle_table(on, off)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "summary": summary, "pool_on": on, "pool_off": off,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    return 0


def run(args) -> int:
    from warmlink.rendezvous import Store

    if args.low_latency:
        from warmlink.bench.ep_low_latency import run_low_latency

        if args.deep_ep:
            return refuse("warmlink bench ep", "--deep-ep times normal-mode calls; with --low-latency DeepEP V1 "
                          "runs beside warmlink whenever `import deep_ep` finds it (drop --deep-ep)")

        return run_low_latency(args)
    cfg = _defaults(args)
    problem = _refusal(cfg, args)
    if problem is not None:
        return refuse("warmlink bench ep", problem)
    if args.lifecycles:
        return _run_lifecycles(cfg, args)
    with Store(is_server=True, prefix="bench-ep", timeout_s=args.timeout) as server, Group(args.timeout) as group:
        port = free_port()
        for r in range(cfg["ranks"]):
            group.start(f"rank{r}", _rank_main, rank=r, num_ranks=cfg["ranks"], store_address=server.address,
                        secret=server.secret, dist_port=port, cfg=cfg)
        ranks = sorted((m["value"] for m in group.expect("result", cfg["ranks"])), key=lambda r: r["rank"])
    lines, summary = table(cfg, ranks)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "summary": summary, "ranks": ranks, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                      f, indent=1)
    return 0 if all(summary["checks"].values()) else 1
