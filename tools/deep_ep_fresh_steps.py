"""Where a fresh dispatch of the DeepEP drop-in spends its host time, step by step, on two ranks.

``tools/deep_ep_fresh_profile.py`` times whole calls and cProfile charges its own overhead to every
Python call; this wraps named steps with ``time.perf_counter`` (about 0.3 us each) and prints, per
rank, each step's median start (us after the call began) and median inclusive time per call, then
the device's view from CUDA events on the caller's stream: when the count exchange's launches ended
and when the GPU reached the streamed kernel's launch (it idles between the two while the host
reads the board and prepares the launch). DeepEP's API as the bench calls it (``get_dispatch_layout``
then ``dispatch``), its hint budget, the bench's inputs (4096 x 7168 BF16, top-8 of 256); with
``--call`` a cached dispatch or a combine of the first dispatch's handle instead. It counts Python's
cyclic garbage collections during the timed calls and their time (``--no-gc`` turns the collector
off after the warm-up, to see what it costs)::

    python tools/deep_ep_fresh_steps.py [--calls 40] [--budget hint|2e9] [--padded] [--fp8] [--call cached|combine]
                                        [--no-gc] [--trace PREFIX]
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

import torch
import torch.distributed as dist
from _spawn import spawn_ranks
from _timing import timed


def _steps():
    """(owner, attribute) of every step timed; module functions where their caller looks them up.
    Steps the code at hand lacks are left out (the tool times the previous code too: SRC)."""
    import warmlink.ep.deep_ep.buffer as de_buffer
    import warmlink.ep.deep_ep.calls as de_calls
    import warmlink.ep.deep_ep.handle as de_handle
    import warmlink.ep.deep_ep.rounds as de_rounds
    from warmlink import _cuda, _nvrtc
    from warmlink.ep.api import buffer as api_buffer
    from warmlink.ep.kernels import launch, layout_cuda, steps, stream_cuda
    from warmlink.ep.paths import cuda_mover, streamed as paths_streamed
    from warmlink.ep.paths import senders
    try:  # (the code before planned calls has none)
        from warmlink.ep.paths import planned
    except ImportError:
        planned = None
    from warmlink.ep.protocol import checks, normal as proto_normal, rounds as proto_rounds, streamed as proto_streamed

    return [(owner, attr) for owner, attr in [
        (de_buffer.Buffer, "get_dispatch_layout"), (de_buffer, "dispatch_layout"), (de_buffer.Buffer, "dispatch"),
        (de_buffer, "pack_scales"), (de_calls, "fresh"), (de_rounds, "argument_problem"),
        (de_calls, "widen"), (de_calls, "narrow"), (de_calls, "unpack_scales"), (de_handle.DispatchHandle, "of"),
        (de_handle, "_prefix"), (api_buffer.Buffer, "dispatch"), (proto_streamed.StreamedMode, "dispatch"),
        (proto_streamed.StreamedMode, "before_call"), (checks.Checks, "dispatch"), (proto_streamed.StreamedMode, "_fresh"),
        (paths_streamed.StreamPath, "launch_counts"), (paths_streamed, "call_words"), (cuda_mover.CudaMover, "send_counts"),
        (_cuda, "graph_launch"), (_cuda, "memcpy_async"), (_cuda, "event_record"), (proto_streamed.StreamedMode, "_complete"),
        (cuda_mover.CudaMover, "wait_board"), (checks.Checks, "counts"), (proto_streamed, "plan_from_board"),
        (paths_streamed.StreamPath, "valid"), (paths_streamed.StreamPath, "offsets"),
        (paths_streamed.StreamPath, "prepare_dispatch"), (stream_cuda, "prepare_dispatch"),
        (de_calls, "cached"), (de_calls, "combine"), (de_buffer.Buffer, "combine"), (api_buffer.Buffer, "combine"),
        (proto_streamed.StreamedMode, "_cached"), (proto_streamed.StreamedMode, "combine"),
        (paths_streamed.StreamPath, "combine"), (stream_cuda, "combine"), (de_buffer, "combine_biases"),
        (getattr(stream_cuda, "PreparedDispatch", None), "launch"),
        (getattr(stream_cuda, "PreparedDispatch", None), "launch_from_board"), (layout_cuda, "layout"),
        (paths_streamed.StreamPath, "padded_offsets"), (proto_streamed, "stream_outputs"),
        (paths_streamed.StreamPath, "dispatch"), (stream_cuda, "dispatch"), (stream_cuda, "_launch"),
        (proto_streamed, "per_expert_list"), (proto_streamed.StreamedMode, "event"),
        (_nvrtc.Kernel, "__call__"), (launch.FastLaunch, "__call__"), (steps, "layout"),
        (proto_streamed.StreamedMode, "_clear_asked"), (paths_streamed.StreamPath, "failures"),
        (proto_streamed, "recv_starts"), (proto_streamed.StreamedMode, "_fill"), (paths_streamed.StreamPath, "_slot"),
        # the slot design's (a budget past the streamed one's: e.g. --budget 2e9)
        (proto_normal.NormalMode, "dispatch"), (proto_normal.NormalMode, "before_call"),
        (proto_normal.NormalMode, "_fresh_sm"), (proto_normal.NormalMode, "_complete_sm"),
        (proto_normal.NormalMode, "_arrived"), (senders.SmPath, "launch"), (proto_rounds.Rounds, "meet"),
        (proto_rounds.Rounds, "before_receive"), (proto_rounds.Rounds, "wait_readers"),
        (proto_normal, "dispatch_outputs"), (proto_normal, "plan_from_board"), (cuda_mover.CudaMover, "arrived"),
        # a kind of call seen before (ep.paths.planned)
        (paths_streamed.StreamPath, "fresh_front"), (paths_streamed.StreamPath, "planned_front"),
        (paths_streamed.StreamPath, "fresh_padded"), (paths_streamed.StreamPath, "board_landed"),
        (getattr(planned, "FreshPlan", None), "front"), (getattr(planned, "FreshPlan", None), "padded"),
        (getattr(planned, "FreshPlan", None), "launch_from_board"), (getattr(planned, "FreshPlan", None), "post_outputs"),
        (proto_streamed.StreamedMode, "_handle"),
        # what a call settles of the padded call before it (StreamedMode.before_call)
        (proto_streamed.StreamedMode, "resolve"), (proto_streamed.StreamedMode, "_settled"),
        (paths_streamed.StreamPath, "board_now"),
    ] if owner is not None and hasattr(owner, attr)]


_marks: list[tuple[str, float, float]] = []  # (step, entered, left) of the call in progress


def _mark(name: str, entered: float, left: float) -> None:
    _marks.append((name, entered, left))


def _rank(rank: int, num_ranks: int, port: int, args) -> None:
    import warmlink.ep.deep_ep as deep_ep
    from warmlink.bench._ep_routing import routing
    from warmlink.ep.kernels import stream_cuda
    from warmlink.ep.paths import cuda_mover
    from warmlink.ep.wire.fp8 import quantize

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
    num_experts, hidden = 256, 7168
    x, topk_idx, weights = routing(rank, 4096, num_experts, 8, hidden, torch.device("cuda", rank))
    if args.fp8:
        values, scales = quantize(x)
        x = (values, scales.T.contiguous().T)
    budget = int(float(args.budget)) if args.budget != "hint" else max(
        c.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
        for c in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)))
    buf = deep_ep.Buffer(dist.group.WORLD, budget, explicitly_destroy=True)
    extra = {"num_worst_tokens": num_ranks * 4096} if args.padded else {}

    def dispatch():
        lay = buf.get_dispatch_layout(topk_idx, num_experts)
        return buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                            topk_idx=topk_idx, topk_weights=weights, **extra)

    made = dispatch()
    handle = made[4]
    rows = (made[0][0] if isinstance(made[0], tuple) else made[0]).to(torch.bfloat16)
    fresh = {"fresh": dispatch, "cached": lambda: buf.dispatch(x, handle=handle, **extra),
             "combine": lambda: buf.combine(rows, handle)}[args.call]
    for _ in range(5):  # compiles, captures the exchange's graphs
        fresh()
    torch.cuda.synchronize()
    # the device's view: events after the exchange's launches and before the streamed kernel's
    front_done, before_stream = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    send_counts = cuda_mover.CudaMover.send_counts
    # the streamed kernel's launch: a prepared one's (PreparedDispatch.launch, or launch_from_board by the
    # compiled host steps), else the packed one's
    prepared = getattr(stream_cuda, "PreparedDispatch", None)
    launches = [(prepared, "launch"), (prepared, "launch_from_board")] if prepared is not None else [
        (stream_cuda, "_launch")]
    launches = [(owner, attr, getattr(owner, attr)) for owner, attr in launches if hasattr(owner, attr)]

    recorded: set[str] = set()  # the marks of the call in progress (a slot-design call has no streamed kernel)

    def send_counts_marked(*a, **kw):
        key = send_counts(*a, **kw)
        front_done.record()
        recorded.add("front")
        return key

    def marked(launch):
        def launch_marked(*a, **kw):
            if "stream" not in recorded:  # (the compiled steps may hand the launch back to Python's)
                before_stream.record()
                recorded.add("stream")
            return launch(*a, **kw)
        return launch_marked

    cuda_mover.CudaMover.send_counts = send_counts_marked
    for owner, attr, launch in launches:
        setattr(owner, attr, marked(launch))
    try:  # a planned call launches its exchange in FreshPlan.front (a padded one its stream too: no gap)
        from warmlink.ep.paths.planned import FreshPlan
    except ImportError:
        FreshPlan = None
    if FreshPlan is not None:
        def front_marked(front):
            def planned_front(*a, **kw):
                out = front(*a, **kw)
                front_done.record()
                recorded.add("front")
                return out
            return planned_front

        FreshPlan.front, FreshPlan.padded = front_marked(FreshPlan.front), front_marked(FreshPlan.padded)
        if hasattr(FreshPlan, "launch_from_board"):  # (with posted outputs the stream goes out in front)
            FreshPlan.launch_from_board = marked(FreshPlan.launch_from_board)
    for owner, attr in _steps():
        setattr(owner, attr, timed(f"{getattr(owner, '__name__', owner)}.{attr}".replace("warmlink.ep.", ""),
                                   getattr(owner, attr), _mark))
    gc_spent: list[float] = []  # seconds of each cyclic garbage collection during the timed calls
    gc_began: list[float] = []

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            gc_began[:] = [time.perf_counter()]
        elif gc_began:
            gc_spent.append(time.perf_counter() - gc_began[0])

    if args.no_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    gc.callbacks.append(gc_timer)
    flag = torch.zeros(1, device="cuda")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    starts, spent, calls = (collections.defaultdict(list) for _ in range(3))
    wall, device, gap, to_front = [], [], [], []
    for i in range(args.calls + 5):
        dist.all_reduce(flag)
        torch.cuda.synchronize()
        _marks.clear()
        recorded.clear()
        begin.record()
        t0 = time.perf_counter()
        fresh()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        if i < 5:
            gc_spent.clear()
            continue
        wall.append((t1 - t0) * 1e6)
        device.append(begin.elapsed_time(end) * 1e3)
        if "front" in recorded:
            to_front.append(begin.elapsed_time(front_done) * 1e3)
        if recorded >= {"front", "stream"}:
            gap.append(front_done.elapsed_time(before_stream) * 1e3)
        first: dict[str, float] = {}
        total: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for name, entered, left in _marks:
            first.setdefault(name, entered - t0)
            total[name] += left - entered
            count[name] += 1
        for name in total:
            starts[name].append(first[name] * 1e6)
            spent[name].append(total[name] * 1e6)
            calls[name].append(count[name])
    med = statistics.median
    kind = args.budget + (", padded" if args.padded else "") + (", fp8" if args.fp8 else "") + (
        f", {args.call}" if args.call != "fresh" else "")
    front = f"exchange launches done {med(to_front):.0f} us after the call began" if to_front else "no exchange seen"
    stream = f", streamed kernel reached {med(gap):.0f} us after that" if gap else ", no streamed kernel"
    lines = [f"=== rank {rank} ({kind}): host wall {med(wall):.0f} us, CUDA events {med(device):.0f} us; device: {front}"
             f"{stream} (medians of {args.calls}); {len(gc_spent)} garbage collections in the timed calls, "
             f"{sum(gc_spent) * 1e6 / args.calls:.1f} us a call" + (" (collector off)" if args.no_gc else ""),
             f"  {'step':52s} {'starts':>8s} {'spends':>8s} {'calls':>6s}"]
    for name in sorted(spent, key=lambda n: med(starts[n])):
        lines.append(f"  {name:52s} {med(starts[name]):8.1f} {med(spent[name]):8.1f} {med(calls[name]):6.0f}")
    if args.trace:
        lines += _device_timeline(fresh, flag, f"{args.trace}.rank{rank}.json")
    report = "\n".join(lines)
    gathered = [None] * num_ranks
    dist.all_gather_object(gathered, report)
    if rank == 0:
        print("\n".join(gathered), flush=True)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


def _device_timeline(call, flag, path: str, calls: int = 12) -> list[str]:
    """``calls`` calls under torch.profiler (CUPTI: kernels, copies and a graph's nodes each), its
    chrome trace written to ``path``; per GPU step of a call (in order; the all-reduce that starts
    each call is left out), its median start after the call's first GPU step and its median time:
    where the GPUs spend a call, and where they wait for the host or a peer."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dist.all_reduce(flag)
            torch.cuda.synchronize()
            call()
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = sorted((e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"
                         and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: float(e["ts"]))
    per_call: list[list[dict]] = []
    for e in events:  # an NCCL kernel (the all-reduce) opens each call
        if "nccl" in e["name"].lower():
            per_call.append([])
        elif per_call:
            per_call[-1].append(e)
    shapes = collections.Counter(len(c) for c in per_call if c)
    if not shapes:
        return [f"  (no GPU steps traced; trace in {path})"]
    steps = shapes.most_common(1)[0][0]
    kept = [c for c in per_call if len(c) == steps]
    out = [f"  device timeline ({len(kept)} of {len(per_call)} calls with {steps} GPU steps; trace {path}):",
           f"  {'GPU step':60s} {'starts':>8s} {'takes':>8s}"]
    for i in range(steps):
        name = kept[0][i]["name"][:60]
        start = statistics.median(float(c[i]["ts"]) - float(c[0]["ts"]) for c in kept)
        took = statistics.median(float(c[i].get("dur", 0)) for c in kept)
        out.append(f"  {name:60s} {start:8.1f} {took:8.1f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--budget", default="hint", help="'hint' (DeepEP's Config hint, as the bench) or bytes, e.g. 2e9")
    p.add_argument("--padded", action="store_true", help="pass num_worst_tokens (ranks x tokens)")
    p.add_argument("--no-gc", action="store_true", help="freeze and disable Python's cyclic garbage collector "
                   "after the warm-up calls (does the collector cost the calls?)")
    p.add_argument("--fp8", action="store_true", help="FP8 tokens with column-major scales, as DeepEP's tests")
    p.add_argument("--call", choices=("fresh", "cached", "combine"), default="fresh",
                   help="the call timed: a fresh dispatch, a cached one with its handle, or the combine of its rows")
    p.add_argument("--trace", metavar="PREFIX", default=None,
                   help="also trace 12 calls with torch.profiler (PREFIX.rankN.json) and print each GPU step of a "
                   "call (the layout, the count exchange's copies and kernels, the streamed kernel) with its start "
                   "and time on the device")
    args = p.parse_args()
    spawn_ranks(_rank, args.ranks, args)

if __name__ == "__main__":
    main()
