"""Refit between Ray actors: TP trainer ranks publish a small model, engines pull it every step.

On CPU the actors share one node and move bytes over POSIX shared memory (``backend="shm"``);
on GPUs the same job runs with ``--backend cuda_ipc --device cuda`` and actors holding a GPU
each (not run in CI; see the notes in ``warmlink.integrations.ray``).

    pip install -e '.[ray]'
    python examples/ray_refit.py --steps 5 --trainers 2 --engines 2

Prints, per refit and engine, the cycle's phases (ms) and what it created, and checks that every
engine's weights equal the trainers' bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time

PHASES = ("connect_s", "sync_s", "plan_s", "alloc_s", "register_s", "pull_s", "translate_s", "install_s", "total_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (each followed by a refit)")
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks (the trainer's TP size)")
    p.add_argument("--engines", type=int, default=1, help="inference engines (TP=1 each)")
    p.add_argument("--backend", default="shm", help="shm (CPU, default) or cuda_ipc (GPUs)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds for any wait or remote call")
    p.add_argument("--num-cpus", type=int, default=None, help="ray.init(num_cpus=...) (default: Ray's)")
    args = p.parse_args(argv)

    import ray

    from warmlink.integrations.ray import RefitJob

    t0 = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    options = {"num_cpus": 0, "num_gpus": 1} if args.device.startswith("cuda") else {"num_cpus": 0}
    failures = 0
    try:
        with RefitJob(args.trainers, args.engines, backend=args.backend, device=args.device,
                      timeout_s=args.timeout, actor_options=options) as job:
            print(f"ray up and {args.trainers} trainer rank(s) + {args.engines} engine(s) started "
                  f"in {time.perf_counter() - t0:.2f} s; store {job.store.address}")
            for e in job.export():
                print(f"trainer rank {e['rank']}: exported version {e['version']} in {e['export_s'] * 1e3:.2f} ms")
            print(f"{'step':>4} {'ver':>3} {'eng':>3} " + " ".join(f"{ph[:-2]:>9}" for ph in PHASES)
                  + "  exact  created")
            for step in range(args.steps + 1):
                for r in job.refit():
                    rep = r["report"]
                    created = {k: v for k, v in rep["created"].items() if v}
                    print(f"{step:>4} {r['version']:>3} {r['index']:>3} "
                          + " ".join(f"{rep[ph] * 1e3:9.3f}" for ph in PHASES)
                          + f"  {r['exact']!s:5}  {created or '-'}")
                    failures += not r["exact"]
                if step < args.steps:
                    waits = [s["wait_s"] for s in job.step()]
                    print(f"     trainers stepped to version {job.version} (max wait for readers {max(waits) * 1e3:.2f} ms)")
    finally:
        ray.shutdown()
    print("all refits bit-exact" if not failures else f"{failures} refit(s) NOT bit-exact")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
