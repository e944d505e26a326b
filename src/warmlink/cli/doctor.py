"""``warmlink doctor``: what this machine offers warmlink, and what it cannot load."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys

__all__ = ["collect", "run_doctor"]


def _backends() -> dict[str, str]:
    out = {"shm": "ok" if os.path.isdir("/dev/shm") else "missing /dev/shm"}
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        out["cuda_ipc"] = "unavailable: pip install warmlink[cuda] (cuda-bindings)"
    else:
        import torch

        out["cuda_ipc"] = "ok" if torch.cuda.is_available() else "unavailable: no CUDA device"
    from warmlink.transport._nixl_agent import installed_package

    nixl = installed_package()
    out["nixl"] = f"importable ({nixl})" if nixl else "not installed (optional: pip install warmlink[nixl])"
    return out


def collect(measure: bool = True) -> dict:
    """Machine facts as a dict: versions, GPUs, peer access, NVLink, copy bandwidth, backends, and
    (``measure``, NIXL installed) the NIXL probe: a few seconds in a subprocess."""
    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
        info["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
        if shutil.which("nvidia-smi"):
            try:
                topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20, check=False).stdout
                info["topology"] = topo.strip()
            except (OSError, subprocess.SubprocessError) as exc:
                info["topology"] = f"nvidia-smi failed: {exc}"
        if measure and n >= 1:
            from warmlink.bench.peak import peer_copy_peak

            info["copy_engine"] = peer_copy_peak(0, min(1, n - 1), nbytes=256 << 20, repeats=5)
    from warmlink.transport._nixl_agent import installed_package

    from warmlink.ep.kernels import host

    info["backends"] = _backends()
    info["ep_host_steps"] = host.describe()
    if measure and installed_package() is not None:
        # A subprocess (UCX prints its protocol choice from C, and a crash there must not end the doctor).
        from warmlink.transport._nixl_probe import probe

        info["nixl"] = probe()
    info["env"] = _environment()
    return info


def _environment() -> dict:
    """Every ``WARMLINK_*`` variable: ``set`` (name -> value, as set; a secret's hidden) and ``problems`` (name ->
    message) for a value ``warmlink._env`` refuses or a name it does not read."""
    from warmlink import _env

    names = sorted(n for n in os.environ if n.startswith("WARMLINK_"))
    problems = {name: str(e) for name, e in _env.check_all(unknown=True).items()}
    return {"known": list(_env.VARIABLES), "set": {n: _env.shown(n, os.environ[n]) for n in names}, "problems": problems}


def run_doctor() -> int:
    info = collect()
    print("warmlink doctor")
    print(f"  python {info['python']}, torch {info['torch']}")
    if info["cuda_available"]:
        print(f"  CUDA {info['cuda']}, NCCL {info['nccl']}, {len(info['gpus'])} GPU(s): {', '.join(info['gpus'])}")
        for i, row in enumerate(info["peer_access"]):
            print(f"  peer access from {i}: {''.join('Y' if x else '.' for x in row)}")
        if "copy_engine" in info:
            ce = info["copy_engine"]
            print(f"  copy engine {ce.get('src_device')} -> {ce.get('dst_device')}: {ce.get('one_way_gbps', 0):.1f} GB/s one way, "
                  f"{ce.get('both_ways_total_gbps', 0):.1f} GB/s both ways (256 MiB copies)")
        if "topology" in info:
            print("  topology:\n    " + info["topology"].replace("\n", "\n    "))
    else:
        print("  no CUDA device: refit and the demo run on CPU over shared memory")
    for name, state in info["backends"].items():
        print(f"  backend {name:9s} {state}")
    print(f"  ep host steps: {info['ep_host_steps']}")
    if "nixl" in info:
        for line in _nixl_lines(info["nixl"]):
            print(line)
    env = info["env"]
    for name in sorted(set(env["known"]) | set(env["set"])):
        value = env["set"].get(name)
        state = "INVALID" if name in env["problems"] else "ok"
        print(f"  {name}={value!r} {state}" if value is not None else f"  {name} unset (default)")
    for message in env["problems"].values():  # stderr too: a doctor run in a script fails on them
        print(f"warmlink doctor: {message}", file=sys.stderr)
    return 2 if env["problems"] else 0


def _nixl_lines(nx: dict) -> list[str]:
    """One line for NIXL (loads? which UCX transports would carry put/get?), plus loud warnings."""
    if not nx.get("loads"):
        return [f"  NIXL: does not load: {nx.get('error')}"] + [f"  WARNING: {w}" for w in nx.get("warnings", [])]
    parts = []
    for kind, tag in (("dram", ""), ("vram", "VRAM ")):
        res = nx.get(kind)
        if not isinstance(res, dict):
            continue
        if not res.get("ok"):
            parts.append(f"{tag or 'DRAM '}transfer FAILED: {res.get('error')}")
        parts += [f"{tag}{op}: {', '.join(tls)}" for op, tls in res.get("transports", {}).items()]
    tls = "" if nx.get("ucx_tls") in (None, "(unset)") else f", UCX_TLS={nx['ucx_tls']}"
    lines = [f"  NIXL: loads (agent {nx.get('agent_create_s', 0):.1f} s{tls}); UCX transports: " + ("; ".join(parts) or "(none seen)")]
    return lines + [f"  WARNING: {w}" for w in nx.get("warnings", [])]
