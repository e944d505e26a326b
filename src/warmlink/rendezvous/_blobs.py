"""Values past one store value: ``Store.set_blob`` / ``get_blob`` (mixed into ``rendezvous.Store``).

# Note [Blobs]
``set_blob`` stores up to ``schema.MAX_PAYLOAD_BYTES``. Data that fits one chunk is stored as it is
under its key (one round trip, as ``set``). Larger data is cut into chunks stored under
``{key}/blob/{sha256}/{i}``, written first, and then a header (``BLOB_MAGIC`` and a JSON
``blob_header``, Note [Blob header] in ``rendezvous.schema``) is written under the key, last: a
reader that sees the header sees every chunk. Chunk keys are named by the digest of the whole, so
an overwrite never mixes old and new chunks: a reader fetches the chunks of the header it read,
checks their count and sizes (no chunk past the last either, which a writer removes) and the
digest, and raises MetadataError naming the key otherwise. Data that itself starts with ``BLOB_MAGIC`` always takes
the chunked form, so the value under a key is never read as the other form. Superseded chunks are
left in place (a reader may still be fetching them): refit writes each manifest once, under a key
of its own generation.
"""

from __future__ import annotations

import hashlib

from warmlink.errors import ConfigError, MetadataError
from warmlink.rendezvous import schema

__all__ = ["BLOB_MAGIC", "BlobMethods", "CHUNK_BYTES", "as_bytes", "chunk_key"]

BLOB_MAGIC = b"\x00warmlink.blob\x00"  # See Note [Blobs]
CHUNK_BYTES = 4 << 20  # set_blob's default: a 12 MB manifest is three chunks
MAX_BLOB_KEY_CHARS = 1024 - 128  # a store key's limit, less room for "/blob/{sha256}/{i}"


