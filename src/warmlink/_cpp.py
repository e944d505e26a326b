"""Host C++ compiled at first use against the PyTorch at hand, and imported as a Python module.

Why: a call that launches a kernel after reading a few words from pinned memory (ep's fresh
dispatch: the count board, its outputs sized from it, the launch) costs a Python host tens of
microseconds of interpreter work in which the GPUs idle; the same steps compiled cost a few.

A module is one source file (``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``) built by the system's
C++ compiler (``$CXX``, default ``c++``) with PyTorch's headers and libraries, once per source,
PyTorch version and Python, and kept on disk (``$WARMLINK_CACHE_DIR``, default
``~/.cache/warmlink``, under ``cpp/``): later processes import it in milliseconds. Without a
compiler, or where the build fails, ``load`` raises ``BackendUnavailable`` and the caller keeps its
Python path; nothing of warmlink needs a module built here to import or to be right.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

from warmlink import _env
from warmlink.errors import BackendUnavailable

__all__ = ["cache_dir", "compiler", "load", "target"]

BUILD_TIMEOUT_S = 600.0
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where built modules are kept: ``$WARMLINK_CACHE_DIR/cpp`` (default ``~/.cache/warmlink``)."""
    return Path(_env.cache_dir()) / "cpp"


def compiler() -> str | None:
    """The C++ compiler a build would run (``$CXX``, default ``c++``), as a path; None where it is not on PATH."""
    return shutil.which(os.environ.get("CXX") or "c++")


def target(source: str, name: str) -> tuple[str, Path]:
    """``(module name, file)`` of the module built from ``source``: one per source, PyTorch version,
    Python ABI, C library and compiler (a cache directory shared by machines, e.g. a home on NFS,
    then holds one build per kind of machine instead of one that does not import on the others)."""
    import torch

    parts = (source, torch.__version__, sysconfig.get_config_var("SOABI") or "", platform.machine(),
             "-".join(platform.libc_ver()), compiler() or "")
    key = hashlib.sha256("\0".join(parts).encode())
    module = f"{name}_{key.hexdigest()[:16]}"
    return module, cache_dir() / (module + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _command(source: Path, target: Path, module: str) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    compiler_path = compiler()
    if compiler_path is None:
        raise BackendUnavailable(f"warmlink._cpp: no C++ compiler ({os.environ.get('CXX') or 'c++'!r} is not on PATH; "
                                 "set CXX)")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [compiler_path, "-O2", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-DTORCH_EXTENSION_NAME={module}",
            *(f"-I{d}" for d in includes), str(source), "-o", str(target),
            *(f"-L{d}" for d in cpp_extension.library_paths()), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


@functools.cache
def load(source: str, name: str):
    """The module built from ``source`` (C++ text defining ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``),
    imported; built first where no process built it before. Once per process and source.

    Raises:
        BackendUnavailable: no compiler, the build failed (its output in the message) or timed out,
            or the module does not import.
    """
    module, built = target(source, name)
    with _lock:
        if not built.exists():
            _build(source, built.parent, built, module)
        spec = importlib.util.spec_from_loader(module, importlib.machinery.ExtensionFileLoader(module, str(built)))
        try:
            loaded = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
        except ImportError as exc:
            raise BackendUnavailable(f"warmlink._cpp: {built} does not import ({exc})") from exc
    return loaded


def _build(source: str, folder: Path, target: Path, module: str) -> None:
    """Compile into a file of this process's own, then rename it into place (another process may
    build the same module at once: each renames a whole file)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BackendUnavailable(f"warmlink._cpp: cannot create {folder} ({exc}); set WARMLINK_CACHE_DIR") from exc
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / f"{module}.cpp"
        src.write_text(source)
        built = Path(tmp) / target.name
        try:
            done = subprocess.run(_command(src, built, module), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise BackendUnavailable(f"warmlink._cpp: building {module} took over {BUILD_TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0:
            raise BackendUnavailable(f"warmlink._cpp: building {module} failed:\n{done.stderr[-4000:]}")
        os.replace(built, target)
