"""The emulated cluster (``warmlink.bench.cluster``): hosts that look like other machines, links
that really run at their rate, and nothing left behind, however the owner ends.

The cluster needs root, ip, tc, unshare and nsenter: where any is missing or refused the tests
skip and say why (``unavailable``). Timing is asserted as a lower bound only (a transfer cannot
beat its link); every wait is bounded with a wide margin.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from warmlink.bench.cluster import DEVICE, Cluster, ClusterUnavailable, parse_rate, reap_stale, unavailable
from warmlink.errors import ConfigError
from warmlink.pool.liveness import pid_alive  # (a zombie is dead; a process gone mid-read too)

RATE_BPS = 40_000_000
NBYTES = 3 << 20  # 0.63 s at 40 Mbit/s: far above the buckets' 32 KiB and the start-up


@pytest.fixture(scope="module", autouse=True)
def _cluster_possible():
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


_WHO = ("import json, os, socket; st = os.stat('/dev/shm'); "
        "print(json.dumps({'hostname': socket.gethostname(), 'ns_pid': os.getpid(), "
        "'host_pid': int(os.readlink('/proc/self')), 'shm_dev': st.st_dev}))")

_SINK = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], 0))
    print(s.getsockname()[1], flush=True)
    conn, _ = s.accept()
    n = 0
    while (chunk := conn.recv(1 << 20)):
        n += len(chunk)
    print(n, flush=True)
""")

_SOURCE = textwrap.dedent("""
    import socket, sys, time
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
    t0 = time.monotonic()
    conn.sendall(b"x" * int(sys.argv[3]))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the sink closes after the last byte: the time is the transfer's, end to end
    print(time.monotonic() - t0, flush=True)
""")


def _tc(*args: str) -> str:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def _limit(ns: str, dev: str) -> tuple[int | None, int]:
    """``(rate in bits/s, bytes sent)`` of the limit on ``dev``'s egress in ``ns`` (rate None: no
    limit): the ``htb``'s top class of a small-first link, the ``tbf`` of a FIFO one."""
    root = next(q for q in json.loads(_tc("-n", ns, "-s", "-j", "qdisc", "show", "dev", dev)) if q.get("root"))
    if root["kind"] == "tbf":
        return int(root["options"]["rate"]) * 8, int(root["bytes"])  # tc's JSON rate is in bytes/s
    if root["kind"] == "htb":  # tc prints htb classes as text, even with -j
        rate = re.search(r"class htb 1:1 root .*?\brate (\S+)", _tc("-n", ns, "class", "show", "dev", dev)).group(1)
        return parse_rate(rate.lower()), int(root["bytes"])
    return None, int(root.get("bytes", 0))


def test_four_hosts_are_other_machines_behind_links_at_their_rate() -> None:
    with Cluster(4, link_rate_bps=RATE_BPS) as cluster:
        seen = [json.loads(subprocess.run(cluster.command(h.idx, [sys.executable, "-c", _WHO]), capture_output=True,
                                          text=True, timeout=60, check=True).stdout) for h in cluster.hosts]
        assert [s["hostname"] for s in seen] == [f"wl-host-{i}" for i in range(4)]
        assert all(s["ns_pid"] != s["host_pid"] for s in seen)  # a pid table of its own
        assert len({s["shm_dev"] for s in seen} | {os.stat("/dev/shm").st_dev}) == 5  # a /dev/shm of its own
        assert [h.address for h in cluster.hosts] == [f"10.214.0.{i}" for i in range(1, 5)]

        sink = subprocess.Popen(cluster.command(0, [sys.executable, "-c", _SINK, cluster.hosts[0].address]),
                                stdout=subprocess.PIPE, text=True)
        try:
            port = sink.stdout.readline().strip()
            sent_before = _limit(cluster.hosts[3].netns, DEVICE)[1]
            received_before = _limit(cluster.switch, "h0")[1]
            source = subprocess.run(cluster.command(3, [sys.executable, "-c", _SOURCE, cluster.hosts[0].address, port,
                                                        str(NBYTES)]), capture_output=True, text=True, timeout=120)
            assert source.returncode == 0, source.stderr
            assert int(sink.stdout.readline()) == NBYTES
        finally:
            sink.kill()
            sink.wait(timeout=30)
        elapsed_s = float(source.stdout)
        assert elapsed_s >= 0.95 * NBYTES * 8 / RATE_BPS, f"{NBYTES} bytes in {elapsed_s:.3f} s: faster than the link"
        # Both ends' limits carried the bytes: host 3's sending side and host 0's receiving side.
        rate, sent = _limit(cluster.hosts[3].netns, DEVICE)
        assert rate == RATE_BPS and sent - sent_before >= NBYTES
        rate, received = _limit(cluster.switch, "h0")
        assert rate == RATE_BPS and received - received_before >= NBYTES
        assert cluster.link_bytes(3)[0] >= NBYTES and cluster.link_bytes(0)[1] >= NBYTES
    assert not {h.netns for h in cluster.hosts} & _namespaces()


