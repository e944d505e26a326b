"""An emulated cluster on one machine: hosts as network namespaces behind rate-limited links.

``Cluster(num_hosts, link_rate_bps=...)`` makes, for host ``i``:

* a network namespace with one link ``wl0`` at ``10.214.0.{i + 1}/24``, whose other end sits on a
  bridge (the switch) in a namespace of its own, so nothing is added to this machine's network;
* a ``tc`` rate limit on both ends of that link at ``link_rate_bps``, standing in for the
  host's NIC: the host's end limits what the host sends, the switch's end what it receives
  (Note [Link queues]: small packets go before bulk ones, as a NIC serves them);
* a host init: ``unshare --pid --uts --mount`` in that namespace under hostname ``wl-host-{i}``
  with a tmpfs of its own on /dev/shm. Processes started on the host (``command``, ``start``)
  enter the init's namespaces with ``nsenter``: they share the host's hostname, pid table,
  /dev/shm and network, and see other hosts' processes only over the links, as on other machines.

# Note [Link queues]
Behind a rate limit, packets wait. One FIFO (a ``tbf`` of 100 ms, as this module first had) puts a
100-byte read request, a header read's answer or an ACK behind every byte another flow queued
there: on a host that receives a version and passes it on, each request it sends upstream waits
behind the bytes it sends downstream, and each request from downstream behind the bytes arriving
from upstream, up to 100 ms apiece. Real NICs do not do that: an RDMA NIC arbitrates between its
queue pairs packet by packet, and Linux's default qdisc (fq_codel) serves a sparse flow before a
busy one. So each end of a link is an ``htb`` at the rate with two classes: packets shorter than
512 bytes (requests, ACKs, small answers: a ``u32`` match on the IP length) go first, bulk ones
after, each class with a queue of 100 ms of the rate. This kernel has neither fq nor fq_codel to
attach below a limit. ``link_queue="fifo"`` keeps the single ``tbf`` FIFO for comparison (a chain
of fan-out relays pays for it: BENCHMARKS.md). Byte counters then count GSO segments as the
kernel hands them over: their headers once per segment, not per wire packet.

Everything needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ``ip``, ``tc``, ``unshare`` and
``nsenter``. ``unavailable()`` says what is missing or refused; ``Cluster`` raises
``ClusterUnavailable`` with the refused command and the kernel's answer. Teardown:
Note [Cluster teardown].
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import shutil
import subprocess
import uuid
from dataclasses import dataclass

from warmlink.bench.json_child import JsonChild
from warmlink.errors import WarmlinkError

__all__ = ["Cluster", "ClusterUnavailable", "Host", "LINK_QUEUES", "parse_rate", "reap_stale", "unavailable", "DEVICE"]

DEVICE = "wl0"  # every host's link, by the same name on every host (UCX_NET_DEVICES=wl0)
_SUBNET = "10.214.0"  # inside the cluster's own namespaces: never seen by this machine's network
_NAME = re.compile(r"^wlc-(\d+)-([0-9a-f]{8})-(sw|h\d+)$")
LINK_QUEUES = ("small-first", "fifo")  # Note [Link queues]
_SMALL_BYTES = 512  # an IP packet shorter than this is "small" (the u32 match below is on its length's top 7 bits)
_TOOLS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux", "nsenter": "util-linux"}

# The host init, under ``unshare``: it names the host, mounts its /dev/shm, prints its pid as this
# machine sees it (``/proc`` is still this machine's: /proc/self is the shell itself, which the
# exec keeps), and sleeps as pid 1 of the host's processes.
_INIT = ('hostname "$1" && mount -t tmpfs -o "$2" wl-shm /dev/shm && read -r pid _ < /proc/self/stat && '
         'echo "$pid" && exec sleep infinity')

# Note [Cluster teardown]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A cluster leaves nothing behind, whatever happens to the process that made it:
#
# * ``close`` (``with``, an exception, Ctrl-C's KeyboardInterrupt) SIGKILLs each host's
#   ``unshare``. Its ``--kill-child`` kills the host init, and when a PID namespace's init dies
#   the kernel kills every process in it: no process of a host outlives it. Then each namespace
#   is deleted; a link goes with the namespace of either end.
# * The process that made the cluster dies without ``close`` (SIGKILL): each ``unshare`` runs
#   under ``setpriv --pdeathsig KILL``, so the host processes die with it. Only the namespaces'
#   names stay behind, and they carry the owner's pid (``wlc-<pid>-<tag>-h<i>``): the next
#   cluster made on the machine deletes those of owners that no longer run.
# * Processes run on a host start a session of their own (``JsonChild``): Ctrl-C at a terminal
#   reaches the owner only, which ends them in order instead of in a storm of tracebacks.


class ClusterUnavailable(WarmlinkError, RuntimeError):
    """This machine cannot make an emulated cluster: not root, a tool missing, or the kernel refused
    a step (the message names the command and quotes the kernel's answer)."""


@dataclass(frozen=True)
class Host:
    """One emulated host: ``idx`` in the cluster, its network namespace, hostname, address on
    ``DEVICE``, and the pid (as this machine sees it) of its init, whose namespaces processes enter."""

    idx: int
    netns: str
    hostname: str
    address: str
    init_pid: int


def parse_rate(text: str) -> int:
    """A link rate as ``tc`` writes it (``200mbit``, ``1gbit``, ``500kbit``, ``64000bit``) in bits
    per second.

    Raises:
        ConfigError: not a positive rate with one of those units.
    """
    from warmlink.errors import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"parse_rate: rate={text!r} invalid; expected a number and a unit of bit, kbit, mbit or "
                          "gbit, e.g. 200mbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def _missing() -> str | None:
    """Why no cluster can start here without trying one (user, tools), or None."""
    if os.geteuid() != 0:
        return (f"the emulated cluster needs root (network namespaces, veth links and tc need CAP_NET_ADMIN and "
                f"CAP_SYS_ADMIN); this process runs as uid {os.geteuid()}")
    for tool, package in _TOOLS.items():
        if shutil.which(tool) is None:
            return f"the emulated cluster needs {tool}(8), which is not on PATH (install {package})"
    return None


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why this machine cannot make an emulated cluster, or None. Tries a one-host cluster with a
    rate-limited link once per process (a fraction of a second)."""
    reason = _missing()
    if reason is not None:
        return reason
    try:
        Cluster(1, link_rate_bps=10**9).close()
    except ClusterUnavailable as exc:
        return str(exc)
    return None


def _check_rate(link_rate_bps, func: str) -> None:
    from warmlink.errors import ConfigError

    if link_rate_bps is not None and (isinstance(link_rate_bps, bool) or not isinstance(link_rate_bps, int)
                                      or link_rate_bps < 8000):
        raise ConfigError(f"{func}: link_rate_bps={link_rate_bps!r} invalid; expected None or an int >= 8000 bits "
                          "per second")


def _run(argv: list[str], what: str, timeout_s: float = 30.0) -> str:
    """Run one setup command; its stdout, or ClusterUnavailable naming ``what`` and the answer."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterUnavailable(f"Cluster: {what} failed: `{' '.join(argv)}`: {exc}") from None
    if done.returncode != 0:
        raise ClusterUnavailable(f"Cluster: {what} refused: `{' '.join(argv)}` exited {done.returncode}: "
                                 f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> list[str]:
    """Delete the namespaces of clusters whose owner process no longer runs (Note [Cluster
    teardown]); returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    stale = [n for n in (line.split()[0] for line in out.splitlines() if line.strip())
             if (m := _NAME.match(n)) and not _owner_alive(int(m.group(1)))]
    for name in stale:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return stale


class Cluster:
    """``num_hosts`` emulated hosts joined by links of ``link_rate_bps`` (see the module docstring).

    Args:
        num_hosts: how many hosts, 1 to 250; host ``i`` has address ``10.214.0.{i + 1}``.
        link_rate_bps: each host's link rate in bits per second, both ways (None: unlimited).
        link_queue: how a limited link queues (Note [Link queues]): ``"small-first"`` (default),
            packets under 512 bytes before bulk ones; ``"fifo"``, one 100 ms FIFO.
        shm_bytes: the size of each host's /dev/shm tmpfs, bytes (None: the kernel's default, half
            of this machine's memory).
        timeout_s: how long one setup step may take, seconds.

    Raises:
        ClusterUnavailable: not root, a tool missing, or the kernel refused a step (what is made
            before it is torn down again).
        ConfigError: a value out of range.

    The thread that makes a cluster must outlive it: its host inits die with that thread
    (Note [Cluster teardown]). ``close`` is idempotent; ``with`` calls it.
    """

    def __init__(self, num_hosts: int, *, link_rate_bps: int | None = None, link_queue: str = "small-first",
                 shm_bytes: int | None = None, timeout_s: float = 30.0) -> None:
        from warmlink.errors import ConfigError

        if isinstance(num_hosts, bool) or not isinstance(num_hosts, int) or not 1 <= num_hosts <= 250:
            raise ConfigError(f"Cluster: num_hosts={num_hosts!r} out of range; expected an int in [1, 250]")
        _check_rate(link_rate_bps, "Cluster")
        if link_queue not in LINK_QUEUES:
            raise ConfigError(f"Cluster: link_queue={link_queue!r} unknown; expected one of {', '.join(LINK_QUEUES)}")
        self.link_queue = link_queue
        reason = _missing()
        if reason is not None:
            raise ClusterUnavailable(f"Cluster: {reason}")
        self.link_rate_bps: int | None = None  # what the links run at now; set_link_rate sets it
        self.timeout_s = timeout_s
        self.hosts: list[Host] = []
        self._tag = f"wlc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._made: list[str] = []  # namespaces, in the order made
        self._inits: list[subprocess.Popen] = []
        self._closed = False
        reap_stale()
        try:
            self._make(num_hosts, shm_bytes, link_rate_bps)
        except BaseException:
            self.close()
            raise

    @property
    def switch(self) -> str:
        """The namespace of the bridge every host's link ends on."""
        return f"{self._tag}-sw"

    def _netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name], "making a network namespace", self.timeout_s)
        self._made.append(name)

    def _make(self, num_hosts: int, shm_bytes: int | None, link_rate_bps: int | None) -> None:
        self._netns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"], "making the switch's bridge")
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"], "starting the switch's bridge")
        for i in range(num_hosts):
            ns, port = f"{self._tag}-h{i}", f"h{i}"
            self._netns(ns)
            # Both ends made inside their namespaces: no device ever appears on this machine's network.
            _run(["ip", "link", "add", DEVICE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch],
                 f"making host {i}'s link (veth)")
            address = f"{_SUBNET}.{i + 1}"
            for step in (["-n", ns, "addr", "add", f"{address}/24", "dev", DEVICE], ["-n", ns, "link", "set", DEVICE, "up"],
                         ["-n", ns, "link", "set", "lo", "up"], ["-n", self.switch, "link", "set", port, "master", "br0"],
                         ["-n", self.switch, "link", "set", port, "up"]):
                _run(["ip", *step], f"setting up host {i}'s link")
            self.hosts.append(Host(i, ns, f"wl-host-{i}", address, self._start_init(ns, f"wl-host-{i}", shm_bytes)))
        self.set_link_rate(link_rate_bps)

    def set_link_rate(self, link_rate_bps: int | None) -> None:
        """Set every host's link to ``link_rate_bps`` bits per second both ways (None: unlimited),
        while the hosts run.

        Raises:
            ConfigError: a rate below 8000 bits per second.
            ClusterUnavailable: tc refused the limit (the kernel's sch_tbf module missing, say).
        """
        _check_rate(link_rate_bps, "Cluster.set_link_rate")
        for host in self.hosts:
            for ns, dev, side in ((host.netns, DEVICE, "sending"), (self.switch, f"h{host.idx}", "receiving")):
                self._limit(ns, dev, link_rate_bps, f"host {host.idx}'s {side} side")
        self.link_rate_bps = link_rate_bps

    def _limit(self, ns: str, dev: str, rate: int | None, what: str) -> None:
        """A limit at ``rate`` on ``dev``'s egress (None: none), queued as ``link_queue`` says (Note
        [Link queues]). Its bucket holds 1 ms of the rate (at least 32 KiB): a burst no longer than
        that can beat the rate; its queues hold 100 ms of it."""
        tc = ["tc", "-n", ns]
        if rate is None:
            if self.link_rate_bps is not None:
                _run(tc + ["qdisc", "del", "dev", dev, "root"], f"lifting the rate limit on {what}")
            return
        burst = str(max(32 << 10, rate // 8 // 1000))
        if self.link_queue == "fifo":
            steps = [["qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit", "burst", burst, "latency",
                      "100ms"]]
        else:
            queue, small = str(max(64 << 10, rate // 8 // 10)), rate // 10  # the small class needs far less than its share
            bucket = ["burst", burst, "cburst", burst]
            steps = [["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20", "r2q", "1000"],
                     ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{rate}bit", *bucket],
                     ["class", "replace", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", f"{small}bit",
                      "ceil", f"{rate}bit", *bucket, "prio", "0"],
                     ["class", "replace", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate", f"{rate - small}bit",
                      "ceil", f"{rate}bit", *bucket, "prio", "1"],
                     ["qdisc", "replace", "dev", dev, "parent", "1:10", "bfifo", "limit", queue],
                     ["qdisc", "replace", "dev", dev, "parent", "1:20", "bfifo", "limit", queue],
                     ["filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                      "match", "u16", "0", f"{0xffff & ~(_SMALL_BYTES - 1):#06x}", "at", "2", "flowid", "1:10"]]
        for step in steps:
            try:
                _run(tc + step, f"the rate limit on {what} (tc {step[0]})")
            except ClusterUnavailable as exc:
                kind = "sch_tbf" if self.link_queue == "fifo" else "sch_htb, cls_u32 and sch_fifo"
                raise ClusterUnavailable(f"{exc} (are the kernel's {kind} modules available?)") from None

    def _start_init(self, ns: str, hostname: str, shm_bytes: int | None) -> int:
        """Start the host init in ``ns`` (see ``_INIT``); returns its pid as this machine sees it."""
        options = "mode=1777" + (f",size={shm_bytes}" if shm_bytes else "")
        cmd = ["ip", "netns", "exec", ns, "unshare", "--pid", "--uts", "--mount", "--fork", "--kill-child", "--",
               "sh", "-c", _INIT, "sh", hostname, options]
        if shutil.which("setpriv"):  # the inits die with this thread even if it dies by SIGKILL
            cmd = ["setpriv", "--pdeathsig", "KILL", "--", *cmd]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self._inits.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            proc.kill()
            proc.wait(timeout=30)
            raise ClusterUnavailable(f"Cluster: starting host {hostname!r} (unshare --pid --uts --mount, a tmpfs on "
                                     f"/dev/shm) refused: `{' '.join(cmd)}`: {proc.stderr.read().strip() or 'no answer'}")
        proc.stdout.close()
        return int(line)

    def command(self, host_idx: int, argv: list[str]) -> list[str]:
        """``argv`` run as a process of host ``host_idx`` (its namespaces entered with ``nsenter``),
        in this process's working directory."""
        host = self.hosts[self._index(host_idx)]
        return ["nsenter", "--target", str(host.init_pid), "--net", "--uts", "--mount", "--pid", f"--wd={os.getcwd()}",
                "--", *argv]

    def start(self, host_idx: int, argv: list[str], *, env: dict[str, str | None] | None = None,
              name: str | None = None) -> JsonChild:
        """Start ``argv`` on host ``host_idx`` as a ``JsonChild`` (env: variables set or, None, removed)."""
        return JsonChild(self.command(host_idx, argv), env=env, name=name or f"process on host {host_idx}")

    def link_bytes(self, host_idx: int) -> tuple[int, int]:
        """``(sent, received)`` bytes so far on host ``host_idx``'s link, headers included."""
        host = self.hosts[self._index(host_idx)]
        out = _run(["ip", "-n", host.netns, "-s", "-j", "link", "show", "dev", DEVICE], "reading a link's counters")
        stats = json.loads(out)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def _index(self, host_idx: int) -> int:
        from warmlink.errors import ConfigError

        if isinstance(host_idx, bool) or not isinstance(host_idx, int) or not 0 <= host_idx < len(self.hosts):
            raise ConfigError(f"Cluster: host_idx={host_idx!r} out of range; expected 0 <= host_idx < {len(self.hosts)}")
        return host_idx

    def close(self) -> None:
        """End every process of every host and delete the namespaces (Note [Cluster teardown])."""
        if self._closed:
            return
        self._closed = True
        for proc in self._inits:  # unshare ignores SIGTERM and SIGINT: only SIGKILL ends it
            proc.kill()
        for proc in self._inits:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            import warnings

            warnings.warn("Cluster was not closed; call close() or use it in a with block", ResourceWarning,
                          stacklevel=2)
            self.close()
