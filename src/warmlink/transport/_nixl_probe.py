"""Does NIXL load here, and which UCX transports would it use? (``warmlink doctor``'s NIXL line.)

Run as ``python -m warmlink.transport._nixl_probe [--json]``; ``probe()`` does that in a
subprocess with ``UCX_PROTO_INFO=y``, because UCX prints its protocol selection tables from C
(nothing in NIXL's API says which transport moved the bytes), because a NIXL/UCX crash or hang must
not take the doctor down, and because UCX reads its environment once per process.

The subprocess makes a UCX agent and a target agent in a second process (as a link has them: in one
process UCX would not use cuda_ipc), moves a 4 MiB host buffer (and a GPU buffer, where there is a
GPU: device 0 to 1, or 0 to 0) by WRITE and READ, checks the bytes, and prints one last line
``WARMLINK_PROBE_JSON {...}``. The parent parses UCX's tables (``parse_proto_info``) into
"put cuda->cuda: cuda_ipc" and warns where GPU memory would go over TCP.

Imports no NIXL at import time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

__all__ = ["MARKER", "parse_proto_info", "probe", "summarize"]

MARKER = "WARMLINK_PROBE_JSON "
_NBYTES = 4 << 20
_XFER_DEADLINE_S = 10.0
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_TCP_WARNING = ("UCX would move GPU memory over TCP ({what}); expected cuda_ipc on one node or rc/dc (RDMA) "
                "across nodes; check UCX_TLS and that the memory is plain cudaMalloc")


# -- parsing UCX_PROTO_INFO ------------------------------------------------------------------------
_PREFIX = re.compile(r"^\s*(?:\[[^\]]*\]\s*){1,3}")  # "[1795314650.531251] [vm:861  :0]" or "[...]"
_OP = re.compile(r"by\s+ucp_([A-Za-z]+)")
_FROM = re.compile(r"\bfrom\s+([\w.\-/\[\]]+)")
_TO = re.compile(r"\b(?:to|into)\s+([\w.\-/\[\]]+)")  # put: "from host memory to cuda"; get: "into host memory from cuda"
_SCOPE = re.compile(r"([\w-]+)\s+cfg#\d+")  # "probe-initiator intra-node cfg#1": self, intra-node, inter-node
_RANGE = re.compile(r"^\d[\w.]*(?:\.\.(?:inf|\d[\w.]*))?$")
_LANE = re.compile(r"([A-Za-z][\w.\-]*)/([^\s|]+)")


_FIELDS = ("operation", "from", "to", "range", "protocol", "transport", "device", "scope")


def _memtype(word: str) -> str:
    """``cuda/dev[4]`` -> ``cuda``: the memory type without UCX's device suffix."""
    return word.split("/", 1)[0].lower()


def parse_proto_info(text: str) -> list[dict]:
    """UCX_PROTO_INFO tables as entries {operation, from, to, range, protocol, transport, device,
    scope}; ``scope`` is the endpoint kind of the table (``self``, ``intra-node``, ...) or None.

    Header rows name the operation (``... by ucp_put* from host memory to cuda/dev[4]``, ``... by
    ucp_get* into host memory from cuda``: ``from`` is where the data comes from); data rows are ``| range | protocol | transport/device |`` (a multi-lane cell gives one entry per
    lane). Unparseable lines are skipped: this reads C log output and must never raise.
    Duplicates (UCX prints one table per endpoint configuration) are dropped, order kept.
    """
    entries: list[dict] = []
    seen: set[tuple] = set()
    if not isinstance(text, str):
        return entries
    op = src = dst = scope = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw, count=1).strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        m_scope = next((m for m in map(_SCOPE.search, cells) if m), None)
        if m_scope:
            scope = m_scope.group(1).lower()
        header = next((c for c in cells if _OP.search(c)), None)
        if header is not None:
            m_op = _OP.search(header)
            op, rest = m_op.group(1).split("_")[0].lower(), header[m_op.end():]
            src, dst = (_memtype(m.group(1)) if m else None for m in (_FROM.search(rest), _TO.search(rest)))
            continue
        if op is None or len(cells) < 3 or not _RANGE.match(cells[0]):
            continue
        for transport, device in _LANE.findall(cells[-1]):
            key = (op, src, dst, cells[0], cells[1], transport, device, scope)
            if key not in seen:
                seen.add(key)
                entries.append(dict(zip(_FIELDS, key)))
    return entries


