"""A warmlink process that tests start in other namespaces (``unshare``) or as a plain child.

``python _ns_child.py MODE [ARGS...]``; it reports JSON lines on stdout and reads commands on stdin.

* ``arena``: lease a 4 MiB shm arena filled with 0x5A, report ``ready``, wait until stdin closes.
* ``reaper INTERVAL_S``: the same, with ``arenas.REAP_INTERVAL_S`` set first (a long-lived process).
* ``receiver ADDRESS PREFIX SECRET NUMEL SYNC``: refit version 1 of a float32 tensor ``w`` of NUMEL
  elements over shm (reporting whether it equals ``arange``), then on any stdin line refit version
  2 with the shm copies held after the first 4 KiB chunk, reporting ``pulling``: killed there, it
  dies mid-pull inside the version. SYNC ``board``: it syncs on the publisher's version board, as
  a receiver sharing the publisher's /dev/shm does; ``store``: through the store's reader counts,
  as a receiver that cannot open the board does.
* ``publisher ADDRESS PREFIX SECRET NUMEL``: publish version 1 of a float32 tensor ``w`` of NUMEL
  elements, ``arange``, over shm, report ``ready``, and keep it published until stdin closes.
* ``nixl_publisher HOST PREFIX SECRET``: serve a store on HOST only and publish a small model
  (``SHAPES``, version v holding ``model_values(v)``) from host memory over nixl, reporting
  ``ready``; then obey stdin lines: ``update TIMEOUT_S`` (begin_update, write v+1, publish:
  ``updated``).
* ``nixl_receiver ADDRESS PREFIX SECRET``: connect (SECRET ``-``: with none) and receive the model
  over nixl, reporting ``ready``; then stdin lines: ``refit`` (the newest version: ``refit``, with
  whether it is bit-exact), ``hold`` (start a refit and leave it: ``pulling``, counted in) and
  ``finish`` (wait for the held refit and install it: ``refit``).
* ``attacker ADDRESS PREFIX``: a plain TCPStore client without the secret that replays and forges
  store values on stdin commands (see ``attacker``), reporting ``done`` after each.
  A failed step reports ``error`` with the exception's type and message, and whether the targets
  are still all zero.

Every report carries who the process is: its pid here and in the test's namespace, hostname,
shm file prefix and liveness token. The test's side is ``Child`` (a ``JsonChild``): it starts
this script, in new PID and UTS namespaces where asked, and waits for its reports with deadlines,
never forever. On an emulated host (``warmlink.bench.cluster``) tests start it with
``Cluster.start``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import zlib

from warmlink.bench.json_child import JsonChild, say

# In new PID and UTS namespaces: set the hostname and optionally the pid the next process gets, and
# run the command as a child of the namespace's init (not exec'd: it must not be pid 1 there).
_SETUP = ('hostname "$1" && { [ "$2" = - ] || echo "$2" > /proc/sys/kernel/ns_last_pid; } && shift 2 && "$@"; '
          'exit $?')


def _in_namespaces(cmd: list[str], hostname: str, last_pid: int | None = None) -> list[str]:
    """``cmd`` run under ``hostname`` in new PID and UTS namespaces (see ``Child``)."""
    return ["unshare", "--pid", "--uts", "--fork", "--kill-child", "--", "sh", "-c", _SETUP, "sh", hostname,
            "-" if last_pid is None else str(last_pid), *cmd]


def free_pid() -> int | None:
    """A pid that no process of this namespace has now, near the top (allocated last), or None."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read())
    for pid in range(top - 2, 300, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    return None


def wait_dead(token: str, pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the lock behind ``token`` is free: a killed process's threads may still be
    exiting (its pid a zombie already) for a moment, holding its files."""
    from warmlink.pool import liveness

    deadline = time.monotonic() + timeout_s
    while liveness.token_alive(token, pid=pid) is not False:
        assert time.monotonic() < deadline, f"the lock of {token} still held {timeout_s} s after its process ended"
        time.sleep(0.05)


def namespaces_unavailable() -> str | None:
    """Why this machine cannot start a process in new PID and UTS namespaces (see ``Child``), or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    what = "unshare --pid --uts"
    try:
        done = subprocess.run(_in_namespaces(["true"], "wl-probe"), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{what} failed: {exc}"
    return None if done.returncode == 0 else f"{what} is not permitted here: {done.stderr.strip()}"


class Child(JsonChild):
    """This script as a child process: ``expect(event)`` returns its next report of that event
    (``warmlink.bench.json_child.JsonChild``).

    Args:
        args: the mode and its arguments.
        hostname: run in new PID and UTS namespaces under this hostname (None: a plain child).
        last_pid: in the new PID namespace, the pid before the one the script gets.
        env: variables set (None: removed) in the script's environment.
    """

    def __init__(self, args: list[str], *, hostname: str | None = None, last_pid: int | None = None,
                 env: dict[str, str | None] | None = None) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), *args]
        if hostname is not None:
            cmd = _in_namespaces(cmd, hostname, last_pid)
        super().__init__(cmd, env=env, name=f"_ns_child.py {args[0]}")


def who() -> dict:
    from warmlink.pool import arenas, liveness

    # /proc is the test's mount: /proc/self names this process by its pid there.
    return {"ns_pid": os.getpid(), "host_pid": int(os.readlink("/proc/self")), "hostname": socket.gethostname(),
            "prefix": arenas.shm_prefix(), "token": liveness.token()}


def arena(interval_s: float | None = None) -> None:
    from warmlink.pool import arenas, lease_arena

    if interval_s is not None:
        arenas.REAP_INTERVAL_S = interval_s
    lease = lease_arena("shm", 4 << 20)
    lease.resource.tensor.fill_(0x5A)
    say(event="ready", name=lease.resource.name, **who())
    sys.stdin.read()
    lease.release()


def receiver(address: str, prefix: str, secret: str, numel: int, sync: str) -> None:
    import torch

    from warmlink.refit import Receiver, TensorLayout, _board
    from warmlink.rendezvous import Store
    from warmlink.transport import shm

    if sync == "store":
        _board.ReaderBoard.open = classmethod(lambda cls, *args: None)

    store = Store.connect(address, prefix=prefix, timeout_s=120, secret=secret)
    target = torch.zeros(numel, dtype=torch.float32)
    rec = Receiver(store, num_publishers=1, backend="shm", install="copy", timeout_s=300)
    rec.add("w", TensorLayout.plain("w", "float32", (numel,)), target)
    report = rec.refit(version=1)
    say(event="ready", version=report.version, ok=bool(torch.equal(target, torch.arange(numel, dtype=torch.float32))),
        **who())
    sys.stdin.readline()
    calls = []

    def hold(nbytes: int) -> None:
        calls.append(nbytes)
        if len(calls) == 2:  # one chunk landed: the pull is under way, its reader count held
            say(event="pulling")
            time.sleep(3600)

    shm.CHUNK_NBYTES = 4096
    shm.fault_hook = hold
    rec.refit(version=2)
    say(event="finished")



def publisher(address: str, prefix: str, secret: str, numel: int) -> None:
    import torch

    from warmlink.refit import Publisher, TensorLayout
    from warmlink.rendezvous import Store

    store = Store.connect(address, prefix=prefix, timeout_s=120, secret=secret)
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=120)
    pub.add("w", torch.arange(numel, dtype=torch.float32), TensorLayout.plain("w", "float32", (numel,)))
    pub.export()
    say(event="ready", version=pub.version, **who())
    sys.stdin.read()
    pub.close()
    store.close()

