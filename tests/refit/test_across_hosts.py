"""Refit across two hosts over nixl: publisher and receivers on two emulated hosts
(``warmlink.bench.cluster``: network namespaces on one bridge, each host with its own hostname,
PID namespace and /dev/shm). As far as warmlink can tell they are other machines: a receiver
cannot open the publisher's version board (their liveness tokens name another tmpfs), so it syncs
through the store's reader counts (Note [Version protocol], Note [Reader slots] in
``warmlink.refit.protocol``).

UCX moves host memory over TCP on the hosts' links (``UCX_TLS=tcp``, ``UCX_NET_DEVICES``); the
store serves on host A's address only, under a secret. The cluster needs root: where it is refused
(``warmlink.bench.cluster.unavailable`` says why) the tests skip and say why. Every wait is bounded
with a wide margin: two loaded cores must not fail them.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import uuid
from typing import NamedTuple

import pytest

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")

import tests._ns_child
from warmlink.bench.cluster import DEVICE, Cluster, unavailable
from warmlink.bench.json_child import JsonChild

_NS_CHILD = tests._ns_child.__file__

ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE, "WARMLINK_SECRET": None}  # the secret only as an argument


@pytest.fixture(scope="module")
def hosts():
    """Two emulated hosts (``warmlink.bench.cluster``), links not rate-limited; torn down at the end."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with Cluster(2) as cluster:
        yield cluster


@pytest.fixture
def spawn(hosts):
    """Start an ``_ns_child.py`` mode on host ``"a"`` (0) or ``"b"`` (1); every child ends at teardown."""
    started: list[JsonChild] = []

    def start(host: str, *args: str, env: dict | None = None) -> JsonChild:
        idx = int(host == "b")
        child = hosts.start(idx, [sys.executable, _NS_CHILD, *args], env={**ENV, **(env or {})},
                            name=f"_ns_child.py {args[0]} on host {idx}")
        started.append(child)
        return child

    yield start
    for child in started:
        child.close(timeout_s=30)


class Side(NamedTuple):
    child: JsonChild
    ready: dict
    prefix: str
    secret: str


@pytest.fixture
def publisher(spawn, hosts) -> Side:
    """Host A: the store on A's veth address only, under a secret, and a publisher of the model."""
    secret, prefix = secrets.token_hex(16), f"hosts-{uuid.uuid4().hex[:8]}"
    child = spawn("a", "nixl_publisher", hosts.hosts[0].address, prefix, secret)
    return Side(child, child.expect("ready", timeout_s=120), prefix, secret)


def _receiver(spawn, pub: Side, secret: str | None = None, **kwargs) -> JsonChild:
    return spawn("b", "nixl_receiver", pub.ready["address"], pub.prefix, secret or pub.secret, **kwargs)


def _update(pub: Side, timeout_s: float = 60.0) -> dict:
    pub.child.send(f"update {timeout_s}")
    return pub.child.expect("updated", timeout_s=timeout_s + 60)


def _refit(rec: JsonChild) -> dict:
    rec.send("refit")
    return rec.expect("refit", timeout_s=120)


def test_refit_between_two_hosts_over_nixl_is_bit_exact_across_versions(spawn, publisher, hosts) -> None:
    rec = _receiver(spawn, publisher, env={"UCX_PROTO_INFO": "y"})
    a, b = publisher.ready, rec.expect("ready", timeout_s=120)
    # Other hosts as far as warmlink can tell: names, pid tables and /dev/shm all differ.
    assert (a["hostname"], b["hostname"]) == ("wl-host-0", "wl-host-1")
    assert a["ns_pid"] != a["host_pid"] and b["ns_pid"] != b["host_pid"]
    assert a["token"].split("/")[0] != b["token"].split("/")[0]  # another tmpfs: no version board
    assert a["address"].startswith(f"{hosts.hosts[0].address}:") and a["loopback"] == "refused"  # bound to the veth address only

    first = _refit(rec)
    assert first["exact"]
    for version in (first["version"] + 1, first["version"] + 2):
        updated = _update(publisher)
        assert updated["version"] == version
        assert updated["slots"] == 1  # the receiver counted itself in through the store
        assert _refit(rec) == {"event": "refit", "version": version, "exact": True}
    rec.close(timeout_s=60)  # UCX's log reaches the pipe by exit at the latest
    assert "inter-node" in rec.output() and f"tcp/{DEVICE}" in rec.output()  # UCX moved the bytes over the veth


