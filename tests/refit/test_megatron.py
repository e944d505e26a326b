"""The megatron convention: Megatron ranks refit HF, vLLM-style and other Megatron ranks bit-exact.

Publishers hold what Megatron-core ranks hold, built from the whole HF tensors with plain torch ops
(``_megatron_ref.megatron_rank``: interleaved QKV as a view and a cat per query group, fc1 as
``[gate; up]`` chunks, vocabulary zero-padded then chunked) and declared with
``layouts(..., convention="megatron")``. Every receiver tensor, over two versions, is compared with
a reference built the same way (HF: the whole tensors; vLLM-style: ``vllm_rank``), never with
warmlink's layouts. ``test_megatron_core.py`` checks the same references against Megatron-core.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

pytest.importorskip("transformers")

import _megatron_ref as ref  # noqa: E402
from _harness import TIMEOUT_S, new_store, refit_layouts  # noqa: E402
from warmlink.errors import LayoutError  # noqa: E402
from warmlink.refit import Publisher, Receiver, TensorLayout  # noqa: E402
from warmlink.refit.families import layouts  # noqa: E402

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MLA = ("deepseek_v3", "deepseek_v3_no_q_lora")
MOE = ("qwen3_moe", "mixtral", "deepseek_v3")


@lru_cache(maxsize=None)
def hf(family: str):
    return ref.hf_model(family)


def state(family: str, version: int = 1) -> dict[str, torch.Tensor]:
    """The HF tensors at ``version``: each publish after the first adds 1 to every source tensor."""
    return {k: v + (version - 1) for k, v in ref.hf_state(hf(family)).items()}


def mg_layouts(family: str, **kw) -> dict[str, TensorLayout]:
    return layouts(hf(family), convention="megatron", **{"make_vocab_size_divisible_by": ref.DIVISIBLE, **kw})


def megatron_ranks(family: str, tp: int, ep: int = 1, etp: int | None = None) -> list[dict]:
    """Every Megatron rank's place: one per (ep_rank, tp_rank), so ``dp = ep`` (which says what is
    replicated: Note [Megatron layouts]); expert TP is ``tp`` or 1."""
    etp = tp if etp is None else etp
    assert etp in (tp, 1)
    return [dict(tp=tp, rank=r, ep=ep, ep_rank=e, etp=etp, etp_rank=r if etp == tp else 0, dp=ep)
            for e in range(ep) for r in range(tp)]


def plain_hf(family: str) -> dict[str, TensorLayout]:
    return {k: TensorLayout.plain(k, "float32", v.shape) for k, v in ref.hf_state(hf(family)).items()}


def _refit_and_compare(family: str, src: list[dict], receivers: list[tuple[str, dict, object]]) -> None:
    """Publish Megatron ranks ``src``; each receiver ``(what, layouts, reference(state))`` must get
    ``reference`` of the version's HF tensors, bit-exact, and zeros in its padding."""
    cfg = hf(family).config
    sources = {}
    for i, place in enumerate(src):
        tensors = ref.megatron_rank(state(family), cfg, **place)
        lay = mg_layouts(family, **place)
        assert set(tensors) == set(lay), f"{family} {place}: names differ"
        sources[i] = {name: (tensors[name], lay[name]) for name in lay}

    def step(version):
        for tensors in sources.values():
            for t, _ in tensors.values():
                t.add_(1)

    got = refit_layouts(sources, [lay for _, lay, _ in receivers], versions=2, step=step)
    for version, per_receiver in enumerate(got, start=1):
        for (what, lay, reference), received in zip(receivers, per_receiver):
            want = reference(state(family, version))
            for name in lay:
                assert torch.equal(received[name], want[name]), f"{family} v{version} {what}: {name} differs"


def _vllm(family, **kw):
    return ("vLLM-style " + str(kw), ref.vllm_layouts(state(family), hf(family).config, **kw),
            lambda s, kw=kw: ref.vllm_rank(s, hf(family).config, **kw))


def _megatron(family, place):
    return ("Megatron " + str(place), mg_layouts(family, **place),
            lambda s, place=place: ref.megatron_rank(s, hf(family).config, **place))


def _hf(family):
    return ("HF whole", plain_hf(family), lambda s: s)


# -- the layouts themselves ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", DENSE + ("llama_bias",) + MLA + MOE[:2])
@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (2, 1, 2), (4, 1, 4), (2, 2, 1), (1, 4, 1)])
def test_layouts_hold_the_reference_shapes(family, tp, ep, etp):
    cfg = hf(family).config
    for place in megatron_ranks(family, tp, ep, etp):
        lay = mg_layouts(family, **place)
        want = ref.megatron_rank(state(family), cfg, **place)
        assert set(lay) == set(want)
        for name, layout in lay.items():
            assert layout.shape == tuple(want[name].shape), name