# The model refit across hosts: name -> (shape, dtype); version v holds model_values(v).
SHAPES = {"embed": ((64, 32), "bfloat16"), "proj": ((32, 32), "float32"), "norm": ((32,), "float32")}


def model_values(version: int) -> dict:
    import torch

    out = {}
    for name, (shape, dtype) in SHAPES.items():
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{version}".encode()))  # same in every process
        out[name] = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
    return out


def _layouts() -> dict:
    from warmlink.refit import TensorLayout

    return {n: TensorLayout.plain(n, dtype, shape) for n, (shape, dtype) in SHAPES.items()}


def _failed(exc: BaseException, **extra) -> None:
    say(event="error", type=type(exc).__name__, msg=str(exc), **extra)


def nixl_publisher(host: str, prefix: str, secret: str) -> None:
    from warmlink.refit import Publisher, protocol
    from warmlink.rendezvous import Store

    store = Store(host, 0, is_server=True, prefix=prefix, secret=secret, timeout_s=60)
    pub = Publisher(store, rank=0, world_size=1, backend="nixl", timeout_s=60)
    tensors = model_values(1)
    for name, layout in _layouts().items():
        pub.add(name, tensors[name], layout)
    pub.export()
    try:  # bound to HOST only: this namespace's loopback has nothing on the port
        socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
        loopback = "open"
    except OSError:
        loopback = "refused"
    say(event="ready", address=store.address, loopback=loopback, version=pub.version, **who())
    for line in sys.stdin:
        cmd, arg = line.split()
        try:
            if cmd == "update":
                pub.begin_update(timeout_s=float(arg))
                for name, t in model_values(pub.version + 1).items():
                    tensors[name].copy_(t)
                say(event="updated", version=pub.publish(), slots=protocol.num_reader_slots(store, 0))
        except Exception as exc:  # noqa: BLE001  reported to the test, which asserts on it
            _failed(exc)
    pub.close()
    store.close()


