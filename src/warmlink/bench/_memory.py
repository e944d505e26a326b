"""Memory a benchmark needs, checked before it starts any of its processes.

A benchmark that does not fit would find out late, after minutes of setup: host memory swapped
away, or a child's PoolError when /dev/shm fills. Each bench states its ``Need`` (bytes of host
memory, of /dev/shm, per CUDA device) from the sizes it moves, and ``shortfall`` compares it with
what the machine has free now: host memory (``MemAvailable``, capped by a cgroup limit where one
applies), /dev/shm free space, and free device memory (asked in a short child process, so that
the parent never makes a CUDA context). The bench then refuses through ``bench.args.refuse``.
Estimates are upper bounds of the peak, with a fixed allowance per process for Python, torch
and a CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Need", "PROCESS_HOST_BYTES", "PROCESS_DEVICE_BYTES", "free_memory", "shortfall"]

PROCESS_HOST_BYTES = 512 << 20  # a Python process with torch imported
PROCESS_DEVICE_BYTES = 1 << 30  # a CUDA context and the allocator's slack, per process and device
GB = 1e9


@dataclass
class Need:
    """Peak bytes a run needs at once. ``device_bytes``: CUDA device index -> bytes."""

    host_bytes: int = 0
    shm_bytes: int = 0
    device_bytes: dict[int, int] = field(default_factory=dict)

    def on(self, device: int, nbytes: int) -> None:
        """Add ``nbytes`` of ``device`` (host memory when ``device < 0``)."""
        if device < 0:
            self.host_bytes += nbytes
        else:
            self.device_bytes[device] = self.device_bytes.get(device, 0) + nbytes

    def processes(self, devices: list[int]) -> None:
        """Add one process's allowance per entry of ``devices`` (-1: a process without a GPU)."""
        for d in devices:
            self.host_bytes += PROCESS_HOST_BYTES
            if d >= 0:
                self.on(d, PROCESS_DEVICE_BYTES)

    def peak(self, other: "Need") -> "Need":
        """The larger of two needs that never hold memory at the same time (scenarios in turn)."""
        devices = set(self.device_bytes) | set(other.device_bytes)
        return Need(max(self.host_bytes, other.host_bytes), max(self.shm_bytes, other.shm_bytes),
                    {d: max(self.device_bytes.get(d, 0), other.device_bytes.get(d, 0)) for d in devices})


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:  # a container's limit (cgroup v2) caps what this host would give
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            available = min(available, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return available


def _device_free(devices: list[int]) -> dict[int, int]:
    import torch

    return {d: int(torch.cuda.mem_get_info(d)[0]) for d in devices}


def free_memory(devices: list[int]) -> dict:
    """What is free now: ``{"host": bytes | None, "shm": bytes | None, "devices": {index: bytes}}``.

    Device memory is asked in a child process (no CUDA context here); a device that cannot be
    asked is left out (not checked).
    """
    from warmlink.pool.arenas import shm_free_bytes

    shm = shm_free_bytes()
    free = {"host": _host_available_bytes(), "shm": None if shm is None else shm[0], "devices": {}}
    if devices:
        from warmlink.bench._proc import run_in_child

        try:
            free["devices"] = {int(d): n for d, n in run_in_child(_device_free, timeout_s=120, devices=sorted(devices)).items()}
        except RuntimeError:
            pass
    return free


def shortfall(need: Need, hint: str, free: dict | None = None) -> str | None:
    """What ``need`` lacks on this machine now, in one line for ``bench.args.refuse``, or None
    when it fits.

    Args:
        need: the run's peak.
        hint: what to change, e.g. ``"lower --scale"``.
        free: ``free_memory()`` (read here when None).
    """
    free = free if free is not None else free_memory(sorted(need.device_bytes))
    short = []
    if free["host"] is not None and need.host_bytes > free["host"]:
        short.append(f"{need.host_bytes / GB:.1f} GB of host memory ({free['host'] / GB:.1f} GB available)")
    if free["shm"] is not None and need.shm_bytes > free["shm"]:
        from warmlink.pool.arenas import SHM_DIR

        short.append(f"{need.shm_bytes / GB:.1f} GB in {SHM_DIR} ({free['shm'] / GB:.1f} GB free)")
    for d, nbytes in sorted(need.device_bytes.items()):
        have = free["devices"].get(d)
        if have is not None and nbytes > have:
            short.append(f"{nbytes / GB:.1f} GB on cuda:{d} ({have / GB:.1f} GB free)")
    if not short:
        return None
    return f"not enough memory to start: needs {'; '.join(short)}; {hint}"