def test_receiver_killed_on_the_other_host_is_revoked_once_its_heartbeat_stops(spawn, publisher) -> None:
    """Its token names another /dev/shm, so nothing on host A can see its process (Note [Reader
    slots]); its heartbeat stops with it (Note [Reader leases]). An update with less time than the
    lease raises TransferTimeout naming the version and count, never hangs; one with more revokes
    the dead reader and goes on, and a new receiver on host B refits bit-exact."""
    from warmlink.refit import protocol

    doomed, fresh = _receiver(spawn, publisher), _receiver(spawn, publisher)  # their imports overlap
    dead = doomed.expect("ready", timeout_s=120)
    fresh.expect("ready", timeout_s=120)
    doomed.send("hold")
    version = doomed.expect("pulling", timeout_s=120)["version"]
    os.kill(dead["host_pid"], signal.SIGKILL)  # counted in, its read posted

    publisher.child.send(f"update {protocol.LEASE_S / 2}")
    timeout = publisher.child.expect("error", timeout_s=60)
    assert timeout["type"] == "TransferTimeout"
    assert f"version {version} still has 1 reader(s)" in timeout["msg"]

    assert _update(publisher, timeout_s=6 * protocol.LEASE_S)["version"] == version + 1
    assert _refit(fresh) == {"event": "refit", "version": version + 1, "exact": True}


def test_a_receiver_on_the_other_host_needs_the_store_secret(spawn, publisher) -> None:
    """Without it the client refuses to start; with a wrong one the first value read fails its MAC,
    nothing is installed and no reader count stays behind to hold the publisher up."""
    no_secret = _receiver(spawn, publisher, secret="-")
    wrong = _receiver(spawn, publisher, secret=secrets.token_hex(16))
    refused = no_secret.expect("error", timeout_s=120)
    assert refused["type"] == "ConfigError" and "no secret" in refused["msg"]

    wrong.expect("ready", timeout_s=120)
    wrong.send("refit")
    forged = wrong.expect("error", timeout_s=120)
    assert forged["type"] == "MetadataError" and "key='pub/0/state'" in forged["msg"]
    assert forged["zero"]  # the targets are untouched
    assert _update(publisher, timeout_s=10)["version"] == publisher.ready["version"] + 1


def test_an_attacker_without_the_secret_cannot_tear_or_roll_back_the_other_host(spawn, publisher) -> None:
    """A plain TCPStore client on host B (no secret) replays the publisher's signed "published"
    state of an earlier version and forges the reader counts under a held pull: the receiver on B
    installs only whole current versions, refuses the pull the trainer wrote under (typed, targets
    untouched), and a new receiver's first cycle installs the present version too (Note [Version
    header] in warmlink.refit._header)."""
    rec = _receiver(spawn, publisher)
    attacker = spawn("b", "attacker", publisher.ready["address"], publisher.prefix)
    rec.expect("ready", timeout_s=120)
    attacker.expect("ready", timeout_s=120)

    def attack(cmd: str) -> None:
        attacker.send(cmd)
        attacker.expect("done", timeout_s=60)

    attack("keep pub/0/state")  # "published 1", signed
    assert _refit(rec) == {"event": "refit", "version": 1, "exact": True}
    for version in (2, 3):  # replayed after each update: the receiver installs the present
        assert _update(publisher)["version"] == version
        attack("replay pub/0/state")
        assert _refit(rec) == {"event": "refit", "version": version, "exact": True}

    rec.send("hold")
    assert rec.expect("pulling", timeout_s=120)["version"] == 3
    attack("forge_counts 0 3")  # the receiver's count gone: the trainer is let in under the pull
    assert _update(publisher, timeout_s=10)["version"] == 4
    attack("replay pub/0/state")
    rec.send("finish")
    refused = rec.expect("error", timeout_s=120)
    assert refused["type"] == "VersionError" and "version header moved" in refused["msg"], refused
    assert _refit(rec) == {"event": "refit", "version": 4, "exact": True}

    first = _receiver(spawn, publisher)  # a first cycle, with the replayed state still in the store
    first.expect("ready", timeout_s=120)
    assert _refit(first) == {"event": "refit", "version": 4, "exact": True}
