"""Host-time wrappers for the tools that time ep's steps in place (``setattr`` on the owner of a
function with the wrapper)."""

from __future__ import annotations

import functools
import time


def timed(name: str, fn, done):
    """``fn`` wrapped so that every call, raising or not, ends with ``done(name, entered, left)``
    (``time.perf_counter`` seconds)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            done(name, t0, time.perf_counter())
    return wrapper