def _upper(rng: str) -> float:
    end = rng.rsplit("..", 1)[-1]
    if end == "inf":
        return float("inf")
    try:
        return float(end)
    except ValueError:
        return -1.0


def summarize(entries: list[dict]) -> dict[str, list[str]]:
    """``{"put host->host": ["cma"], ...}``: per operation and memory types, the transports of the
    largest messages (the range ending in ``inf``, else the highest one): what bulk data rides on.
    Tables of an agent's endpoint to itself (scope ``self``) count only where there are no others:
    a link between two agents uses the intra-/inter-node ones."""
    entries = _between_agents(entries)
    top: dict[tuple, float] = {}
    for e in entries:
        key = (e["operation"], e["from"], e["to"])
        top[key] = max(top.get(key, -2.0), _upper(e["range"]))
    out: dict[str, set[str]] = {}
    for e in entries:
        key = (e["operation"], e["from"], e["to"])
        if _upper(e["range"]) == top[key]:
            out.setdefault(_label(*key), set()).add(e["transport"])
    return {k: sorted(v) for k, v in out.items()}


def _between_agents(entries: list[dict]) -> list[dict]:
    keys = {(e["operation"], e["from"], e["to"]) for e in entries if e.get("scope") != "self"}
    return [e for e in entries if e.get("scope") != "self" or (e["operation"], e["from"], e["to"]) not in keys]


def _label(op: str, src: str | None, dst: str | None) -> str:
    if src and dst:
        return f"{op} {src}->{dst}"
    return f"{op} from {src}" if src else f"{op} to {dst}" if dst else op


def _tcp_warnings(entries: list[dict]) -> list[str]:
    """GPU-to-GPU put/get whose largest messages go over TCP or software emulation: ~1 GB/s
    instead of hundreds, the silent failure mode of a UCX without CUDA/RDMA transports."""
    bulk = [e for e in _between_agents(entries) if e["operation"] in ("put", "get") and e["from"] == "cuda" and e["to"] == "cuda"]
    if not bulk:
        return []
    top = max(_upper(e["range"]) for e in bulk)
    bad = sorted({f"{e['operation']} cuda->cuda: {e['transport']}/{e['device']} {e['protocol']}"
                  for e in bulk if _upper(e["range"]) == top
                  and (e["transport"] == "tcp" or "emulation" in e["protocol"])})
    return [_TCP_WARNING.format(what="; ".join(bad))] if bad else []


