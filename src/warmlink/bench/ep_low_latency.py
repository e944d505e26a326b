"""``warmlink bench ep --low-latency``: per-call latency of DeepEP's low-latency dispatch (FP8) and
combine (BF16), beside DeepEP V1 itself on the same inputs in the same run where ``import deep_ep``
finds it (GPUs, one rank per GPU), and DeepEP's published figures for reference.

Every rank draws a routing as DeepEP's test does (top-K of random scores, 10 entries masked to
-1), builds one ``ep.Buffer`` with ``low_latency_mode=True`` and times each of ``--iterations``
calls after ``--warmup``: a dispatch, a combine, and in hook mode the send phase and the hook of
each, called right after the send. Every call waits for its peers' rows, so the ranks stay in
step without a barrier. The row per operation is the slowest rank's median and p90. On GPUs the
calls are then captured in CUDA graphs and replayed: a dispatch + hook and a combine + hook, and
each phase alone after a host barrier (``... alone, replay``: its own device time, no peer behind).

With CUDA: one rank per GPU (cuda_ipc, the device path), DeepEP's shape by default (128 tokens x
7168, top-8 of 256), timed by CUDA events around each call's kernels; with one GPU two ranks
share it, which times the kernels and the protocol but not a link. Without CUDA the rows move on
the host over shared memory (the shm backend), timed on the host clock; DeepEP's shape holds
about 1.9 GB per rank there, so the default is a reduced one.

DeepEP runs the same loop through its own ``Buffer`` (built as its test builds it, with its size
hint, over the ranks' ``torch.distributed`` group) after warmlink's, on the same tensors; it needs
a GPU per rank (NVSHMEM), so with ranks sharing GPUs, or without DeepEP, its columns say why they
are empty. ``pair`` rows are a dispatch and a combine of one iteration, summed per iteration.
"""

from __future__ import annotations

import json
import statistics
import time

from warmlink.bench._proc import Group, free_port
from warmlink.bench.args import refuse

__all__ = ["DEEPEP_LOW_LATENCY", "run_low_latency"]

# DeepEP's published low-latency figures: deepseek-ai/DeepEP docs/legacy.md ("Low-latency kernels
# with pure RDMA", linked from README.md as the V1 documentation), at commit dd758ca: H800, one CX7
# InfiniBand 400 Gb/s NIC per GPU, 128 tokens per batch, 7168 hidden, top-8, FP8 dispatch, BF16 combine.
# (EP size, dispatch us, dispatch RDMA GB/s, combine us, combine RDMA GB/s)
DEEPEP_LOW_LATENCY = ((8, 77, 98, 114, 127), (16, 118, 63, 195, 74), (32, 155, 48, 273, 53),
                      (64, 173, 43, 314, 46), (128, 192, 39, 369, 39), (256, 194, 39, 360, 40))
_DEEPEP_SOURCE = ("DeepEP docs/legacy.md @dd758ca (linked from its README): H800, CX7 400 Gb/s RDMA, "
                  "128 tokens, 7168 hidden, top-8, FP8 dispatch, BF16 combine")
_OPS = ("dispatch", "combine", "dispatch_send", "dispatch_hook", "combine_send", "combine_hook")
_GRAPH_OPS = ("dispatch_graph", "combine_graph")  # GPUs only: replays of captured calls, no host launches
# GPUs only: each phase's graph replayed alone, every rank's previous phase done (a host barrier
# between replays), so that a row is the phase's own device time, not a wait for a slower peer
_PHASE_OPS = ("dispatch_send_graph", "dispatch_hook_graph", "combine_send_graph", "combine_hook_graph")
_PAIRS = {"pair": ("dispatch", "combine"), "pair_graph": ("dispatch_graph", "combine_graph")}  # per iteration
_MASKED = 10  # entries set to -1, as DeepEP's test does


def _routing(rank: int, tokens: int, experts: int, topk: int, hidden: int):
    import torch

    gen = torch.Generator().manual_seed(4321 + rank)
    scores = torch.randn(tokens, experts, generator=gen).abs() + 1
    idx = scores.topk(topk, dim=1).indices
    for _ in range(_MASKED if tokens else 0):
        idx[torch.randint(tokens, (1,), generator=gen), torch.randint(topk, (1,), generator=gen)] = -1
    x = (torch.randn(tokens, hidden, generator=gen) * 0.1).to(torch.bfloat16)
    return x, idx, torch.rand(tokens, topk, generator=gen)


