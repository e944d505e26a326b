"""The version header over CUDA IPC (Note [Version header] in warmlink.refit._header).

A publisher process writes its header into device memory; a receiver here, on the other GPU when
there are two, syncs through the store (as a receiver on another host does) and reads the header
through its link before and after each pull. An attacker without the secret replays the signed
``published`` state and forges the reader counts under a posted pull: the receiver installs the
present version bit-exact, refuses the pull the trainer wrote under, and the next refit is exact.
"""

from __future__ import annotations

import datetime
import uuid

import pytest
import torch

from _spawned import SpawnedWorker, close_keys, serve

from warmlink.errors import VersionError
from warmlink.refit import Receiver, TensorLayout, protocol
from warmlink.rendezvous import Store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TIMEOUT_S = 60.0
LAYOUTS = (TensorLayout.plain("w", "bfloat16", (1024, 4096)), TensorLayout.plain("b", "float32", (4096,)))


def values(version: int, device) -> dict:
    """What each tensor holds at ``version``: distinct per tensor and per version."""
    g = torch.Generator().manual_seed(version)
    return {lay.name: torch.randn(lay.shape, generator=g).to(getattr(torch, lay.dtype)).to(device) for lay in LAYOUTS}


def _cmd_init(state, *, address, secret, prefix):
    from warmlink.refit import Publisher

    torch.cuda.set_device(0)
    state["store"] = Store.connect(address, prefix=prefix, timeout_s=TIMEOUT_S, secret=secret)
    state["tensors"] = values(1, "cuda:0")
    pub = state["pub"] = Publisher(state["store"], backend="cuda_ipc", timeout_s=TIMEOUT_S)
    for lay in LAYOUTS:
        pub.add(lay.name, state["tensors"][lay.name], lay)
    pub.export()
    return pub.version


def _cmd_step(state, *, timeout_s=TIMEOUT_S):
    pub = state["pub"]
    pub.begin_update(timeout_s=timeout_s)
    for name, t in values(pub.version + 1, "cuda:0").items():
        state["tensors"][name].copy_(t)
    return pub.publish()


def _reset(state):
    close_keys(state, "pub", "store")


def _worker(control, results):
    serve(control, results, {"init": _cmd_init, "step": _cmd_step}, {}, _reset)


def test_gpu_replays_and_forged_counts_never_install_a_stale_or_torn_version(store_sync) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
    prefix = f"header-gpu-{uuid.uuid4().hex[:8]}"
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix, timeout_s=TIMEOUT_S) as store:
        raw = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", store.port, None, False,
                                                     timeout=datetime.timedelta(seconds=30)))
        trainer = SpawnedWorker(_worker)
        try:
            assert trainer.call("init", timeout_s=180, address=store.address, secret=store.secret, prefix=prefix) == 1
            stale = raw.get("pub/0/state")
            targets = {lay.name: torch.zeros(lay.shape, dtype=getattr(torch, lay.dtype), device=device) for lay in LAYOUTS}
            with Receiver(store, num_publishers=1, backend="cuda_ipc", device=device.index, timeout_s=TIMEOUT_S) as rec:
                for lay in LAYOUTS:
                    rec.add(lay.name, lay, targets[lay.name])

                def exact(version: int) -> bool:
                    want = values(version, device)
                    return all(torch.equal(targets[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)

                assert rec.refit().version == 1 and exact(1)
                for version in (2, 3):
                    assert trainer.call("step") == version
                    raw.set("pub/0/state", stale)  # "published 1", signed
                    assert rec.refit().version == version and exact(version)

                handle = rec.start_refit()  # counted in, copies posted
                for slot in range(1, int(raw.add("pub/0/reader_slots", 0)) + 1):
                    raw.set(protocol.readers_key(0, 3, slot), "0")
                assert trainer.call("step", timeout_s=5.0) == 4  # let in under the pull
                with pytest.raises(VersionError, match="version header moved"):
                    handle.wait()
                assert exact(3)  # nothing of that pull installed
                assert rec.refit().version == 4 and exact(4)
        finally:
            trainer.stop()
