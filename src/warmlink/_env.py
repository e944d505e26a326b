"""The only module that reads ``WARMLINK_*`` environment variables.

Each variable is parsed once, validated, and cached. Precedence everywhere is
argument > environment > default; callers write ``x if x is not None else _env.pool_enabled()``.

Variables:
    WARMLINK_POOL: ``1`` (default) pools every expensive resource; ``0`` makes every lease create
        and every release destroy, and disables the registration, mapping and plan caches. This
        is the A/B baseline every benchmark prints.
    WARMLINK_BACKEND: default transport when none is given: ``auto`` (default), ``shm``,
        ``cuda_ipc``. ``auto`` picks ``cuda_ipc`` when the tensors are on CUDA, else ``shm``.
    WARMLINK_TIMEOUT_S: default timeout in seconds for store waits and transfers (default 60).
    WARMLINK_LOG_LEVEL: level for the ``warmlink`` logger (default ``WARNING``).
    WARMLINK_NIXL_THREADS: UCX threads of each NIXL agent (``NixlLink(ucx_threads=...)``); unset
        means the link's default (see ``warmlink.transport.nixl``).
    WARMLINK_EP_COPY_STREAMS, WARMLINK_EP_SEND, WARMLINK_EP_GRAPH: the defaults of ``ep.Buffer``'s
        ``copy_streams``, ``send`` and ``graphs`` on cuda_ipc (see their functions below).
    WARMLINK_EP_STREAM_KERNEL: the kernels of a streamed ``ep.Buffer`` (``send="stream"``): ``cuda``
        (default: CUDA C++ compiled at run time, a warp group per peer, where NVRTC loads; Triton's
        otherwise) or ``triton``.
    WARMLINK_CACHE_DIR: where run-time compiled kernels are kept (default ``~/.cache/warmlink``).
    WARMLINK_SECRET: the job's secret, under which every value of the rendezvous store carries a
        MAC (``rendezvous.Store``): the same value on every process of the job, 16 to 1024 bytes
        of UTF-8 (e.g. ``python -c 'import secrets; print(secrets.token_hex(32))'``). Its value is
        never printed: errors and ``warmlink doctor`` say only whether it is set and its length.

``check_all`` parses every one of them at once (the CLI calls it before it starts anything, and
``warmlink doctor`` reports it), and names any ``WARMLINK_*`` variable that is not one of them.
"""

from __future__ import annotations

import functools
import os

from warmlink.errors import ConfigError

__all__ = ["pool_enabled", "default_backend", "default_timeout_s", "log_level", "nixl_threads", "ep_copy_streams",
           "ep_send", "ep_graph", "ep_stream_kernel", "ep_host", "cache_dir", "secret", "check_secret", "shown", "VARIABLES", "check_all", "clear_cache"]

_BACKENDS = ("auto", "shm", "cuda_ipc", "nixl")
MIN_SECRET_BYTES = 16  # a guessable secret would be no secret: refuse short ones
MAX_SECRET_BYTES = 1024
_HIDDEN = ("SECRET",)  # variables whose value is never shown, whatever the name's spelling


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


@functools.cache
def pool_enabled() -> bool:
    """``WARMLINK_POOL``: whether pooling and caching are on (default True)."""
    value = _raw("WARMLINK_POOL")
    if value is None:
        return True
    if value.lower() in ("1", "true", "on", "yes"):
        return True
    if value.lower() in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"WARMLINK_POOL={value!r} is not a switch; expected 0 or 1")


@functools.cache
def default_backend() -> str:
    """``WARMLINK_BACKEND``: the transport used when none is passed (default ``auto``)."""
    value = _raw("WARMLINK_BACKEND") or "auto"
    if value not in _BACKENDS:
        raise ConfigError(f"WARMLINK_BACKEND={value!r} is unknown; expected one of {list(_BACKENDS)}")
    return value


@functools.cache
def default_timeout_s() -> float:
    """``WARMLINK_TIMEOUT_S``: default timeout for waits and transfers, in seconds (default 60)."""
    value = _raw("WARMLINK_TIMEOUT_S")
    if value is None:
        return 60.0
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"WARMLINK_TIMEOUT_S={value!r} is not a number; expected seconds > 0") from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"WARMLINK_TIMEOUT_S={value!r} out of range; expected finite seconds > 0")
    return seconds


