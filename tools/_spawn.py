"""Rank processes for the tools that time ep on several GPUs: the device machine's NVLink settings
set, a free port for the process group, one process per rank."""

from __future__ import annotations

import os
import socket

import torch.multiprocessing as mp

# the device machine's rules: no NVLink multicast anywhere (the lent machines refuse it)
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, ranks: int, *args) -> None:
    """``fn(rank, ranks, port, *args)`` in ``ranks`` spawned processes, NVLink multicast off."""
    os.environ.update(NVLS_OFF)
    mp.spawn(fn, args=(ranks, free_port(), *args), nprocs=ranks, join=True)
