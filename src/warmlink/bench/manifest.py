"""``warmlink bench manifest``: export and first plan of a manifest of tens of thousands of tensors.

A DeepSeek-V3-shaped model (61 layers, 3 dense, 256 routed experts per MoE layer: 45,395
tensors with names such as ``model.layers.57.mlp.experts.211.gate_proj.weight``) is published by
``tp`` tensor-parallel ranks in one process over the shm backend, bf16, cut to ``--tensors``
tensors. Widths are DeepSeek-V3's divided by 128 (hidden 56): what is measured is metadata, whose
size and work follow the number of tensors and parts, not their bytes.

Two timings, each on the host clock (``time.perf_counter``, seconds) and as this process's CPU
time (``time.process_time``, steadier on a shared host), in this one process:

* **export**, per publisher rank: ``Publisher.export()``, which builds the manifest, validates it
  (``schema.encode``), writes it to the store (a blob past 4 MiB, Note [Blobs] in
  ``rendezvous._blobs``) and copies the tensors into staging once. Declaring the tensors (``add``)
  is timed apart.
* **first plan** of a receiver, per receiver layout: what its first refit does before it
  allocates: read every rank's manifest (``Store.get_blob``), validate it (``schema.decode``),
  parse its layouts (``TensorLayout.from_json``), then ``layout_signature`` and ``build_plan``.
  A receiver of the publishers' layout takes the matched path; TP-1 gathers every shard.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["deepseek_v3_like", "make_tensors", "run_manifest", "add_arguments", "run"]

_DENSE, _EXPERTS = 3, 256  # of DeepSeek-V3's 61 layers, the first 3 are dense
# DeepSeek-V3's widths / 128: hidden 7168, q_lora 1536, q heads x qk dims 24576, kv_a 576 and
# kv_lora 512, kv_b 32768, o_proj 16384 inputs, dense intermediate 18432, expert 2048, vocab 129280.
_H, _QA, _QB, _KVA, _KVL, _KVB, _O, _I, _MI, _V = 56, 12, 192, 4, 4, 256, 128, 144, 16, 1010
_MAX_TP = 8


def _specs(num_tensors: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(name, global shape, split dim or None for replicated)`` of the first ``num_tensors``
    tensors (more layers than 61 when asked for more); ``model.norm`` and ``lm_head`` end it."""
    out: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (_V, _H), 0)]
    layer = 0
    while len(out) < num_tensors - 2:
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (_H,), None), (p + "self_attn.q_a_proj.weight", (_QA, _H), None),
                (p + "self_attn.q_a_layernorm.weight", (_QA,), None), (p + "self_attn.q_b_proj.weight", (_QB, _QA), 0),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (_KVA + _KVL, _H), None),
                (p + "self_attn.kv_a_layernorm.weight", (_KVL,), None),
                (p + "self_attn.kv_b_proj.weight", (_KVB, _KVL), 0), (p + "self_attn.o_proj.weight", (_H, _O), 1),
                (p + "post_attention_layernorm.weight", (_H,), None)]
        mlp = [(f"{p}mlp.", _I)] if layer < _DENSE else [(f"{p}mlp.shared_experts.", _MI)] + [
            (f"{p}mlp.experts.{e}.", _MI) for e in range(_EXPERTS)]
        if layer >= _DENSE:
            out += [(p + "mlp.gate.weight", (_EXPERTS, _H), None), (p + "mlp.gate.e_score_correction_bias", (_EXPERTS,), None)]
        for q, inter in mlp:
            out += [(q + "gate_proj.weight", (inter, _H), 0), (q + "up_proj.weight", (inter, _H), 0),
                    (q + "down_proj.weight", (_H, inter), 1)]
        layer += 1
    tail = [("model.norm.weight", (_H,), None), ("lm_head.weight", (_V, _H), 0)]
    return (out[: max(0, num_tensors - 2)] + tail)[:num_tensors]


def deepseek_v3_like(num_tensors: int, tp: int, rank: int) -> dict:
    """Name -> ``TensorLayout`` of tensor-parallel ``rank`` of ``tp``: the first ``num_tensors``
    tensors of a DeepSeek-V3-shaped model at 1/128 width, bf16. Column-parallel weights split dim
    0, row-parallel ones (``o_proj``, ``down_proj``) dim 1, as ``torch.tensor_split``; norms, the
    router and the low-rank ``*_a_proj`` are replicated."""
    from warmlink.refit.manifest import TensorLayout

    return {name: TensorLayout.plain(name, "bfloat16", shape, dim, tp if dim is not None else 1,
                                     rank if dim is not None else 0)
            for name, shape, dim in _specs(num_tensors)}


