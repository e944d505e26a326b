"""One NIXL agent, wrapped: the only module of warmlink that calls NIXL.

NIXL's Python API returns status strings (``"DONE"``, ``"PROC"``, ``"ERR"``), logs some failures
instead of raising, and raises its own exception types (``nixlRemoteDisconnectError``, ...). This
wrapper turns all of that into warmlink errors and owns the agent's lock: an agent made without a
listener thread runs in NIXL's ``NIXL_THREAD_SYNC_NONE`` mode and must not be entered by two
threads at once.

The package is ``nixl-cu13`` on PyPI (``pip install warmlink[nixl]``); it installs the module
``nixl_cu13`` (the ``nixl`` meta-package, where present, provides ``nixl``). Neither is imported
until an agent is made.

# Note [UCX settings on a host without GPU]
Nothing has to be set. With nixl-cu13 1.5.1 on a machine without CUDA, the UCX backend loads,
registers DRAM and moves it between two processes of one host. ``UCX_PROTO_INFO=y`` shows what UCX
picks there: ``cma/memory`` zero-copy (Linux cross-memory attach) for the data of every ``READ``
(``ucp_get``) and ``WRITE`` (``ucp_put``), and ``tcp/lo`` for its control messages. Posting a
transfer then copies inline: ``read``/``write`` return after the bytes moved (256 MiB: ~0.1 s).
``UCX_TLS=tcp,self`` (for hosts where CMA is not allowed) also passes the tests. warmlink writes
no ``UCX_*`` variable; users set ``UCX_TLS`` (and ``UCX_NET_DEVICES`` on RDMA clusters) before the
link is made.

# Note [NIXL's progress thread]
NIXL's Python API makes every agent with a progress thread that wakes at least every ``pthrDelay``
microseconds besides when UCX signals work, and sets that to 0: the thread polls without pause and
an idle agent takes a whole core (measured: 2.0 s of CPU in 2 s of sleep, nixl-cu13 1.5.1). Every
process with a NIXL link then spins one core for its lifetime; on a host running a trainer and
several engine processes the spinning threads starve the processes that move bytes (8 fan-out
replicas on a 2-core host: 70% of the CPU in the kernel, in the threads' poll and eventfd reads).
The thread still wakes at once on UCX's events (it arms the worker and polls its event fd); the
timeout only covers wakeups UCX misses, so the agent is made with ``PROGRESS_WAKEUP_US`` (an
idle agent then takes 3% of a core). The API has no parameter for it: the agent is constructed
with NIXL's own config object amended (``_agent_with_wakeup``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from secrets import token_hex

from warmlink.errors import (
    BackendUnavailable,
    MetadataError,
    PeerLostError,
    TransferError,
)

log = logging.getLogger("warmlink.transport")

__all__ = ["Agent", "PROGRESS_WAKEUP_US", "installed_package", "load_nixl", "make_agent_name"]

_MODULES = ("nixl_cu13._api", "nixl._api")
PROGRESS_WAKEUP_US = 1000  # Note [NIXL's progress thread]
_MAKING = threading.Lock()


def installed_package() -> str | None:
    """The NIXL package that is installed (``nixl_cu13`` or ``nixl``), without importing it; None
    when neither is."""
    import importlib.util

    for name in _MODULES:
        package = name.split(".")[0]
        try:
            if importlib.util.find_spec(package) is not None:
                return package
        except (ImportError, ValueError):
            continue
    return None


def load_nixl():
    """The NIXL ``_api`` module (``nixl_cu13`` first, then ``nixl``).

    Raises:
        BackendUnavailable: neither imports; the message says what each import raised.
    """
    import importlib

    problems = []
    for name in _MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:  # also OSError-like loader failures surface as ImportError
            problems.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent at INFO; its variable still rules
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise BackendUnavailable(
        "NixlLink: NIXL cannot load (" + "; ".join(problems) + "); install it with "
        "`pip install warmlink[nixl]` (the nixl-cu13 package)"
    )


def make_agent_name() -> str:
    """``wl-<host>-<pid>-<random>``: unique per link across a cluster, within the schema's pattern."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
    return f"wl-{host}-{os.getpid()}-{token_hex(6)}"


