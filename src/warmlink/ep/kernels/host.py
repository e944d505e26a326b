"""The compiled host steps of a fresh dispatch (``host.cpp`` beside this module, built by
warmlink._cpp at first use): where they run, ``get_dispatch_layout``'s launch, the count
exchange's launch and a streamed dispatch's outputs-and-launch after the count board are one call
each instead of tens of Python lines (ep.kernels.layout_cuda, ep.paths.sm_pushes and
ep.kernels.stream_cuda use them, with the Python steps kept where they do not run: no compiler,
``WARMLINK_EP_HOST=python``).

Why: between the count exchange and the streamed kernel's launch the GPUs idle while the host
reads the board, allocates the outputs and launches; and with DeepEP's way of calling (a layout,
then a dispatch, each on an idle GPU) the layout's host time is idle time too. In Python each
torch allocation, struct pack and driver call costs several microseconds on the GPU machines'
hosts, and tens once the interpreter's other work has left the caches cold.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from importlib import resources

log = logging.getLogger("warmlink.ep")

__all__ = ["LATE", "LAUNCHED", "NAME", "OUT_OF_RANGE", "describe", "front_addresses", "launch_address", "module"]

# host.cpp's fresh_launch statuses
LAUNCHED, LATE, OUT_OF_RANGE, DRIVER_ERROR = 0, 1, 2, 3


NAME = "warmlink_ep_host"


def _source() -> str:
    return resources.files("warmlink.ep.kernels").joinpath("host.cpp").read_text()


def describe() -> str:
    """Whether the compiled steps run on this machine, in one line (``warmlink doctor``); builds nothing."""
    from warmlink import _cpp, _env
    from warmlink.errors import ConfigError

    try:
        if _env.ep_host() != "cpp":
            return "Python (WARMLINK_EP_HOST=python)"
        compiler = _cpp.compiler()
        if compiler is None:
            return "Python (no C++ compiler: set CXX, or install one)"
        built = _cpp.target(_source(), NAME)[1]
    except ConfigError as exc:  # a WARMLINK_* variable the doctor names too
        return f"unknown ({exc})"
    return f"compiled, built in {built.parent}" if built.exists() else f"compiled, built at first use by {compiler}"


@functools.cache
def module():
    """The built module, or None where it is not to run (``WARMLINK_EP_HOST=python``) or cannot be
    built (a warning says why, once per process)."""
    from warmlink import _cpp, _env
    from warmlink.errors import BackendUnavailable

    if _env.ep_host() != "cpp":
        return None
    try:
        return _cpp.load(_source(), NAME)
    except BackendUnavailable as exc:
        log.warning("ep: the compiled host steps are unavailable (%s): the Python ones run", exc)
        return None


def _driver_address(name: str) -> int:
    return ctypes.cast(getattr(ctypes.CDLL("libcuda.so.1"), name), ctypes.c_void_p).value


@functools.cache
def launch_address() -> int:
    """The address of the driver's ``cuLaunchKernel`` (the compiled steps launch through it)."""
    return _driver_address("cuLaunchKernel")


@functools.cache
def front_addresses() -> tuple[int, int]:
    """The addresses of ``cuGraphLaunch`` and ``cuEventRecord`` (``front_launch``'s)."""
    return tuple(_driver_address(name) for name in ("cuGraphLaunch", "cuEventRecord"))
