"""The ``warmlink`` command: ``demo``, ``bench refit|lifecycle|reconfigure|ep|manifest|fp8`` and ``doctor``."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main", "build_parser"]

_EPILOG = """\
examples:
  warmlink demo                          trainer (TP=2) -> inference (TP=1), refit after each step
  warmlink bench refit --scale 0.05      Qwen3-4B-shaped refit at 5% size, pool on/off vs NCCL
  warmlink bench refit --cycles 5 --plot out/refit.png --json out/refit.json
  warmlink bench refit --hosts 4 --engines 1..8
                                         one trainer into 1-8 engines on 4 emulated hosts (root; nixl)
  warmlink bench lifecycle               create -> first refit -> destroy, N times, pool on vs off
  warmlink bench reconfigure             a receiver process replaced: P50s beside a new NCCL group
  warmlink bench ep                      MoE dispatch/combine on every GPU: normal, hook, FP8 vs torch+NCCL
  warmlink bench ep --low-latency        DeepEP's low-latency dispatch/combine: per-call latency
  warmlink bench manifest               export and first plan of 40,000 DeepSeek-V3-shaped tensors
  warmlink bench fp8                     FP8 quantize-on-send throughput beside a flat copy of the same bytes
  warmlink doctor                        GPUs, peer access, copy-engine bandwidth, backends

environment (operational switches only; arguments win):
  WARMLINK_POOL=0        turn every pool and cache off (the A/B baseline)
  WARMLINK_BACKEND       default transport: auto | shm | cuda_ipc | nixl
  WARMLINK_TIMEOUT_S     default timeout of waits and transfers, seconds (60)
  WARMLINK_LOG_LEVEL     DEBUG | INFO | WARNING (default) | ERROR
  a bad value ends any command at once (exit 2); warmlink doctor checks every WARMLINK_* variable
