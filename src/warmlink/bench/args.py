"""Command-line values checked where they are parsed: argparse ``type=`` callables and the one-line
refusal of a value that only the machine can judge (``--devices 0,1`` without CUDA).

A bad value ends the command before any process starts, with one line on stderr that names the
flag, and exit code 2 (``warmlink.cli.main`` makes argparse's own errors one line too).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

__all__ = ["check_devices", "devices", "fraction", "int_in", "positive_float", "refuse"]


def int_in(lo: int, hi: int | None = None, multiple: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (no upper bound when ``hi`` is None) and a
    multiple of ``multiple``."""
    bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    expected = f"an integer {bounds}" + (f" and a multiple of {multiple}" if multiple > 1 else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected {expected}") from None
        if value < lo or (hi is not None and value > hi) or value % multiple:
            raise argparse.ArgumentTypeError(f"{value} out of range; expected {expected}")
        return value

    parse.__name__ = f"int {bounds}"  # argparse names the type in some messages
    return parse


def _number(text: str, ok: Callable[[float], bool], expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected {expected}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"{value} out of range; expected {expected}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (seconds)."""
    return _number(text, lambda v: v > 0, "a finite number > 0")


def fraction(text: str) -> float:
    """An argparse ``type``: a number in ``(0, 1]``."""
    return _number(text, lambda v: 0 < v <= 1, "a number in (0, 1]")


def devices(text: str) -> tuple[int, int]:
    """An argparse ``type``: ``trainer,inference`` CUDA device indices, or ``-1,-1`` (CPU over shm)."""
    expected = "two comma-separated CUDA device indices, trainer,inference (e.g. 0,1), or -1,-1 for CPU over shm"
    parts = text.split(",")
    try:
        pair = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device pair; expected {expected}") from None
    if len(pair) != 2 or min(pair) < -1 or (min(pair) < 0) != (max(pair) < 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device pair; expected {expected}")
    return pair  # type: ignore[return-value]


def check_devices(pair: tuple[int, int], flag: str = "--devices") -> str | None:
    """Why ``pair`` (from ``devices``) cannot run on this machine, or None. Imports torch."""
    if pair[0] < 0:
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return (f"{flag}={pair[0]},{pair[1]} needs CUDA, and this machine has no CUDA device; "
                "expected -1,-1 (CPU over shm)")
    if max(pair) >= count:
        return f"{flag}={pair[0]},{pair[1]} out of range; expected device indices below {count} (the visible GPUs)"
    return None


def refuse(prog: str, message: str) -> int:
    """Print ``message`` as the command's one line on stderr; the exit code of a bad value (2)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2
