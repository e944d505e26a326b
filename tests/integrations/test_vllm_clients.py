"""The vLLM client protocol over a pipe (``warmlink.integrations.vllm.clients``), without vLLM: a
fake engine records the calls a trainer's ``ConnectionClient`` makes through ``serve_client``."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading

import pytest

from warmlink.errors import TransferError, TransferTimeout
from warmlink.integrations.vllm.clients import ConnectionClient, serve_client


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