def _rank_main(control, results, rank: int, num_ranks: int, store_address: str, secret: str, cfg: dict) -> None:
    import torch

    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    torch.set_num_threads(1)
    tokens, hidden, experts = cfg["tokens"], cfg["hidden"], cfg["experts"]
    gpu = cfg["device"] == "cuda"
    if gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x, idx, w = (t.to(dev) for t in _routing(rank, tokens, experts, cfg["topk"], hidden))
    y = torch.zeros(experts // num_ranks, num_ranks * tokens, hidden, dtype=torch.bfloat16, device=dev)
    with Store.connect(store_address, prefix="bench-ep-ll", timeout_s=cfg["timeout"], secret=secret) as store:
        with Buffer(store, rank, num_ranks, max_tokens_per_rank=tokens, hidden=hidden, num_topk=cfg["topk"],
                    backend="cuda_ipc" if gpu else "shm", timeout_s=cfg["timeout"], low_latency_mode=True,
                    num_experts=experts) as buf:
            times = _time_calls(buf, x, idx, w, y, cfg, _Barrier(store, "warmlink", num_ranks))
            checks = {"warmlink": check_outputs(buf, x, idx, w, rank, num_ranks, cfg)}
        value = {"rank": rank, "times_s": times, "checks": checks}
        if cfg["deepep"] == "ran":
            value["deepep_times_s"], checks["deepep_v1"] = _time_deepep(rank, num_ranks, x, idx, w, y, cfg,
                                                                        _Barrier(store, "deepep", num_ranks))
    results.put({"event": "result", "value": value})


class _Barrier:
    """Every rank's host reached the same call: a counter in the store (no GPU collective, which
    would sit on the streams being timed)."""

    def __init__(self, store, side: str, num_ranks: int) -> None:
        self._store, self._key, self._ranks, self._calls = store, f"phase-barrier/{side}", num_ranks, 0

    def __call__(self) -> None:
        self._calls += 1
        want = self._calls * self._ranks
        if self._store.add(self._key, 1, checked=False) < want:
            self._store.wait_until(lambda: self._store.add(self._key, 0, checked=False) >= want,
                                   what=f"{self._key} {self._calls}")


def check_outputs(buf, x, idx, w, rank: int, num_ranks: int, cfg: dict) -> dict[str, bool]:
    """One more dispatch and combine after the timed ones, against the routing every rank can draw
    (``_routing`` is seeded by rank): each local expert's ``recv_count``, and, with every expert
    handing back the rows it received, each token's combined row against ``x * sum of its
    weights`` (DeepEP's test's measure; FP8 dispatch: within 1e-3). ``buf`` is either side's."""
    import torch

    tokens, experts = cfg["tokens"], cfg["experts"]
    local = experts // num_ranks
    want = torch.zeros(local, dtype=torch.int64)
    for s in range(num_ranks):
        ids = _routing(s, tokens, experts, cfg["topk"], cfg["hidden"])[1].flatten()
        mine = ids[(ids >= rank * local) & (ids < (rank + 1) * local)] - rank * local
        want += torch.bincount(mine, minlength=local)
    (rows, scales), count, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)
    y = torch.zeros(rows.shape, dtype=torch.bfloat16, device=rows.device)
    for e, n in enumerate(count.tolist()):  # the identity expert: its rows dequantized
        y[e, :n] = (rows[e, :n].float() * scales[e, :n].repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    combined = buf.low_latency_combine(y, idx, w, handle)[0].double()
    ref = x.double() * (w.double() * (idx >= 0)).sum(1, keepdim=True)
    diff = 1 - 2 * (ref * combined).sum() / (ref * ref + combined * combined).sum().clamp(min=1e-30)
    return {"recv_count": torch.equal(count.cpu().to(torch.int64), want), "combine": bool(diff.item() < 1e-3)}


def _time_deepep(rank: int, num_ranks: int, x, idx, w, y, cfg: dict, barrier) -> tuple[dict[str, list[float]], dict]:
    """The same loop through DeepEP V1's ``Buffer`` over a ``torch.distributed`` group of the ranks,
    and the same output check."""
    import torch.distributed as dist

    from warmlink.bench.ep_deep_ep import real_deep_ep

    deep_ep = real_deep_ep()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}", rank=rank,
                            world_size=num_ranks, device_id=x.device)
    try:
        group = dist.new_group(list(range(num_ranks)))
        tokens, hidden, experts = cfg["tokens"], cfg["hidden"], cfg["experts"]
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts)
        buf = deep_ep.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=experts // num_ranks,
                             explicitly_destroy=True)
        try:
            idx = idx.to(deep_ep.topk_idx_t)
            return _time_calls(buf, x, idx, w, y, cfg, barrier), check_outputs(buf, x, idx, w, rank, num_ranks, cfg)
        finally:
            buf.destroy()
    finally:
        dist.destroy_process_group()