def test_qkv_is_interleaved_per_query_group():
    # llama: 8 query heads in 2 groups of head_dim 8; Megatron's rows per group: q (4 heads), k, v.
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    lay = mg_layouts("llama", tp=1, rank=0)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert [(p.logical, p.shard.bounds[0], p.offset[0]) for p in lay.parts] == [
        (q, (0, 32), 0), (k, (0, 8), 32), (v, (0, 8), 40), (q, (32, 64), 48), (k, (8, 16), 80), (v, (8, 16), 88)]
    # tp=4 > 2 groups: each rank holds 24 of the 96 rows, cutting group 0 after its third query head
    lay = mg_layouts("llama", tp=4, rank=1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert [(p.logical, p.shard.bounds[0]) for p in lay.parts] == [(q, (24, 32)), (k, (0, 8)), (v, (0, 8))]


def test_vocabulary_is_padded_and_a_rank_may_hold_only_padding():
    # 300 rows, divisible by 64 * tp: tp=4 pads to 512, 128 rows per rank; rank 3 holds none of them.
    for rank, rows in enumerate([(0, 128), (128, 256), (256, 300), (300, 300)]):
        lay = mg_layouts("qwen3", tp=4, rank=rank)["embedding.word_embeddings.weight"]
        assert lay.shape == (128, 64) and lay.parts[0].shard.bounds[0] == rows
    assert "output_layer.weight" not in mg_layouts("qwen3", tp=4, rank=0)  # tied: no output_layer
    assert layouts(hf("llama"), convention="megatron")["output_layer.weight"].shape == (384, 64)  # default 128


# -- refits -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", DENSE)
def test_tp2_to_1(family):
    _refit_and_compare(family, megatron_ranks(family, 2),
                       [_hf(family), _vllm(family, tp=1, rank=0), _megatron(family, megatron_ranks(family, 1)[0])])


@pytest.mark.parametrize("family", DENSE)
def test_tp1_to_2(family):
    dst = [_vllm(family, tp=2, rank=r) for r in range(2)] + [_megatron(family, p) for p in megatron_ranks(family, 2)]
    _refit_and_compare(family, megatron_ranks(family, 1), dst)


@pytest.mark.parametrize("family", DENSE)
def test_tp2_to_4(family):
    dst = [_vllm(family, tp=4, rank=r) for r in range(4)] + [_megatron(family, p) for p in megatron_ranks(family, 4)]
    _refit_and_compare(family, megatron_ranks(family, 2), dst)


def test_linear_biases_tp2_to_1_and_4():
    family = "llama_bias"  # linear_qkv.bias interleaved, linear_fc1.bias [gate; up], row-parallel biases whole
    dst = [_hf(family)] + [_megatron(family, p) for p in megatron_ranks(family, 4) + megatron_ranks(family, 1)]
    _refit_and_compare(family, megatron_ranks(family, 2), dst)


@pytest.mark.parametrize("family", MLA)
def test_mla_tp(family):
    _refit_and_compare(family, megatron_ranks(family, 2, ep=2, etp=1),
                       [_hf(family)] + [_megatron(family, p) for p in megatron_ranks(family, 4, ep=1, etp=1)])


@pytest.mark.parametrize("family", MOE)
def test_ep2_to_1(family):
    dst = [_hf(family), _megatron(family, megatron_ranks(family, 1)[0])]
    if family not in MLA:
        dst.append(_vllm(family, tp=1, rank=0))
    _refit_and_compare(family, megatron_ranks(family, 1, ep=2), dst)


@pytest.mark.parametrize("family", MOE)
def test_ep1_to_2(family):
    dst = [_megatron(family, p) for p in megatron_ranks(family, 1, ep=2)]
    if family not in MLA:
        dst += [_vllm(family, ep=2, ep_rank=e) for e in range(2)]
    _refit_and_compare(family, megatron_ranks(family, 1), dst)


@pytest.mark.parametrize("family", MOE[:2])
def test_expert_tp2_ep2_to_vllm_tp2(family):
    dst = [_hf(family)] + [_vllm(family, tp=2, rank=r) for r in range(2)]
    _refit_and_compare(family, megatron_ranks(family, 2, ep=2, etp=2), dst)


# -- refusals -----------------------------------------------------------------------------------------
def _config(**kw):
    import transformers

    base = dict(vocab_size=300, hidden_size=96, intermediate_size=96, num_hidden_layers=1, head_dim=8)
    return transformers.LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("kw,needle", [
    (dict(config=dict(num_attention_heads=12, num_key_value_heads=4), tp=6), "tp=6 not a multiple of num_query_groups=4"),
    (dict(config=dict(num_attention_heads=12, num_key_value_heads=6), tp=4), "num_query_groups=6 not divisible by tp=4"),
    (dict(config=dict(num_attention_heads=12, num_key_value_heads=12), tp=8), "num_attention_heads=12 not divisible by tp=8"),
    (dict(config=dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=90), tp=4), "intermediate=90"),
    (dict(tp=2, make_vocab_size_divisble_by=64), "option='make_vocab_size_divisble_by' is unknown"),
    (dict(tp=2, make_vocab_size_divisible_by=0), "make_vocab_size_divisible_by=0"),
    (dict(tp=2, etp=1), "etp_rank=None with etp=1 != tp=2"),
    (dict(tp=2, etp=2, etp_rank=2), "etp_rank=2 out of range"),
    (dict(tp=2, spec="transformer_engine"), "spec='transformer_engine' is unknown"),
    (dict(tp=2, dp=0), "dp=0 invalid"),
    (dict(tp=2, ep=4, etp=1, etp_rank=0, dp=1), "tp * dp = 2 is not a multiple of ep * etp = 4"),
])
def test_bad_input_is_refused_by_name(kw, needle):
    kw = dict(kw)
    cfg = _config(**{"num_attention_heads": 4, "num_key_value_heads": 2, **kw.pop("config", {})})
    with pytest.raises(LayoutError) as info:
        layouts(cfg, convention="megatron", rank=0, **kw)
    assert needle in str(info.value)