def _wrap(exc: BaseException, what: str, peer: str | None = None) -> Exception:
    kind = type(exc).__name__
    if kind == "nixlRemoteDisconnectError":
        return PeerLostError(f"NixlLink.{what}: peer agent {peer!r} disconnected ({kind})")
    return TransferError(f"NixlLink.{what}: NIXL raised {kind}: {exc}" + (f" (peer agent {peer!r})" if peer else ""))


def _agent_with_wakeup(api, name: str, wakeup_us: int):
    """``api.nixl_agent(name, ...)`` (no backend yet, telemetry on) whose progress thread wakes at
    least every ``wakeup_us`` microseconds instead of spinning (Note [NIXL's progress thread]).

    ``nixl_agent.__init__`` builds NIXL's config object and the native agent from its module's
    ``nixlBind``; for the call it sees a stand-in whose ``nixlAgent`` amends the config, for this
    thread only, so that an agent another thread makes meanwhile (a vLLM connector's) is NIXL's own."""
    real, me = api.nixlBind, threading.get_ident()

    class Bindings:
        def __getattr__(self, attr):
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name, config):  # noqa: N802 - NIXL's name
            if threading.get_ident() == me and hasattr(config, "pthrDelay"):
                config.pthrDelay = wakeup_us
            return real.nixlAgent(agent_name, config)

    with _MAKING:
        api.nixlBind = Bindings()
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=[], capture_telemetry=True))
        finally:
            api.nixlBind = real


