"""The authenticated store (Notes [Store MAC] and [Store secret] in
warmlink.rendezvous._mac): a value written without the job's secret is refused, naming its key and
peer, before anything acts on it; a client needs the secret; the server listens on the asked host
only. A real TCPStore server on 127.0.0.1, no GPU; nothing here depends on timing."""

from __future__ import annotations

import datetime
import json
import os
import socket
import struct
import subprocess
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink import _env
from warmlink.errors import ConfigError, MetadataError
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import _mac, schema
from warmlink.rendezvous.store import Store

SECRET, OTHER = "a" * 16 + "-job-secret", "b" * 16 + "-other-secret"
STATE = {"schema_version": 1, "kind": "version_state", "version": 3, "state": "published", "generation": 2}


@pytest.fixture
def server():
    with Store(is_server=True, prefix=f"mac-{uuid.uuid4().hex[:8]}", timeout_s=10, secret=SECRET) as s:
        yield s


@pytest.fixture
def no_env_secret(monkeypatch):
    monkeypatch.delenv("WARMLINK_SECRET", raising=False)
    _env.clear_cache()
    yield monkeypatch
    _env.clear_cache()


def _raw(store: Store):
    """An attacker's client: plain TCPStore under the job's prefix, without the secret."""
    import torch.distributed as dist

    tcp = dist.TCPStore(store.host, store.port, None, False, timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore(store.prefix, tcp)


def _refused(match: str, *calls) -> None:
    for call in calls:
        with pytest.raises(MetadataError, match=match) as info:
            call()
        assert SECRET not in str(info.value) and OTHER not in str(info.value)


# -- values under another secret, or none -------------------------------------------------------------
def test_values_under_another_secret_are_refused_naming_key_and_peer(server: Store) -> None:
    with Store.connect(server.address, prefix=server.prefix, timeout_s=10, secret=OTHER) as other:
        other.set("k", b"v")
        other.set_json("state", STATE)
        other.set_blob("small", b"x" * 100)
        other.set_blob("big", b"y" * (5 * schema.MIN_CHUNK_BYTES + 1), chunk_nbytes=schema.MIN_CHUNK_BYTES)
        assert other.get("k") == b"v"  # the writer's own secret opens its own values
    _refused(r"Store\.try_get: key='k'.*fails its MAC", lambda: server.get("k", timeout_s=1), lambda: server.try_get("k"))
    _refused(r"key='k' from peer='trainer/0'.*fails its MAC", lambda: server.get("k", timeout_s=1, peer="trainer/0"))
    _refused(r"key='state' from peer='publisher/0'.*fails its MAC",
             lambda: server.get_json("state", "version_state", "publisher/0", timeout_s=1))
    for key in ("small", "big"):
        _refused(rf"key='{key}' from peer='publisher/1'.*fails its MAC",
                 lambda: server.get_blob(key, timeout_s=1, peer="publisher/1"),
                 lambda: server.try_get_blob(key, peer="publisher/1"))
    _refused(r"Store\.compare_set: key='k'.*fails its MAC", lambda: server.compare_set("k", b"", b"w"))
    assert server.compare_set("mine", b"", b"1") == b"1" and server.compare_set("mine", b"1", b"2") == b"2"


def test_chunks_of_a_blob_are_checked_each(server: Store) -> None:
    data = bytes(range(256)) * (3 * schema.MIN_CHUNK_BYTES // 256)
    server.set_blob("m", data, chunk_nbytes=schema.MIN_CHUNK_BYTES)
    digest = json.loads(server.get("m")[len(b"\x00warmlink.blob\x00"):])["sha256"]
    _raw(server).set(f"m/blob/{digest}/1", data[schema.MIN_CHUNK_BYTES : 2 * schema.MIN_CHUNK_BYTES])  # no MAC
    _refused(rf"key='m/blob/{digest}/1' from peer='p'.*fails its MAC", lambda: server.get_blob("m", peer="p"))


def test_raw_writes_without_the_secret_are_refused(server: Store) -> None:
    raw = _raw(server)
    raw.set("plain", json.dumps(STATE).encode())
    raw.set("empty", b"")
    sealed = _mac.Mac(SECRET, server.prefix).seal("elsewhere", b"moved")
    raw.set("moved", sealed)  # a genuine value, copied under another key
    for key in ("plain", "empty", "moved"):
        _refused(rf"key='{key}'", lambda: server.try_get(key))
    with Store(is_server=True, prefix=server.prefix + "x", secret=SECRET, timeout_s=10) as other_prefix:
        other_prefix.set("k", b"v")
        stolen = _raw(other_prefix).get("k")
    raw.set("k", stolen)  # a genuine value of another prefix
    _refused("key='k'", lambda: server.try_get("k"))


@settings(max_examples=200, deadline=None)
@given(value=st.binary(max_size=300), key=st.text(min_size=1, max_size=40), data=st.data())
def test_any_change_to_a_sealed_value_is_refused(value: bytes, key: str, data) -> None:
    mac = _mac.Mac(SECRET, "job")
    sealed = mac.seal(key, value)
    assert mac.open(key, sealed) == value
    i = data.draw(st.integers(0, len(sealed) - 1))
    flip = data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(sealed) - 1))
    extra = data.draw(st.binary(min_size=1, max_size=8))
    for bad in (sealed[:i] + bytes([sealed[i] ^ flip]) + sealed[i + 1:], sealed[:cut], sealed + extra, extra + sealed):
        assert mac.open(key, bad) is None
    assert _mac.Mac(OTHER, "job").open(key, sealed) is None
    assert _mac.Mac(SECRET, "job2").open(key, sealed) is None
    assert mac.open(key + "x", sealed) is None


