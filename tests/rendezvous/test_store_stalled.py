"""Every ``Store`` call ends within its limit while the server is stopped (SIGSTOP): Note [Store
deadlines] in warmlink.rendezvous.store. A call that blocks past its limit plus ``MARGIN_S`` fails
its test at once (tests/_stalled.py) rather than hanging the suite."""

from __future__ import annotations

import sys
import threading

import pytest
import torch.distributed  # noqa: F401 - its first import takes seconds: before any timed call

from tests._stalled import stoppable_server, times_out, within
from warmlink.errors import PeerLostError, TransferTimeout
from warmlink.rendezvous import Store

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP and /proc: Linux")

LIMIT_S = 1.0
BIG = b"x" * (7 << 20)  # a few of these fill the sockets' buffers: a send then blocks


@pytest.fixture(scope="module")
def server():
    with stoppable_server("stall") as s:
        yield s


@pytest.fixture
def client(server):
    """A client whose own default limit (60 s) is far past LIMIT_S: the calls' limits must reach the socket."""
    with Store.connect(server.address, prefix=server.prefix, timeout_s=60, secret=server.secret) as c:
        c.set("present", b"v")
        c.set_json("state", {"schema_version": 1, "kind": "version_state", "version": 1, "state": "published",
                             "generation": 1})
        yield c


def _times_out(fn) -> TransferTimeout:
    return times_out(fn, LIMIT_S)


def test_connect_to_a_stopped_server_raises_within_its_timeout(server) -> None:
    with server.stopped():
        exc = _times_out(lambda: Store.connect(server.address, prefix=server.prefix, timeout_s=LIMIT_S, secret=server.secret))
    assert server.address in str(exc) and "did not answer" in str(exc)


CALLS = {
    "try_get": lambda c: c.try_get("present", timeout_s=LIMIT_S),
    "get": lambda c: c.get("present", timeout_s=LIMIT_S),
    "get_absent": lambda c: c.get("absent", timeout_s=LIMIT_S),
    "get_json": lambda c: c.get_json("state", "version_state", "pub/0", timeout_s=LIMIT_S),
    "set": lambda c: c.set("small", b"v", timeout_s=LIMIT_S),
    "set_big": lambda c: [c.set("big", BIG, timeout_s=LIMIT_S) for _ in range(8)],
    "set_json": lambda c: c.set_json("state", {"schema_version": 1, "kind": "version_state", "version": 2,
                                               "state": "published", "generation": 1}, timeout_s=LIMIT_S),
    "add": lambda c: c.add("counter", 1, timeout_s=LIMIT_S),
    "add_unchecked": lambda c: c.add("counter", 1, checked=False, timeout_s=LIMIT_S),
    "next_generation": lambda c: c.next_generation("pub/0", timeout_s=LIMIT_S),
    "compare_set": lambda c: c.compare_set("present", b"v", b"w", timeout_s=LIMIT_S),
    "delete": lambda c: c.delete("present", timeout_s=LIMIT_S),
    "wait_until": lambda c: c.wait_until(lambda: c.try_get("absent") is not None, what="absent", timeout_s=LIMIT_S),
    "set_blob": lambda c: c.set_blob("blob", BIG * 3, timeout_s=LIMIT_S),
    "get_blob": lambda c: c.get_blob("present", timeout_s=LIMIT_S),
    "try_get_blob": lambda c: c.try_get_blob("present", timeout_s=LIMIT_S),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_call_raises_within_its_timeout(server, client: Store, name: str) -> None:
    with server.stopped():
        exc = _times_out(lambda: CALLS[name](client))
    assert server.address in str(exc)


def test_deadline_bounds_calls_without_a_timeout_of_their_own(server, client: Store) -> None:
    def scoped() -> None:
        with client.deadline(LIMIT_S):
            client.add("counter", 1, checked=False)

    with server.stopped():
        _times_out(scoped)


def test_the_stores_own_timeout_bounds_a_call(server) -> None:
    with Store.connect(server.address, prefix=server.prefix, timeout_s=LIMIT_S, secret=server.secret) as c, server.stopped():
        _times_out(lambda: c.try_get("present"))


def test_a_timed_out_connection_is_replaced_and_never_reads_a_late_reply(server, client: Store) -> None:
    client.set("a", b"A")
    client.set("b", b"B")
    with server.stopped():
        _times_out(lambda: client.try_get("a", timeout_s=LIMIT_S))
    # The first connection still holds the reply for "a": read on it, it would answer "b" with "A".
    assert client.try_get("b", timeout_s=30) == b"B"
    assert client.try_get("a", timeout_s=30) == b"A"
    assert client.add("n", 2) == 2 and client.add("n", 3) == 5


def test_a_call_behind_another_threads_stalled_call_gives_up_at_its_own_limit(server, client: Store) -> None:
    result: list = []
    with server.stopped():
        slow = threading.Thread(target=lambda: result.append(client.try_get("present", timeout_s=60)))
        slow.start()
        exc = _times_out(lambda: client.try_get("present", timeout_s=LIMIT_S))
        assert "another thread" in str(exc)
    slow.join(30)
    assert result == [b"v"]  # continued before its own limit, it gets its answer


def test_a_lost_server_fails_every_later_call_at_once() -> None:
    server = Store(is_server=True, prefix="lost", timeout_s=60)
    client = Store.connect(server.address, prefix="lost", timeout_s=60, secret=server.secret)
    server.close()
    try:
        for _ in range(2):  # not reconnected: the second call fails as the first did
            exc, _took = within(lambda: client.try_get("k"), 5.0)
            assert isinstance(exc, PeerLostError) and server.address in str(exc)
    finally:
        client.close()
