"""A manifest past TCPStore's 8 MiB value limit: 40,000 DeepSeek-V3-shaped tensors published over shm,
planned against and partly refitted in this process (Note [Blobs] in warmlink.rendezvous._blobs).

Tensors are tiny (``warmlink.bench.manifest``: widths / 128); their number is what makes the manifest
large. One publisher is exported once for the module; tests that need other publishers use small ones.
"""

from __future__ import annotations

import functools
import hashlib
import uuid

import pytest
import torch

from warmlink import pool
from warmlink.bench.manifest import deepseek_v3_like, make_tensors
from warmlink.errors import MetadataError
from warmlink.refit import Publisher, Receiver, protocol
from warmlink.refit.manifest import Part, TensorLayout
from warmlink.refit.plan import build_plan
from warmlink.rendezvous import Store, schema

NUM_TENSORS = 40_000
TIMEOUT_S = 60.0
# What the receiver refits: an expert, the vocabulary, a row-parallel projection and a norm.
FEW = ("model.layers.50.mlp.experts.211.gate_proj.weight", "lm_head.weight",
       "model.layers.7.self_attn.o_proj.weight", "model.layers.40.post_attention_layernorm.weight")


def _values(layout: TensorLayout) -> torch.Tensor:
    """Distinct small integers (exact in bf16) for a whole tensor, seeded by its name."""
    base = sum(layout.name.encode()) % 61
    return ((torch.arange(layout.numel) + base) % 251).to(torch.bfloat16).view(layout.shape)


@pytest.fixture(scope="module")
def published():
    pool.set_enabled(True)
    with Store("127.0.0.1", 0, is_server=True, prefix=f"large-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as store:
        layouts = deepseek_v3_like(NUM_TENSORS, 1, 0)
        tensors = make_tensors(layouts)
        for name in FEW:
            tensors[name].copy_(_values(layouts[name]))
        pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
        for name, layout in layouts.items():
            pub.add(name, tensors[name], layout)
        pub.export()
        try:
            yield store, pub, layouts
        finally:
            pub.close()
            pool.set_enabled(None)


@pytest.fixture(scope="module")
def manifest(published) -> tuple[bytes, dict, tuple[TensorLayout, ...]]:
    store, pub, _ = published
    raw = store.get_blob(protocol.manifest_key(0, pub.generation))
    m = schema.decode(raw, "publisher_manifest", "publisher/0")
    return raw, m, tuple(TensorLayout.from_json(t) for t in m["tensors"])


def test_manifest_past_one_store_value_is_a_blob(published, manifest) -> None:
    store, pub, layouts = published
    raw, m, sources = manifest
    assert len(raw) > schema.MAX_VALUE_BYTES  # the size that used to cost the publisher its store client
    key = protocol.manifest_key(0, pub.generation)
    assert len(store.try_get(key)) < 1024  # the key holds a blob header; its chunks hold the manifest
    assert store.try_get(f"{key}/blob/{hashlib.sha256(raw).hexdigest()}/2") is not None
    assert [t["name"] for t in m["tensors"]] == list(layouts) and sources == tuple(layouts.values())
    with pytest.raises(MetadataError, match=r"Store\.set: key='whole'.*exceeds the store's limit"):
        store.set("whole", raw)
    assert store.try_get(protocol.state_key(0)) is not None  # the client still works


def test_receiver_refits_a_few_of_40000_tensors(published) -> None:
    store, pub, layouts = published
    # Two whole tensors (matched), a tensor-parallel shard of each of the others (sliced).
    mine = {FEW[0]: layouts[FEW[0]], FEW[3]: layouts[FEW[3]],
            FEW[1]: TensorLayout.plain(FEW[1], "bfloat16", layouts[FEW[1]].shape, 0, 2, 1),
            FEW[2]: TensorLayout.plain(FEW[2], "bfloat16", layouts[FEW[2]].shape, 1, 2, 0)}
    targets = {n: torch.full(lay.local_shape, -1.0, dtype=torch.bfloat16) for n, lay in mine.items()}
    with Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S) as rec:
        for name, lay in mine.items():
            rec.add(name, lay, targets[name])
        report = rec.refit(timeout_s=TIMEOUT_S)
    assert report.version == pub.version
    for name, lay in mine.items():
        (bounds,) = [p.shard.bounds for p in lay.parts]
        want = _values(layouts[name])[tuple(slice(a, b) for a, b in bounds)]
        assert torch.equal(targets[name], want), name


