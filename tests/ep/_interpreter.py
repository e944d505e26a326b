"""What Triton's interpreter needs before ep's kernels run in it (the ``interpreted_*`` test files)."""

from __future__ import annotations

try:
    import triton.language as tl  # noqa: F401 - the interpreter wants it visible to the jit'd fakes below
except ImportError:  # the interpreted_* files run only where Triton is
    tl = None


def numpy_scalars_in_the_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with ``int(array of shape [1])``, which
    NumPy >= 2.5 refuses; loops over a runtime bound then fail. Read the one element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    _patch_the_language_once_a_launch(interpreter)


def _patch_the_language_once_a_launch(interpreter) -> None:
    """Triton's interpreter patches ``triton.language`` for a launch (``GridExecutor``), and again at
    every call of a jit'd helper inside it (``InterpretedFunction.__call__``), never restoring the
    second: a scan of the language's members each time, most of an interpreted kernel's run
    (the low-latency kernels call a helper tens of thousands of times). A helper whose modules are
    patched already is skipped. One that is not (Triton's own ``tl.zeros`` sees other modules than
    ep's kernels) is patched, and its patch is undone with the launch's that encloses it, newest
    first: undoing only the launch's would leave the helper's entry claiming modules whose stand-ins
    the launch's restore just took away."""
    original = interpreter._patch_lang
    if getattr(original, "once_a_launch", False):
        return
    import inspect

    import triton.language as lang

    held: list[tuple[object, set]] = []  # the scopes in force, oldest first, with the modules each patched

    def langs(fn) -> set:  # the modules _patch_lang patches for fn
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (lang, lang.core)}

    class Held:
        def __init__(self, scope, patched: set) -> None:
            self.depth = len(held)
            held.append((scope, patched))

        def restore(self) -> None:  # this scope and every one patched inside it, newest first
            while len(held) > self.depth:
                held.pop()[0].restore()

    class Covered:  # nothing to restore: the scope that patched the language restores it
        @staticmethod
        def restore() -> None:
            pass

    def patch_lang(fn):
        wanted = langs(fn)
        if held and wanted <= set().union(*(patched for _, patched in held)):
            return Covered()
        return Held(original(fn), wanted)

    patch_lang.once_a_launch = True
    interpreter._patch_lang = patch_lang


# the fake device clock, in nanoseconds: from a value past 32 bits, as %globaltimer's are, so that the
# interpreter types every reading int64 (from 0 it typed the first ones int32, and a process that
# read it over 2,147 times failed on an int32 overflow, in whichever test was running then)
CLOCK = [1 << 40]


def advance_clock() -> int:
    CLOCK[0] += 1_000_000  # every read of the device clock is a millisecond later
    return CLOCK[0]


def swap_ptx_helpers(monkeypatch, module) -> None:
    """Give ``module``'s kernels Python stand-ins for the clock, the system fence and cta_any (PTX, which
    the interpreter cannot run); the interpreter resolves a kernel's helpers through its module."""
    import triton

    for name, fake in (("device_clock_ns", _fake_clock), ("fence_system", _no_fence), ("fence_by_one", _no_fence),
                       ("store_by_one", _store), ("store_release_system", _store_masked),
                       ("store_relaxed_system", _store_masked), ("cta_any", _one_thread_any)):
        if hasattr(module, name):  # the helpers the module's kernels call
            monkeypatch.setattr(module, name, triton.jit(fake))


def _fake_clock():
    return advance_clock()


def _no_fence():
    pass


def _store(addr, value):
    tl.store(addr.to(tl.pointer_type(tl.int64)), value)


def _store_masked(addrs, values, mask):  # (both system-scope stores: one thread orders nothing)
    tl.store(addrs.to(tl.pointer_type(tl.int64)), values, mask=mask)


def _one_thread_any(x):
    return (x != 0).to(tl.int32)  # the interpreter runs a program as one thread: nothing to agree on