def _rates(cluster: Cluster) -> list[int | None]:
    """The limit's rate (bits/s) on each end of each link, or None."""
    return [_limit(ns, dev)[0] for h in cluster.hosts for ns, dev in ((h.netns, DEVICE), (cluster.switch, f"h{h.idx}"))]


@pytest.mark.parametrize("queue", ["small-first", "fifo"])
def test_the_links_rate_changes_while_the_hosts_run(queue) -> None:
    with Cluster(2, link_rate_bps=RATE_BPS, link_queue=queue) as cluster:
        assert _rates(cluster) == [RATE_BPS] * 4
        cluster.set_link_rate(None)
        assert _rates(cluster) == [None] * 4 and cluster.link_rate_bps is None
        cluster.set_link_rate(2 * RATE_BPS)
        assert _rates(cluster) == [2 * RATE_BPS] * 4 and cluster.link_rate_bps == 2 * RATE_BPS
        with pytest.raises(ConfigError, match="link_rate_bps=10 invalid"):
            cluster.set_link_rate(10)
        assert _rates(cluster) == [2 * RATE_BPS] * 4


_ECHO = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 0))
    print(s.getsockname()[1], flush=True)
    while True:
        data, peer = s.recvfrom(64)
        s.sendto(data, peer)
""")

_PINGS = textwrap.dedent("""
    import socket, statistics, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    rtts = []
    for i in range(20):
        t0 = time.monotonic()
        s.sendto(b"%d" % i, (sys.argv[1], int(sys.argv[2])))
        s.recvfrom(64)
        rtts.append(time.monotonic() - t0)
        time.sleep(0.02)
    print(statistics.median(rtts), flush=True)
""")


def _small_rtt_beside_bulk(queue: str) -> tuple[float, str]:
    """The median round trip of a 1-byte UDP request from host 1 to host 0 while hosts 1 and 2 both
    stream to host 0 (Note [Link queues]): twice what host 0's link takes arrives at the switch,
    whose side of that link queues the streams' bytes and the request together. Also the classes'
    counters on that side (tc's text)."""
    with Cluster(3, link_rate_bps=RATE_BPS, link_queue=queue) as cluster:
        address = cluster.hosts[0].address
        procs = []

        def start(host: int, code: str, *args: str) -> subprocess.Popen:
            procs.append(subprocess.Popen(cluster.command(host, [sys.executable, "-c", code, *args]),
                                          stdout=subprocess.PIPE, text=True))
            return procs[-1]

        try:
            echo_port = start(0, _ECHO, address).stdout.readline().strip()
            sources = [start(h, _SOURCE, address, start(0, _SINK, address).stdout.readline().strip(), str(4 * NBYTES))
                       for h in (1, 2)]
            time.sleep(0.5)  # the streams fill the queue
            pings = subprocess.run(cluster.command(1, [sys.executable, "-c", _PINGS, address, echo_port]),
                                   capture_output=True, text=True, timeout=60)
            assert pings.returncode == 0, pings.stderr
            assert all(s.poll() is None for s in sources), "a stream ended before the requests did: not measured beside it"
            return float(pings.stdout), _tc("-n", cluster.switch, "-s", "class", "show", "dev", "h0")
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=30)


def _class_sent(text: str, classid: str) -> tuple[int, int]:
    """``(bytes, packets)`` an htb class sent, from ``tc -s class show``."""
    found = re.search(rf"class htb {classid} .*?\n\s*Sent (\d+) bytes (\d+) pkt", text)
    return int(found.group(1)), int(found.group(2))


def test_small_packets_pass_a_busy_links_queue_that_a_fifo_holds_them_in() -> None:
    """The requests go to the small class, the streams' bytes to the bulk one, and the requests
    come back sooner than through one FIFO, which holds them behind the bytes queued before them
    (tens of ms here; only the order is asserted, which load on this machine does not turn)."""
    fifo, _ = _small_rtt_beside_bulk("fifo")
    small_first, classes = _small_rtt_beside_bulk("small-first")
    assert _class_sent(classes, "1:10")[1] >= 20  # the 20 requests (and the streams' handshakes)
    assert _class_sent(classes, "1:20")[0] >= NBYTES
    assert small_first < fifo, (fifo, small_first)


