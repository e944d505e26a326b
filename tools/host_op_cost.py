"""Host time of the operations an ep call is made of, alone and inside rank processes (device machine).

Every figure of the ep host path rests on what one torch op, one CUDA call or one kernel launch
costs the host. This times each (best of three loops, mean per call) in this process, then in
``--ranks`` processes spawned with an NCCL group as the bench's are, all timing at once, so that
a host that is slow by itself and one slowed by its neighbours (NCCL's threads, the other ranks)
tell apart; it prints the CPUs each process may run on and the machine's CPU model::

    python tools/host_op_cost.py [--calls 2000] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import struct

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _spawn import NVLS_OFF, free_port
from cuda_call_cost import per_call_us


def measure(device: int, calls: int) -> dict[str, float]:
    from warmlink import _cuda

    on = torch.device("cuda", device)
    x = torch.zeros(4096, 8, dtype=torch.int64, device=on)
    event = _cuda.event_create(device)
    stream = torch.cuda.current_stream(device).cuda_stream
    packed = struct.Struct("<40q")
    values = tuple(range(40))
    out = {
        "python loop (nothing)": per_call_us(lambda: None, calls),
        "torch.empty (cuda, 1 MB)": per_call_us(lambda: torch.empty(1 << 18, device=on), calls),
        "tensor slice x[1:2]": per_call_us(lambda: x[1:2], calls),
        "x.data_ptr()": per_call_us(lambda: x.data_ptr(), calls),
        "x.zero_() (a kernel)": per_call_us(x.zero_, calls),
        "torch.zeros (cuda, 64 words)": per_call_us(lambda: torch.zeros(64, dtype=torch.int64, device=on), calls),
        "torch.cuda.current_stream": per_call_us(lambda: torch.cuda.current_stream(device), calls),
        "_cuda.event_record": per_call_us(lambda: _cuda.event_record(event, stream), calls),
        "_cuda.event_query": per_call_us(lambda: _cuda.event_query(event), calls),
        "struct.pack 40 words": per_call_us(lambda: packed.pack(*values), calls),
    }
    out.update(_launches(device, stream, packed.pack(*values), calls))
    _cuda.event_destroy(event)
    return out


_PROBE = """
struct Args { long long v[40]; };
extern "C" __global__ void warmlink_probe(const Args a) { if (a.v[0] == -1) *(long long*)a.v[1] = 1; }
"""


def _launches(device: int, stream: int, packed: bytes, calls: int) -> dict[str, float]:
    """An empty kernel taking a 320-byte struct, launched through ``warmlink._nvrtc`` (cuda.bindings)
    and through ctypes on the driver library, with and without packing its arguments first."""
    import ctypes

    from warmlink import _nvrtc

    kernel = _nvrtc.load(_PROBE, "warmlink_probe", device, ("warmlink_probe",))["warmlink_probe"]
    args = ctypes.create_string_buffer(packed, len(packed))
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                                                                  ctypes.c_void_p]
    function = int(kernel._function)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(args))

    def by_ctypes():
        if launch(function, 1, 1, 1, 32, 1, 1, 0, stream, params, None):
            raise RuntimeError("cuLaunchKernel failed")

    def packed_then_bindings():
        kernel(1, 32, ctypes.create_string_buffer(packed, len(packed)), stream)

    return {"NVRTC launch (cuda.bindings)": per_call_us(lambda: kernel(1, 32, args, stream), calls),
            "NVRTC launch (ctypes)": per_call_us(by_ctypes, calls),
            "string buffer + launch (bindings)": per_call_us(packed_then_bindings, calls)}


def _rank(rank: int, num_ranks: int, port: int, calls: int, queue) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank % torch.cuda.device_count()))
    dist.barrier()
    got = measure(rank % torch.cuda.device_count(), calls)
    queue.put((rank, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), got))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    os.environ.update(NVLS_OFF)
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "?"
    print(f"CPU {model}; {os.cpu_count()} CPUs, this process may run on {len(os.sched_getaffinity(0))}; "
          f"load {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    alone = measure(0, args.calls)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.calls, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    ranks = sorted(queue.get() for _ in procs)
    for proc in procs:
        proc.join(60)
    print(f"{'us per call':34s} {'alone':>8s} " + " ".join(f"{'rank ' + str(r):>8s}" for r, *_ in ranks))
    for name, us in alone.items():
        print(f"{name:34s} {us:8.2f} " + " ".join(f"{got[name]:8.2f}" for *_, got in ranks))
    for r, cpus, threads, _ in ranks:
        print(f"rank {r}: may run on {len(cpus)} CPUs ({cpus[0]}-{cpus[-1]}), torch threads {threads}")


if __name__ == "__main__":
    main()
