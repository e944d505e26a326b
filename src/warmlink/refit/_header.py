"""A publisher's version words in its own transfer memory, which every receiver reads through its link.

# Note [Version header]
The store is not trusted and carries no freshness: whoever reaches its port can write back any
value the job ever signed (a "published v1" state while the trainer is at v37, an earlier
generation's manifest after the publisher was re-created over the same memory) and forge or roll
back its counters (reader counts, revocations), which carry no MAC at all. A receiver that syncs
through the store (another host, or no version board) therefore takes nothing it reads there as
the present. The present is in the publisher's memory, which only the publisher writes and which
the receiver reads through the same link that moves the bytes: each publisher rank keeps a
*header* of ``HEADER_NBYTES`` in a region of its own, announced in its manifest
(``"header": {"region", "offset"}``), holding its generation, version, state, the first 16 bytes
of the SHA-256 of its manifest's bytes and a random *incarnation* drawn when the publisher object
is made. An update moves the state through ``published v`` -> ``updating v`` (written before it
reads its readers' counts: new readers stay out) -> ``writing v`` (written once they are out, before
``begin_update`` returns, so before the trainer writes a byte) -> ``published v+1`` (after the
tensors were refreshed and synchronised); ``closed`` is written before its memory goes back.

* A store-synced receiver counts itself in (Note [Version protocol]), loads the manifest the
  store's state names, then reads every header: each must say ``published``, the version it
  entered, the generation of the manifest it loaded and that manifest's digest. Else it leaves and
  tries the version and generation the headers name (a replayed state costs a retry, not an
  install), or waits while one is updating. If the publisher's read of the counts missed its count,
  its count came later, so its header read came after ``updating`` was written: it backs off.
* After its bytes arrived and before it installs anything, it reads every header again: the same
  publisher, generation, manifest and version, still ``published`` or ``updating`` (waiting for
  it), or nothing is installed (VersionError). A trainer write that overlapped the pull came after
  ``writing`` was written and before the pull completed, so the second read sees ``writing`` or a
  later version. This is a seqlock whose words only the writer can touch. The incarnation keeps it
  one across publishers: one re-created over the same memory, in the same process, with an equal
  manifest keeps its generation (Note [Warm metadata] in refit._memo) and starts again at version
  1, so without it a pull of version 1 that spans the re-creation could find the words as they were.

So reader counts, leases and revocations keep a publisher from writing under its readers (and a
reader from being starved), but no longer decide what a receiver installs: forged or rolled-back
counters cost retries, never a torn or misplaced install. A manifest replayed after its generation
number was reused fails the digest; a region of a departed publisher reads as no header at all
(wrong magic) or a header of another generation. Receivers on the publisher's host sync on its
version board (Note [Version board]), which the kernel guards, and read no header.
"""

from __future__ import annotations

import secrets
import struct
from typing import NamedTuple

from warmlink.refit._board import CLOSED, PUBLISHED, UPDATING
from warmlink.rendezvous.schema import VERSION_HEADER_NBYTES

__all__ = ["HEADER_NBYTES", "Header", "PublisherHeader", "parse", "digest_prefix", "PUBLISHED", "UPDATING", "WRITING", "CLOSED",
           "STATE_NAMES"]

HEADER_NBYTES = VERSION_HEADER_NBYTES
WRITING = 3  # drained: the trainer may write (a board says "updating" throughout)
STATE_NAMES = {PUBLISHED: "published", UPDATING: "updating", WRITING: "writing", CLOSED: "closed"}
_MAGIC = 0x31304144485A4C57  # "WLZHDA01", little-endian
_WORDS = struct.Struct("<Qqqq16sQ")  # magic, generation, version, state, manifest digest prefix, incarnation
DIGEST_BYTES = 16


class Header(NamedTuple):
    """One publisher's version words as a receiver read them."""

    generation: int
    version: int
    state: int
    digest: bytes
    incarnation: int  # which publisher object wrote it: compared, never checked against a value

    def same_version(self, other: Header | None) -> bool:
        """Whether ``other``, read later, shows no write since this was read: the same publisher,
        generation, manifest and version, and not yet drained for the next (Note [Version header])."""
        return (other is not None and other.state in (PUBLISHED, UPDATING)
                and (other.generation, other.version, other.digest, other.incarnation)
                == (self.generation, self.version, self.digest, self.incarnation))

    def describe(self) -> str:
        return f"generation {self.generation}, version {self.version} {STATE_NAMES.get(self.state, self.state)}"


def digest_prefix(manifest_hex_digest: str) -> bytes:
    """The header's digest field for a manifest whose SHA-256 is ``manifest_hex_digest``."""
    return bytes.fromhex(manifest_hex_digest)[:DIGEST_BYTES]


def parse(raw: bytes) -> Header | None:
    """The header in ``raw`` (``HEADER_NBYTES`` read from a publisher's region), or None when it
    holds no header (wrong magic: memory a departed publisher gave back, or never a header)."""
    magic, generation, version, state, digest, incarnation = _WORDS.unpack_from(raw)
    if magic != _MAGIC or state not in STATE_NAMES:
        return None
    return Header(generation, version, state, digest, incarnation)


class PublisherHeader:
    """The header of one publisher rank, at ``offset`` of ``region``, one of its link's regions
    (Note [Version header]): the front of its staging arena, or an arena of its own when nothing
    is staged. The region is the publisher's, released with its others."""

    __slots__ = ("region", "offset", "incarnation")

    def __init__(self, region, offset: int = 0) -> None:
        self.region, self.offset = region, offset
        self.incarnation = secrets.randbits(64)
        self.write(0, 0, CLOSED, b"")  # a pooled arena may hold an earlier header

    def write(self, generation: int, version: int, state: int, digest: bytes) -> None:
        """Put the words in place; returns once peers can read them (a device header is copied
        and synchronised)."""
        import torch

        words = bytearray(HEADER_NBYTES)
        _WORDS.pack_into(words, 0, _MAGIC, generation, version, state, digest[:DIGEST_BYTES], self.incarnation)
        src = torch.frombuffer(words, dtype=torch.uint8)
        dst = self.region.tensor[self.offset:self.offset + HEADER_NBYTES]
        if dst.device.type == "cpu":
            dst.copy_(src)
            return
        with torch.cuda.device(dst.device):
            dst.copy_(src)
            torch.cuda.current_stream().synchronize()
