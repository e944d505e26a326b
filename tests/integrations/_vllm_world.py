"""Trainer ranks for the vLLM tests: spawned processes that train a tiny Qwen2 and send each step
to a vLLM ``LLM`` in the test process through the ``"warmlink"`` backend.

Three ways of holding the weights, as trainers do:

* ``fsdp``: FSDP2 (``fully_shard``) over a gloo world; DTensor layouts from their placements.
* ``megatron`` / ``vllm``: a TP rank in that framework's layout (Megatron's interleaved QKV, vLLM's
  ``[q; k; v]``, both with padded vocabularies), tensors built from the full model with plain torch
  ops (``_megatron_ref``, ``_references``); every rank steps a replica of the full model with the
  same batches and copies its rank's tensors into the published ones in place, as a TP trainer's
  optimizer updates its shards.

Rank 0 reaches the ``LLM`` through ``ConnectionClient`` over a pipe that the test serves with
``serve_client`` while it waits for the ranks (``run_all``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "refit") not in sys.path:
    sys.path.insert(0, str(TESTS / "refit"))

from _spawned import CTX, SpawnedWorker, serve  # noqa: E402

TIMEOUT_S = 240.0
WORLD = 2
PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 8
# A tiny Qwen2 vLLM's CPU backend runs: head_dim 32 (its attention needs >= 32), GQA 4:2, a
# vocabulary of 300 (padded by vLLM to 320, by Megatron to 384 at TP 2), untied LM head.
QWEN2 = dict(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
# The same with 4 experts (top 2) in layer 0 and a dense layer 1 (vLLM's RoutedExperts w13/w2 and a
# GateLinear router beside Merged/RowParallelLinear), q/k norms.
QWEN3_MOE = dict(QWEN2, head_dim=32, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                 norm_topk_prob=True)


# GPT-OSS: experts held transposed by vLLM (Note [vLLM GPT-OSS]), attention sinks, a sliding window.
GPT_OSS = dict(vocab_size=300, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=256, sliding_window=128, tie_word_embeddings=False)
_CONFIGS = {"qwen2": ("Qwen2Config", QWEN2), "qwen3_moe": ("Qwen3MoeConfig", QWEN3_MOE), "gpt_oss": ("GptOssConfig", GPT_OSS)}


def save_tiny(path: str, family: str, **overrides) -> None:
    """A tiny random ``family`` ("qwen2", "qwen3_moe" or "gpt_oss") model saved with transformers
    (no downloads); ``overrides`` change its config."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    cls, base = _CONFIGS[family]
    config = getattr(T, cls)(**dict(base, **overrides))
    T.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)


def _batches(vocab: int, steps: int):
    import torch

    gen = torch.Generator().manual_seed(7)  # every rank trains on the same batches
    return [torch.randint(0, vocab, (2, 8), generator=gen) for _ in range(steps)]


def _full_state(model) -> dict:
    from warmlink.refit._declare import module_tensors

    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in module_tensors(model).items()}


class _Rank:
    """This rank's published module and how to refresh it after a step."""

    def __init__(self, mode: str, model, rank: int) -> None:
        from warmlink.refit.families import layouts

        self.mode, self.model, self.rank = mode, model, rank
        self.layouts = None
        self.published = model
        if mode in ("megatron", "vllm"):
            from test_readme import module_of

            self.layouts = layouts(model.config, convention=mode, tp=WORLD, rank=rank, dtype="float32",
                                   **({"make_vocab_size_divisible_by": 64} if mode == "megatron" else {}))
            self.published = module_of(self._tensors())

    def _tensors(self) -> dict:
        from _megatron_ref import megatron_rank
        from _references import ref_vllm

        state = _full_state(self.model)
        if self.mode == "megatron":
            return megatron_rank(state, self.model.config, tp=WORLD, rank=self.rank, divisible=64)
        return ref_vllm(self.model.config, state, WORLD, self.rank)

    def refresh(self) -> None:
        """The rank's tensors from the stepped replica, copied in place (the published memory stays)."""
        if self.published is self.model:
            return
        import torch

        new = self._tensors()
        with torch.no_grad():
            for name, p in self.published.named_parameters():
                p.copy_(new[name])


class _NoClient:
    """Ranks other than 0 never call the client (vLLM's rule: only the sender drives the engine)."""

    def __getattr__(self, name):
        raise AssertionError(f"trainer rank > 0 called client.{name}")