def make_tensors(layouts: dict) -> dict:
    """Zeroed CPU tensors of each layout's shape and dtype: views of one flat allocation, which
    the caller owns (through the views)."""
    import torch

    from warmlink._dtypes import torch_dtype
    from warmlink.errors import ConfigError

    dtypes = {lay.dtype for lay in layouts.values()}
    if len(dtypes) != 1:
        raise ConfigError(f"make_tensors: dtypes={sorted(dtypes)} of the layouts; expected one dtype")
    flat = torch.zeros(sum(lay.numel for lay in layouts.values()), dtype=torch_dtype(dtypes.pop()))
    out, at = {}, 0
    for name, lay in layouts.items():
        out[name] = flat[at : at + lay.numel].view(lay.shape)
        at += lay.numel
    return out


def _first_plan(store, num_publishers: int, generations: list[int], targets: list) -> dict:
    """One receiver's first plan, phase by phase, as ``SourceSet`` and ``Receiver`` do it."""
    from warmlink.refit import protocol
    from warmlink.refit.manifest import TensorLayout
    from warmlink.refit.plan import build_plan, layout_signature
    from warmlink.rendezvous import schema

    c0, t0 = time.process_time(), time.perf_counter()
    raws = [store.get_blob(protocol.manifest_key(r, g)) for r, g in enumerate(generations)]
    t1 = time.perf_counter()
    manifests = [schema.decode(raw, "publisher_manifest", f"publisher/{r}") for r, raw in enumerate(raws)]
    t2 = time.perf_counter()
    sources = {r: tuple(TensorLayout.from_json(t) for t in m["tensors"]) for r, m in enumerate(manifests)}
    t3 = time.perf_counter()
    sig = layout_signature(sources, targets)
    t4 = time.perf_counter()
    plan = build_plan(sources, targets, _signature=sig)
    t5, c5 = time.perf_counter(), time.process_time()
    return {"read_s": t1 - t0, "decode_s": t2 - t1, "layouts_s": t3 - t2, "signature_s": t4 - t3, "plan_s": t5 - t4,
            "total_s": t5 - t0, "total_cpu_s": c5 - c0, "num_runs": plan.num_runs, "num_staged": plan.num_staged,
            "link_nbytes": plan.link_nbytes}


def run_manifest(*, num_tensors: int, tp: int = 2, receiver_tps: tuple[int, ...] = (2, 1), timeout_s: float = 300.0,
                 progress=None) -> dict:
    """Export ``tp`` publisher ranks of ``num_tensors`` tensors each, then plan each receiver layout.

    Args:
        num_tensors: tensors per publisher rank (``deepseek_v3_like``), >= 1.
        tp: publisher ranks, each one tensor-parallel shard, 1 to 8.
        receiver_tps: one first plan per entry: a receiver of rank 0 of that many shards.
        timeout_s: store timeout, seconds.
        progress: optional callable taking one line of text.

    Returns:
        A JSON-able dict: ``publishers`` (per rank: ``declare_s``, ``export_s``, ``export_cpu_s``,
        ``manifest_nbytes``), ``receivers`` (per layout: ``read_s``, ``decode_s``, ``layouts_s``,
        ``signature_s``, ``plan_s``, ``total_s``, ``total_cpu_s`` in seconds, and the plan's
        ``num_runs``).
    """
    from warmlink.refit import Publisher, protocol
    from warmlink.rendezvous import Store

    say = progress or (lambda line: None)
    prefix = f"bench-manifest-{time.monotonic_ns()}"
    publishers, receivers, pubs = [], [], []
    with Store("127.0.0.1", 0, is_server=True, prefix=prefix, timeout_s=timeout_s) as store:
        try:
            for rank in range(tp):
                layouts = deepseek_v3_like(num_tensors, tp, rank)
                tensors = make_tensors(layouts)
                t0 = time.perf_counter()
                pub = Publisher(store, rank=rank, world_size=tp, backend="shm", timeout_s=timeout_s)
                pubs.append(pub)
                for name, lay in layouts.items():
                    pub.add(name, tensors[name], lay)
                c1, t1 = time.process_time(), time.perf_counter()
                pub.export()
                t2, c2 = time.perf_counter(), time.process_time()
                nbytes = len(store.get_blob(protocol.manifest_key(rank, pub.generation)))
                publishers.append({"rank": rank, "declare_s": t1 - t0, "export_s": t2 - t1, "export_cpu_s": c2 - c1,
                                   "manifest_nbytes": nbytes})
                say(f"publisher {rank}/{tp}: {num_tensors} tensors declared in {t1 - t0:.2f} s, exported in {t2 - t1:.2f} s")
            generations = [p.generation for p in pubs]
            for rtp in receiver_tps:
                targets = list(deepseek_v3_like(num_tensors, rtp, 0).values())
                row = {"receiver": f"TP-{rtp} rank 0" + (" (matched)" if rtp == tp else ""), **_first_plan(
                    store, tp, generations, targets)}
                receivers.append(row)
                say(f"receiver {row['receiver']}: first plan in {row['total_s']:.2f} s ({row['num_runs']} runs)")
        finally:
            for pub in pubs:
                pub.close()
    return {"publishers": publishers, "receivers": receivers}


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensors", type=int, default=40000,
                   help="tensors per publisher rank, DeepSeek-V3-shaped at 1/128 width (default 40000; the whole "
                        "model is 45395)")
    p.add_argument("--tp", type=int, default=2, help=f"publisher ranks, one tensor-parallel shard each (1 to {_MAX_TP}, "
                                                     "default 2)")
    p.add_argument("--receiver-tp", default=None,
                   help="comma-separated receiver layouts to plan, each rank 0 of that many shards (default: "
                        "the publishers' (matched) and 1 (gathers every shard))")
    p.add_argument("--json", dest="json_path", default=None, help="write the JSON record here")
    p.add_argument("--timeout", type=float, default=300.0, help="store timeout, seconds (default 300)")


