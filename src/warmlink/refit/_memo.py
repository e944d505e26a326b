"""Process-wide memos of refit metadata, each a pool kind (counted in ``warmlink.pool.stats()``).

The memos live here and their users reach them by name: ``exported_manifests`` (the publisher),
``validated_manifests`` (``refit.sources``) and ``read_states`` (``refit.protocol``, read by
``refit._sync``). Being pool kinds (``warmlink.pool.core``), they follow ``WARMLINK_POOL`` without
any of their users reading it.

# Note [Warm metadata]
A warm engine lifecycle (create, export or refit once, close, again and again) creates nothing,
so what is left is metadata: store round trips and JSON. Three memos cut it, each under a rule that
keeps metadata from peers validated (DESIGN invariant 3); all are off with pooling off (they are
pool kinds: a ``PerOwner`` remembers nothing and a ``SharedCache`` makes every value again).

* Publisher: an export whose manifest equals the last one this process wrote, for the same rank
  through the same ``Store`` object, keeps that manifest and its generation instead of drawing a new
  generation and writing the manifest again (``exported_manifests``). The stored bytes are read
  back first (one round trip; a manifest past one store value is a blob, read back and checked
  whole, Note [Blobs] in ``rendezvous._blobs``) and must still be exactly what was written. A
  generation is reused only through the ``Store`` object that drew it: another server (a restarted
  one at the same address) may have handed out the same number for other content. Equal manifests
  name the same process, regions and offsets, so receivers holding that generation hold valid
  mappings.
* Receiver: manifests are always read from the store, but bytes equal to bytes this process has
  already validated are not decoded and validated again (``validated_manifests``, keyed by the
  SHA-256 of the exact bytes). Any other bytes are decoded and validated in full.
* Receiver: a new receiver's first sync tries to enter the state this process last read for each
  publisher rank (``read_states``) instead of reading it first, and so does a sync told which
  version to pull (that version, of the generations last read); the state read after entering
  decides, exactly as in Note [Version protocol], and a stale guess only costs a leave and the
  normal path (``refit._sync``).
"""

from __future__ import annotations

from warmlink.pool.core import PerOwner, SharedCache

__all__ = ["exported_manifests", "validated_manifests", "read_states"]

# (store, rank) -> (generation, manifest dict, its bytes) last written through that Store object.
exported_manifests = PerOwner("exported_manifest")

# SHA-256 of exact manifest bytes -> their validated parse (a digest, not the bytes: manifests of
# large models run to tens of MB), made by the caller on a miss.
validated_manifests = SharedCache("validated_manifest", max_entries=32)

# (store, rank) -> the VersionState this process last read through that Store object: a guess
# only. Never trusted: entering reads the state again.
read_states = PerOwner("read_version_state")
