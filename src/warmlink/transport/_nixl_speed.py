"""When a NIXL transfer is too slow to be the path it should be, and what to tell the user.

# Note [Loud fallbacks]
UCX picks a transport per memory type and peer. When the fast one cannot serve (memory that is
not plain ``cudaMalloc``, ``UCX_TLS`` without ``cuda_ipc``, no GPUDirect RDMA across nodes) it
falls back to staging through host memory and runs 100-1000x slower, silently: on two H200s a
peer's tensor in torch's expandable segments moved at 0.4 GB/s against ~260 for ``cudaMalloc``
memory. So ``NixlLink`` times the first transfer of every batch of at least
``SPEED_CHECK_BYTES`` with NIXL's telemetry. Below ``floor_gbps`` (default ``DEFAULT_MIN_GBPS``
when GPU memory is on either side; host-only batches are not judged) it warns once with
``SlowTransportWarning``, naming the causes ``slow_causes`` finds, or raises
``SlowTransportError`` with ``on_slow="raise"``. ``warmlink doctor`` prints the transports UCX
selects.

Pure functions: the link measures, this module judges and words.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MIN_GBPS", "SPEED_CHECK_BYTES", "floor_gbps", "slow_causes", "slow_message"]

# CUDA IPC over NVLink gives ~260 GB/s through UCX, PCIe peer copies ~25, a 100 Gb/s NIC ~12;
# UCX's staged or TCP paths for GPU memory give 0.4-3. 5 GB/s separates them with margin.
DEFAULT_MIN_GBPS = 5.0
# Smaller batches are dominated by fixed costs: their speed says nothing about the path.
SPEED_CHECK_BYTES = 64 << 20

_SHM_TLS = ("sm", "cma", "posix", "sysv", "xpmem", "knem")
_RDMA_TLS = ("rc", "dc", "ud", "ib")


def floor_gbps(min_gbps: float | None, vram: bool) -> float:
    """The speed below which a batch is reported: the user's, else 5 GB/s with GPU memory, else 0."""
    if min_gbps is not None:
        return float(min_gbps)
    return DEFAULT_MIN_GBPS if vram else 0.0


def slow_causes(*, vram: bool, remote_host: bool, num_not_ipc: int, ucx_tls: str) -> list[str]:
    """The known reasons a batch of this kind would take a slow path, most specific first."""
    causes = []
    if ucx_tls and not ucx_tls.startswith("^") and "all" not in ucx_tls.split(","):
        if remote_host:
            wanted, names = "RDMA transports (rc, dc, ud)", _RDMA_TLS
        elif vram:
            wanted, names = "cuda_ipc", ("cuda_ipc",)
        else:
            wanted, names = "shared-memory transports (sm, cma)", _SHM_TLS
        if not any(t in ucx_tls for t in names):
            causes.append(f"UCX_TLS={ucx_tls!r} leaves out {wanted}")
    if num_not_ipc:
        causes.append(f"{num_not_ipc} local GPU allocation(s) are not plain cudaMalloc memory (expandable segments, "
                      "cudaMallocAsync or VMM); stage through NixlLink.allocate")
    if remote_host:
        causes.append("the peer is on another host: check that UCX_NET_DEVICES names an RDMA NIC and that GPUDirect "
                      "RDMA (nvidia-peermem or dma-buf) is available")
    if not causes:
        causes.append("UCX found no direct path between these memories (check UCX_TLS and the memory types; "
                      "a peer's expandable-segments memory looks the same from here)")
    return causes


def slow_message(nbytes: int, gbps: float, floor: float, causes: list[str]) -> str:
    return (f"NixlLink: {nbytes / 1e6:.1f} MB moved at {gbps:.2f} GB/s, below min_gbps={floor:g}: UCX probably fell "
            f"back to a slow transport. Likely causes: {'; '.join(causes)}. Run `warmlink doctor` or set "
            "UCX_PROTO_INFO=y to see the transports UCX selected")