def _time_calls(buf, x, idx, w, y, cfg: dict, barrier) -> dict[str, list[float]]:
    """Per iteration a dispatch and a combine, then the same in hook mode; on GPUs then replays of
    both captured in CUDA graphs, and of each phase alone. ``buf`` is warmlink's ``ep.Buffer`` or
    DeepEP's (one API); ``barrier()`` returns once every rank called it."""
    tokens, experts = cfg["tokens"], cfg["experts"]
    gpu = cfg["device"] == "cuda"
    times: dict[str, list[float]] = {op: [] for op in _OPS}
    marks = _Marks(gpu)
    for i in range(cfg["warmup"] + cfg["iterations"]):
        marks.mark()
        handle = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)[2]
        marks.mark()
        buf.low_latency_combine(y, idx, w, handle)
        marks.mark()
        hook = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True, return_recv_hook=True)
        marks.mark()
        hook[4]()
        marks.mark()
        _, _, combine_hook = buf.low_latency_combine(y, idx, w, hook[2], return_recv_hook=True)
        marks.mark()
        combine_hook()
        marks.mark()
        spans = marks.spans()
        if i >= cfg["warmup"]:
            for op, t in zip(_OPS, spans, strict=True):
                times[op].append(t)
    if gpu:
        times.update(_graph_times(buf, x, idx, w, y, tokens, experts, cfg, marks))
        times.update(_phase_times(buf, x, idx, w, y, tokens, experts, cfg, barrier))
    for pair, (dispatch, combine) in _PAIRS.items():
        if dispatch in times:
            times[pair] = [a + b for a, b in zip(times[dispatch], times[combine], strict=True)]
    return times


def capture_decode_step(buf, x, idx, w, y, tokens: int, experts: int):
    """``(dispatch, combine)``: an FP8 dispatch + hook and a BF16 combine + hook of ``y`` with its
    handle, each captured in a CUDA graph, as a decode step runs them (DeepEP's calls: ``buf`` is
    warmlink's Buffer or DeepEP's)."""
    import torch

    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    dispatch, combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch):
        sent = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True, return_recv_hook=True)
        sent[4]()
    with torch.cuda.graph(combine):
        hook = buf.low_latency_combine(y, idx, w, sent[2], return_recv_hook=True, out=out)[2]
        hook()
    return dispatch, combine


def _graph_times(buf, x, idx, w, y, tokens: int, experts: int, cfg: dict, marks) -> dict[str, list[float]]:
    """A decode step's graphs (``capture_decode_step``), each replay timed: the device's own
    latency, without the host's launches."""
    dispatch, combine = capture_decode_step(buf, x, idx, w, y, tokens, experts)
    times: dict[str, list[float]] = {op: [] for op in _GRAPH_OPS}
    for i in range(cfg["warmup"] + cfg["iterations"]):
        marks.mark()
        dispatch.replay()
        marks.mark()
        combine.replay()
        marks.mark()
        spans = marks.spans()
        if i >= cfg["warmup"]:
            for op, t in zip(_GRAPH_OPS, spans, strict=True):
                times[op].append(t)
    return times


