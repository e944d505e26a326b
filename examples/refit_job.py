"""A whole refit job on one host: launcher, FSDP2 trainer ranks, engine ranks, shutdown.

The launcher (this process) starts the job's rendezvous store, then starts every rank as a process
of its own and watches them:

* trainer ranks shard a small language model with FSDP2 (gloo on CPU, NCCL on GPUs), publish it
  (``Publisher``) and take an optimizer step inside ``pub.update()``: every step is a new version;
* engine ranks hold their own copy of the model, zeroed, and pull every version into it
  (``Receiver.refit``).

After each version every rank writes a digest of the weights it holds to the store; the trainer
waits until each engine holds the version before it steps again, and the launcher checks at the
end that every engine held every version bit for bit. A rank that fails or dies takes the job
down: the launcher stops the others and exits 1, naming it.

Defaults: CPU and shared memory without a GPU; with GPUs, one trainer rank per GPU (up to two)
and CUDA IPC. Run from the repository root (after ``pip install -e .``):

    python examples/refit_job.py
    python examples/refit_job.py --engines 2 --steps 5
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time

PREFIX = "job"  # every key of this job lives under it (one store could serve several jobs)
VOCAB, DIM, HIDDEN, LAYERS, SEQ = 512, 64, 192, 2, 16
GRACE_S = 10.0  # how long a rank stopped by the launcher gets to close what it holds before SIGKILL

# Note [Secret hand-off]
# Every store value carries an HMAC under the job's secret, so whoever reaches the store's port
# without it can neither write a value a rank would act on nor pass for a rank. The launcher's
# server takes its `secret` argument, else WARMLINK_SECRET, else makes a fresh random one; it is
# read back as store.secret and goes to each rank as an argument of its Process, over the
# forkserver's socket. Not on a command line: every user of the host can read those (ps,
# /proc/PID/cmdline). Not in the environment either when there is a choice: only the same user
# and root can read /proc/PID/environ, but every program a rank starts inherits it. Across nodes,
# where another launcher starts the ranks and no Python argument can reach them, the environment
# is the way: the same WARMLINK_SECRET on every process (`python -c 'import secrets;
# print(secrets.token_hex(32))'`), and secret= left out.
#
# Note [Shutdown order]
#  1. Each engine installs the last version, then closes its Receiver and its store connection.
#  2. Each trainer rank waits until every engine holds the last version, then closes its Publisher.
#     Trainers close after engines because Publisher.close withdraws the version: a receiver
#     mid-pull keeps the memory alive (close waits for it, at most the timeout) and installs the
#     whole version, but a receiver that asks for a later version after the close waits for a
#     successor that never comes and gets TransferTimeout, keeping the version it had.
#  3. The launcher closes the store last, once every rank has exited: publishers withdraw and
#     receivers count out through it, and a rank that finds it gone gets PeerLostError.

HELP_EPILOG = """\
how the pieces fit:
  store     The launcher runs Store(is_server=True) on 127.0.0.1 and closes it last. Each
            rank connects with Store.connect(address, prefix="job", secret=...).
  secret    Every store value carries an HMAC under the job's secret. The launcher hands
            store.secret to each rank as an argument of its Process (multiprocessing):
            never on a command line, which every user of the host can read (ps). A job
            launched across nodes sets WARMLINK_SECRET in each process's environment instead
            (readable by its user and root only) and leaves secret= out.
  shutdown  Engines close first, then trainers (Publisher.close waits for readers still
            inside; a receiver asking for a version after it gets TransferTimeout), then the
            store, once every rank has exited.
  failure   A rank that raises or dies makes the launcher stop the others and exit 1,
            naming the rank; every wait inside a rank ends within --timeout seconds.
"""


def build_model():
    """A small language model (embedding, MLP blocks, head) in plain torch; the same seed gives
    every trainer rank the same initial weights, as a checkpoint would."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, HIDDEN)
            self.down = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return TinyLM()


def digest(named_tensors) -> str:
    """SHA-256 over every tensor's name and bytes, by name: equal digests, equal weights."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer_key(version: int) -> str:
    return f"check/trainer/{version}"


def engine_key(engine: int, version: int) -> str:
    return f"check/engine/{engine}/{version}"


def _stop_on_sigterm() -> None:
    """SIGTERM (the launcher stopping the job) raises SystemExit, so ``with`` blocks close the
    publisher, receiver and store connection on the way out, as on a normal exit."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def _use_device(device: str, index: int) -> None:
    import torch

    torch.set_num_threads(1)  # ranks share the host's cores
    if device == "cuda":
        torch.cuda.set_device(index % torch.cuda.device_count())


