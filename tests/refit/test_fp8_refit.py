"""Quantize on send, end to end over shm: BF16 trainer ranks publish FP8 values and scales
(``Publisher.add(..., fp8=Fp8(scheme))``), vLLM-layout FP8 engine ranks
(``families.layouts(..., convention="vllm", fp8=scheme)``) install both, and every byte equals what
vLLM's loaders make of a checkpoint quantized by vLLM's own formulas (``_fp8_reference``, which
never calls warmlink), over two versions, for Qwen3- and DeepSeek-V3-shaped models at trainer and
engine TP 1 and 2. Then: the bytes on the wire, trainer ranks whose cuts split scale cells (a gloo
group reduces them), and what is refused before any byte moves.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

pytest.importorskip("transformers")

from _fp8_reference import quantize_state, ref_block, vllm_fp8  # noqa: E402
from _fp8_world import World, local, model, state, trainer_layouts  # noqa: E402
from _harness import TIMEOUT_S, module_of, new_store, zeros_like_layout  # noqa: E402
from _references import ref_hf, ref_vllm  # noqa: E402
from warmlink.errors import ConfigError, LayoutError  # noqa: E402
from warmlink.refit import Publisher, Receiver, TensorLayout  # noqa: E402
from warmlink.refit.families import fp8_weights, layouts  # noqa: E402
from warmlink.refit.fp8 import Fp8  # noqa: E402

NOTHING = {"arena": 0, "registration": 0, "peer_mapping": 0, "plan": 0}


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, FP8 compared as bytes."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype == torch.float8_e4m3fn:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got, want)


def publishers(store, family: str, scheme: str | None, tp: int, sd: dict) -> tuple[list, dict]:
    """``tp`` trainer ranks of ``family`` in transformers' TP layout, its FP8 weights quantized on
    send; returns the publishers and each rank's live tensors (by name)."""
    m = model(family)
    weights = fp8_weights(m)
    pubs, tensors = [], {}
    for r in range(tp):
        ref = ref_hf(m.config, sd, tp, r)
        pub = Publisher(store, rank=r, world_size=tp, backend="shm", timeout_s=TIMEOUT_S)
        tensors[r] = {}
        for n, lay in layouts(m, convention="hf", tp=tp, rank=r).items():
            tensors[r][n] = ref[n].clone()
            pub.add(n, tensors[r][n], lay, fp8=Fp8(scheme) if scheme and n in weights else None)
        pubs.append(pub)
    for pub in pubs:
        pub.export()
    return pubs, tensors


def receiver(store, family: str, scheme: str | None, num_publishers: int, tp: int, r: int):
    lays = layouts(model(family), convention="vllm", tp=tp, rank=r, fp8=scheme)
    rec = Receiver(store, num_publishers=num_publishers, backend="shm", timeout_s=TIMEOUT_S)
    targets = {n: zeros_like_layout(lay) for n, lay in lays.items()}
    for n, lay in lays.items():
        rec.add(n, lay, targets[n])
    return rec, targets


def check(targets: dict, want: dict, label: str) -> None:
    assert set(targets) == set(want), f"{label}: names differ: {sorted(set(targets) ^ set(want))}"
    wrong = [n for n in want if not same(targets[n], want[n])]
    assert wrong == [], f"{label}: {wrong}"