def _fail(msg: str) -> int:
    print(f"warmlink bench manifest: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """The ``warmlink bench manifest`` command: prints progress, the table and the record path."""
    from warmlink.bench.report import cycle_table, machine_info, write_record
    from warmlink.rendezvous import schema

    if not 1 <= args.tensors <= schema.MAX_TENSORS:
        return _fail(f"--tensors={args.tensors} out of range; expected 1 to {schema.MAX_TENSORS}")
    if not 1 <= args.tp <= _MAX_TP:
        return _fail(f"--tp={args.tp} out of range; expected 1 to {_MAX_TP}")
    try:
        rtps = tuple(int(x) for x in args.receiver_tp.split(",")) if args.receiver_tp else tuple(dict.fromkeys((args.tp, 1)))
    except ValueError:
        return _fail(f"--receiver-tp={args.receiver_tp!r} invalid; expected comma-separated ints, e.g. 2,1")
    if not rtps or not all(1 <= t <= _MAX_TP for t in rtps):
        return _fail(f"--receiver-tp={args.receiver_tp!r} out of range; expected each in 1 to {_MAX_TP}")
    if not args.timeout > 0:
        return _fail(f"--timeout={args.timeout} invalid; expected seconds > 0")
    machine = machine_info()
    print(f"warmlink bench manifest: {args.tensors} tensors x {args.tp} publisher ranks (DeepSeek-V3-shaped, bf16, "
          f"TP-{args.tp} shards), CPU over shm, {machine['cpu_count']} CPUs, torch {machine['torch_version']}", flush=True)
    t = time.perf_counter()
    result = run_manifest(num_tensors=args.tensors, tp=args.tp, receiver_tps=rtps, timeout_s=args.timeout,
                          progress=lambda line: print(f"  {line} ({time.perf_counter() - t:.1f} s)", flush=True))
    print()
    print(cycle_table([{"publisher": f"rank {p['rank']}", **p, "manifest MiB": p["manifest_nbytes"] / 2**20}
                       for p in result["publishers"]],
                      ["publisher", "declare_s", "export_s", "export_cpu_s", "manifest MiB"],
                      title="export (ms; cpu: this process's CPU time, steadier than wall time on a busy host)"))
    print()
    print(cycle_table(result["receivers"], ["receiver", "read_s", "decode_s", "layouts_s", "signature_s", "plan_s",
                                            "total_s", "total_cpu_s", "num_runs"],
                      title="first plan (ms): read manifests, decode, layouts, signature, build_plan"))
    record = {"bench": "manifest", "num_tensors": args.tensors, "tp": args.tp, "receiver_tps": list(rtps),
              "backend": "shm", **result, "machine": machine}
    if args.json_path:
        write_record(args.json_path, record)
        print(f"record: {args.json_path}")
    return 0
