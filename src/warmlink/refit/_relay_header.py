"""A fan-out relay's words in its own transfer memory, read by the replicas it serves through their
link, and in host shared memory, read there by the replicas on its host.

Note [Fan-out] in ``refit._relay`` says what they mean and who writes them when. The words are
written only by their relay, in memory only it writes; a reader takes nothing the store says
about them on trust (the store only says where they are).

# Note [Relay header in host memory]
A replica reads its source's header after each batch of chunk copies. Through the link that read
is a copy on the GPU, queued behind the copies in flight and, when the source shares the GPU,
behind the source's own work from another process: on 2 x H200 the read that checked a chained
replica's last chunk took 2.5 ms while its source installed. So the relay also keeps its words in
a small shared-memory region of its host (the record names it), and a replica on that host reads
them there with one memcpy, after its copies completed. A read may meet a write half done: every
header ends with a checksum of its words (BLAKE2b, 8 bytes), and a read whose checksum fails is
read again (``parse`` returns None for it). A writer preempted inside its 128-byte copy leaves the
words torn for a scheduler's time slice, milliseconds on a loaded host, so rereads back off (about
50 ms in all) and a header still torn after them routes around its relay for this cycle
only: torn words are never read as a relay gone. (Rereading at once, eight reads took microseconds,
and on 4 emulated hosts a replica took its healthy source for closed, for good: 1.6x the trainer's
bytes from then on.)
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import NamedTuple

__all__ = ["RELAY_HEADER_NBYTES", "RelayWords", "RelayHeader", "parse", "EMPTY", "FILLING", "HELD", "FAILED", "CLOSED",
           "STATE_NAMES", "digest16"]

RELAY_HEADER_NBYTES = 128
EMPTY, FILLING, HELD, FAILED, CLOSED = 0, 1, 2, 3, 4
STATE_NAMES = {EMPTY: "empty", FILLING: "filling", HELD: "held", FAILED: "failed", CLOSED: "closed"}
_MAGIC = 0x31305941_4C45524C  # "LRELAY01" read as little-endian bytes
# magic, incarnation, epoch, version, state, chunks held, num_chunks, chunk_bytes, served bytes,
# label (which publishers' version), plan signature, served region
_WORDS = struct.Struct("<QQqqqqqqq16s16s16s")
_CHECK_BYTES = 8  # the checksum of the words, at the header's end: Note [Relay header in host memory]


def digest16(value) -> bytes:
    """The first 16 bytes of the SHA-256 of ``value`` (str, bytes, or JSON-able: a region descriptor)."""
    if isinstance(value, str):
        value = value.encode()
    elif not isinstance(value, bytes):
        value = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(value).digest()[:16]


class RelayWords(NamedTuple):
    """One relay's header as written or read (Note [Fan-out])."""

    incarnation: int  # the relay object that wrote it (random): a header of another one is not its
    epoch: int  # bumped before the relay's region takes other bytes
    version: int
    state: int
    held: int  # chunks 0 .. held-1 hold ``version`` (of ``label``) and stay while ``epoch`` does
    num_chunks: int
    chunk_bytes: int
    served_nbytes: int
    label: bytes  # digest of the publishers' generations and manifest digests the version is of
    signature: bytes  # digest of the plan signature: equal plans, equal receive regions
    region: bytes  # digest of the served region's descriptor: the region a reader opened is this one

    def same_fill(self, other: "RelayWords | None") -> bool:
        """Whether ``other``, read later, shows the region untouched since this was read."""
        return (other is not None and other.state in (FILLING, HELD)
                and (other.incarnation, other.epoch, other.label, other.region) == (self.incarnation, self.epoch, self.label, self.region))

    def describe(self) -> str:
        return f"version {self.version} {STATE_NAMES.get(self.state, self.state)}, {self.held}/{self.num_chunks} chunks"

    def pack(self) -> bytes:
        body = _WORDS.pack(_MAGIC, *self).ljust(RELAY_HEADER_NBYTES - _CHECK_BYTES, b"\0")
        return body + _checksum(body)


def _checksum(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_CHECK_BYTES).digest()


def parse(raw: bytes) -> RelayWords | None:
    """The words in ``raw`` (``RELAY_HEADER_NBYTES`` read from a relay's header region), or None
    when they are not a relay header (memory given back, never written, or read in the middle of
    a write: Note [Relay header in host memory])."""
    body = raw[:RELAY_HEADER_NBYTES - _CHECK_BYTES]
    if len(raw) < RELAY_HEADER_NBYTES or raw[len(body):RELAY_HEADER_NBYTES] != _checksum(body):
        return None
    magic, *rest = _WORDS.unpack_from(raw)
    words = RelayWords(*rest)
    if magic != _MAGIC or words.state not in STATE_NAMES:
        return None
    return words


class RelayHeader:
    """The header a relay writes, at the front of ``region`` (one of its link's regions, the
    relay's own, released by it) and of ``host`` (a region of a shared-memory link on its host, or
    None: Note [Relay header in host memory]). Device memory is written on a stream of its own, so
    that a relay's progress never waits for the engine's kernels."""

    __slots__ = ("region", "host", "_stream")

    def __init__(self, region, host=None) -> None:
        self.region = region
        self.host = host
        self._stream = None

    def write(self, words: RelayWords) -> None:
        """Put ``words`` in place; returns once peers can read them."""
        import torch

        src = torch.frombuffer(bytearray(words.pack()), dtype=torch.uint8)
        if self.host is not None:
            self.host.tensor[:RELAY_HEADER_NBYTES].copy_(src)
        dst = self.region.tensor[:RELAY_HEADER_NBYTES]
        if dst.device.type == "cpu":
            dst.copy_(src)
            return
        with torch.cuda.device(dst.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(dst.device)
            with torch.cuda.stream(self._stream):
                dst.copy_(src)
            self._stream.synchronize()
