"""Where one fan-out cycle of each engine replica spends its time: cProfile of cycle ``--cycle`` in
the engine's thread and in its relay's driver thread (the chunk copies run there; from Python 3.12
one profile covers both).

Runs ``bench.fanout.run_fanout`` (fan-out only) with every engine's cycle ``--cycle`` profiled; each
engine writes ``fanout_profile_<engine>.txt`` (its cycle report's phases, then both profiles) to
``--out``. Usage:
    python3 tools/fanout_cycle_profile.py [--engines 3] [--devices 0,1] [--install swap] [--cycle 2] [--cycles 3]
        [--scale 1.0] [--out .] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats


def _profiled_engine(*, out_dir: str, cycle: int, top: int, **kwargs) -> None:
    """``bench.fanout.engine_main`` with cycle ``cycle`` of its receiver profiled in both threads."""
    from warmlink.bench import fanout
    from warmlink.refit import Receiver
    from warmlink.refit._relay import Relay

    main_prof, relay_prof, state = cProfile.Profile(), cProfile.Profile(), {"on": False}
    refit, fill = Receiver.refit, Relay._fill

    def profiled_refit(self, **kw):
        if self.cycle + 1 != cycle:
            return refit(self, **kw)
        state["on"] = True
        main_prof.enable()
        try:
            report = refit(self, **kw)
        finally:
            main_prof.disable()
            state["on"] = False
        text = io.StringIO()
        text.write(f"cycle {report.cycle}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in report.as_dict().items()
                                                          if k.endswith("_s")) + "\n\n== engine thread\n")
        pstats.Stats(main_prof, stream=text).sort_stats("cumulative").print_stats(top)
        text.write("\n== relay thread\n")
        if relay_prof.getstats():
            pstats.Stats(relay_prof, stream=text).sort_stats("cumulative").print_stats(top)
        with open(os.path.join(out_dir, f"fanout_profile_{kwargs['name']}.txt"), "w") as f:
            f.write(text.getvalue())
        return report

    def profiled_fill(self, job):
        if not state["on"]:
            return fill(self, job)
        try:
            relay_prof.enable()
        except ValueError:  # Python >= 3.12: the engine thread's profile (sys.monitoring) sees every thread
            return fill(self, job)
        try:
            return fill(self, job)
        finally:
            relay_prof.disable()

    Receiver.refit, Relay._fill = profiled_refit, profiled_fill
    fanout.engine_main(**kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--devices", default="0,1", help="trainer's GPU, then the engines' (alternating with the trainer's)")
    p.add_argument("--install", default="swap", choices=("copy", "swap"))
    p.add_argument("--cycle", type=int, default=2, help="the cycle to profile (1 includes setup)")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--out", default=".")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()

    from functools import partial

    from warmlink.bench import fanout
    from warmlink.bench.model_spec import qwen3_4b_like
    from warmlink.bench.refit_engines_cli import engine_devices

    trainer, engine = (int(d) for d in args.devices.split(","))
    placed = engine_devices((trainer, engine), args.engines)
    fanout.engine_main = partial(_profiled_engine, out_dir=os.path.abspath(args.out), cycle=args.cycle, top=args.top)
    out = fanout.run_fanout(qwen3_4b_like(args.scale), engines=args.engines, modes=("fanout",), cycles=args.cycles,
                            devices=placed, install=args.install, timeout_s=300)
    for row in out["modes"]["fanout"]["cycles"]:
        print(f"cycle {row['cycle']}: {row['wall_s'] * 1e3:.1f} ms; " + ", ".join(
            f"replica {e['replica']} <- {'/'.join(e['sources'])} end {e['end_s'] * 1e3:.1f} pull {e['pull_s'] * 1e3:.1f}"
            for e in sorted(row["engines"], key=lambda e: e["replica"])))
    print("correct:", out["modes"]["fanout"]["correct"])


if __name__ == "__main__":
    main()