def trainer(rank: int, world: int, engines: int, steps: int, address: str, secret: str, device: str,
            init_file: str, timeout_s: float) -> None:
    _stop_on_sigterm()
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from warmlink.refit import Publisher
    from warmlink.rendezvous import Store

    _use_device(device, rank)
    # NVLink multicast is no use to a 2-rank job, and some shared GPU hosts refuse it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    model = build_model().to(device)
    mesh = init_device_mesh(device, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensors: each rank holds its shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + rank)  # data parallel: each rank its own batches

    def announce(store, version: int) -> None:
        full = [(n, p.full_tensor()) for n, p in model.named_parameters()]  # a collective: every rank
        if rank == 0:
            store.set(trainer_key(version), digest(full))

    def wait_for_engines(store, version: int) -> None:
        for e in range(engines):  # each get ends within timeout_s: TransferTimeout names the key
            store.get(engine_key(e, version), timeout_s=timeout_s, peer=f"engine {e}")

    try:
        with Store.connect(address, prefix=PREFIX, secret=secret, timeout_s=timeout_s) as store, \
                Publisher(store, rank=rank, world_size=world, timeout_s=timeout_s) as pub:
            pub.add_module(model)  # local shards, read in place; layouts from their placements
            pub.export()           # version 1
            announce(store, pub.version)
            for step in range(1, steps + 1):
                wait_for_engines(store, pub.version)  # one refit per step: the engines take every version
                ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=data).to(device)
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                loss.backward()
                with pub.update():  # waits until no engine reads, then publishes version + 1
                    optimizer.step()
                optimizer.zero_grad()
                if rank == 0:
                    print(f"trainer: step {step} loss {loss.item():.3f}, published version {pub.version}", flush=True)
                announce(store, pub.version)
            wait_for_engines(store, pub.version)  # Note [Shutdown order], step 2
        # Leaving the block closed the publisher (withdraws the version, waits for readers still
        # inside, gives the memory back), then the store connection.
    finally:
        dist.destroy_process_group()


def engine(index: int, trainers: int, steps: int, address: str, secret: str, device: str, timeout_s: float) -> None:
    _stop_on_sigterm()
    import torch

    from warmlink.refit import Receiver
    from warmlink.rendezvous import Store

    _use_device(device, trainers + index)  # with GPUs: the next one after the trainers', round robin
    model = build_model().to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # nothing of the trainer's: every byte the check sees came through refit
    with Store.connect(address, prefix=PREFIX, secret=secret, timeout_s=timeout_s) as store, \
            Receiver(store, num_publishers=trainers, timeout_s=timeout_s) as rec:
        rec.add_module(model)  # every parameter whole, by name: pulls from every trainer shard
        for version in range(1, steps + 2):
            report = rec.refit(version=version)  # waits for the version; installs it whole or raises
            store.set(engine_key(index, version), digest(model.named_parameters()))
            print(f"engine {index}: installed version {version}: pull {report.pull_s * 1e3:.1f} ms, install "
                  f"{report.install_s * 1e3:.1f} ms (waited {report.sync_s:.2f} s for the version)", flush=True)
    # Note [Shutdown order], step 1: the receiver and the store connection closed as the block ended.


def _how_it_ended(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}" + (" (its traceback is above)" if code == 1 else "")


def _stop(procs: dict) -> list[str]:
    """Stop every rank still running: SIGTERM, then SIGKILL after GRACE_S. Returns their names."""
    alive = {name: p for name, p in procs.items() if p.is_alive()}
    for p in alive.values():
        p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in alive.values():
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join(5.0)
    return list(alive)


def check(store, engines: int, versions: int) -> list[str]:
    """Every engine's digest of every version against the trainer's: the mismatches, by name."""
    wrong = []
    for v in range(1, versions + 1):
        want = store.try_get(trainer_key(v))
        for e in range(engines):
            got = store.try_get(engine_key(e, v))
            if want is None or got != want:
                wrong.append(f"engine {e} at version {v}")
    return wrong