def timeout_arg(owner: str, value) -> float:
    """A ``timeout_s`` argument of ``owner`` (e.g. "Receiver"): finite seconds > 0, or None for
    ``default_timeout_s()``."""
    if value is None:
        return default_timeout_s()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{owner}: timeout_s={value!r}; expected finite seconds > 0, or None (WARMLINK_TIMEOUT_S, "
                          "default 60)")
    return float(value)


def count_arg(owner: str, name: str, value, least: int) -> int:
    """An int argument ``name`` of ``owner`` that must be at least ``least`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{owner}: {name}={value!r}; expected an int >= {least}")
    return value


@functools.cache
def log_level() -> str:
    """``WARMLINK_LOG_LEVEL``: the ``warmlink`` logger's level (default ``WARNING``)."""
    value = (_raw("WARMLINK_LOG_LEVEL") or "WARNING").upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"WARMLINK_LOG_LEVEL={value!r} is unknown; expected DEBUG, INFO, WARNING or ERROR")
    return value


@functools.cache
def nixl_threads() -> int | None:
    """``WARMLINK_NIXL_THREADS``: UCX threads per NIXL agent, or None when unset."""
    value = _raw("WARMLINK_NIXL_THREADS")
    if value is None:
        return None
    if not value.isdigit() or int(value) > 64:
        raise ConfigError(f"WARMLINK_NIXL_THREADS={value!r} out of range; expected an integer from 0 to 64")
    return int(value)


def ep_copy_streams() -> str:
    """``WARMLINK_EP_COPY_STREAMS``, the default of ``ep.Buffer(copy_streams=...)``: ``"one"``
    (default: every destination's copies on one stream, in issue order) or ``"per-peer"`` (one copy
    stream per destination)."""
    value = _raw("WARMLINK_EP_COPY_STREAMS") or "one"
    if value not in ("per-peer", "one"):
        raise ConfigError(f"WARMLINK_EP_COPY_STREAMS={value!r} is unknown; expected 'per-peer' or 'one'")
    return value


def ep_send() -> str:
    """``WARMLINK_EP_SEND``, the default of ``ep.Buffer(send=...)`` on cuda_ipc: how a dispatch
    without a receive hook moves its rows: ``"sm"`` (default: kernels trade the counts and store
    the rows into the peers, ep.paths.sm_pushes Note [SM sends]), ``"copy"`` (the host meets the peers,
    then the copy engines push) or ``"stream"`` (the rows stream through a fixed space, ep.paths.streamed)."""
    value = _raw("WARMLINK_EP_SEND") or "sm"
    if value not in ("sm", "copy", "stream"):
        raise ConfigError(f"WARMLINK_EP_SEND={value!r} is unknown; expected 'sm', 'copy' or 'stream'")
    return value


def ep_graph() -> bool:
    """``WARMLINK_EP_GRAPH``, the default of ``ep.Buffer(graphs=...)`` on cuda_ipc: ``1`` (default)
    replays a dispatch's send launches as CUDA graphs after its first call per shape (ep.paths.sm_pushes,
    Note [Fresh send graph]); ``0`` launches them one by one every call."""
    value = _raw("WARMLINK_EP_GRAPH") or "1"
    if value not in ("0", "1"):
        raise ConfigError(f"WARMLINK_EP_GRAPH={value!r} is not a switch; expected '1' or '0'")
    return value == "1"


def ep_stream_kernel() -> str:
    """``WARMLINK_EP_STREAM_KERNEL``: ``"cuda"`` (default) or ``"triton"``, the kernels of a streamed
    Buffer (ep.kernels.stream_cuda, Note [Warp groups])."""
    value = _raw("WARMLINK_EP_STREAM_KERNEL") or "cuda"
    if value not in ("cuda", "triton"):
        raise ConfigError(f"WARMLINK_EP_STREAM_KERNEL={value!r} is unknown; expected 'cuda' or 'triton'")
    return value


