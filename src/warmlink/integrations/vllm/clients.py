"""vLLM's client protocol (``VLLMWeightSyncClient``) over a ``multiprocessing`` connection.

For trainer ranks that run in processes of their own beside an ``LLM`` in the driver (a test, an
example, a one-node job without Ray or HTTP): rank 0's trainer engine calls a ``ConnectionClient``;
the driver runs ``serve_client(llm, conn, until=...)``, which calls the ``LLM``'s own methods.
Messages are JSON (no pickle); every wait is bounded.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from warmlink.errors import ConfigError, PeerLostError, TransferError, TransferTimeout

__all__ = ["ConnectionClient", "serve_client"]

_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class ConnectionClient:
    """The four client calls, each sent over ``conn`` and answered by ``serve_client``.

    Args:
        conn: one end of ``multiprocessing.Pipe()``; the driver holds the other.
        timeout_s: how long one call may take on the engine, seconds.
    """

    def __init__(self, conn, *, timeout_s: float = 600.0) -> None:
        self.conn, self.timeout_s = conn, timeout_s

    def _call(self, method: str, arg: Any = None) -> None:
        try:
            self.conn.send_bytes(json.dumps({"method": method, "arg": arg}).encode())
            if not self.conn.poll(self.timeout_s):
                raise TransferTimeout(f"ConnectionClient.{method}: no answer from the engine within {self.timeout_s} s")
            reply = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise PeerLostError(f"ConnectionClient.{method}: the engine's side of the connection is gone ({exc!r})") from None
        if reply.get("error"):
            raise TransferError(f"ConnectionClient.{method}: the engine failed: {reply['error']}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def serve_client(engine, conn, *, until: Callable[[], bool], timeout_s: float = 600.0, poll_s: float = 0.02) -> int:
    """Answer ``ConnectionClient`` calls on ``engine`` (an ``LLM``) until ``until()`` is true.

    Args:
        engine: what the calls reach: ``engine.init_weight_transfer_engine({"init_info": ...})``,
            ``start_weight_update()``, ``update_weights({"update_info": ...})``,
            ``finish_weight_update(weight_version)``.
        conn: the driver's end of the pipe.
        until: checked between calls (e.g. "every trainer rank answered").
        timeout_s: total time to serve, seconds.

    Returns:
        How many calls were served. An engine error is sent back (the trainer raises it) and
        serving goes on.

    Raises:
        TransferTimeout: ``until()`` still false after ``timeout_s``.
    """
    deadline, served = time.monotonic() + timeout_s, 0
    while not until():
        if time.monotonic() > deadline:
            raise TransferTimeout(f"serve_client: still serving after {timeout_s} s")
        try:
            if not conn.poll(poll_s):
                continue
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the trainer's end closed (a killed rank 0): nothing more to serve
            time.sleep(poll_s)
            continue
        method, arg = msg.get("method"), msg.get("arg")
        error = None
        try:
            if method not in _METHODS:
                raise ConfigError(f"serve_client: method={method!r} unknown; expected one of {list(_METHODS)}")
            if method == "init_weight_transfer_engine":
                engine.init_weight_transfer_engine({"init_info": arg})
            elif method == "update_weights":
                engine.update_weights({"update_info": arg})
            elif method == "finish_weight_update":
                engine.finish_weight_update(arg)
            else:
                engine.start_weight_update()
        except Exception as exc:  # noqa: BLE001 - sent back to the trainer, which raises it
            error = f"{type(exc).__name__}: {exc}"[:4000]
        try:
            conn.send_bytes(json.dumps({"error": error}).encode())
        except (EOFError, OSError):
            pass
        served += 1
    return served
