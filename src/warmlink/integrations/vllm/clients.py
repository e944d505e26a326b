"""vLLM's client protocol (``VLLMWeightSyncClient``) over a ``multiprocessing`` connection.

For trainer ranks that run in processes of their own beside an ``LLM`` in the driver (a test, an
example, a one-node job without Ray or HTTP): rank 0's trainer engine calls a ``ConnectionClient``;
the driver runs ``serve_client(llm, conn, until=...)``, which calls the ``LLM``'s own methods.
Messages are JSON (no pickle); every wait is bounded.

``prefix_cache_resetter(client, mode)`` finds how a client resets the engine's prefix cache after
an update (Note [Stale prefix cache]).

# Note [Stale prefix cache]
vLLM's prefix cache keeps the KV of prompt blocks it has seen, keyed by their tokens only: after
the weights change, a prompt whose first blocks were cached is answered from KV the previous
weights computed (off-policy samples with no symptom, and RL prompts share system prompts and
templates). vLLM resets it only in ``pause_generation(clear_cache=True)``; its weight-update calls
do not, and its workers, where warmlink runs, cannot reach the scheduler that owns it. So the
trainer resets it through the client right after ``finish_weight_update``, with
``reset_running_requests=True``: requests still running are preempted and recomputed with the new
weights, as vLLM does for a reset it cannot otherwise make. Generation that runs *concurrently*
with an update can still start a request between the install and the reset; a server that keeps
generating while it updates should pause around ``send_weights`` (``pause_generation``), as vLLM
advises for any weight update.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from warmlink.errors import ConfigError, PeerLostError, TransferError, TransferTimeout

__all__ = ["ConnectionClient", "serve_client"]

_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
            "reset_prefix_cache")


class ConnectionClient:
    """The four client calls and ``reset_prefix_cache``, each sent over ``conn`` and answered by
    ``serve_client``.

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

    def reset_prefix_cache(self) -> None:
        """Reset the engine's prefix cache, preempting running requests (Note [Stale prefix cache])."""
        self._call("reset_prefix_cache")


def serve_client(engine, conn, *, until: Callable[[], bool], timeout_s: float = 600.0, poll_s: float = 0.02) -> int:
    """Answer ``ConnectionClient`` calls on ``engine`` (an ``LLM``) until ``until()`` is true.

    Args:
        engine: what the calls reach: ``engine.init_weight_transfer_engine({"init_info": ...})``,
            ``start_weight_update()``, ``update_weights({"update_info": ...})``,
            ``finish_weight_update(weight_version)``, ``reset_prefix_cache(reset_running_requests=True)``.
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
            elif method == "reset_prefix_cache":
                _check_reset(engine.reset_prefix_cache(reset_running_requests=True), "LLM.reset_prefix_cache")
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


def _check_reset(done, where: str) -> None:
    if done is False:
        raise TransferError(f"{where}: the engine did not reset its prefix cache (requests waiting for a remote KV "
                            "transfer?); its KV of the previous weights may still be served")


def prefix_cache_resetter(client, mode: str = "reset") -> Callable[[], None] | None:
    """How ``client`` resets the engine's prefix cache after an update (Note [Stale prefix cache]),
    or None with ``mode="keep"``.

    ``ConnectionClient`` and any client with a ``reset_prefix_cache()`` method call it; vLLM's
    ``RayVLLMWeightSyncClient`` calls ``reset_prefix_cache`` on each of its actors (an ``LLM`` or
    ``AsyncLLM``: both have it); vLLM's ``HTTPVLLMWeightSyncClient`` posts to the server's
    ``/reset_prefix_cache``, which a server started with ``VLLM_SERVER_DEV_MODE=1`` has.

    Raises:
        ConfigError: ``client`` offers no way to reset it (checked here, at ``trainer_init``, so
            that no update runs before it is known), naming what to do instead.
    """
    if mode == "keep":
        return None
    own = getattr(client, "reset_prefix_cache", None)
    if callable(own):
        return lambda: _check_reset(own(), f"{type(client).__name__}.reset_prefix_cache")
    kind = type(client).__name__
    handles = getattr(client, "handles", None)
    if kind == "RayVLLMWeightSyncClient" and handles:
        missing = [h for h in handles if not hasattr(h, "reset_prefix_cache")]
        if missing:
            raise ConfigError(f"prefix_cache='reset': {len(missing)} of the client's Ray actors have no reset_prefix_cache "
                              "method; expected actors of vLLM's LLM / AsyncLLM (or a wrapper that exposes it), or "
                              "prefix_cache='keep' with the cache reset by the caller")

        def reset_ray() -> None:
            import ray

            for done in ray.get([h.reset_prefix_cache.remote(True) for h in handles]):
                _check_reset(done, "ray actor reset_prefix_cache")

        return reset_ray
    base_url = getattr(client, "base_url", None)
    if kind == "HTTPVLLMWeightSyncClient" and isinstance(base_url, str):
        return _http_resetter(base_url, getattr(client, "timeout", 300))
    raise ConfigError(f"prefix_cache='reset': the client {kind} has no reset_prefix_cache() method, so the engine's prefix "
                      "cache (KV computed with the previous weights) cannot be reset after an update; expected a client "
                      "with reset_prefix_cache() (warmlink's ConnectionClient has one), or prefix_cache='keep' with the "
                      "cache reset or salted by the caller")


def _http_resetter(base_url: str, timeout_s: float) -> Callable[[], None]:
    def reset() -> None:
        import requests

        try:
            response = requests.post(f"{base_url}/reset_prefix_cache", params={"reset_running_requests": "true"},
                                     timeout=timeout_s)
        except requests.RequestException as exc:
            raise PeerLostError(f"POST {base_url}/reset_prefix_cache: {exc}") from None
        if response.status_code == 404:
            raise ConfigError(f"POST {base_url}/reset_prefix_cache: 404; expected a vLLM server started with "
                              "VLLM_SERVER_DEV_MODE=1 (which serves it), or prefix_cache='keep'")
        if response.status_code >= 400:
            raise TransferError(f"POST {base_url}/reset_prefix_cache: HTTP {response.status_code}: {response.text[:500]}")
        try:
            done = response.json().get("success")
        except (ValueError, AttributeError):
            done = None
        _check_reset(done is not False, f"POST {base_url}/reset_prefix_cache")

    reset()  # checked now (trainer_init): a server without the route fails here, not after an update
    return reset