def _phase_times(buf, x, idx, w, y, tokens: int, experts: int, cfg: dict, barrier) -> dict[str, list[float]]:
    """Each phase (a dispatch's send, its hook, a combine's send, its hook) captured in a graph of
    its own and replayed once every rank finished the phase before: what the phase costs on the
    device when its peers are not behind (a hook then finds every row arrived)."""
    import torch

    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    graphs = {op: torch.cuda.CUDAGraph() for op in _PHASE_OPS}
    with torch.cuda.graph(graphs["dispatch_send_graph"]):
        sent = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True, return_recv_hook=True)
    with torch.cuda.graph(graphs["dispatch_hook_graph"]):
        sent[4]()
    with torch.cuda.graph(graphs["combine_send_graph"]):
        hook = buf.low_latency_combine(y, idx, w, sent[2], return_recv_hook=True, out=out)[2]
    with torch.cuda.graph(graphs["combine_hook_graph"]):
        hook()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {op: [] for op in _PHASE_OPS}
    for i in range(cfg["warmup"] + cfg["iterations"]):
        for op, graph in graphs.items():
            barrier()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if i >= cfg["warmup"]:
                times[op].append(start.elapsed_time(end) / 1e3)
    return times


class _Marks:
    """Time between consecutive ``mark()`` calls: CUDA events on the current stream (the calls
    return at launch), or the host clock."""

    def __init__(self, gpu: bool) -> None:
        import torch

        self._gpu = gpu
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(len(_OPS) + 1)] if gpu else []
        self._at: list[float] = []

    def mark(self) -> None:
        if self._gpu:
            self._events[len(self._at)].record()
            self._at.append(0.0)
        else:
            self._at.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between the marks so far (then starts over); waits for the GPU."""
        at, self._at = self._at, []
        if self._gpu:
            self._events[len(at) - 1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._events, self._events[1:len(at)])]
        return [b - a for a, b in zip(at, at[1:])]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _defaults(args) -> dict:
    import torch

    def pick(given, default):  # argument > default: 0 and False are answers
        return given if given is not None else default

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"ranks": pick(args.ranks, max(2, min(gpus, 8))), "tokens": pick(args.tokens, 128 if gpus else 32),
            "hidden": pick(args.hidden, 7168 if gpus else 1024), "experts": pick(args.experts, 256 if gpus else 32),
            "topk": args.topk, "iterations": args.iterations, "warmup": args.warmup, "timeout": args.timeout,
            "device": "cuda" if gpus else "cpu", "gpus": gpus}


def _summary(ranks: list[dict], key: str) -> dict:
    """Per operation the slowest rank's median and p90, in us."""
    ops = [op for op in (*_OPS, *_GRAPH_OPS, *_PAIRS, *_PHASE_OPS) if op in ranks[0][key]]
    return {op: {"median_us": max(statistics.median(r[key][op]) for r in ranks) * 1e6,
                 "p90_us": max(_p90(r[key][op]) for r in ranks) * 1e6} for op in ops}