def _cmd_init(state, *, mode, rank, path, address, secret, prefix, init_file, timeout_s, buffer_bytes, conn,
              world_size=WORLD, client=True, prefix_cache="reset", catch=False):
    """Build the rank's model and its trainer engine; returns its publisher version, or with
    ``catch`` the error ``_caught`` describes."""
    import datetime

    import torch
    import torch.distributed as dist
    import transformers as T
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from warmlink.integrations.vllm import ConnectionClient, WarmlinkSource, WarmlinkTrainerInitInfo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    held = _Rank(mode, model, rank)
    client = (ConnectionClient(conn, timeout_s=TIMEOUT_S) if rank == 0 else _NoClient()) if client else None
    info = WarmlinkTrainerInitInfo(rank=rank, world_size=world_size, store_address=address, secret=secret, prefix=prefix,
                                   timeout_s=timeout_s, update_timeout_s=TIMEOUT_S, buffer_bytes=buffer_bytes,
                                   layouts=held.layouts, prefix_cache=prefix_cache)
    t0 = time.perf_counter()
    try:
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=WarmlinkSource(held.published))
    except Exception as exc:
        if catch:
            return _caught(exc, t0)
        raise
    state.update(model=model, held=held, engine=engine, step=0,
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                 batches=_batches(model.config.vocab_size, 8))
    return engine.publisher.version


def _caught(exc: BaseException, t0: float) -> dict:
    """What the test checks of an error a rank got: its type, message, how long it took, and
    whether another error hangs off it (a second traceback)."""
    return {"error": type(exc).__name__, "message": str(exc), "after_s": time.perf_counter() - t0,
            "chained": exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__)}


def _cmd_readme(state, *, rank, path, address, secret, init_file, steps, code, conn):
    """The README's trainer snippet, run as written by an FSDP2 rank; returns its last version and
    the full weights after its loop."""
    import datetime

    import torch
    import torch.distributed as dist
    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from warmlink.integrations.vllm import ConnectionClient

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ns = {"rank": rank, "world": WORLD, "address": address, "secret": secret, "model": model,
          "client": ConnectionClient(conn, timeout_s=TIMEOUT_S) if rank == 0 else _NoClient(),
          "batches": _batches(model.config.vocab_size, steps),
          "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own snippet
    state["engine"] = ns["engine"]
    return ns["engine"].served, _full_state(model)


def _train_step(state) -> None:
    model, opt = state["model"], state["optimizer"]
    batch = state["batches"][state["step"]]
    state["step"] += 1
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    state["held"].refresh()


def _cmd_step(state, catch=False):
    """An optimizer step, then ``send_weights``; returns (the engine's update count, the full
    weights after the step, seconds), or with ``catch`` the error ``_caught`` describes (and the
    weights)."""
    _train_step(state)
    t0 = time.perf_counter()
    try:
        state["engine"].send_weights()
    except Exception as exc:
        if catch:
            return dict(_caught(exc, t0), state=_full_state(state["model"]))
        raise
    send_s = time.perf_counter() - t0
    return state["engine"].served, _full_state(state["model"]), send_s


def _cmd_die_mid_update(state):
    """An optimizer step, then the start of an update, then SIGKILL: a trainer killed mid-update."""
    import signal

    _train_step(state)
    state["engine"].publisher.begin_update()
    os.kill(os.getpid(), signal.SIGKILL)


def _cmd_close(state):
    engine = state.pop("engine", None)
    if engine is not None:
        engine.shutdown()
    state.clear()


def _reset(state):
    import torch.distributed as dist

    _cmd_close(state)
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(control, results, conn):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    commands = {"init": lambda s, **kw: _cmd_init(s, conn=conn, **kw), "step": _cmd_step,
                "readme": lambda s, **kw: _cmd_readme(s, conn=conn, **kw),
                "die_mid_update": _cmd_die_mid_update, "close": _cmd_close}
    serve(control, results, commands, {}, _reset)


class Trainers:
    """``WORLD`` trainer processes; rank 0's client pipe is served by ``run_all``."""

    def __init__(self) -> None:
        self.conn, child = CTX.Pipe()
        self.workers = [SpawnedWorker(_worker, child if r == 0 else None) for r in range(WORLD)]

    def run_all(self, llm, commands: dict, timeout_s: float = TIMEOUT_S, allow_death=()) -> dict:
        """Send ``commands`` (rank -> (cmd, kwargs)), serve rank 0's client calls on ``llm`` until
        every rank answered, and return rank -> answer (raising a rank's error; a rank of
        ``allow_death`` that died answers None)."""
        import queue

        from warmlink.integrations.vllm import serve_client

        for r, (cmd, kw) in commands.items():
            self.workers[r].send(cmd, **kw)
        answers: dict = {}

        def done() -> bool:
            for r in commands:
                if r in answers:
                    continue
                w = self.workers[r]
                try:
                    answers[r] = w.results.get_nowait()
                except queue.Empty:
                    if not w.proc.is_alive():
                        answers[r] = ("ok", None) if r in allow_death else ("error", f"rank {r} died (exit code {w.proc.exitcode})")
            return len(answers) == len(commands)

        serve_client(llm, self.conn, until=done, timeout_s=timeout_s)
        errors = {r: v for r, (status, v) in answers.items() if status == "error"}
        if errors:
            raise RuntimeError(f"trainer ranks failed: {errors}")
        return {r: v for r, (_, v) in answers.items()}

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
