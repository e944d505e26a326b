"""The processes of ``bench refit --hosts``: the trainer on host 0, the engines on the other hosts.

``python -m warmlink.bench.refit_hosts_roles trainer|engine``. The first stdin line is the run's
JSON config (the store's secret travels there, never on a command line); then one command a line.
Reports are JSON lines (``bench.json_child``); a failed step reports ``error`` with the exception's
type and message, and the process exits.

* ``trainer``: serves the store on its host's address, publishes version 1 of the model from host
  memory over nixl and reports ``ready`` (the store's address and secret). ``publish``: the next
  version's values, published (``published``).
* ``engine``: a TP-1 receiver of the whole model, made as the run's mode says
  (``receiver_options``), reports ``ready``. ``refit V``: takes version V, timed on this
  machine's monotonic clock, which every host shares (``cycle``). ``verify V``: its targets
  against version V's values, byte for byte (``verified``): kept apart from ``refit`` so that no
  engine's check takes the CPU from another's transfer.

Version v holds values of its own (seeded values XOR ``version_key(v)``): an engine that kept an
older version, or mixed two, fails ``verify``.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import traceback

from warmlink.bench.json_child import say

__all__ = ["MODES", "receiver_options", "trainer_copies", "version_key", "version_values"]

# Note [Refit modes]
# ~~~~~~~~~~~~~~~~~~
# A mode is how the engines take a version from the trainer, and nothing else: the cluster, the
# processes, the model, the timing and the check are the same for every mode. What a mode changes
# lives in two functions here: ``receiver_options`` (the engines' Receiver arguments) and
# ``trainer_copies`` (how many copies of the model must cross the trainer's link, the bound).
#
# * ``pull``: every engine pulls the whole model from the trainer. N engines put N copies
#   through the trainer's link: at best N x bytes / rate.
# * ``fanout``: the engines join one fan-out group (``warmlink.refit.FanOut``) in the order they
#   first refit, and take the version from each other; the trainer sends it about once: at best
#   bytes / rate. The bench places engines on hosts in blocks (engines 0..k-1 on host 1, the next
#   k on host 2, ...) and lets engines new to the job take their first version one after another
#   in engine order, so that a chain in join order crosses each host's link once each way.
MODES = ("pull", "fanout")


def receiver_options(mode: str) -> dict:
    """The ``Receiver`` keyword arguments of ``mode`` (Note [Refit modes])."""
    if mode == "fanout":
        from warmlink import refit

        return {"fanout": refit.FanOut("bench-refit")}
    return {}


def trainer_copies(mode: str, num_engines: int) -> int:
    """How many copies of the model must leave the trainer's host for ``num_engines`` engines to
    hold a version (Note [Refit modes])."""
    return num_engines if mode == "pull" else 1


def version_key(version: int) -> int:
    """The 16-bit word version ``version``'s values are XORed with: one for every version below
    65536 (an odd multiplier is a bijection modulo 2**16)."""
    return (version * 0x9E37) & 0xFFFF


def _base(config: dict) -> dict:
    """The model's seeded values (``bench.refit.build_physical``), the same in every process."""
    from warmlink.bench.model_spec import ModelSpec
    from warmlink.bench.refit import build_physical

    layouts = ModelSpec(**config["spec"]).layouts(1, 0)
    return {name: build_physical(layout, "cpu", config["seed"]) for name, layout in layouts.items()}


def version_values(base, version: int, out=None):
    """Version ``version`` of one tensor: every 16-bit word of ``base`` XOR ``version_key``, one
    pass (into ``out``), where new seeded values would cost a random draw per element."""
    import torch

    words = base.view(torch.int16)
    key = torch.tensor(version_key(version), dtype=torch.int32).to(torch.int16)  # the word, as a signed int16
    return torch.bitwise_xor(words, key, out=None if out is None else out.view(torch.int16)).view(base.dtype)


def _trainer(config: dict) -> None:
    from warmlink.bench.model_spec import ModelSpec
    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    timeout_s = config["timeout_s"]
    layouts = ModelSpec(**config["spec"]).layouts(1, 0)
    base = _base(config)
    tensors = {name: version_values(b, 1) for name, b in base.items()}
    with Store(config["host"], 0, is_server=True, prefix=config["prefix"], timeout_s=timeout_s) as store, \
            Publisher(store, rank=0, world_size=1, backend="nixl", timeout_s=timeout_s) as pub:
        for name, t in tensors.items():
            pub.add(name, t, layouts[name])
        pub.export()
        say(event="ready", address=store.address, secret=store.secret, version=pub.version,
            hostname=socket.gethostname())
        for line in sys.stdin:
            if line.strip() == "publish":
                wait_s = pub.begin_update(timeout_s=timeout_s)
                for name, t in tensors.items():
                    version_values(base[name], pub.version + 1, out=t)
                say(event="published", version=pub.publish(), wait_s=wait_s)


def _engine(config: dict) -> None:
    import torch

    from warmlink.bench.model_spec import ModelSpec
    from warmlink.refit import Receiver
    from warmlink.rendezvous import Store

    timeout_s = config["timeout_s"]
    layouts = ModelSpec(**config["spec"]).layouts(1, 0)
    base = _base(config)
    targets = {name: torch.zeros(layout.local_shape, dtype=getattr(torch, layout.dtype)) for name, layout in layouts.items()}
    with Store.connect(config["address"], prefix=config["prefix"], secret=config["secret"], timeout_s=timeout_s) as store, \
            Receiver(store, num_publishers=1, backend="nixl", timeout_s=timeout_s, **receiver_options(config["mode"])) as rec:
        for name, layout in layouts.items():
            rec.add(name, layout, targets[name])
        say(event="ready", hostname=socket.gethostname())
        for line in sys.stdin:
            cmd, arg = line.split()
            if cmd == "refit":
                t0 = time.monotonic()
                report = rec.refit(version=int(arg))
                say(event="cycle", t0=t0, t1=time.monotonic(), report=report.as_dict())
            elif cmd == "verify":
                want = {n: version_values(b, int(arg)) for n, b in base.items()}  # bit-exact: the bytes, not the values
                bad = [n for n in layouts if not torch.equal(targets[n].view(torch.int16), want[n].view(torch.int16))]
                say(event="verified", version=int(arg), bad=bad[:5], num_bad=len(bad))


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        if role not in ("trainer", "engine"):
            raise SystemExit(f"refit_hosts_roles: role={role!r} is unknown; expected trainer or engine")
        (_trainer if role == "trainer" else _engine)(json.loads(sys.stdin.readline()))
    except Exception as exc:  # noqa: BLE001  reported to the parent, which raises with it
        traceback.print_exc()  # to stderr, which the parent's error quotes
        say(event="error", type=type(exc).__name__, msg=str(exc))
        raise SystemExit(1) from None