def refit_versions(family: str, scheme: str, trainer_tp: int, engine_tps: tuple[int, ...]) -> None:
    """Two versions from ``trainer_tp`` publishers into every rank of each engine TP size, each
    checked against the reference; the second cycle creates nothing."""
    m = model(family)
    weights = fp8_weights(m)
    versions = [state(m), state(m, seed=7)]
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        pubs, tensors = publishers(store, family, scheme, trainer_tp, versions[0])
        for pub in pubs:
            closing.callback(pub.close)
        recs = []
        for tp in engine_tps:
            for r in range(tp):
                rec, targets = receiver(store, family, scheme, trainer_tp, tp, r)
                closing.callback(rec.close)
                recs.append((tp, r, rec, targets))
        for version, sd in enumerate(versions, 1):
            if version > 1:
                for pub in pubs:
                    pub.begin_update()
                for r, live in tensors.items():
                    ref = ref_hf(m.config, sd, trainer_tp, r)
                    for n, t in live.items():
                        t.copy_(ref[n])
                for pub in pubs:
                    pub.publish()
            quantized = quantize_state(sd, weights, scheme)
            for tp, r, rec, targets in recs:
                report = rec.refit()
                assert report.version == version
                check(targets, vllm_fp8(m.config, sd, weights, scheme, tp, r, quantized),
                      f"{family} {scheme} trainer TP {trainer_tp} -> engine TP {tp} rank {r} v{version}")
                if version > 1:
                    assert report.created == NOTHING