def test_tampered_bytes_in_the_store_are_refused(server: Store) -> None:
    server.set("k", b"payload")
    stored = _raw(server).get("k")
    raw = _raw(server)
    for i in (0, 31, 32, len(stored) - 1):
        raw.set("k", stored[:i] + bytes([stored[i] ^ 1]) + stored[i + 1:])
        _refused("key='k'", lambda: server.try_get("k"))
    raw.set("k", stored)
    assert server.get("k") == b"payload"


# -- counters: no MAC, but never more than a small integer -------------------------------------------
def test_counters_hold_small_integers_or_are_refused(server: Store) -> None:
    assert server.add("c", 2) == 2 and server.add("c", 0, checked=False) == 2
    raw = _raw(server)
    raw.set("huge", str((1 << 63) - 2).encode())
    _refused(r"key='huge' holds the counter", lambda: server.add("huge", 0), lambda: server.add("huge", 0, checked=False))
    raw.set("word", b"abc")
    _refused(r"key='word' holds b'abc', not an integer", lambda: server.add("word", 1))
    server.set("sealed", b"12")
    _refused(r"key='sealed' holds .* not an integer", lambda: server.add("sealed", 1))


def test_an_unchecked_add_on_a_forged_counter_costs_a_refusal_not_the_connection(server: Store) -> None:
    _raw(server).set("word", b"abc")
    with Store.connect(server.address, prefix=server.prefix, timeout_s=10, secret=SECRET) as client:
        # the server drops the client's connection (Note [TCPStore quirks]); the add is made again,
        # checked, on a new one: refused naming the key, and the client works on
        with pytest.raises(MetadataError, match=r"key='word' holds b'abc', not an integer"):
            client.add("word", 1, checked=False)
        assert client.add("count", 2, checked=False) == 2
        client.set("value", b"v")
        assert client.get("value", timeout_s=5) == b"v"
    assert server.add("fine", 1) == 1  # other clients keep theirs


# -- the secret -------------------------------------------------------------------------------------
def test_client_without_a_secret_is_a_config_error(server: Store, no_env_secret) -> None:
    for connect in (lambda: Store.connect(server.address, prefix=server.prefix, timeout_s=5),
                    lambda: Store(server.host, server.port, prefix=server.prefix, timeout_s=5)):
        with pytest.raises(ConfigError, match="no secret.*WARMLINK_SECRET"):
            connect()
    for bad in ("short", 12, b"b" * 32):
        with pytest.raises(ConfigError, match="expected a str of 16 to 1024 bytes") as info:
            Store.connect(server.address, prefix=server.prefix, timeout_s=5, secret=bad)
        assert "short" not in str(info.value)


