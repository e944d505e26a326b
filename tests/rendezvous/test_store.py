"""Tests for warmlink.rendezvous.store: a real TCPStore server on 127.0.0.1, no GPU."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

import pytest

from warmlink.errors import ConfigError, MetadataError, PeerLostError, TransferTimeout, WarmlinkError
from warmlink.rendezvous.store import Store

SECRET = "test-secret-" + "0" * 20
STATE = {"schema_version": 1, "kind": "version_state", "version": 3, "state": "published", "generation": 2}


@pytest.fixture
def server():
    with Store(is_server=True, prefix="job", timeout_s=5) as s:
        yield s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_picks_port_and_client_connects(server: Store) -> None:
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    with Store.connect(server.address, prefix="job", timeout_s=5, secret=server.secret) as client:
        client.set("k", b"\x00\xffraw")
        assert server.get("k") == b"\x00\xffraw"
        server.set("s", "text")
        assert client.get("s", timeout_s=1) == b"text"
        assert client.try_get("missing") is None
        client.set("empty", b"")
        assert server.try_get("empty") == b""
        assert client.delete("k") is True and client.delete("k") is False
        assert server.try_get("k") is None


def test_get_timeout_is_quick_and_names_key(server: Store) -> None:
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"waiting for key='never'"):
        server.get("never", timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 0.6


def test_get_waits_for_late_writer(server: Store) -> None:
    timer = threading.Timer(0.05, server.set, ("late", b"v"))
    timer.start()
    try:
        assert server.get("late", timeout_s=2) == b"v"
    finally:
        timer.join()


def test_prefixes_isolate_jobs(server: Store) -> None:
    with Store.connect(server.address, prefix="other", timeout_s=5, secret=server.secret) as other:
        server.set("k", b"job")
        other.set("k", b"other")
        assert server.get("k") == b"job" and other.get("k") == b"other"
        assert server.next_generation("pub/0") == 1 and other.next_generation("pub/0") == 1


def test_next_generation_and_add(server: Store) -> None:
    assert [server.next_generation("pub/1") for _ in range(3)] == [1, 2, 3]
    assert server.next_generation("pub/2") == 1
    assert server.add("ctr", 5) == 5 and server.add("ctr", -2) == 3


def test_add_on_non_integer_keeps_connection(server: Store) -> None:
    server.set("text", b"hello")
    with pytest.raises(MetadataError, match="not an integer"):
        server.add("text", 1)
    assert server.get("text") == b"hello"  # the connection survived (see Note [TCPStore quirks])


def test_compare_set(server: Store) -> None:
    assert server.compare_set("cs", b"", b"a") == b"a"
    assert server.compare_set("cs", b"a", b"b") == b"b"
    assert server.compare_set("cs", b"zzz", b"c") == b"b"
    assert server.compare_set("absent", b"x", b"y") == b"x"  # TCPStore: absent + non-empty expected
    assert server.try_get("absent") is None


def test_json_round_trip_and_validation(server: Store) -> None:
    server.set_json("state", STATE)
    assert server.get_json("state", "version_state", "pub/0") == STATE
    server.set("bad", b'{"schema_version":1,"kind":"version_state","version":-1,"state":"published","generation":1}')
    with pytest.raises(MetadataError, match=r"peer='pub/0': version=-1 out of range"):
        server.get_json("bad", "version_state", "pub/0")
    with pytest.raises(MetadataError, match="state='gone' is unknown"):
        server.set_json("state", {**STATE, "state": "gone"})
    with pytest.raises(TransferTimeout, match="key='nothing'"):
        server.get_json("nothing", "version_state", "pub/0", timeout_s=0.05)


def test_wait_until(server: Store) -> None:
    calls = []
    server.wait_until(lambda: calls.append(1) or len(calls) > 3, what="four polls", timeout_s=1)
    assert len(calls) == 4
    with pytest.raises(TransferTimeout, match="waiting for the moon"):
        server.wait_until(lambda: False, what="the moon", timeout_s=0.05)


def test_close_idempotent_and_fails_closed() -> None:
    s = Store(is_server=True, timeout_s=5)
    client = Store.connect(s.address, timeout_s=5, secret=s.secret)
    s.close()
    s.close()
    with pytest.raises(PeerLostError, match="is closed"):
        s.get("k")
    with pytest.raises(PeerLostError, match=s.address):  # the server is gone
        client.get("k", timeout_s=1)
    client.close()
    client.close()
    assert "closed" in repr(client)


def test_dead_port_fails_within_timeout() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=f"127.0.0.1:{port}"):
        Store("127.0.0.1", port, timeout_s=0.3, secret=SECRET)
    assert time.monotonic() - start < 1.0


def test_client_waits_for_late_server() -> None:
    port = _free_port()
    box: list[Store] = []
    timer = threading.Timer(0.1, lambda: box.append(Store("127.0.0.1", port, is_server=True, timeout_s=5,
                                                          secret=SECRET)))
    timer.start()
    try:
        with Store("127.0.0.1", port, timeout_s=5, secret=SECRET) as client:
            client.set("up", b"1")
    finally:
        timer.join()
        for s in box:
            s.close()


def test_port_in_use_and_bad_arguments(server: Store) -> None:
    with pytest.raises(ConfigError, match=f"127.0.0.1:{server.port}"):
        Store("127.0.0.1", server.port, is_server=True, timeout_s=1)
    for kwargs in ({"port": 0}, {"port": 70000}, {"is_server": True, "prefix": ""}, {"timeout_s": 0}, {"timeout_s": float("inf")}):
        with pytest.raises(ConfigError):
            Store(**kwargs)
    for address in ("nohost", "h:", ":1", "h:x"):
        with pytest.raises(ConfigError, match="address="):
            Store.connect(address)
    with pytest.raises(ConfigError, match="key="):
        server.get("")
    with pytest.raises(ConfigError, match="expected bytes or str"):
        server.set("k", 5)  # type: ignore[arg-type]


def _child(address: str, secret: str, out: mp.Queue) -> None:
    try:
        with Store.connect(address, prefix="job", timeout_s=10, secret=secret) as store:
            state = store.get_json("ping", "version_state", "parent", timeout_s=10)
            store.set_json("pong", {**state, "version": state["version"] + 1})
            out.put(("ok", store.next_generation("child")))
    except WarmlinkError as e:  # pragma: no cover - reported to the parent
        out.put(("error", repr(e)))


def test_across_processes(server: Store) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(server.address, server.secret, out))
    proc.start()
    try:
        server.set_json("ping", STATE)
        assert server.get_json("pong", "version_state", "child", timeout_s=20)["version"] == 4
        assert out.get(timeout=20) == ("ok", 1)
        assert server.next_generation("child") == 2
    finally:
        proc.join(timeout=20)
        if proc.is_alive():  # pragma: no cover
            proc.kill()
    assert proc.exitcode == 0