def _table(cfg: dict, ranks: list[dict]) -> tuple[list[str], dict]:
    summary = _summary(ranks, "times_s")
    ops = list(summary)
    deepep = _summary(ranks, "deepep_times_s") if cfg["deepep"] == "ran" else None
    if cfg["device"] == "cuda":
        where = f"{cfg['gpus']} GPU(s), cuda_ipc, CUDA events"
        if cfg["ranks"] == 1:
            where += "; one rank to itself: the kernels' own work, no link"
        elif cfg["ranks"] > cfg["gpus"]:
            where += "; ranks share GPUs: kernels and protocol, not a link"
    else:
        where = "CPU, shm, host clock"
    ranks = f"{cfg['ranks']} rank" + ("s" if cfg["ranks"] > 1 else "")
    lines = [f"ep low-latency bench: {ranks} ({where}), {cfg['tokens']} tokens x "
             f"{cfg['hidden']}, top-{cfg['topk']} of {cfg['experts']} experts, FP8 dispatch, BF16 combine; "
             f"{cfg['iterations']} calls after {cfg['warmup']} warmup, slowest rank",
             "", f"{'operation':<34}{'median (us)':>13}{'p90 (us)':>11}{'DeepEP V1 (us)':>16}{'DeepEP / warmlink':>19}"]
    names = {"dispatch": "dispatch (fp8)", "combine": "combine (bf16)", "dispatch_send": "dispatch, hook mode: send",
             "dispatch_hook": "dispatch, hook mode: hook", "combine_send": "combine, hook mode: send",
             "combine_hook": "combine, hook mode: hook", "dispatch_graph": "dispatch + hook, CUDA graph replay",
             "combine_graph": "combine + hook, CUDA graph replay", "pair": "dispatch + combine, eager",
             "pair_graph": "dispatch + combine, graph replays", "dispatch_send_graph": "dispatch send alone, replay",
             "dispatch_hook_graph": "dispatch hook alone, replay", "combine_send_graph": "combine send alone, replay",
             "combine_hook_graph": "combine hook alone, replay"}
    for op in ops:
        theirs = f"{deepep[op]['median_us']:>16.1f}{deepep[op]['median_us'] / summary[op]['median_us']:>18.2f}x" \
            if deepep else ""
        lines.append(f"{names[op]:<34}{summary[op]['median_us']:>13.1f}{summary[op]['p90_us']:>11.1f}{theirs}")
    if deepep is None:
        lines.append(f"DeepEP V1 in this run: {cfg['deepep']}")
    else:
        summary = {"warmlink": summary, "deepep_v1": deepep}
    lines += ["", f"for reference, {_DEEPEP_SOURCE}:",
              f"  {'EP':>4}{'dispatch (us)':>15}{'GB/s':>7}{'combine (us)':>15}{'GB/s':>7}"]
    lines += [f"  {ep:>4}{d:>15}{dg:>7}{c:>15}{cg:>7}" for ep, d, dg, c, cg in DEEPEP_LOW_LATENCY]
    return lines, summary


def _deepep_here(cfg: dict) -> str:
    """``"ran"`` where DeepEP V1 runs beside warmlink in this bench, else why not."""
    if cfg["device"] != "cuda":
        return "not run (its kernels need CUDA)"
    if cfg["ranks"] > cfg["gpus"]:
        return f"not run ({cfg['ranks']} ranks on {cfg['gpus']} GPU(s): DeepEP needs a GPU per rank)"
    from warmlink.bench.ep_deep_ep import real_deep_ep

    return "ran" if real_deep_ep() is not None else "not run (`import deep_ep` does not find DeepEP V1 here)"


def run_low_latency(args) -> int:
    from warmlink.rendezvous import Store

    cfg = _defaults(args)
    if cfg["experts"] % cfg["ranks"]:
        return refuse("warmlink bench ep --low-latency", f"--experts={cfg['experts']} is not a multiple of "
                      f"--ranks={cfg['ranks']}; expected every rank to hold as many experts")
    if cfg["topk"] > cfg["experts"]:
        return refuse("warmlink bench ep --low-latency", f"--topk={cfg['topk']} exceeds --experts={cfg['experts']}")
    cfg["deepep"], cfg["dist_port"] = _deepep_here(cfg), free_port()
    with Store(is_server=True, prefix="bench-ep-ll", timeout_s=args.timeout) as server, Group(args.timeout) as group:
        for r in range(cfg["ranks"]):
            group.start(f"rank{r}", _rank_main, rank=r, num_ranks=cfg["ranks"], store_address=server.address,
                        secret=server.secret, cfg=cfg)
        ranks = sorted((m["value"] for m in group.expect("result", cfg["ranks"])), key=lambda r: r["rank"])
    lines, summary = _table(cfg, ranks)
    wrong = sorted({f"{side} {what} on rank {r['rank']}" for r in ranks for side, checked in r["checks"].items()
                    for what, ok in checked.items() if not ok})
    lines.append(f"outputs checked against the routing (recv_count, combine): {'WRONG: ' + ', '.join(wrong) if wrong else 'right'}"
                 + (", on both sides" if cfg["deepep"] == "ran" and not wrong else ""))
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "summary": summary, "deepep_published": {"source": _DEEPEP_SOURCE,
                       "rows": DEEPEP_LOW_LATENCY}, "ranks": ranks,
                       "wrong": wrong, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    return 1 if wrong else 0
