"""CUDA C++ compiled at run time for the GPU at hand (NVRTC) and its kernels launched (driver API).

Both through ``cuda.bindings`` (as warmlink._cuda), imported on first use. NVRTC ships with every
CUDA build of PyTorch (the ``nvidia-cuda-nvrtc`` wheel), so no compiler or toolkit has to be on
the machine. A cubin is compiled once per source, options, architecture and NVRTC version, and
kept on disk (``$WARMLINK_CACHE_DIR``, default ``~/.cache/warmlink``, under ``cubin/``): a second
process, or a second run, loads it in milliseconds.

A kernel takes one argument, a struct whose bytes the caller packs (``struct.pack`` into a ctypes
buffer, as ep.kernels.stream_cuda does); a launch passes their address (``cuLaunchKernel`` copies
them), so the host work of a launch is one driver call whatever the number of fields.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
import threading
from pathlib import Path

from warmlink import _cuda, _env
from warmlink.errors import BackendUnavailable

__all__ = ["Kernel", "cache_dir", "compile_cubin", "load"]

_lock = threading.Lock()


def _buffer(nbytes: int):
    """The bytes NVRTC writes a log or a cubin into (the bindings fill the object they are given)."""
    return b" " * nbytes


def cache_dir() -> Path:
    """Where compiled cubins are kept: ``$WARMLINK_CACHE_DIR/cubin`` (default ``~/.cache/warmlink``)."""
    return Path(_env.cache_dir()) / "cubin"


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise BackendUnavailable(f"warmlink._nvrtc: cuda.bindings.nvrtc cannot be imported ({exc}); install "
                                 "warmlink[cuda]") from exc
    return nvrtc


def _check_nvrtc(nvrtc, result, what: str, prog=None):
    err = result[0] if isinstance(result, tuple) else result
    if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return result[1:] if isinstance(result, tuple) else ()
    log = ""
    if prog is not None:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = _buffer(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).decode(errors="replace").strip(" \0\n")
    raise BackendUnavailable(f"warmlink._nvrtc: {what} failed ({getattr(err, 'name', err)}){': ' + log if log else ''}")


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """The cubin of ``source`` for ``arch`` (``"sm_90"``), from the disk cache or NVRTC.

    Raises:
        BackendUnavailable: no NVRTC, or the source does not compile (the log in the message).
    """
    nvrtc = _nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    opts = (f"--gpu-architecture={arch}", "-std=c++17", *options)
    key = hashlib.sha256("\0".join((source, *opts, f"nvrtc {major}.{minor}")).encode()).hexdigest()[:32]
    path = cache_dir() / f"{name}-{arch}-{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    (prog,) = _check_nvrtc(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                           "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        _check_nvrtc(nvrtc, nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded), f"compiling {name}.cu for {arch}",
                     prog)
        (size,) = _check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = _buffer(size)
        _check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        cubin = bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    try:  # another process may write the same file: each writes its own, then renames
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            f.write(cubin)
        os.replace(f.name, path)
    except OSError:
        pass  # a read-only home: compile again next time
    return cubin


class Kernel:
    """One ``extern "C" __global__`` function of a loaded module, taking one struct argument."""

    __slots__ = ("name", "address", "_function", "_launch")

    def __init__(self, name: str, function, driver) -> None:
        self.name = name
        self._function = function
        self.address = int(function)  # the CUfunction, for launches from compiled code (ep.kernels.host)
        self._launch = driver.cuLaunchKernel

    def __call__(self, grid: int, block: int, args: ctypes.Array, stream: int) -> None:
        """Launch ``grid`` blocks of ``block`` threads on ``stream`` (a ``cudaStream_t`` as an int),
        ``args`` the bytes of the kernel's argument struct."""
        params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        err = self._launch(self._function, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(params), 0)[0]
        if err:
            self.failed(err, grid, block)

    def failed(self, err, grid: int, block: int) -> None:
        """Raise the error of a launch of this kernel that returned ``err`` (a ``CUresult`` or its int)."""
        _cuda.check(err, f"cuLaunchKernel({self.name}, grid {grid}, block {block})")


@functools.cache
def _module(source: str, name: str, device: int, options: tuple[str, ...]):
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    cubin = compile_cubin(source, name, f"sm_{major}{minor}", options)
    drv = _cuda._driver()
    with _cuda.use_device(device):
        module = _cuda.check(drv.cuModuleLoadData(cubin), f"cuModuleLoadData({name}) on cuda:{device}")
    return module, drv


def load(source: str, name: str, device: int, kernels: tuple[str, ...], options: tuple[str, ...] = ()) -> dict:
    """``{kernel name: Kernel}`` of ``source`` compiled for ``device`` (once per process and device).

    Raises:
        BackendUnavailable: no NVRTC or no driver bindings, or the source does not compile.
        TransferError: the driver refuses the cubin or a kernel name.
    """
    with _lock:
        module, drv = _module(source, name, device, tuple(options))
        return {k: Kernel(k, _cuda.check(drv.cuModuleGetFunction(module, k.encode()), f"cuModuleGetFunction({k})"), drv)
                for k in kernels}
