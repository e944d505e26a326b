"""A ctypes function standing in for ``cuLaunchKernel``, for ``PackedLaunch``'s launches on CPU."""

from __future__ import annotations

import ctypes

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
FUNCTION, STREAM = 0xF00D, 0x5EA


class Driver:
    """A ``cuLaunchKernel`` that records each launch: function, grid, block, shared bytes, stream and
    each parameter's bytes (``sizes`` of them); it returns ``error``."""

    def __init__(self, sizes: list[int], error: int = 0) -> None:
        self.launches: list[tuple] = []
        self.error = error

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            values = [ctypes.string_at(params[i], size) for i, size in enumerate(sizes)]
            self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
            return self.error

        self._fn = _LAUNCH(launch)
        self.address = ctypes.cast(self._fn, ctypes.c_void_p).value
