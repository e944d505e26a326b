"""A whole refit in this process: publishers and receivers of one job over the shm backend.

For tests that check what arrives, layout against layout, through the real Publisher, store,
manifest, plan, transport and install, without spawning processes. Tests of process death and
membership use their own harnesses (``_spawned``, ``test_membership``).
"""

from __future__ import annotations

import uuid
from typing import Mapping

import torch

from warmlink.refit import Publisher, Receiver, TensorLayout
from warmlink.rendezvous import Store

TIMEOUT_S = 60.0


def new_store() -> Store:
    return Store("127.0.0.1", 0, is_server=True, prefix=f"harness-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S)


def zeros_like_layout(layout: TensorLayout) -> torch.Tensor:
    return torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters have exactly these dotted names (an engine's, here vLLM's)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def refit_layouts(
    sources: Mapping[int, Mapping[str, tuple[torch.Tensor, TensorLayout]]],
    receivers: list[Mapping[str, TensorLayout]],
    *,
    versions: int = 1,
    step=None,
) -> list[list[dict[str, torch.Tensor]]]:
    """Publish ``sources`` (rank -> name -> (tensor, layout)) and refit every receiver layout set.

    Args:
        versions: how many versions to publish; before each after the first, ``step(version)``
            runs inside ``Publisher.update`` on every rank (it changes the source tensors in place).

    Returns:
        For each version, for each receiver: name -> received tensor (the receiver's targets,
        cloned), so that a test compares them against a reference built with plain torch ops.
    """
    store = new_store()
    pubs: list[Publisher] = []
    recs: list[tuple[Receiver, dict[str, torch.Tensor]]] = []
    try:
        for rank in sorted(sources):
            pub = Publisher(store, rank=rank, world_size=len(sources), backend="shm", timeout_s=TIMEOUT_S)
            for name, (tensor, layout) in sources[rank].items():
                pub.add(name, tensor, layout)
            pub.export()
            pubs.append(pub)
        for layouts in receivers:
            rec = Receiver(store, num_publishers=len(sources), backend="shm", timeout_s=TIMEOUT_S)
            targets = {name: zeros_like_layout(layout) for name, layout in layouts.items()}
            for name, layout in layouts.items():
                rec.add(name, layout, targets[name])
            recs.append((rec, targets))
        out = []
        for version in range(1, versions + 1):
            if version > 1:
                for pub in pubs:
                    pub.begin_update()
                step(version)
                for pub in pubs:
                    pub.publish()
            got = []
            for rec, targets in recs:
                assert rec.refit().version == version
                got.append({name: t.clone() for name, t in targets.items()})
            out.append(got)
        return out
    finally:
        for rec, _ in recs:
            rec.close()
        for pub in pubs:
            pub.close()
        store.close()
