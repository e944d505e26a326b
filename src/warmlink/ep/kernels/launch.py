"""Launch a Triton kernel again without Triton's per-call argument binding.

``JITFunction.run`` binds the arguments, specializes each one, hashes a key and looks the compiled
kernel up on every call: 26-47 us of host time per launch on the bench host, where a torch launch
costs 18 (``tools/ep_launch_cost.py``). ep launches up to five kernels per call, some of them on
the path to the first copy. ``FastLaunch`` keys the compiled kernel by the same specialization
Triton computes (its native ``specialize_impl`` on every runtime argument), the constexprs and the
device; the first call of a key compiles and launches through Triton, later ones launch that
compiled kernel directly, as ``JITFunction.run`` itself does once it has found it.
"""

from __future__ import annotations

import torch

__all__ = ["FastLaunch", "capturing", "current_stream", "launch", "on_stream"]

# The handle of the current stream: the call Triton's own launcher makes (its torch driver's
# get_current_stream), 1-2 us of host time where ``torch.cuda.current_stream(d).cuda_stream``
# costs 3-6 us, and ep asks for it several times per call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where there is no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def current_stream(device: int) -> int:
    """``cudaStream_t`` of ``device``'s current torch stream, as an int."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


class on_stream:  # noqa: N801 - used like torch.cuda.stream
    """``with on_stream(stream):`` runs the block with ``stream`` (a ``torch.cuda.Stream``) current,
    as ``torch.cuda.stream(stream)`` does, for a few us of host time where that costs 10-20 (its
    StreamContext looks the devices up and builds Stream objects); the receive work is launched
    inside one on the way to the last byte. Falls back to it when the stream is on another device
    than the current one, or without CUDA (fakes in tests)."""

    __slots__ = ("_to", "_saved", "_plain")

    def __init__(self, stream) -> None:
        self._plain = None
        if _set_stream is None or _get_device() != stream.device_index:
            self._plain = torch.cuda.stream(stream)
        else:
            self._to = (stream.stream_id, stream.device_index, stream.device_type)

    def __enter__(self) -> None:
        if self._plain is not None:
            self._plain.__enter__()
            return
        self._saved = _get_stream(self._to[1])
        _set_stream(*self._to)

    def __exit__(self, *exc) -> None:
        if self._plain is not None:
            self._plain.__exit__(*exc)
        else:
            _set_stream(*self._saved)


class FastLaunch:
    """A ``triton.jit`` kernel whose constexpr parameters come last in its signature."""

    def __init__(self, jit) -> None:
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl

        self.jit = jit
        self._knobs = knobs
        self._specialize = native_specialize_impl
        self._cache: dict[tuple, object] = {}

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 0) -> None:
        device = _get_device() if _get_device is not None else torch.cuda.current_device()  # 0.3 us, not 2-4
        backend = self.jit.device_caches[device][3]
        spec = self._specialize
        key = (device, num_warps, tuple(constexprs.values()), tuple(spec(backend, a, False, True, True) for a in args))
        compiled = self._cache.get(key)
        if compiled is None:
            names = self.jit.arg_names[len(args):]
            if list(constexprs) != names:
                raise TypeError(f"FastLaunch({getattr(self.jit, '__name__', 'kernel')}): constexprs {list(constexprs)}; expected {names} in order")
            compiled = self.jit[grid](*args, **constexprs, **({"num_warps": num_warps} if num_warps else {}))
            self._cache[key] = compiled.result() if hasattr(compiled, "result") else compiled
            return
        g = (*grid, 1, 1)
        values = (*args, *constexprs.values())
        stream = current_stream(device)
        enter, exit_ = self._knobs.runtime.launch_enter_hook, self._knobs.runtime.launch_exit_hook
        meta = compiled.launch_metadata(g[:3], stream, *values) if enter is not None else None
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta, enter, exit_, *values)


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 0) -> None:
    """Launch ``kernel`` (a ``FastLaunch`` or a plain, e.g. interpreted, Triton kernel);
    ``num_warps`` 0: Triton's default."""
    if isinstance(kernel, FastLaunch):
        kernel(grid, args, constexprs, num_warps)
    else:
        kernel[grid](*args, **constexprs, **({"num_warps": num_warps} if num_warps else {}))