def ep_host() -> str:
    """``WARMLINK_EP_HOST``: ``"cpp"`` (default) or ``"python"``, the host steps of ep's fresh dispatch
    between the GPUs (ep.kernels.host): compiled at first use where a C++ compiler is, else Python's."""
    value = _raw("WARMLINK_EP_HOST") or "cpp"
    if value not in ("cpp", "python"):
        raise ConfigError(f"WARMLINK_EP_HOST={value!r} is unknown; expected 'cpp' or 'python'")
    return value


def cache_dir() -> str:
    """``WARMLINK_CACHE_DIR``: the directory of warmlink's on-disk caches (default ``~/.cache/warmlink``),
    an absolute path (a relative one would move with each process's working directory)."""
    value = _raw("WARMLINK_CACHE_DIR")
    if value is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "warmlink")
    if not os.path.isabs(value):
        raise ConfigError(f"WARMLINK_CACHE_DIR={value!r} is not an absolute path; expected one")
    return value


def _secret_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"has type {type(value).__name__}"
    try:
        nbytes = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not UTF-8 text"  # lone surrogates: nothing another process could be given
    return None if MIN_SECRET_BYTES <= nbytes <= MAX_SECRET_BYTES else f"has {nbytes} bytes"


def check_secret(value: object, where: str) -> str:
    """``value`` when it is a valid job secret (a str of 16 to 1024 UTF-8 bytes), else ConfigError.
    The message gives its type and length, never the value."""
    problem = _secret_problem(value)
    if problem is not None:
        raise ConfigError(f"{where}: secret {problem}; expected a str of {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} "
                          "bytes of UTF-8 (e.g. secrets.token_hex(32))")
    return value  # type: ignore[return-value]


@functools.cache
def secret() -> str | None:
    """``WARMLINK_SECRET``: the job's store secret, or None when unset (see ``rendezvous.Store``)."""
    value = _raw("WARMLINK_SECRET")
    problem = None if value is None else _secret_problem(value)
    if problem is not None:
        raise ConfigError(f"WARMLINK_SECRET={shown('WARMLINK_SECRET', value)!r} {problem}; expected "
                          f"{MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes of UTF-8 (e.g. secrets.token_hex(32))")
    return value


def shown(name: str, value: str) -> str:
    """How ``name=value`` may be printed: the value of a secret is replaced by its length."""
    return f"<hidden, {len(value)} characters>" if any(h in name.upper() for h in _HIDDEN) else value


# Every variable this module reads, with its parser; a test holds this to the ``_raw`` calls above.
VARIABLES = {
    "WARMLINK_POOL": pool_enabled, "WARMLINK_BACKEND": default_backend, "WARMLINK_TIMEOUT_S": default_timeout_s,
    "WARMLINK_LOG_LEVEL": log_level, "WARMLINK_NIXL_THREADS": nixl_threads,
    "WARMLINK_EP_COPY_STREAMS": ep_copy_streams, "WARMLINK_EP_SEND": ep_send, "WARMLINK_EP_GRAPH": ep_graph,
    "WARMLINK_EP_STREAM_KERNEL": ep_stream_kernel, "WARMLINK_EP_HOST": ep_host, "WARMLINK_CACHE_DIR": cache_dir,
    "WARMLINK_SECRET": secret,
}


def check_all(unknown: bool = False) -> dict[str, ConfigError]:
    """Parse every variable of ``VARIABLES`` from the environment as it is now (not the cached
    values): name -> error, in name order, for each that is refused; with ``unknown``, also for
    each set ``WARMLINK_*`` variable that warmlink does not read (a misspelled name does nothing)."""
    errors = {}
    for name in sorted(VARIABLES):
        parse = VARIABLES[name]
        try:
            getattr(parse, "__wrapped__", parse)()  # past functools.cache: the environment now
        except ConfigError as e:
            errors[name] = e
    if unknown:
        for name in sorted(n for n in os.environ if n.startswith("WARMLINK_") and n not in VARIABLES):
            value = shown(name, os.environ[name])  # a misspelled secret's name still hides its value
            errors[name] = ConfigError(f"{name}={value!r} is not a warmlink variable; expected one of {sorted(VARIABLES)}")
    return errors


def clear_cache() -> None:
    """Forget parsed values so that the next call reads the environment again (tests, bench A/B)."""
    for fn in (pool_enabled, default_backend, default_timeout_s, log_level, nixl_threads, secret):
        fn.cache_clear()