@pytest.mark.parametrize("trainer_tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_block_fp8_reaches_vllm_layout_ranks_bit_exact(family, trainer_tp):
    """128 x 128 blocks with ``weight_scale_inv``: fused QKV, gate/up, MLA's fused_qkv_a_proj (a
    partial block at its end) and stacked experts, into engine ranks at TP 1 and 2."""
    refit_versions(family, "block", trainer_tp, (1, 2))


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_channel_and_tensor_scales_reach_vllm_layout_ranks_bit_exact(scheme):
    """Per-row ``weight_scale [N, 1]`` and per-partition ``weight_scale [P]`` from a trainer holding
    whole weights (TP 1) into engine ranks at TP 1 and 2."""
    refit_versions("qwen3", scheme, 1, (1, 2))


def test_checkpoint_blocks_equal_what_vllm_quantizes_on_each_engine_rank():
    """The reference's two readings agree, so either is what the engine holds: blocks of the whole
    tensor sliced by vLLM's loader (a checkpoint) equal vLLM's online ``fp8_per_block`` run on each
    rank's BF16 weight (``per_block_cast_to_fp8`` of the fused shard)."""
    m = model("qwen3")
    sd, weights = state(m), fp8_weights(m)
    for tp in (1, 2):
        for r in range(tp):
            fp8, bf16 = vllm_fp8(m.config, sd, weights, "block", tp, r), ref_vllm(m.config, sd, tp, r)
            quantized = [n for n in fp8 if n + "_scale_inv" in fp8]
            assert len(quantized) == 8  # qkv, o, gate_up and down of 2 layers
            for n in quantized:
                values, scales = ref_block(bf16[n])
                assert same(fp8[n], values) and same(fp8[n + "_scale_inv"], scales), (tp, r, n)


def test_fp8_bytes_on_the_wire_are_half_of_bf16():
    """The bytes a cycle pulls (``CycleReport.nbytes``): FP8 weights move one byte per element plus
    one float32 per 128 x 128 block, against two bytes in BF16; the rest of the model is unchanged."""
    m = model("qwen3")
    sd = state(m)
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        for pub in publishers(store, "qwen3", "block", 1, sd)[0]:
            closing.callback(pub.close)
        fp8_rec, _ = receiver(store, "qwen3", "block", 1, 1, 0)
        closing.callback(fp8_rec.close)
        fp8_bytes = fp8_rec.refit().nbytes
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        for pub in publishers(store, "qwen3", None, 1, sd)[0]:
            closing.callback(pub.close)
        bf16_rec, _ = receiver(store, "qwen3", None, 1, 1, 0)
        closing.callback(bf16_rec.close)
        bf16_bytes = bf16_rec.refit().nbytes
    lays = layouts(m, convention="vllm", fp8="block")
    values = sum(lay.numel for lay in lays.values() if lay.dtype == "float8_e4m3fn")
    scales = sum(lay.nbytes for n, lay in lays.items() if n.endswith("_scale_inv"))
    rest = sum(lay.nbytes for n, lay in lays.items() if lay.dtype == "bfloat16")
    print(f"[figures] qwen3-shaped TP 1 cycle: BF16 {bf16_bytes} B, FP8 {fp8_bytes} B "
          f"({fp8_bytes / bf16_bytes:.3f}); quantized weights {2 * values} -> {values + scales} B")
    assert bf16_bytes == rest + 2 * values
    assert fp8_bytes == rest + values + scales
    assert (values + scales) / (2 * values) < 0.501
    assert fp8_bytes < 0.53 * bf16_bytes  # the embeddings and norms of this tiny model stay BF16


# -- trainer ranks whose cuts split scale cells -------------------------------------------------------
def test_cells_split_between_trainer_ranks_are_reduced_over_their_group(tmp_path):
    """Two gloo trainer ranks whose shards split cells: blocks cut mid-block (o_proj and down_proj's
    320 rows at 160), rows cut by row-parallel layers, every tensor cut by TP. With
    ``Fp8(group=...)`` they reduce the amaxes and each publishes its part of the whole tensor's
    quantization: engine ranks at TP 1 and 2 hold the reference's bytes, over two versions."""
    m = model("qwen3")
    weights = fp8_weights(m)
    versions = (state(m), state(m, seed=11))
    world = World(2, tmp_path)
    with contextlib.ExitStack() as closing:
        closing.callback(world.close)
        for scheme, cut in (("block", "rows"), ("channel", "hf"), ("tensor", "hf")):
            store = new_store()
            closing.callback(store.close)
            lays = [trainer_layouts("qwen3", cut, 2, r) for r in range(2)]
            assert world.call_all("publish", lambda r: dict(
                rank=r, world=2, address=store.address, secret=store.secret, prefix=store.prefix, scheme=scheme,
                layouts=lays[r], tensors={n: local(versions[0][n], lay) for n, lay in lays[r].items()},
                weights=weights)) == [1, 1]
            closing.callback(lambda: world.call_all("close"))
            recs = []
            for tp in (1, 2):
                for r in range(tp):
                    rec, targets = receiver(store, "qwen3", scheme, 2, tp, r)
                    closing.callback(rec.close)
                    recs.append((tp, r, rec, targets))
            for version, sd in enumerate(versions, 1):
                if version > 1:
                    assert world.call_all("step", lambda r: dict(
                        tensors={n: local(sd[n], lay) for n, lay in lays[r].items()})) == [2, 2]
                quantized = quantize_state(sd, weights, scheme)
                for tp, r, rec, targets in recs:
                    assert rec.refit().version == version
                    check(targets, vllm_fp8(m.config, sd, weights, scheme, tp, r, quantized),
                          f"{scheme} cut {cut} -> engine TP {tp} rank {r} v{version}")


# -- refused before any byte moves ----------------------------------------------------------------
def test_a_receiver_taking_fp8_values_without_their_scales_is_refused_naming_them():
    m = model("qwen3")
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        for pub in publishers(store, "qwen3", "block", 1, state(m))[0]:
            closing.callback(pub.close)
        lays = layouts(m, convention="vllm", fp8="block")
        name = "model.layers.0.self_attn.qkv_proj.weight"
        rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(rec.close)
        target = zeros_like_layout(lays[name])
        rec.add(name, lays[name], target)  # the values, not weight_scale_inv
        with pytest.raises(LayoutError, match=r"takes FP8 values of 'model.layers.0.self_attn.q_proj.weight'.*"
                                              r"q_proj.weight_scale_inv"):
            rec.refit()
        assert (target.view(torch.uint8) == 0).all()  # nothing moved

        bf16 = layouts(m, convention="vllm")  # the same weights declared in BF16: a cast would drop the scales
        rec2 = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(rec2.close)
        rec2.add(name, bf16[name], zeros_like_layout(bf16[name]))
        with pytest.raises(LayoutError, match=r"is 'bfloat16' but the publishers send .* in 'float8_e4m3fn'"):
            rec2.refit()


def test_fp8_targets_from_bf16_publishers_are_refused():
    m = model("qwen3")
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        for pub in publishers(store, "qwen3", None, 1, state(m))[0]:
            closing.callback(pub.close)
        rec, _ = receiver(store, "qwen3", "block", 1, 1, 0)
        closing.callback(rec.close)
        with pytest.raises(LayoutError, match=r"is 'float8_e4m3fn' but the publishers send .* in 'bfloat16'"):
            rec.refit()


def test_a_trainer_cut_that_splits_cells_without_a_group_is_refused_naming_it():
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        pub = Publisher(store, rank=0, world_size=2, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(pub.close)
        o_proj = TensorLayout.plain("o_proj", "bfloat16", (320, 512), split_dim=0, num_shards=2, shard_idx=0)
        with pytest.raises(LayoutError, match=r"'o_proj' holds box=\(\(0, 160\), \(0, 512\)\).*cuts at multiples of 128"
                                              r".*Fp8\(group=\.\.\.\)"):
            pub.add("o_proj", torch.zeros(160, 512, dtype=torch.bfloat16), o_proj, fp8=Fp8("block"))
        row = TensorLayout.plain("down", "bfloat16", (320, 512), split_dim=1, num_shards=2, shard_idx=1)
        with pytest.raises(LayoutError, match=r"'down'.*'channel' scale cells.*whole rows"):
            pub.add("down", torch.zeros(320, 256, dtype=torch.bfloat16), row, fp8=Fp8("channel"))
        with pytest.raises(LayoutError, match=r"'down'.*'tensor' scale cells.*the whole tensor"):
            pub.add("down", torch.zeros(320, 256, dtype=torch.bfloat16), row, fp8=Fp8("tensor"))
        pub.add("q", torch.zeros(256, 512, dtype=torch.bfloat16), fp8=Fp8("block"))  # whole: fine
        with pytest.raises(ConfigError, match=r"scheme='channel' differs from scheme='block'"):
            pub.add("k", torch.zeros(256, 512, dtype=torch.bfloat16), fp8=Fp8("channel"))
        assert set(pub.layouts()) == {"q", "q_scale_inv"}


def test_bad_fp8_declarations_are_refused_naming_them():
    store = new_store()
    m = model("qwen3")
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        pub = Publisher(store, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(pub.close)
        with pytest.raises(ConfigError, match=r"scheme='fp4' is unknown"):
            Fp8("fp4")
        with pytest.raises(ConfigError, match=r"fp8.logical=None"):
            pub.add_module(m, fp8=Fp8("block"))
        with pytest.raises(LayoutError, match=r"fp8.logical names \['nope'\], held by no tensor"):
            pub.add_module(m, fp8=Fp8("block", logical={"nope", "model.layers.0.mlp.down_proj.weight"}))
        with pytest.raises(LayoutError, match=r"dtype='int32'; expected a bfloat16, float16 or float32 weight"):
            pub.add("ids", torch.zeros(4, 4, dtype=torch.int32), fp8=Fp8("block"))
        with pytest.raises(LayoutError, match=r"expected a 2-D weight for scheme='tensor'"):
            pub.add("experts", torch.zeros(2, 128, 128, dtype=torch.bfloat16), fp8=Fp8("tensor"))
        with pytest.raises(LayoutError, match=r"expected a weight of 2 or more dims"):
            pub.add("norm", torch.zeros(128, dtype=torch.bfloat16), fp8=Fp8("block"))
        fused = TensorLayout.fused("gate_up", "bfloat16", [("gate", TensorLayout.plain("g", "bfloat16", (192, 256)).parts[0].shard),
                                                           ("up", TensorLayout.plain("u", "bfloat16", (192, 256)).parts[0].shard)])
        with pytest.raises(LayoutError, match=r"places logical='up' at offset=\(192, 0\).*multiples of \(128, 128\)"):
            pub.add("gate_up", torch.zeros(384, 256, dtype=torch.bfloat16), fused, fp8=Fp8("block"))
        assert pub.layouts() == {}  # nothing refused was declared
        pub.add_module(m, fp8=Fp8("block", logical=fp8_weights(m)))
        published = pub.layouts()
        for n in fp8_weights(m):
            assert published[n].dtype == "float8_e4m3fn" and published[n + "_scale_inv"].dtype == "float32"
        assert published["model.embed_tokens.weight"].dtype == "bfloat16"


def test_readme_fp8_snippet_runs_as_written():
    """The README's FP8 lines between a TP-1 trainer's Publisher and its export, and between TP-2
    engine ranks' Receivers and their first refit: every engine parameter holds vLLM's bytes."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "fp8_weights(config)" in b]
    m = model("qwen3")
    sd, weights = state(m), fp8_weights(m)
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        pub = Publisher(store, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(pub.close)
        engines, recs = [], []
        for tp_rank in range(2):
            engine = module_of({n: zeros_like_layout(lay)
                                for n, lay in layouts(m, convention="vllm", tp=2, rank=tp_rank, fp8="block").items()})
            rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S)
            closing.callback(rec.close)
            ns = {"pub": pub if tp_rank == 0 else _Skip(), "rec": rec, "model": m, "config": m.config, "engine": engine,
                  "tp": 2, "tp_rank": tp_rank}
            exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own snippet
            engines.append(engine)
            recs.append(rec)
        pub.export()
        quantized = quantize_state(sd, weights, "block")
        for tp_rank, (engine, rec) in enumerate(zip(engines, recs)):
            assert rec.refit().version == 1
            check(dict(engine.named_parameters()), vllm_fp8(m.config, sd, weights, "block", 2, tp_rank, quantized),
                  f"README snippet, engine rank {tp_rank}")


class _Skip:
    """The trainer's half of the snippet, run once: the second engine rank's pass skips it."""

    def add_module(self, *args, **kwargs) -> None:
        pass


def test_a_weight_cast_on_publish_is_quantized_from_its_cast_values():
    """FP32 master weights declared BF16 on the wire: the FP8 bytes are those of the BF16 weight an
    engine would load, rebuilt from the live FP32 tensor at every publish."""
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(300, 260, generator=gen) * torch.logspace(-3, 1, 300)[:, None]
    store = new_store()
    with contextlib.ExitStack() as closing:
        closing.callback(store.close)
        pub = Publisher(store, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(pub.close)
        pub.add("w", master, TensorLayout.plain("w", "bfloat16", (300, 260)), fp8=Fp8("block"))
        pub.export()
        lays = pub.layouts()
        rec = Receiver(store, num_publishers=1, backend="shm", timeout_s=TIMEOUT_S)
        closing.callback(rec.close)
        targets = {n: zeros_like_layout(lay) for n, lay in lays.items()}
        for n, lay in lays.items():
            rec.add(n, lay, targets[n])
        for version in (1, 2):
            if version == 2:
                with pub.update():
                    master.mul_(-3)
            assert rec.refit().version == version
            values, scales = ref_block(master.to(torch.bfloat16))
            assert same(targets["w"], values) and same(targets["w_scale_inv"], scales), version


def test_fp8_engine_layouts_refuse_what_vllm_refuses():
    """vLLM's FP8 layers refuse a shard that is not whole 128-row blocks, and per-tensor scales of
    stacked experts are not one per tensor: ``families.layouts(..., fp8=)`` says so by name."""
    import transformers

    from _fp8_world import CONFIGS

    cfg = transformers.AutoConfig.for_model("qwen3", **{**CONFIGS["qwen3"], "intermediate_size": 320})
    with pytest.raises(LayoutError, match=r"gate_up_proj.weight.*box=\(\(0, 160\), \(0, 320\)\).*multiples of 128"):
        layouts(cfg, convention="vllm", tp=2, rank=0, fp8="block")
    with pytest.raises(LayoutError, match=r"w13_weight.*2-D weight for scheme='tensor'"):
        layouts(model("deepseek_v3"), convention="vllm", fp8="tensor")
    with pytest.raises(ConfigError, match=r"scheme='fp16' is unknown"):
        layouts(cfg, convention="vllm", fp8="fp16")