def as_bytes(value: bytes | bytearray | memoryview | str, func: str, key: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ConfigError(f"{func}: value for key={key!r} has type {type(value).__name__}; expected bytes or str")


def chunk_key(key: str, digest: str, idx: int) -> str:
    return f"{key}/blob/{digest}/{idx}"


class BlobMethods:
    """``set_blob``, ``get_blob`` and ``try_get_blob`` of ``rendezvous.Store``, over its ``set``,
    ``get``, ``try_get``, ``delete`` and deadlines (See Note [Blobs])."""

    def set_blob(self, key: str, data: bytes | str, *, chunk_nbytes: int = CHUNK_BYTES,
                 timeout_s: float | None = None) -> None:
        """Store ``data`` of up to ``schema.MAX_PAYLOAD_BYTES`` (64 MiB) under ``key``, for ``get_blob``.

        Args:
            key: at most 896 characters (chunk keys extend it).
            data: bytes, or str as UTF-8. Up to ``chunk_nbytes`` it is stored as one value.
            chunk_nbytes: bytes per chunk, ``schema.MIN_CHUNK_BYTES`` (1 KiB) to
                ``schema.MAX_VALUE_BYTES`` (8 MiB less 64 bytes); default 4 MiB.
            timeout_s: seconds for every round trip together (None: the store's).

        Raises:
            MetadataError: ``data`` is over ``schema.MAX_PAYLOAD_BYTES``; nothing is written.
            ConfigError: a bad key or ``chunk_nbytes``.
            TransferTimeout: the store did not take it all within ``timeout_s``.

        Blocking? One round trip per chunk, plus one for the header. Warm path? No: for metadata
        written once (manifests).
        """
        func = "Store.set_blob"
        data = as_bytes(data, func, self._blob_key(key, "set_blob"))
        if type(chunk_nbytes) is not int or not schema.MIN_CHUNK_BYTES <= chunk_nbytes <= schema.MAX_VALUE_BYTES:
            raise ConfigError(f"{func}: chunk_nbytes={chunk_nbytes!r} out of range; expected an int in "
                              f"[{schema.MIN_CHUNK_BYTES}, {schema.MAX_VALUE_BYTES}] bytes")
        if len(data) > schema.MAX_PAYLOAD_BYTES:
            raise MetadataError(f"{func}: key={key!r}: data of {len(data)} bytes exceeds the limit; expected at most "
                                f"{schema.MAX_PAYLOAD_BYTES} bytes (schema.MAX_PAYLOAD_BYTES)")
        with self.deadline(self._limit(timeout_s, func)):
            self._write_blob(key, data, chunk_nbytes)

    def _write_blob(self, key: str, data: bytes, chunk_nbytes: int) -> None:
        if len(data) <= chunk_nbytes and not data.startswith(BLOB_MAGIC):
            self.set(key, data)
            return
        digest = hashlib.sha256(data).hexdigest()
        num_chunks = -(-len(data) // chunk_nbytes)
        for i in range(num_chunks):  # every chunk before the header: See Note [Blobs]
            self.set(chunk_key(key, digest, i), data[i * chunk_nbytes : (i + 1) * chunk_nbytes])
        self.delete(chunk_key(key, digest, num_chunks))  # a stray one past the last: readers refuse it
        header = {"schema_version": 1, "kind": "blob_header", "nbytes": len(data), "chunk_nbytes": chunk_nbytes,
                  "num_chunks": num_chunks, "sha256": digest}
        self.set(key, BLOB_MAGIC + schema.encode(header))

    def get_blob(self, key: str, *, timeout_s: float | None = None, peer: str | None = None) -> bytes:
        """Wait until ``key`` exists and return the data ``set_blob`` stored there, checked whole.

        Raises:
            TransferTimeout: ``key`` did not appear within ``timeout_s`` (``None``: the store's).
            MetadataError: a bad header, or chunks missing, extra, of the wrong size or not matching
                the header's SHA-256, or a header or chunk that fails its MAC (names the key, and
                ``peer``, who is expected to have written it, where given). Memory is bounded by the
                header's checked ``nbytes``, at most ``schema.MAX_PAYLOAD_BYTES``.
        """
        with self.deadline(self._limit(timeout_s, "Store.get_blob")):
            value = self.get(self._blob_key(key, "get_blob"), timeout_s=timeout_s, peer=peer)
            return self._read_blob(key, value, "get_blob", peer)

    def try_get_blob(self, key: str, *, timeout_s: float | None = None, peer: str | None = None) -> bytes | None:
        """As ``get_blob``, but ``None`` at once when ``key`` is absent."""
        with self.deadline(self._limit(timeout_s, "Store.try_get_blob")):
            value = self.try_get(self._blob_key(key, "try_get_blob"), peer=peer)
            return None if value is None else self._read_blob(key, value, "try_get_blob", peer)

    def _read_blob(self, key: str, value: bytes, func: str, peer: str | None) -> bytes:
        if not value.startswith(BLOB_MAGIC):
            return value
        where = f"Store.{func}: key={key!r}"
        try:
            header = schema.decode(value[len(BLOB_MAGIC) :], "blob_header", self.address if peer is None else peer)
        except MetadataError as e:
            raise MetadataError(f"{where}: {e}") from None
        nbytes, chunk_nbytes, num_chunks, digest = (header[k] for k in ("nbytes", "chunk_nbytes", "num_chunks", "sha256"))
        sha, chunks = hashlib.sha256(), []
        for i in range(num_chunks):
            got = self.try_get(chunk_key(key, digest, i), peer=peer)
            want = min(chunk_nbytes, nbytes - i * chunk_nbytes)
            if got is None or len(got) != want:
                raise MetadataError(
                    f"{where}: chunk {i} of num_chunks={num_chunks} is "
                    f"{'missing' if got is None else f'{len(got)} bytes'}; expected {want} bytes"
                )
            sha.update(got)
            chunks.append(got)
        if self._fetch(chunk_key(key, digest, num_chunks), func, self._limit(None, f"Store.{func}")) is not None:
            raise MetadataError(f"{where}: a chunk {num_chunks} exists; expected num_chunks={num_chunks} chunks")
        if sha.hexdigest() != digest:
            raise MetadataError(f"{where}: SHA-256 of the chunks is {sha.hexdigest()}; expected {digest} from its header")
        return b"".join(chunks)

    def _blob_key(self, key: str, func: str) -> str:
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_BLOB_KEY_CHARS:
            raise ConfigError(
                f"Store.{func}: key={key!r} invalid; expected a string of 1 to {MAX_BLOB_KEY_CHARS} characters"
            )
        return key