def run(args) -> int:
    from warmlink.rendezvous import Store

    versions = args.steps + 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stopped, it still stops its ranks
    # Each rank is a process of its own, forked from a server process that imported torch and
    # warmlink once (forkserver, which starts clean: no threads, no CUDA), not importing them
    # again in every rank: that costs seconds of CPU per rank.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp", "warmlink.refit", "warmlink.rendezvous"])
    # The server listens on loopback only. Its secret: the `secret` argument, else WARMLINK_SECRET,
    # else a fresh random one, read back as store.secret.
    with Store("127.0.0.1", 0, is_server=True, prefix=PREFIX, timeout_s=args.timeout) as store, \
            tempfile.TemporaryDirectory(prefix="refit-job-") as tmp:
        # store.secret goes to each rank as a Process argument: Note [Secret hand-off].
        common = dict(steps=args.steps, address=store.address, secret=store.secret, device=args.device,
                      timeout_s=args.timeout)
        procs = {f"trainer {r}": ctx.Process(target=trainer, name=f"trainer-{r}", kwargs=dict(
                     common, rank=r, world=args.trainers, engines=args.engines, init_file=os.path.join(tmp, "pg")))
                 for r in range(args.trainers)}
        procs.update({f"engine {e}": ctx.Process(target=engine, name=f"engine-{e}", kwargs=dict(
                          common, index=e, trainers=args.trainers))
                      for e in range(args.engines)})
        print(f"launcher: store at {store.address}; {args.trainers} trainer rank(s), {args.engines} engine(s), "
              f"{args.steps} step(s) on {args.device}", flush=True)
        try:
            for name, p in procs.items():
                p.start()
                print(f"launcher: started {name} (pid {p.pid})", flush=True)
            failed = _watch(procs, time.monotonic() + args.job_timeout)
        finally:
            stopped = _stop(procs)  # a rank left running here is a failure or an interrupt
        if failed:
            print(f"launcher: job failed: {failed}" + (f"; stopped {', '.join(stopped)}" if stopped else ""),
                  file=sys.stderr, flush=True)
            return 1
        wrong = check(store, args.engines, versions)  # the store is still up: every rank has exited
    # Note [Shutdown order], step 3: the store closed as its block ended, after every rank.
    if wrong:
        print(f"check FAILED: the trainer's weights differ from {', '.join(wrong)}", file=sys.stderr, flush=True)
        return 1
    print(f"check OK: {args.engines} engine(s) held the trainer's weights bit for bit at versions 1..{versions}",
          flush=True)
    return 0


def _watch(procs: dict, deadline: float) -> str | None:
    """Wait until every rank has exited; return what went wrong first (None: all exited 0)."""
    running = dict(procs)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"{', '.join(running)} still running at --job-timeout"
        ready = mp.connection.wait([p.sentinel for p in running.values()], timeout=min(left, 1.0))
        failed = []  # all that ended since the last look: which failed first cannot be told apart
        for name, p in list(running.items()):
            if p.sentinel in ready:
                p.join()
                del running[name]
                if p.exitcode != 0:
                    failed.append(f"{name} (pid {p.pid}) {_how_it_ended(p)}")
        if failed:
            return "; ".join(failed)
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Run a refit job on this host: FSDP2 trainer ranks publish every optimizer step, engine "
                    "ranks pull it, and the launcher checks that the engines hold the trainer's weights.",
        epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, each followed by a refit (default 3)")
    p.add_argument("--trainers", type=int, default=None,
                   help="trainer ranks, the FSDP2 world (default: 2 on CPU; on GPUs one per GPU, at most 2)")
    p.add_argument("--engines", type=int, default=1, help="engine ranks, each a Receiver of the whole model (default 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda when a GPU is present (transport cuda_ipc), else cpu (shared memory)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any wait inside a rank may take: store, refit, update, close (default 60)")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds after which the launcher stops every rank and fails (default 300)")
    args = p.parse_args(argv)
    if args.steps < 0 or args.engines < 1 or (args.trainers is not None and args.trainers < 1):
        p.error("expected --steps >= 0, --engines >= 1 and --trainers >= 1")
    if args.timeout <= 0 or args.job_timeout <= 0:
        p.error("expected --timeout and --job-timeout > 0")
    import torch  # after --help: it takes seconds to import

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus else "cpu"
    if args.device == "cuda" and not gpus:
        p.error("--device cuda: no CUDA device here")
    if args.trainers is None:
        args.trainers = min(2, gpus) if args.device == "cuda" else 2
    if args.device == "cuda" and args.trainers > gpus:
        p.error(f"--trainers {args.trainers}: NCCL takes one GPU per rank and there are {gpus}")
    return args


if __name__ == "__main__":
    sys.exit(run(parse_args()))
