"""Where a direct install's targets live now, asked once per cycle without walking them in Python.

An engine may replace a parameter's ``.data`` between cycles (re-packing after a load, say); a
direct pull must then land at the new address, never the old one (Note [Install modes] in
refit._install). Asking 290 tensors for ``data_ptr()`` from Python took 0.1-0.15 ms of a 6.5 ms
colocated cycle; torch's own check for CUDA-graph inputs compares them in C++.
"""

from __future__ import annotations

import functools
import itertools

__all__ = ["TargetAddresses"]

_generations = itertools.count(1)  # never reused in a process, so a key never names two address sets


class TargetAddresses:
    """The addresses of ``tensors``, and a key that changes whenever any of them moves."""

    def __init__(self, tensors: list) -> None:
        self.tensors = tensors
        self._indices = list(range(len(tensors)))
        self._pointers = [t.data_ptr() for t in tensors]
        self.key = next(_generations)

    def current_key(self) -> int:
        """The key for the addresses the tensors have now: the last one while none moved."""
        if not self._unchanged():
            self._pointers = [t.data_ptr() for t in self.tensors]
            self.key = next(_generations)
        return self.key

    def _unchanged(self) -> bool:
        same = _same_pointers()
        if same is not None:
            return same(self.tensors, self._pointers, self._indices)
        return [t.data_ptr() for t in self.tensors] == self._pointers


@functools.cache
def _same_pointers():
    """torch's check of CUDA-graph inputs' addresses, or None: CPU-only builds of torch lack it.
    Looked up on first use so that importing warmlink.refit does not import torch."""
    import torch

    return getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
