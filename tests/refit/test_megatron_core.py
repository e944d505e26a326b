"""The megatron convention against Megatron-core's own code, running on CPU in a gloo world of 4.

For each case (a family and Megatron's tp / ep / expert-tp), every rank of the world builds the
real ``GPTModel`` (local spec) and checks, in ``_megatron_world``:

(a) its parameter names, local shapes and dtypes are those ``layouts(..., convention="megatron")``
    gives for that rank (ranks read from ``parallel_state``);
(b) filled from the whole HF model through a warmlink refit (``Receiver.add_module``), it holds what
    plain torch ops say (``_megatron_ref.megatron_rank``);
(c) Megatron-core's modules read those bytes as the HF weights: ``get_query_key_value_tensors``
    (q/k/v heads, q/k layernorm, groups cut across ranks included), ``linear_proj`` and the MLP
    (fc1 ``[gate; up]`` through ``glu``, all-reduced), each local expert and the shared experts,
    the router, ``VocabParallelEmbedding`` and ``output_layer`` against ``VocabUtility``'s range
    (padding rows give 0), the norms, MLA's projections;
(d) a Megatron module with vLLM-style layouts is refused by ``Publisher.add_module`` and
    ``Receiver.add_module``, and nothing in it changes;
(e) every rank publishes its Megatron tensors in place and rank 0 receives a whole HF model from
    the 4 publishers, bit-exact.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from _megatron_world import run_world  # noqa: E402

#: (case id, family, tp, ep, etp); ranks beyond tp * ep are data-parallel replicas.
CASES = [
    ("llama-tp2", "llama", 2, 1, 2),  # one query group per rank
    ("llama-tp4", "llama", 4, 1, 4),  # 2 groups over 4 ranks: each rank holds half a group's rows
    ("llama_bias-tp2", "llama_bias", 2, 1, 2),  # every linear with a bias (add_bias_linear)
    ("mistral-tp2", "mistral", 2, 1, 2),  # one group (MQA) cut in two
    ("qwen2-tp2", "qwen2", 2, 1, 2),  # QKV bias, two groups per rank
    ("qwen3-tp4", "qwen3", 4, 1, 4),  # q/k layernorm, tied embeddings, rank 3 holds only padding
    ("qwen3_moe-tp2-ep2-etp2", "qwen3_moe", 2, 2, 2),  # experts cut by expert TP; layer 1 dense
    ("qwen3_moe-ep4", "qwen3_moe", 1, 4, 1),  # one expert per rank
    ("mixtral-tp2-ep2", "mixtral", 2, 2, 1),
    ("mixtral-tp4-etp4", "mixtral", 4, 1, 4),
    ("deepseek_v3-tp2-ep2", "deepseek_v3", 2, 2, 1),  # MLA, shared experts, expert bias
    ("deepseek_v3-tp4-ep2-etp2", "deepseek_v3", 4, 2, 2),  # expert TP differs from TP
    ("deepseek_v3_no_q_lora-tp2", "deepseek_v3_no_q_lora", 2, 1, 2),  # MLA's linear_q_proj
]
WORLD_SIZE = 4
TIMEOUT_S = 900.0  # a loaded 2-core machine: four processes importing torch, transformers and Megatron


@pytest.fixture(scope="module")
def world():
    return run_world(CASES, WORLD_SIZE, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_megatron_core_agrees(world, case_id):
    problems = [f"rank {r}: {p}" for r, found in enumerate(world) for p in found.get(case_id, ["case did not run"])]
    problems += [f"rank {r}: {p}" for r, found in enumerate(world) for p in found.get("world", [])]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_te_spec_names_are_the_ones_megatron_core_maps_to_the_local_spec(family):
    """Transformer Engine is absent here, so its spec cannot be built; megatron-core's own rename of
    its state dict keys to the local spec's (``mcore_gpt_load_te_state_dict_pre_hook``) must turn
    the ``spec="te"`` layouts into the local ones, box for box (the local ones are checked above)."""
    import _megatron_ref as ref
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import mcore_gpt_load_te_state_dict_pre_hook

    from warmlink.refit.families import layouts

    cfg = ref.hf_config(family)
    for tp, rank in ((1, 0), (2, 1)):
        te = layouts(cfg, convention="megatron", tp=tp, rank=rank, spec="te")
        local = layouts(cfg, convention="megatron", tp=tp, rank=rank)
        assert sum(name.endswith(".layer_norm_weight") for name in te) == 2 * cfg.num_hidden_layers
        renamed = dict(te)
        mcore_gpt_load_te_state_dict_pre_hook(renamed, "", {}, True, [], [], [])
        assert set(renamed) == set(local)
        for name, lay in renamed.items():
            assert (lay.dtype, lay.parts, lay.shape) == (local[name].dtype, local[name].parts, local[name].shape), name