class Agent:
    """A NIXL agent with the UCX backend, and the remote agents loaded into it (counted).

    Args:
        name: the agent's name (see ``make_agent_name``).
        ucx_params: the UCX backend's parameters (strings, as NIXL takes them), e.g.
            ``{"num_threads": "4", "split_batch_size": "16"}``; None or empty: NIXL's defaults.

    Costs: creating one takes 0.4 s here (1.18 s on the H200 machine): keep it (the pool does).
    """

    def __init__(self, name: str, ucx_params: dict[str, str] | None = None) -> None:
        api = load_nixl()
        try:
            self._agent = _agent_with_wakeup(api, name, PROGRESS_WAKEUP_US)
            self._agent.create_backend("UCX", dict(ucx_params or {}))
        except Exception as exc:
            raise BackendUnavailable(f"NixlLink: cannot create NIXL agent {name!r}: {type(exc).__name__}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise BackendUnavailable(
                f"NixlLink: NIXL agent {name!r} has no UCX backend; plugins found: {self._agent.get_plugin_list()}"
            )
        self.name = name
        self.lock = threading.Lock()
        self._remote_refs: dict[str, int] = {}
        self.closed = False

    # -- local memory ------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, mem: str = "DRAM", device: int = 0) -> tuple[object, str]:
        """Register ``[addr, addr + nbytes)`` of ``mem`` (``"DRAM"``, or ``"VRAM"`` on ``device``);
        returns (registration, metadata hex).

        The metadata is this agent's partial metadata for that one registration plus its
        connection info: what a peer needs to reach exactly this memory.
        """
        with self.lock:
            try:
                reg = self._agent.register_memory([(addr, nbytes, device, "")], mem)
                meta = self._agent.get_partial_agent_metadata(reg, True)
            except Exception as exc:
                raise _wrap(exc, "register") from exc
        return reg, bytes(meta).hex()

    def deregister(self, reg) -> None:
        with self.lock:
            if not self.closed:
                self._agent.deregister_memory(reg)

    # -- remote agents -----------------------------------------------------------------------------
    def load_remote(self, meta_hex: str, expected: str, peer_key: str) -> None:
        """Load a peer's metadata (``add_remote_agent``); it must name agent ``expected``.

        Raises:
            MetadataError: NIXL cannot parse it, or it names another agent.
        """
        with self.lock:
            try:
                name = self._agent.add_remote_agent(bytes.fromhex(meta_hex))
            except Exception as exc:
                raise MetadataError(
                    f"region descriptor from peer={peer_key!r}: region.agent_meta is not NIXL agent metadata "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != expected:
                if name not in self._remote_refs:
                    self._agent.remove_remote_agent(name)
                raise MetadataError(
                    f"region descriptor from peer={peer_key!r}: region.agent_meta describes agent {name!r}; "
                    f"expected region.agent={expected!r}"
                )

    def hold_remote(self, name: str) -> None:
        with self.lock:
            self._remote_refs[name] = self._remote_refs.get(name, 0) + 1

    def drop_remote(self, name: str) -> None:
        """Drop one hold; the last one disconnects (``remove_remote_agent``)."""
        with self.lock:
            left = self._remote_refs.get(name, 0) - 1
            if left > 0:
                self._remote_refs[name] = left
                return
            self._remote_refs.pop(name, None)
            if not self.closed:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as exc:  # noqa: BLE001  never loaded (metadata refused) or already gone
                    log.debug("nixl remove_remote_agent failed", extra={"agent": name, "error": repr(exc)})

    def check_remote(self, name: str, addr: int, nbytes: int, mem: str, device: int, peer_key: str) -> None:
        """Raise MetadataError unless agent ``name`` registered ``[addr, addr + nbytes)`` of ``mem``."""
        with self.lock:
            try:
                handle = self._agent.prep_xfer_dlist(name, [(addr, nbytes, max(device, 0))], mem)
            except Exception as exc:
                raise MetadataError(
                    f"region descriptor from peer={peer_key!r}: region.addr={addr} nbytes={nbytes} is not memory "
                    f"that agent {name!r} registered ({type(exc).__name__})"
                ) from exc
            handle.release()

    # -- transfers ---------------------------------------------------------------------------------
    def prep_dlist(self, agent: str, rows, mem: str) -> object:
        """A prepared descriptor list of ``mem`` rows ``(addr, nbytes, device)``: ``agent`` is ``""``
        for local memory, else a remote agent's name."""
        with self.lock:
            try:
                return self._agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", rows, mem)
            except Exception as exc:
                raise _wrap(exc, "prepare", agent or None) from exc

    def make_xfer(self, op: str, local, remote, num_descs: int, peer: str) -> object:
        idx = list(range(num_descs))
        with self.lock:
            try:
                return self._agent.make_prepped_xfer(op, local, idx, remote, idx)
            except Exception as exc:
                raise _wrap(exc, op.lower(), peer) from exc

    def post(self, xfer, peer: str, notify: bytes = b"") -> bool:
        """Start (or restart) a transfer; True when it already finished. A non-empty ``notify``
        reaches the peer agent as a notification once the transfer's bytes have landed."""
        with self.lock:
            try:
                state = self._agent.transfer(xfer, notify)
            except Exception as exc:
                raise _wrap(exc, "post", peer) from exc
        if state == "ERR":
            raise TransferError(f"NixlLink.post: NIXL refused the transfer to peer agent {peer!r}")
        return state == "DONE"

    def state(self, xfer, peer: str) -> bool:
        """True when done; raises PeerLostError or TransferError on failure."""
        with self.lock:
            try:
                state = self._agent.check_xfer_state(xfer)
            except Exception as exc:
                raise _wrap(exc, "wait", peer) from exc
        if state == "ERR":
            raise TransferError(f"NixlLink.wait: NIXL reports the transfer with peer agent {peer!r} failed")
        return state == "DONE"

    def duration_s(self, xfer) -> float | None:
        """How long the last run of ``xfer`` took, by NIXL's telemetry (post to completion);
        None when NIXL cannot say."""
        with self.lock:
            try:
                return self._agent.get_xfer_telemetry(xfer).xferDuration * 1e-6
            except Exception:  # noqa: BLE001  telemetry is advisory
                return None

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sending agent name."""
        with self.lock:
            try:
                got = self._agent.get_new_notifs()
            except Exception as exc:
                raise _wrap(exc, "notifications") from exc
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in got.items()}

    def release(self, handle) -> None:
        """Release a prepared list or transfer handle (NIXL cancels a transfer still running)."""
        with self.lock:
            if self.closed:
                return
            try:
                handle.release()
            except Exception as exc:  # noqa: BLE001  a request NIXL cannot cancel stays allocated
                log.warning("nixl handle release failed", extra={"agent": self.name, "error": repr(exc)})

    def close(self) -> None:
        """Forget the agent. NIXL has no destroy call: the C++ agent goes with the last reference."""
        with self.lock:
            self.closed = True
            self._remote_refs.clear()
            self._agent = None
