"""Where the first refit cycle's milliseconds go on this machine: imports and IPC handle opens.

Run on a 2-GPU machine: python3 tools/ipc_open_probe.py. Prints JSON.
"""

import json
import multiprocessing as mp
import os
import sys
import time

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})


def publisher(q_out, q_in):
    import torch

    from warmlink import _cuda
    from warmlink.bench.model_spec import qwen3_4b_like

    torch.cuda.set_device(0)
    spec = qwen3_4b_like(1.0)
    tensors = [torch.empty(l.local_shape, dtype=torch.bfloat16, device=0) for l in spec.layouts(1, 0).values()]
    handles = []
    with _cuda.use_device(0):
        for t in tensors:
            base, size = _cuda.alloc_range(t.data_ptr())
            handles.append(_cuda.ipc_get_handle(base).hex())
    one = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16, device=0)
    with _cuda.use_device(0):
        big = _cuda.ipc_get_handle(_cuda.alloc_range(one.data_ptr())[0]).hex()
    q_out.put({"handles": handles, "big": big})
    q_in.get(timeout=300)


def receiver():
    t0 = time.perf_counter()
    import torch

    torch.cuda.set_device(1)
    torch.empty(1, device=1)
    out = {"torch_init_s": time.perf_counter() - t0}
    t = time.perf_counter()
    import cuda.bindings.driver  # noqa: F401
    out["import_driver_s"] = time.perf_counter() - t
    t = time.perf_counter()
    import cuda.bindings.runtime  # noqa: F401
    out["import_runtime_s"] = time.perf_counter() - t
    from concurrent.futures import ThreadPoolExecutor

    from warmlink import _cuda

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=publisher, args=(q_out, q_in), daemon=True)
    p.start()
    msg = q_out.get(timeout=300)
    handles = [bytes.fromhex(h) for h in msg["handles"]]

    def open_all(threads, hs):
        t = time.perf_counter()
        if threads == 1:
            ptrs = [_cuda.ipc_open_handle(h, 1) for h in hs]
        else:
            with ThreadPoolExecutor(threads) as ex:
                ptrs = list(ex.map(lambda h: _cuda.ipc_open_handle(h, 1), hs))
        opened = time.perf_counter() - t
        t = time.perf_counter()
        for ptr in ptrs:
            _cuda.ipc_close_handle(ptr, 1)
        return opened, time.perf_counter() - t

    out["open_290_seq_s"], out["close_290_seq_s"] = open_all(1, handles)
    out["open_290_seq_again_s"], _ = open_all(1, handles)
    for n in (4, 16):
        out[f"open_290_threads{n}_s"], out[f"close_after_threads{n}_s"] = open_all(n, handles)
    out["open_one_8.8GB_s"], out["close_one_s"] = open_all(1, [bytes.fromhex(msg["big"])])
    q_in.put(None)
    p.join(30)
    print(json.dumps({k: round(v * 1e3, 2) for k, v in out.items()}, indent=1), "(ms)")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    receiver()
