"""Fan-out: engine replicas take a version from each other, so the trainer sends each byte about once.

``Receiver(store, num_publishers=P, fanout=FanOut("rollout", rank=tp_rank))`` makes a receiver a
member of the fan-out group of every replica of its engine: it pulls the version it entered at the
publishers from another replica when one holds it, or from the publishers, and serves what it
pulled to the replicas after it. The library plans who pulls from whom from the order receivers
join (a chain by default, or a tree), pipelined in chunks; see Note [Fan-out] in
``refit._relay`` and Note [Fan-out tree] in ``refit._members``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warmlink.errors import ConfigError
from warmlink.refit._members import GROUP_NAME

__all__ = ["FanOut", "CUDA_IPC_NUM_CHUNKS", "DEFAULT_NUM_CHUNKS", "MIN_CHUNK_BYTES"]

# a replica lags the one it pulls from by a few chunks (refit._relay.WINDOW in flight): a chain of
# N takes about (128 + a few N) / 128 of one link's time. Over CUDA IPC a chunk moves in a fraction
# of a millisecond and each costs a header read and stream syncs of about that much: 32 chunks
# (3 engines on 2 x H200, 8.8 GB: 45 ms a cycle at 32, 48 at 16, 59 at 8, 67 at 128)
DEFAULT_NUM_CHUNKS = 128
CUDA_IPC_NUM_CHUNKS = 32
MIN_CHUNK_BYTES = 4096  # a chunk costs a header read: smaller ones would move more words than bytes
_DEFAULT_MIN_CHUNK_BYTES = 64 << 10


@dataclass(frozen=True)
class FanOut:
    """How a receiver takes part in fan-out.

    Args:
        group: the name every replica of one engine gives (letters, digits, ``_.-``; up to 100
            characters), e.g. ``"rollout"``. Receivers of one group and ``rank`` must declare the
            same tensors in the same layout; one that does not is refused with ``LayoutError``.
        rank: this receiver's rank within its engine (its tensor-parallel rank, 0 for a TP-1
            engine): rank ``i`` of one replica serves rank ``i`` of the others.
        degree: how many replicas each one serves: 1 (default) is a chain, each link carrying the
            model once (time about bytes / link rate plus a pipeline fill); ``d > 1`` a tree of
            depth ``log_d N``, whose relays each send the model ``d`` times.
        chunk_bytes: the pipeline's unit, bytes (at least 4 KiB); every replica of a group must use
            the same. Default: a 128th of the bytes a receiver pulls (a 32nd over ``cuda_ipc``, where
            a chunk's own cost is larger against its bytes), at least 64 KiB.
        stall_s: how long a replica waits for the replica it pulls from to show progress before it
            pulls from that one's own source instead (for that cycle), seconds. A replica that
            dies is routed around at once.

    Raises:
        ConfigError: a value out of range (names it).

    Collective? No: each replica joins at its first cycle. Warm path? Yes (Note [Fan-out]).
    """

    group: str
    rank: int = 0
    degree: int = 1
    chunk_bytes: int | None = None
    stall_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not GROUP_NAME.fullmatch(self.group):
            raise ConfigError(f"FanOut: group={self.group!r} invalid; expected 1 to 100 letters, digits or '_.-'")
        for name, low in (("rank", 0), ("degree", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 1 << 20:
                raise ConfigError(f"FanOut: {name}={value!r} out of range; expected an int >= {low}")
        c = self.chunk_bytes
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not MIN_CHUNK_BYTES <= c < 1 << 62):
            raise ConfigError(f"FanOut: chunk_bytes={c!r} invalid; expected None or an int >= {MIN_CHUNK_BYTES} bytes")
        s = self.stall_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < math.inf:
            raise ConfigError(f"FanOut: stall_s={s!r} invalid; expected a finite number of seconds > 0")

    def chunk_bytes_for(self, nbytes: int, backend: str = "") -> int:
        """The chunk size for a receiver that pulls ``nbytes`` bytes over ``backend`` (every replica of
        a group has the same): ``chunk_bytes``, or the default."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        chunks = CUDA_IPC_NUM_CHUNKS if backend == "cuda_ipc" else DEFAULT_NUM_CHUNKS
        return max(_DEFAULT_MIN_CHUNK_BYTES, -(-nbytes // chunks))
