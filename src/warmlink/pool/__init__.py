"""The process-wide warm pool. See ``warmlink.pool.core`` for the model.

Public: ``stats()``, ``reset_stats()``, ``enabled()``, ``set_enabled()``, ``lease_arena()``.
Streams and events (``warmlink.pool.streams``) need CUDA and are imported on first use.
"""

from warmlink.pool.arenas import Arena, lease_arena
from warmlink.pool.core import Counters, Lease, enabled, reset_stats, set_enabled, stats

__all__ = ["stats", "reset_stats", "enabled", "set_enabled", "lease_arena", "Arena", "Lease", "Counters"]