"""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr, exit code 2: no usage block (the
    line says where --help is). Its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from warmlink.bench.args import int_in, positive_float

    parser = _Parser(
        prog="warmlink",
        description="Move tensors between GPU processes with the setup paid once.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small Llama and refit it into an inference process every step",
                          description="Two trainer ranks (TP=2) train a small transformers Llama with random weights; "
                          "after every optimizer step one inference rank (TP=1) refits and checks that its logits equal "
                          "the trainer's. Uses GPUs when present, CPU shared memory otherwise.")
    demo.add_argument("--steps", type=int_in(1), default=5, help="optimizer steps, each followed by a refit (default 5)")
    demo.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    demo.add_argument("--timeout", type=positive_float, default=120.0,
                      help="seconds any process may stall before the demo fails (default 120)")

    bench = sub.add_parser("bench", help="benchmarks that reproduce the seed tables")
    bench.set_defaults(bench_parser=bench)  # `warmlink bench` without a benchmark prints this parser's help
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    from warmlink.bench.refit_cli import add_arguments

    add_arguments(bench_sub.add_parser(
        "refit", help="refit of a Qwen3-4B-shaped model: pool on / off vs NCCL broadcast vs copy-engine peak",
        description="Refit cycles of a synthetic Qwen3-4B-shaped model (290 bf16 tensors, 8.8 GB at --scale 1) "
        "from trainer to inference processes, printed as the seed's table (cycle | alloc | register | pull | "
        "translate | total) for warmlink pool on, WARMLINK_POOL=0, NCCL broadcast per tensor and in 1 GiB buckets, "
        "all in one run, with the copy-engine peak measured in the same run. With --hosts: one trainer into N "
        "engine replicas across emulated hosts (network namespaces behind tc-limited links), time against N.",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    from warmlink.bench import lifecycle, reconfigure

    lifecycle.add_arguments(bench_sub.add_parser(
        "lifecycle", help="engine create -> first refit -> destroy, N times (seed 002): pool on / off",
        description="N engine lifecycles in one trainer and one inference process (as a test suite that builds "
        "a client per test): Publisher create + add + export, Receiver create + add + first refit, Receiver "
        "close, Publisher close. Phases per lifecycle (median) for warmlink pool on and WARMLINK_POOL=0 in one "
        "run, what each lifecycle created, and the total for N.",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    reconfigure.add_arguments(bench_sub.add_parser(
        "reconfigure", help="a receiver process replaced (seed 001): init / reconfigure / destroy P50, vs a new NCCL group",
        description="A publisher process serves for the whole run while receiver processes come and go: init (a "
        "new process's first refit), reconfigure (that process killed and replaced by a new one, whose first refit "
        "completes) and destroy (close and exit), each as P50 over --repeats, with the new process's phases "
        "(process start + imports, CUDA context, connect, first refit) and the time the staying publisher spends. "
        "warmlink pool on, WARMLINK_POOL=0 and the same change done with a new NCCL (gloo on CPU) group and its "
        "first broadcast, in one run.",
        formatter_class=argparse.RawDescriptionHelpFormatter))

    from warmlink.bench import manifest

    manifest.add_arguments(bench_sub.add_parser(
        "manifest", help="export and first plan of a 40,000-tensor manifest (DeepSeek-V3-shaped, TP-2)",
        description="Publisher ranks (TP-2 by default) in one process export a DeepSeek-V3-shaped model of "
        "--tensors bf16 tensors each over shm (manifest build, validation and store writes: a blob past 4 MiB), "
        "then receivers of the matched layout and of TP-1 time their first plan: read every manifest, validate "
        "it, parse its layouts, layout signature and build_plan. Tensors are tiny (widths / 128): the timings are "
        "metadata work, which follows the number of tensors. Prints both tables and the machine; --json writes "
        "the record.",
        formatter_class=argparse.RawDescriptionHelpFormatter))

    from warmlink.bench import fp8

    fp8.add_arguments(bench_sub.add_parser(
        "fp8", help="FP8 quantize on send (128 x 128 blocks): GB/s and share of a flat copy of the same bytes",
        description="The linear weights of a Qwen3-4B-shaped model (bf16, --scale of 8.8 GB) on one device, "
        "quantized to FP8 values and 128 x 128 block scales by the quantizer a publisher runs at every publish "
        "(a Triton kernel on CUDA), beside a flat copy of the same BF16 bytes in the same run: median time, GB/s "
        "(bytes read + written) and the quantizer's share of the copy's GB/s (HBM bandwidth on a GPU).",
        formatter_class=argparse.RawDescriptionHelpFormatter))

    from warmlink.bench import ep

    ep.add_arguments(bench_sub.add_parser(
        "ep", help="MoE dispatch/combine: normal and hook mode, BF16 and FP8, vs torch + NCCL",
        description="One process per GPU (CPU ranks over shm without a GPU) with random top-k routing: warmlink "
        "dispatch (BF16, FP8, cached handle) and combine (BF16) in normal and hook mode, beside torch + NCCL "
        "dispatch/combine and a bare all_to_all_single of the same bytes, plus a GEMM overlapped between send and "
        "hook, in one run; the combine also summed in one, two and four parts (the default: one part for two ranks, "
        "four for more). On "
        "GPUs also the normal-mode sends through the copy engines, and with eager launches instead of CUDA graphs, "
        "and the link's floors (copy engines alone, SM stores alone, the combine's sum alone); and the host time "
        "until a call returns (a fresh dispatch, padded with num_worst_tokens or not, a cached one, a combine), on an "
        "idle device, on GPUs behind about 1 ms of queued device work, and with two or more ranks while every peer "
        "of rank 0 calls about 1 ms after it. Prints time and GB/s per rank "
        "(bytes that cross to other ranks; a second column in DeepEP's count, every received row) and checks "
        "that warmlink's outputs equal the NCCL path's. With --low-latency instead: DeepEP's low-latency dispatch "
        "(FP8) and combine (BF16), median and p90 per call, beside DeepEP V1 in the same run where it is "
        "importable (one GPU per rank; --ranks 1 puts both on one GPU, the kernels' own work without a link) and "
        "DeepEP's published figures.",
        formatter_class=argparse.RawDescriptionHelpFormatter))

    sub.add_parser(
        "doctor", help="report GPUs, peer access, copy-engine bandwidth and loadable backends",
        description="What this machine offers warmlink: the Python and torch versions; on GPUs the CUDA and NCCL "
        "versions, each GPU's name, peer access between every pair, the copy-engine bandwidth from GPU 0 to GPU 1 "
        "(to itself on one GPU; 256 MiB copies, one way and both ways) and nvidia-smi's topology (NVLink); whether "
        "each backend (shm, cuda_ipc, nixl) loads, and where NIXL is installed which UCX transports carry its puts "
        "and gets (a probe in a subprocess, a few seconds); whether ep's host steps run compiled or in Python; every "
        "WARMLINK_* variable, as set (a secret hidden) or unset. A value warmlink refuses, or a WARMLINK_* name it "
        "does not read, is also named on stderr, and the exit code is 2.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


# Options whose value may begin with "-" (``--devices -1,-1``: host processes), which argparse
# would otherwise read as an option of its own.
_DASH_VALUES = ("--devices",)


def _joined(argv: list[str]) -> list[str]:
    """``argv`` with ``--devices -1,-1`` written as ``--devices=-1,-1``."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _DASH_VALUES and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_joined(list(sys.argv[1:] if argv is None else argv)))
    from warmlink import _env

    errors = _env.check_all()
    if errors and args.command != "doctor":  # the doctor reports every variable instead
        for e in errors.values():  # before any process starts: a child would fail later, with its traceback
            print(f"warmlink: {e}", file=sys.stderr)
        return 2
    level = "WARNING" if "WARMLINK_LOG_LEVEL" in errors else _env.log_level()
    logging.basicConfig(level=logging.INFO if args.verbose else level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from warmlink.cli.demo import run_demo

        return 0 if run_demo(steps=args.steps, seed=args.seed, timeout_s=args.timeout) else 1
    if args.command == "bench" and args.bench == "refit":
        from warmlink.bench.refit_cli import run

        return run(args)
    if args.command == "bench" and args.bench == "ep":
        from warmlink.bench import ep

        return ep.run(args)
    if args.command == "bench" and args.bench == "fp8":
        from warmlink.bench import fp8

        return fp8.run(args)
    if args.command == "bench" and args.bench == "manifest":
        from warmlink.bench import manifest

        return manifest.run(args)
    if args.command == "bench" and args.bench in ("lifecycle", "reconfigure"):
        from warmlink.bench import lifecycle, reconfigure

        return (lifecycle if args.bench == "lifecycle" else reconfigure).run(args)
    if args.command == "doctor":
        from warmlink.cli.doctor import run_doctor

        return run_doctor()
    (args.bench_parser if args.command == "bench" else parser).print_help()  # `warmlink bench` alone: its own help
    return 2


if __name__ == "__main__":
    sys.exit(main())