@pytest.mark.parametrize("family", MOE[:2])
def test_replicas_follow_dp_and_unmarked_duplicates_are_refused(family):
    """Note [Megatron layouts]: in a world of tp=2, ep=2, etp=1 (so dp=2), the dp ranks of a TP rank
    hold its dense boxes and the 2 expert-data-parallel ranks of an EP rank its experts; with
    ``dp`` given the parts say so and a plan over all four ranks is built, without it (dp=1, which
    cannot have these four ranks) the plan is refused, naming a tensor and two ranks."""
    from warmlink.refit.plan import build_plan

    places = megatron_ranks(family, 2, ep=2, etp=1)
    lays = [mg_layouts(family, **p) for p in places]
    assert all(p.replicated for lay in lays for layout in lay.values() for p in layout.parts)
    targets = list(plain_hf(family).values())
    build_plan({i: list(lay.values()) for i, lay in enumerate(lays)}, targets)
    lays = [mg_layouts(family, **{k: v for k, v in p.items() if k != "dp"}) for p in places]
    with pytest.raises(LayoutError, match=r"held by rank=0 tensor='.*' and by rank=2 tensor=.* marked replicated"):
        build_plan({i: list(lay.values()) for i, lay in enumerate(lays)}, targets)
    # etp == tp: experts split over all four ranks, dense tensors on both dp ranks
    lay = mg_layouts(family, **megatron_ranks(family, 2, ep=2, etp=2)[0])
    assert {".local_experts." in n for n, layout in lay.items() if not layout.parts[0].replicated} == {True}


def test_unsplittable_experts_and_unknown_families_are_refused():
    with pytest.raises(LayoutError, match=r"experts=4 not divisible by ep=3"):
        layouts(hf("mixtral"), convention="megatron", ep=3, ep_rank=0)
    with pytest.raises(LayoutError, match=r"intermediate=32 not divisible by etp=3"):
        layouts(hf("mixtral"), convention="megatron", etp=3, etp_rank=0)
    with pytest.raises(LayoutError, match=r"spec='te' with model_type='mixtral' is not laid out"):
        layouts(hf("mixtral"), convention="megatron", spec="te")
    import transformers

    gemma = transformers.Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(LayoutError, match=r"model_type='gemma2' is not laid out for Megatron"):
        layouts(gemma, convention="megatron")


def _module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding ``tensors`` under their dotted names (a stand-in for a framework's rank)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_module_under_another_conventions_layouts_is_refused(family):
    cfg = hf(family).config
    megatron = _module(ref.megatron_rank(state(family), cfg, tp=2, rank=0))
    vllm = _module(ref.vllm_rank(state(family), cfg, tp=2, rank=0))
    vllm_lay = ref.vllm_layouts(state(family), cfg, tp=2, rank=0)
    cases = [(megatron, vllm_lay), (vllm, mg_layouts(family, tp=2, rank=0)),
             (megatron, mg_layouts(family, tp=4, rank=0))]  # Megatron's own names, another tp's shapes
    try:
        cases.append((megatron, layouts(hf(family), convention="vllm", tp=2, rank=0)))
    except ImportError:  # the vllm convention module is optional here
        pass
    store = new_store()
    try:
        for module, lay in cases:
            before = {k: v.clone() for k, v in module.state_dict().items()}
            for side in ("Publisher", "Receiver"):
                obj = (Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=TIMEOUT_S) if side == "Publisher"
                       else Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S))
                try:
                    with pytest.raises(LayoutError):
                        obj.add_module(module, lay)
                finally:
                    obj.close()
            assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    finally:
        store.close()
