"""Launch a Triton kernel again without Triton's per-call argument binding.

``JITFunction.run`` binds the arguments, specializes each one, hashes a key and looks the compiled
kernel up on every call: 26-47 us of host time per launch on the bench host, where a torch launch
costs 18 (``tools/ep_launch_cost.py``). ep launches up to five kernels per call, some of them on
the path to the first copy. ``FastLaunch`` keys the compiled kernel by the same specialization
Triton computes (its native ``specialize_impl`` on every runtime argument), the constexprs and the
device; the first call of a key compiles and launches through Triton, later ones launch that
compiled kernel directly, as ``JITFunction.run`` itself does once it has found it.

That still costs Triton's launcher (it reads each argument from Python) and a specialization per
argument: 15-25 us of an eager low-latency call's host time. ``FastLaunch.prepare`` packs a
compiled kernel's parameters once into a ``PackedLaunch``, which ``host.cpp``'s
``launch_prepared`` patches with a call's varying values (addresses, sizes) and hands to
``cuLaunchKernel``: one compiled call. It checks what the compiled kernel assumed of those values
(a pointer 16-byte aligned, an int within 32 bits) and declines a call that breaks it, which then
launches through ``FastLaunch``. A call may also pack a second kernel's launch with the same
arguments, made later by ``launch_pending``: a low-latency send packs its receive hook's.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["FastLaunch", "PackedLaunch", "capturing", "current_stream", "launch", "on_stream"]

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

    def _key(self, args: tuple, constexprs: dict, num_warps: int) -> tuple:
        device = _get_device() if _get_device is not None else torch.cuda.current_device()  # 0.3 us, not 2-4
        backend = self.jit.device_caches[device][3]
        spec = self._specialize
        return (device, num_warps, tuple(constexprs.values()), tuple(spec(backend, a, False, True, True) for a in args))

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 0) -> None:
        key = self._key(args, constexprs, num_warps)
        device = key[0]
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

    def prepare(self, args: tuple, constexprs: dict, num_warps: int, varying: frozenset[str]) -> "PackedLaunch | None":
        """The launch of the kernel this ``FastLaunch`` compiled for ``args`` (called once with them
        already), its parameters packed; the parameters named in ``varying`` are read from each
        call's args (``PackedLaunch.__call__``), the others are fixed. None where it cannot be prepared:
        no compiled host steps, a kernel that needs what Triton's launcher adds (scratch memory,
        a cooperative or clustered launch), or a varying int that Triton specializes on its value
        (name it in ``triton.jit``'s ``do_not_specialize``). Tensors of a varying arg must keep the
        dtype they had here: the caller keys its packed launches by it."""
        from warmlink.ep.kernels import host

        names = self.jit.arg_names
        unknown = varying - set(names[:len(args)])
        if unknown:
            raise ValueError(f"FastLaunch.prepare({getattr(self.jit, '__name__', 'kernel')}): {sorted(unknown)} are not "
                             "among its runtime parameters")
        varying = {names.index(name) for name in varying}
        key = self._key(args, constexprs, num_warps)
        compiled = self._cache.get(key)
        module = host.module()
        if compiled is None or module is None or getattr(compiled, "function", None) is None:
            return None
        meta = compiled.metadata
        if (getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
                or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False)
                or getattr(meta, "num_ctas", 1) != 1):
            return None
        types = list(compiled.src.signature.values())[:len(args)]
        general_ints = {i if isinstance(i, int) else names.index(i) for i in self.jit.do_not_specialize}
        params = []  # (value, size, check, argument or -1) of each parameter the compiled kernel takes
        for i, (arg, kind) in enumerate(zip(args, types, strict=True)):
            if kind == "constexpr":
                if i in varying:
                    return None
                continue
            if kind.startswith("*"):
                aligned = key[3][i][1] == "D"  # the kernel was compiled assuming a 16-byte aligned address
                params.append((arg.data_ptr() if isinstance(arg, torch.Tensor) else int(arg), 8,
                               CHECK_ALIGNED if aligned else CHECK_NONE, i if i in varying else -1))
            elif kind in ("i32", "i64", "u64"):
                if i in varying and i not in general_ints:
                    return None
                params.append((int(arg), 4 if kind == "i32" else 8, CHECK_INT32 if kind == "i32" else CHECK_NONE,
                               i if i in varying else -1))
            else:
                return None
        layout = param_layout(compiled.function)
        if layout is None or len(layout) < len(params) or any(size != 8 for _, size in layout[len(params):]):
            return None  # the trailing ones: the scratch pointers Triton adds, null where no scratch is used
        if any(size != want[1] for (_, size), want in zip(layout, params)):
            return None
        params += [(0, 8, CHECK_NONE, -1)] * (len(layout) - len(params))
        return PackedLaunch(host.launch_address(), compiled.function, 32 * meta.num_warps, meta.shared,
                            [offset for offset, _ in layout], params, module,
                            getattr(self.jit, "__name__", "kernel"), hooks=self._knobs.runtime)


def param_layout(function: int) -> list[tuple[int, int]] | None:
    """``(offset, size)`` of each parameter of a loaded kernel (``cuFuncGetParamInfo``, CUDA 12.4),
    or None where the driver cannot say."""
    try:
        info = ctypes.CDLL("libcuda.so.1").cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    layout = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while len(layout) <= PLAN_MAX_PARAMS and info(function, len(layout), ctypes.byref(offset), ctypes.byref(size)) == 0:
        layout.append((offset.value, size.value))
    return layout if len(layout) <= PLAN_MAX_PARAMS else None


# A PackedLaunch's plan, int64 words read by host.cpp's launch_prepared (the same constants there)
PLAN_MAX_PARAMS, PLAN_MAX_BYTES = 48, 512
_HEADER, _OFFSETS, _VARY, _BUFFER = 0, 8, 8 + PLAN_MAX_PARAMS, 8 + 2 * PLAN_MAX_PARAMS
PLAN_WORDS = _BUFFER + 2 * PLAN_MAX_BYTES // 8  # the packed parameters, then a pending launch's
CHECK_NONE, CHECK_ALIGNED, CHECK_INT32 = 0, 1, 2  # what launch_prepared checks of a varying value


class PackedLaunch:
    """A kernel's launch with its parameters packed once; a call gives its arguments, from which
    the varying parameters are read, and the grid.

    Args:
        launch_fn: the address of ``cuLaunchKernel``. function: the ``CUfunction``.
        threads, shared_bytes: the block's threads and dynamic shared memory.
        offsets: each parameter's byte offset in the kernel's parameter buffer.
        params: ``(value, size, check, argument)`` per parameter: its value now (the fixed ones'
            for good), 4 or 8 bytes, ``CHECK_*``, and the index of the call's argument it is read
            from (a tensor's address, or an int), -1 for a fixed one.
        compiled: ``host.cpp``'s module (``ep.kernels.host.module()``), whose ``launch_prepared``
            and ``launch_pending`` make the launches (kept as ``compiled``: a caller may launch
            ``plan()`` through another of its calls).
        name: the kernel's, for errors.
        hooks: Triton's ``knobs.runtime``: while a launch hook is set there (proton and other
            Triton-level profilers), every call declines, so that Triton's launcher calls the hook.
    """

    __slots__ = ("_plan", "_addr", "_launcher", "_pending", "compiled", "name", "_hooks")

    def __init__(self, launch_fn: int, function: int, threads: int, shared_bytes: int, offsets: list[int],
                 params: list[tuple[int, int, int, int]], compiled, name: str, hooks=None) -> None:
        if len(params) > PLAN_MAX_PARAMS or max((o + 8 for o in offsets), default=0) > PLAN_MAX_BYTES:
            raise ValueError(f"PackedLaunch({name}): {len(params)} parameters over {PLAN_MAX_PARAMS}, or over "
                             f"{PLAN_MAX_BYTES} bytes")
        plan = (ctypes.c_int64 * PLAN_WORDS)()
        varying = [(i, size, check, arg) for i, (_, size, check, arg) in enumerate(params) if arg >= 0]
        plan[_HEADER:_HEADER + 6] = [launch_fn, function, threads, shared_bytes, len(params), len(varying)]
        for i, offset in enumerate(offsets):
            plan[_OFFSETS + i] = offset
        for j, (i, size, check, arg) in enumerate(varying):
            plan[_VARY + j] = i | size << 8 | check << 16 | arg << 24
        buffer = (ctypes.c_char * PLAN_MAX_BYTES).from_address(ctypes.addressof(plan) + 8 * _BUFFER)
        for offset, (value, size, _, _) in zip(offsets, params, strict=True):
            buffer[offset:offset + size] = int(value).to_bytes(size, "little", signed=value < 0)
        self._plan, self._addr = plan, ctypes.addressof(plan)
        self._launcher, self._pending, self.compiled = compiled.launch_prepared, compiled.launch_pending, compiled
        self.name, self._hooks = name, hooks

    def __call__(self, grid: int, stream: int, args: tuple, then: "PackedLaunch | None" = None,
                 then_grid: int = 0) -> bool:
        """Launch on ``stream`` with the varying parameters read from ``args`` (the kernel's
        arguments, as ``FastLaunch`` takes them); False, launching nothing, where one breaks what
        the kernel was compiled for or a Triton launch hook is set. Once launched, ``then`` (a
        launch of a kernel with the same arguments) gets its launch with ``args`` and
        ``then_grid`` packed, which its ``launch_pending`` makes later. Raises ``RuntimeError``
        where the driver refuses the launch."""
        if self._hooks is not None and _launch_hooked(self._hooks):
            return False
        status = self._launcher(self._addr, grid, stream, args, then._addr if then is not None else 0, then_grid)
        if status == 0:
            return True
        if status < 0:
            return False
        raise RuntimeError(f"cuLaunchKernel({self.name}, grid {grid}): CUDA error {status}")

    def plan(self) -> int:
        """The packed plan's address, for a compiled call that checks its own tensors and launches
        the plan itself (``host.cpp``'s ``ll_combine_launch``: what ``__call__`` then does); 0 while
        a Triton launch hook is set, when every call declines as ``__call__`` does."""
        if self._hooks is not None and _launch_hooked(self._hooks):
            return 0
        return self._addr

    def launch_pending(self, stream: int) -> bool:
        """Make the launch another's call packed in this one (``__call__``'s ``then``), once, on
        ``stream``; False, launching nothing, where none is pending or a Triton launch hook is set.
        Raises ``RuntimeError`` where the driver refuses the launch."""
        if self._hooks is not None and _launch_hooked(self._hooks):
            return False
        status = self._pending(self._addr, stream)
        if status == 0:
            return True
        if status < 0:
            return False
        raise RuntimeError(f"cuLaunchKernel({self.name}, pending): CUDA error {status}")


def _launch_hooked(hooks) -> bool:
    """Whether Triton's ``knobs.runtime`` has a launch hook set: each is None, or Triton's HookChain
    (always there since Triton 3.5: set when it holds calls), or a callable. Every eager
    low-latency call asks: one call, no more."""
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 0) -> None:
    """Launch ``kernel`` (a ``FastLaunch`` or a plain, e.g. interpreted, Triton kernel);
    ``num_warps`` 0: Triton's default."""
    if isinstance(kernel, FastLaunch):
        kernel(grid, args, constexprs, num_warps)
    else:
        kernel[grid](*args, **constexprs, **({"num_warps": num_warps} if num_warps else {}))