def test_secret_comes_from_argument_then_environment_then_is_fresh(server: Store, no_env_secret) -> None:
    no_env_secret.setenv("WARMLINK_SECRET", SECRET)
    _env.clear_cache()
    with Store.connect(server.address, prefix=server.prefix, timeout_s=5) as client:
        client.set("from-env", b"1")
        assert server.get("from-env") == b"1" and client.secret == SECRET
    with Store(is_server=True, timeout_s=5) as s:
        assert s.secret == SECRET
    with Store(is_server=True, timeout_s=5, secret=OTHER) as s:
        assert s.secret == OTHER
    no_env_secret.delenv("WARMLINK_SECRET")
    _env.clear_cache()
    with Store(is_server=True, timeout_s=5) as a, Store(is_server=True, timeout_s=5) as b:
        assert len(a.secret) == 64 and a.secret != b.secret  # fresh, random, per server
        assert a.secret not in repr(a) and a.secret not in repr(a._mac)


# -- the server listens on the asked host only --------------------------------------------------------
def _other_local_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    found = set()
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        found.update(line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3)
    except (OSError, subprocess.SubprocessError):
        pass
    others = sorted(a for a in found if not a.startswith("127."))
    return others[0] if others else None


def _reaches(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=10).close()
        return True
    except OSError:
        return False


def _own_listeners(port: int) -> set[str]:
    """The IPv4 addresses this process listens on at ``port``, read from the kernel's socket table.

    Asking the kernel, not connecting: another process may listen on the same port number at
    another address, and a connection there would be answered by it."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            ip_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port and inode in inodes:  # 0A: LISTEN
                found.add(socket.inet_ntoa(struct.pack("<I", int(ip_hex, 16))))
    return found


def test_server_listens_on_the_asked_host_only(server: Store) -> None:
    assert _own_listeners(server.port) == {"127.0.0.1"}
    assert _reaches("127.0.0.1", server.port)
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no address but loopback")
    with Store(other, 0, is_server=True, timeout_s=10, secret=SECRET) as there:
        assert _own_listeners(there.port) == {other}
        with Store.connect(there.address, timeout_s=10, secret=SECRET) as client:
            client.set("k", b"v")
            assert there.get("k") == b"v"


def test_port_is_released_with_the_server() -> None:
    s = Store(is_server=True, timeout_s=5, secret=SECRET)
    port = s.port
    s.close()
    with Store("127.0.0.1", port, is_server=True, timeout_s=5, secret=SECRET) as again:  # bound again at once
        assert again.port == port


# -- refit: a forged publisher value is refused before the receiver acts on it -------------------------
W = TensorLayout.plain("w", "float32", (16, 8))


def _job(store: Store):
    source = torch.arange(128, dtype=torch.float32).reshape(16, 8)
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=10)
    pub.add("w", source, W)
    pub.export()
    target = torch.full((16, 8), 42.0)
    rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=10)
    rec.add("w", W, target)
    return source, pub, rec, target


def test_forged_version_state_makes_refit_refuse_and_install_nothing(server: Store, store_sync) -> None:
    """A receiver that syncs through the store (one on another host; one on the publisher's host
    reads no state in a warm cycle: Note [Version board])."""
    source, pub, rec, target = _job(server)
    try:
        assert rec.refit().version == 1 and torch.equal(target, source)
        before = target.clone()
        source.mul_(-1)  # only a pull could bring these bytes
        forged = {**STATE, "version": 2, "generation": pub.generation}
        _raw(server).set(protocol.state_key(0), json.dumps(forged).encode())
        with pytest.raises(MetadataError, match=r"key='pub/0/state' from peer='publisher/0'.*fails its MAC"):
            rec.refit(timeout_s=10)
        assert torch.equal(target, before)
    finally:
        rec.close()
        pub.close()


def test_forged_manifest_makes_refit_refuse_and_install_nothing(server: Store) -> None:
    source, pub, rec, target = _job(server)
    try:
        key = protocol.manifest_key(0, pub.generation)
        manifest = json.loads(server.get_blob(key))
        manifest["regions"][0]["name"] = "another-jobs-segment"  # what the store must never make it open
        _raw(server).set(key, json.dumps(manifest).encode())
        with pytest.raises(MetadataError, match=rf"key='{key}'.*fails its MAC"):
            rec.refit(timeout_s=10)
        assert torch.equal(target, torch.full((16, 8), 42.0))
    finally:
        rec.close()
        pub.close()
