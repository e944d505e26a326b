"""``install="direct"``: a pull lands straight in the targets (Note [Install modes] in refit._install).

No receive memory for the tensors it pulls directly, no install pass, the targets keep their
addresses; tensors that need a cast go through receive memory as before. A cycle that fails after
its copies started says so (``PartialLoadError``, ``installed_version`` None) and the next refit
repairs the targets (``test_install_modes.py``, beside the other modes). Over shm, in this process.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from warmlink.bench.refit import build_physical
from warmlink.refit import Publisher, Receiver
from warmlink.refit.manifest import Shard, TensorLayout
from warmlink.rendezvous import Store

F32, BF16 = "float32", "bfloat16"
W = TensorLayout.plain("w", F32, (128, 64))
QK = TensorLayout.fused("qk", F32, [("q", Shard((8, 4))), ("k", Shard((4, 4)))], shape=(16, 4))  # 4 rows padding


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"direct-{uuid.uuid4().hex[:8]}", timeout_s=10) as s:
        yield s


def _publisher(store, tensors: dict):
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=5)
    for name, (t, layout) in tensors.items():
        pub.add(name, t, layout)
    pub.export()
    return pub


def test_direct_pulls_into_the_targets_in_place_and_casts_through_receive_memory(store) -> None:
    w = build_physical(W, "cpu", 1)
    q, k = build_physical(TensorLayout.plain("q", F32, (8, 4)), "cpu", 2), build_physical(TensorLayout.plain("k", F32, (4, 4)), "cpu", 3)
    h = build_physical(TensorLayout.plain("h", BF16, (16,)), "cpu", 4)
    pub = _publisher(store, {"w": (w, W), "q": (q, TensorLayout.plain("q", F32, (8, 4))),
                             "k": (k, TensorLayout.plain("k", F32, (4, 4))), "h": (h, TensorLayout.plain("h", BF16, (16,)))})
    targets = {"w": torch.full((128, 64), 7.0), "qk": torch.full((16, 4), 7.0), "h": torch.full((16,), 7.0)}
    ptrs = {n: t.data_ptr() for n, t in targets.items()}
    rec = Receiver(store, num_publishers=1, install="direct", timeout_s=5)
    rec.add("w", W, targets["w"])
    rec.add("qk", QK, targets["qk"])
    rec.add("h", TensorLayout.plain("h", F32, (16,)), targets["h"])  # bf16 -> f32: a cast, not direct
    try:
        for version in (1, 2):
            if version == 2:
                with pub.update():
                    for t in (w, q, k, h):
                        t.add_(1)
            report = rec.refit()
            assert report.version == version and rec.installed_version == version
            assert torch.equal(targets["w"], w)
            assert torch.equal(targets["qk"][:12], torch.cat([q, k])) and bool((targets["qk"][12:] == 0).all())
            assert torch.equal(targets["h"], h.float())
            assert {n: t.data_ptr() for n, t in targets.items()} == ptrs
        assert report.created == {"arena": 0, "registration": 0, "peer_mapping": 0, "plan": 0}
    finally:
        rec.close()
        pub.close()


def test_a_target_whose_memory_was_replaced_is_pulled_into_at_its_new_address(store) -> None:
    """An engine that swaps a parameter's ``.data`` (re-packing after a load, say) between cycles:
    the next pull must land in the memory the target uses now, never at its old address."""
    w = build_physical(W, "cpu", 1)
    pub = _publisher(store, {"w": (w, W)})
    target = torch.nn.Parameter(torch.zeros(128, 64), requires_grad=False)
    rec = Receiver(store, num_publishers=1, install="direct", timeout_s=5)
    rec.add("w", W, target)
    try:
        rec.refit()
        assert torch.equal(target, w)
        old, v1 = target.data, w.clone()
        target.data = torch.zeros(128, 64)  # new memory; the old tensor lives on elsewhere
        with pub.update():
            w.add_(1)
        assert rec.refit().version == 2
        assert torch.equal(target, w), "the pull went to the target's old memory"
        assert torch.equal(old, v1), "the pull wrote memory the target no longer uses"
    finally:
        rec.close()
        pub.close()
