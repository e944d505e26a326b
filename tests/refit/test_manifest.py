"""Tests for warmlink.refit.manifest: the layout model says what frameworks do, and refuses the rest.

Bad layouts are refused when they are made (before any byte moves), each error naming the tensor
and the part or field. The manifest schema applies the same rules to what peers announce
(tests/rendezvous/test_schema.py).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from warmlink.errors import LayoutError
from warmlink.refit.manifest import Part, Shard, TensorLayout, chunk_bounds, split_bounds

F32 = "float32"


@given(size=st.integers(0, 40), num=st.integers(1, 9))
def test_split_and_chunk_bounds_are_torchs(size: int, num: int) -> None:
    rows = torch.arange(size)
    split = [(int(p[0]), int(p[-1]) + 1) if p.numel() else None for p in torch.tensor_split(rows, num)]
    chunks = torch.chunk(rows, num)
    for i in range(num):
        a, b = split_bounds(size, num, i)
        assert list(range(a, b)) == torch.tensor_split(rows, num)[i].tolist(), (size, num, i, split[i])
        a, b = chunk_bounds(size, num, i)
        want = chunks[i].tolist() if i < len(chunks) else []  # torch.chunk leaves trailing chunks out
        assert list(range(a, b)) == want, (size, num, i)


def test_megatron_qkv_is_several_boxes_of_each_logical() -> None:
    """Two query groups on one rank: [q_g0; k_g0; v_g0; q_g1; k_g1; v_g1] along dim 0."""
    q, kv = (8, 4), (4, 4)  # 4 query heads and 2 KV heads of head_dim 2, hidden 4
    parts = []
    for g in range(2):
        parts += [("q", Shard(q, ((4 * g, 4 * g + 4), (0, 4)))), ("k", Shard(kv, ((2 * g, 2 * g + 2), (0, 4)))),
                  ("v", Shard(kv, ((2 * g, 2 * g + 2), (0, 4))))]
    layout = TensorLayout.fused("linear_qkv.weight", F32, parts)
    assert layout.shape == (16, 4) and not layout.is_padded
    assert [p.offset[0] for p in layout.parts] == [0, 4, 6, 8, 12, 14]


def test_padded_vocab_shard() -> None:
    """vLLM pads vocab 1001 to 1024; rank 3 of 4 holds rows 768:1001 and 23 rows of padding."""
    rank0 = TensorLayout.plain("embed", F32, (1001, 8), 0, 4, 0, logical="embed_tokens", shape=(256, 8))
    assert rank0.parts[0].shard.bounds[0] == (0, 251) and rank0.is_padded  # tensor_split rows, then padding
    rank3 = TensorLayout("embed", F32, (Part("embed_tokens", Shard((1001, 8), ((768, 1001), (0, 8))), (0, 0)),), (256, 8))
    assert rank3.is_padded and rank3.covered_numel == 233 * 8 and rank3.numel == 256 * 8
    only_padding = TensorLayout("embed", F32, (Part("embed_tokens", Shard((100, 8), ((100, 100), (0, 8))), (0, 0)),), (128, 8))
    assert only_padding.covered_numel == 0  # Megatron: vocab 100 padded to 256 over 2 ranks


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda: Shard((4, 3), ((0, 5), (0, 3))), ["bounds[0]=(0, 5) out of range", "<= 4"]),
        (lambda: Shard((4, 3), ((3, 2), (0, 3))), ["bounds[0]=(3, 2) out of range"]),
        (lambda: Shard((4, 3), ((0, 4),)), ["bounds=((0, 4),) has 1 dims; expected 2"]),
        (lambda: Shard.split((4, 3), 2, 2, 0), ["dim=2 out of range"]),
        (lambda: Shard.chunk((4, 3), 0, 2, 2), ["idx=2 out of range"]),
        (lambda: TensorLayout("w", F32, (Part("a", Shard((4,)), (0,)), Part("b", Shard((4,)), (2,)))),
         ["TensorLayout 'w'", "parts[0] and parts[1] overlap in the physical tensor"]),
        (lambda: TensorLayout("w", F32, (Part("a", Shard((8,), ((0, 4),)), (0,)), Part("a", Shard((8,), ((2, 6),)), (4,)))),
         ["TensorLayout 'w'", "overlapping boxes of logical='a'"]),
        (lambda: TensorLayout("w", F32, (Part("a", Shard((8, 2))),), (6, 2)),
         ["TensorLayout 'w'", "offset[0]=0 + extent 8 exceeds shape[0]=6"]),
        (lambda: TensorLayout("w", F32, (Part("a", Shard((4,)), (0,)), Part("a", Shard((5,), ((4, 5),)), (4,)))),
         ["TensorLayout 'w'", "global_shape=(5,) differs from (4,)"]),
        (lambda: TensorLayout("w", F32, (Part("a", Shard((2, 4, 3), ((0, 2), (0, 4), (0, 3)))),), (4, 3)),
         ["TensorLayout 'w'", "squeezes 1 leading dims of extent != 1"]),
        (lambda: TensorLayout("w", F32, (Part("a", Shard((4,))), Part("b", Shard((4,))))),
         ["TensorLayout 'w'", "parts have no offset"]),
        (lambda: TensorLayout("w", "float128", (Part("a", Shard((4,))),)), ["dtype='float128' is unknown"]),
        (lambda: TensorLayout("", F32, (Part("a", Shard((4,))),)), ["name='' invalid"]),
        (lambda: TensorLayout("w", F32, ()), ["TensorLayout 'w': parts=() is empty"]),
        (lambda: TensorLayout.fused("w", F32, [("a", Shard((4, 2))), ("b", Shard((4, 3)))], 0),
         ["TensorLayout.fused 'w': parts disagree outside fuse_dim=0"]),
    ],
)
def test_bad_layouts_are_refused_by_name(make, needles) -> None:
    with pytest.raises(LayoutError) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_layouts_are_values() -> None:
    """Equal layouts are equal and hash equal, also across pickling (test processes ship them)."""
    a = TensorLayout.fused("qkv", F32, [("q", Shard.split((8, 4), 0, 2, 1)), ("k", Shard.chunk((4, 4), 0, 2, 1))])
    b = TensorLayout.fused("qkv", F32, [("q", Shard.split((8, 4), 0, 2, 1)), ("k", Shard.chunk((4, 4), 0, 2, 1))])
    assert a == b and hash(a) == hash(b) and TensorLayout.from_json(a.to_json()) == a
    c = pickle.loads(pickle.dumps(a))
    assert c == a and hash(c) == hash(a)
    assert TensorLayout.plain("w", F32, (4, 2), 0, 2, 1) is TensorLayout.plain("w", F32, (4, 2), 0, 2, 1)


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda: TensorLayout.plain("model.w", F32, (4, 2), 0, 2, 5),
         ["TensorLayout.plain 'model.w'", "shard_idx=5 out of range", "< num_shards=2"]),
        (lambda: TensorLayout.plain("model.w", F32, (4, 2), 0, 0, 0), ["TensorLayout.plain 'model.w'", "num_shards=0"]),
        (lambda: TensorLayout.plain("model.w", F32, (4, 2), 2, 2, 0), ["TensorLayout.plain 'model.w'", "dim=2 out of range"]),
        (lambda: TensorLayout.plain("model.w", F32, (4, -2)), ["TensorLayout.plain 'model.w'", "negative dimension"]),
        (lambda: TensorLayout.plain("model.w", F32, 4), ["TensorLayout.plain 'model.w'", "global_shape=4 invalid"]),
        (lambda: TensorLayout.fused("model.qkv", F32, [("q", (4, 2))]), ["TensorLayout.fused 'model.qkv'", "part=('q', (4, 2))"]),
        (lambda: TensorLayout("model.w", F32, (Part("w", Shard((4,)), replicated=1),)),
         ["TensorLayout 'model.w'", "replicated=1", "expected a bool"]),
        (lambda: TensorLayout.from_json({"name": "model.w", "dtype": F32, "shape": [4], "parts": [
            {"logical": "w", "global_shape": [4], "bounds": [[0, 5]], "offset": [0]}]}),
         ["TensorLayout 'model.w'", "bounds[0]=(0, 5) out of range"]),
    ],
)
def test_every_layout_error_names_its_tensor(make, needles) -> None:
    """Helpers that raise from a sub-helper (split_bounds, Shard) say which tensor they were making."""
    with pytest.raises(LayoutError) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_replicated_parts() -> None:
    """Note [Replicated parts]: a claim about other ranks that travels in the manifest, kept by every
    constructor, and left out of equality (a live engine's layout equals the family's)."""
    plain = TensorLayout.plain("w", F32, (4, 2), 0, 2, 1)
    marked = TensorLayout.plain("w", F32, (4, 2), 0, 2, 1, replicated=True)
    assert marked.parts[0].replicated and not plain.parts[0].replicated
    assert marked == plain and hash(marked) == hash(plain) and marked is not plain
    assert plain.with_replicated().parts[0].replicated and marked.with_replicated() is marked
    assert "replicated" not in plain.to_json()["parts"][0] and marked.to_json()["parts"][0]["replicated"] is True
    for layout in (plain, marked):
        back = TensorLayout.from_json(layout.to_json())
        assert back.parts[0].replicated == layout.parts[0].replicated
        assert pickle.loads(pickle.dumps(layout)).parts[0].replicated == layout.parts[0].replicated
    fused = TensorLayout.fused("qkv", F32, [("q", Shard.split((8, 4), 0, 4, 3)), ("k", Shard.split((2, 4), 0, 2, 1), True)])
    assert [p.replicated for p in fused.parts] == [False, True]
    # A lone unplaced part and a part with list offsets are rebuilt; the flag survives both.
    assert TensorLayout("w", F32, (Part("w", Shard((4,)), replicated=True),)).parts[0].replicated
    assert TensorLayout("w", F32, (Part("w", Shard((4,)), [0], replicated=True),)).parts[0].replicated