# -- the subprocess --------------------------------------------------------------------------------
def _wait(agent, xfer, what: str) -> None:
    deadline = time.monotonic() + _XFER_DEADLINE_S
    state = agent.transfer(xfer)
    while state not in ("DONE", "ERR"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not DONE after {_XFER_DEADLINE_S:.0f} s (state {state!r})")
        time.sleep(0.001)
        state = agent.check_xfer_state(xfer)
    if state != "DONE":
        raise RuntimeError(f"{what} ended in state {state!r}")


def _move(torch, init, remote: str, target: dict, kind: str, src_dev: int) -> dict:
    """WRITE 4 MiB of ``kind`` memory from ``init`` to the target's buffer, zero it here, READ it
    back: the READ's bytes check both directions."""
    out: dict = {"ok": False, "error": target.get("error")}
    if kind == "VRAM":
        out.update(src_device=src_dev, dst_device=target.get("device"))
    if out["error"]:
        out["error"] = f"target: {out['error']}"
        return out
    pattern = (torch.arange(_NBYTES, dtype=torch.int64, device="cpu") % 251).to(torch.uint8)
    a = pattern.to("cpu" if kind == "DRAM" else f"cuda:{src_dev}")
    ids = (0, 0) if kind == "DRAM" else (src_dev, target["device"])
    cleanup = []
    try:
        reg = init.register_memory([(a.data_ptr(), _NBYTES, ids[0], "")], kind)
        cleanup.append(lambda: init.deregister_memory(reg))
        lh = init.prep_xfer_dlist("NIXL_INIT_AGENT", [(a.data_ptr(), _NBYTES, ids[0])], kind)
        cleanup.append(lambda: init.release_dlist_handle(lh))
        rh = init.prep_xfer_dlist(remote, [(target["addr"], _NBYTES, ids[1])], kind)
        cleanup.append(lambda: init.release_dlist_handle(rh))
        t = time.perf_counter()
        for op in ("WRITE", "READ"):
            xfer = init.make_prepped_xfer(op, lh, [0], rh, [0])
            cleanup.append(lambda x=xfer: init.release_xfer_handle(x))
            if op == "READ":
                a.zero_()
                if kind == "VRAM":
                    torch.cuda.synchronize()
            _wait(init, xfer, f"{kind} {op}")
        if kind == "VRAM":
            torch.cuda.synchronize()
        if not torch.equal(a.cpu(), pattern):
            raise RuntimeError(f"{kind} WRITE and READ reported DONE but the bytes read back differ")
        out["seconds"] = round(time.perf_counter() - t, 4)
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001  reported in the JSON: the doctor shows it
        out["error"] = f"{type(exc).__name__}: {exc}"
    for undo in reversed(cleanup):
        try:
            undo()
        except Exception:  # noqa: BLE001, S110  cleanup of a probe; the result is already known
            pass
    return out


def _target(q_out, q_in, plan: list[tuple[str, int]]) -> None:
    """The target agent, in its own process: UCX never picks cuda_ipc between two agents of one
    process (cudaIpcOpenMemHandle refuses handles of its own process; on the H200 machine it chose
    tcp/lo software emulation there, and cuda_ipc between two processes)."""
    try:
        import torch

        from warmlink.transport._nixl_agent import load_nixl

        api = load_nixl()
        for d in sorted({dev for kind, dev in plan if kind == "VRAM"}):  # CUDA context before the agent
            torch.cuda.set_device(d)
            torch.empty(1, device=f"cuda:{d}")
        agent = api.nixl_agent("probe-target", api.nixl_agent_config(backends=["UCX"]))
        keep, info = [], {}
        for kind, dev in plan:
            try:
                buf = torch.zeros(_NBYTES, dtype=torch.uint8, device="cpu" if kind == "DRAM" else f"cuda:{dev}")
                keep.append((buf, agent.register_memory([(buf.data_ptr(), _NBYTES, 0 if kind == "DRAM" else dev, "")], kind)))
                info[kind] = {"addr": buf.data_ptr(), "device": dev}
            except Exception as exc:  # noqa: BLE001
                info[kind] = {"error": f"{type(exc).__name__}: {exc}"}
        q_out.put({"meta": bytes(agent.get_agent_metadata()), "kinds": info})
    except BaseException as exc:  # noqa: BLE001  reported, never hangs the initiator
        q_out.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        q_in.get(timeout=120)
    finally:
        _flush_c_stdio()
        for _, reg in keep:
            try:
                agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001, S110
                pass


def _get(q, proc, timeout_s: float):
    """``q.get`` that gives up when ``proc`` died or ``timeout_s`` passed (a dead child never answers)."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"target process exited with {proc.exitcode} before answering") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"target process did not answer within {timeout_s:.0f} s") from None


def _run() -> dict:
    """The child's work; every failure becomes a string in the result."""
    out: dict = {"loads": False, "error": None, "ucx_tls": os.environ.get("UCX_TLS", "(unset)")}
    try:
        from warmlink.transport._nixl_agent import load_nixl

        api = load_nixl()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    import multiprocessing as mp

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pair = (0, 1 if gpus >= 2 else 0)
    plan = [("DRAM", 0)] + ([("VRAM", pair[1])] if gpus else [])
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_target, args=(q_out, q_in, plan), daemon=True)
    proc.start()  # its imports overlap with this agent's creation
    try:
        if gpus:  # UCX looks for a CUDA context when the agent is made: create it first
            torch.cuda.set_device(pair[0])
            torch.empty(1, device=f"cuda:{pair[0]}")
        t = time.perf_counter()
        init = api.nixl_agent("probe-initiator", api.nixl_agent_config(backends=["UCX"]))
        out["agent_create_s"] = round(time.perf_counter() - t, 3)
        if "UCX" not in init.backends:
            raise RuntimeError(f"agent has no UCX backend; plugins found: {init.get_plugin_list()}")
        out["loads"] = True
        info = _get(q_out, proc, 60)
        if "error" in info:
            raise RuntimeError(f"target agent: {info['error']}")
        remote = init.add_remote_agent(info["meta"])
        remote = remote.decode() if isinstance(remote, bytes) else remote
        out["dram"] = _move(torch, init, remote, info["kinds"]["DRAM"], "DRAM", 0)
        if gpus:
            out["vram"] = _move(torch, init, remote, info["kinds"]["VRAM"], "VRAM", pair[0])
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        q_in.put("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out


def _flush_c_stdio() -> None:
    """UCX writes its tables with C stdio, block-buffered into a pipe: flush before the marker so
    that a child killed after it (a hang in NIXL's teardown) still leaves its tables behind."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001, S110
        pass


def main(argv: list[str] | None = None) -> int:
    """Always exits 0 with the marker line last: the parent reads failures from the JSON."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        result = _run()
    except BaseException as exc:  # noqa: BLE001
        result = {"loads": False, "error": f"{type(exc).__name__}: {exc}"}
    _flush_c_stdio()
    sys.stderr.flush()
    if "--json" in argv:
        print(json.dumps(result, indent=1), flush=True)
    print(MARKER + json.dumps(result), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------------------
def probe(timeout_s: float = 60) -> dict:
    """Run the probe subprocess; {"loads", "error", "agent_create_s", "dram", "vram"?, "ucx_tls",
    "warnings", "transports"}. ``dram``/``vram`` carry ``ok``, ``error`` and ``transports``
    ({"put host->host": ["cma"], ...}, the transports UCX chose for the largest messages)."""
    ucx_tls = os.environ.get("UCX_TLS", "(unset)")
    from warmlink.transport._nixl_agent import installed_package

    if installed_package() is None:
        return {"loads": False, "error": "not installed (pip install warmlink[nixl])", "ucx_tls": ucx_tls, "warnings": []}
    env = {**os.environ, "UCX_PROTO_INFO": "y", **_NO_MULTICAST}
    warnings: list[str] = []
    proc = subprocess.Popen([sys.executable, "-m", "warmlink.transport._nixl_probe"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        warnings.append(f"NIXL probe did not exit within {timeout_s:g} s (killed)")
    line = next((ln for ln in reversed((text or "").splitlines()) if ln.startswith(MARKER)), None)
    try:
        result = json.loads(line[len(MARKER):]) if line else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        tail = " | ".join((text or "").strip().splitlines()[-3:])[-400:]
        result = {"loads": False, "error": f"probe exited {proc.returncode} without a result: {tail or '(no output)'}"}
    entries = parse_proto_info(text or "")
    transports = summarize(entries)
    for kind, memtypes in (("dram", {"host"}), ("vram", {"cuda"})):
        if isinstance(result.get(kind), dict):
            result[kind]["transports"] = {k: v for k, v in transports.items()
                                          if any(k.endswith(f"{m}->{n}") for m in memtypes for n in memtypes)}
    warnings.extend(_tcp_warnings(entries))
    result.update(ucx_tls=ucx_tls, warnings=warnings, transports=transports)
    return result


if __name__ == "__main__":
    sys.exit(main())