def test_close_ends_every_process_of_every_host_even_after_one_died() -> None:
    cluster = Cluster(2)
    names = {h.netns for h in cluster.hosts} | {cluster.switch}
    try:
        lasting = cluster.start(1, [sys.executable, "-c", "import os, sys, json; print(json.dumps({'event': 'ready', "
                                    "'pid': int(os.readlink('/proc/self'))}), flush=True); sys.stdin.read()"])
        dying = cluster.start(0, [sys.executable, "-c", "import sys; sys.exit(3)"], name="dying")
        pid = lasting.expect("ready", timeout_s=60)["pid"]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"dying exited \(3\) before 'ready'"):
            dying.expect("ready", timeout_s=120)
        assert time.monotonic() - t0 < 60  # the exit is seen, not waited out
        assert names <= _namespaces()
        inits = [h.init_pid for h in cluster.hosts]
    finally:
        cluster.close()
    assert _wait_gone([pid, *inits]) == []  # stdin still open: the host's end took it down
    assert not names & _namespaces()
    cluster.close()  # idempotent


_OWNER = textwrap.dedent("""
    import json, os, sys, time
    from warmlink.bench.cluster import Cluster
    with Cluster(2, link_rate_bps=10**8) as c:
        sleeper = c.start(1, [sys.executable, "-c", "import os, json, time; print(json.dumps({'event': 'ready', "
                              "'pid': int(os.readlink('/proc/self'))}), flush=True); time.sleep(600)"])
        pid = sleeper.expect("ready", timeout_s=120)["pid"]
        print(json.dumps({"names": [h.netns for h in c.hosts] + [c.switch], "pids": [pid] + [h.init_pid for h in c.hosts]}),
              flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"])
def test_an_owner_ended_by_a_signal_leaves_nothing_behind(sig) -> None:
    """Ctrl-C: its KeyboardInterrupt tears down; SIGTERM: the bench's handler makes it SystemExit
    (as here); SIGKILL: the hosts die with their owner and the next cluster deletes the namespaces
    (Note [Cluster teardown])."""
    code = _OWNER if sig != signal.SIGTERM else (
        "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n" + _OWNER)
    # Ctrl-C reaches a terminal's foreground process, whose SIGINT is not ignored; a suite started in
    # the background (a CI job, `cmd &`) hands its children SIGINT ignored, and Python then keeps it so
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        made = json.loads(owner.stdout.readline())
        assert set(made["names"]) <= _namespaces()
        owner.send_signal(sig)
        owner.wait(timeout=60)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
    assert _wait_gone(made["pids"]) == [], "a host's process outlived the cluster's owner"
    if sig == signal.SIGKILL:
        assert set(made["names"]) <= set(reap_stale())  # its namespaces: deleted by the next cluster
    assert not set(made["names"]) & _namespaces()


def _unavailable_in(prefix: list[str], env: dict | None = None) -> str:
    code = "from warmlink.bench.cluster import unavailable; print(unavailable())"
    done = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_what_is_refused_and_why_is_said(tmp_path) -> None:
    nobody = _unavailable_in(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert "needs root" in nobody and "uid 65534" in nobody
    for tool in ("ip", "unshare", "nsenter"):  # a PATH without tc
        (tmp_path / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    no_tc = _unavailable_in([], env={"PATH": str(tmp_path)})
    assert "needs tc(8)" in no_tc and "iproute2" in no_tc
    before = _namespaces()
    # Root without CAP_SYS_ADMIN (a container's root): the kernel refuses the namespace's mount.
    refused = _unavailable_in(["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"])
    assert "making a network namespace refused: `ip netns add" in refused and "not permitted" in refused
    assert _namespaces() <= before


def test_bad_arguments_are_refused_before_anything_is_made() -> None:
    before = _namespaces()
    for bad in (0, 251, True, 2.0):
        with pytest.raises(ConfigError, match="num_hosts"):
            Cluster(bad)
    with pytest.raises(ConfigError, match="link_rate_bps"):
        Cluster(2, link_rate_bps=100)
    with pytest.raises(ConfigError, match="link_queue='lifo' unknown"):
        Cluster(2, link_queue="lifo")
    assert _namespaces() == before
    assert parse_rate("200mbit") == 200_000_000 and parse_rate("1.5Gbit") == 1_500_000_000
    assert parse_rate("64000bit") == 64_000
    for bad in ("200", "fast", "0mbit", "-1mbit", "200mbps"):
        with pytest.raises(ConfigError, match="expected a number and a unit"):
            parse_rate(bad)


def test_a_refusal_is_a_typed_error_naming_the_reason(monkeypatch) -> None:
    from warmlink.errors import WarmlinkError

    before = _namespaces()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="needs root.*uid 1000") as refused:
        Cluster(2)
    assert isinstance(refused.value, WarmlinkError)
    assert _namespaces() == before