def nixl_receiver(address: str, prefix: str, secret: str) -> None:
    import torch

    from warmlink.refit import Receiver
    from warmlink.rendezvous import Store

    try:
        store = Store.connect(address, prefix=prefix, timeout_s=60, secret=None if secret == "-" else secret)
    except Exception as exc:  # noqa: BLE001
        _failed(exc)
        return
    targets = {n: torch.zeros(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in SHAPES.items()}
    rec = Receiver(store, num_publishers=1, backend="nixl", timeout_s=60)
    for name, layout in _layouts().items():
        rec.add(name, layout, targets[name])
    say(event="ready", **who())
    for line in sys.stdin:
        try:
            if line.strip() == "hold":
                handle = rec.start_refit()  # counted in, bytes posted: waited for only on "finish"
                say(event="pulling", version=handle.report.version)
            elif line.strip() in ("refit", "finish"):
                version = (rec.refit() if line.strip() == "refit" else handle.wait()).version
                want = model_values(version)
                # bit-exact: compare the bytes, not the values
                exact = all(torch.equal(targets[n].view(torch.uint8), want[n].view(torch.uint8)) for n in SHAPES)
                say(event="refit", version=version, exact=exact)
        except Exception as exc:  # noqa: BLE001
            _failed(exc, zero=all(not t.any() for t in targets.values()))


def attacker(address: str, prefix: str) -> None:
    """A plain TCPStore client of the job's store, without the secret; stdin lines: ``keep KEY``
    (remember its value), ``replay KEY`` (write the remembered value back), ``forge_counts RANK
    VERSION`` (every reader count of that version and the slot count to 0)."""
    import datetime

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    raw = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=30)))
    kept: dict[str, bytes] = {}
    say(event="ready", **who())
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "keep":
            kept[args[0]] = raw.get(args[0])
        elif cmd == "replay":
            raw.set(args[0], kept[args[0]])
        elif cmd == "forge_counts":
            rank, version = args
            for slot in range(1, int(raw.add(f"pub/{rank}/reader_slots", 0)) + 1):
                raw.set(f"pub/{rank}/readers/{version}/{slot}", "0")
            raw.set(f"pub/{rank}/reader_slots", "0")
        say(event="done", cmd=cmd)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "arena":
        arena()
    elif mode == "reaper":
        arena(float(args[0]))
    elif mode == "receiver":
        receiver(args[0], args[1], args[2], int(args[3]), args[4])
    elif mode == "publisher":
        publisher(args[0], args[1], args[2], int(args[3]))
    elif mode == "nixl_publisher":
        nixl_publisher(*args)
    elif mode == "nixl_receiver":
        nixl_receiver(*args)
    elif mode == "attacker":
        attacker(*args)
    else:
        raise SystemExit(f"_ns_child.py: mode={mode!r} is unknown; expected arena, reaper, receiver, publisher, "
                         "nixl_publisher, nixl_receiver or attacker")