def test_matched_plan_of_every_tensor_is_one_whole_run_each(manifest) -> None:
    _, _, sources = manifest
    targets = [TensorLayout(t.name, t.dtype, t.parts, t.shape) for t in sources]
    plan = build_plan({0: sources}, targets)
    assert len(plan.tensors) == NUM_TENSORS and plan.num_runs == NUM_TENSORS and plan.num_staged == 0
    for tp, t in zip(plan.tensors, targets):
        (run,) = tp.runs
        assert (run.src_rank, run.src_tensor, run.src_offset, run.dst_offset, run.nbytes) == (0, t.name, 0, 0, t.nbytes)


def _moves(tp) -> list[tuple[int, int, int, str, int]]:
    """What a tensor plan copies, as maximal ``(dst_start, dst_stop, src_rank, src_tensor, src - dst)``
    byte intervals: equal lists copy the same bytes from the same places."""
    rows = sorted((r.dst_offset + i * r.dst_pitch, r.row_nbytes, r.src_rank, r.src_tensor,
                   r.src_offset + i * r.src_pitch - r.dst_offset - i * r.dst_pitch)
                  for r in tp.runs for i in range(r.num_rows))
    out: list[list] = []
    for start, n, rank, tensor, delta in rows:
        if out and out[-1][1] == start and out[-1][2:] == [rank, tensor, delta]:
            out[-1][1] += n
        else:
            out.append([start, start + n, rank, tensor, delta])
    return [tuple(x) for x in out]


def test_matched_plan_moves_what_the_general_path_moves() -> None:
    """Tensor-parallel shards hold their boxes alone: each matched target is one whole-tensor run,
    copying exactly what the general path (forced by a name_map) copies. Replicated tensors go
    through the general path either way (Note [Replica choice])."""
    sources = {r: tuple(deepseek_v3_like(300, 2, r).values()) for r in range(2)}
    targets = list(sources[1])
    renamed = [TensorLayout(t.name, t.dtype, tuple(Part(p.logical + "~", p.shard, p.offset) for p in t.parts), t.shape)
               for t in targets]
    matched = build_plan(sources, targets)
    general = build_plan(sources, renamed, name_map={p.logical + "~": p.logical for t in targets for p in t.parts})
    whole = 0
    for t, a, b in zip(targets, matched.tensors, general.tensors):
        assert _moves(a) == _moves(b) and not a.staged and not b.staged, t.name
        if t.parts[0].shard.bounds != tuple((0, d) for d in t.parts[0].shard.global_shape):
            assert [(r.src_rank, r.src_tensor, r.src_offset, r.dst_offset, r.nbytes) for r in a.runs] == [
                (1, t.name, 0, 0, t.nbytes)], t.name
            whole += 1
    assert 0 < whole < len(targets)


def test_blob_manifest_read_back_and_refusal(monkeypatch) -> None:
    """Small chunks make a small manifest a blob: an unchanged re-export reads it back whole and keeps
    its generation; a chunk altered in the store makes a receiver refuse it by peer and key, and the
    next export take a new generation."""
    pool.set_enabled(True)
    try:
        with Store("127.0.0.1", 0, is_server=True, prefix=f"chunks-{uuid.uuid4().hex[:8]}", timeout_s=TIMEOUT_S) as store:
            monkeypatch.setattr(store, "set_blob", functools.partial(store.set_blob, chunk_nbytes=schema.MIN_CHUNK_BYTES))
            layouts = deepseek_v3_like(40, 1, 0)
            tensors = make_tensors(layouts)

            def export() -> Publisher:
                pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S)
                for name, layout in layouts.items():
                    pub.add(name, tensors[name], layout)
                pub.export()
                return pub

            with export() as pub:
                generation = pub.generation
            key = protocol.manifest_key(0, generation)
            raw = store.get_blob(key)
            assert len(raw) > 2 * schema.MIN_CHUNK_BYTES and store.get(key) != raw
            with export() as pub:
                assert pub.generation == generation
                store.set(f"{key}/blob/{hashlib.sha256(raw).hexdigest()}/1", b"x" * schema.MIN_CHUNK_BYTES)
                rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S)
                rec.add("model.norm.weight", layouts["model.norm.weight"], torch.zeros(layouts["model.norm.weight"].shape,
                                                                                         dtype=torch.bfloat16))
                with rec, pytest.raises(MetadataError, match=rf"publisher/0.*key='{key}'.*SHA-256"):
                    rec.refit(timeout_s=2)
            with export() as pub:
                assert pub.generation == generation + 1
    finally:
        pool.set_enabled(None)
