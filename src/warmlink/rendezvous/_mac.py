"""The MAC that every value of the rendezvous store carries, for ``rendezvous.Store``.

# Note [Store MAC]
The store is not trusted: TCPStore has no authentication, so anyone who reaches its port can
write any key. Every value ``Store`` writes is ``tag || value``, where ``tag`` is the HMAC-SHA256,
under the job's secret, of ``_DOMAIN || len(prefix) || prefix || len(key) || key || value``
(lengths as 4-byte big-endian, strings as UTF-8): a value is bound to its prefix and key. A value
written by a process without the secret, moved from another key or prefix, cut short or altered
fails the check (``hmac.compare_digest``, in constant time) and is refused before anyone parses it.
- The tag has no nonce: ``compare_set`` compares stored bytes, so one value under one key must
  always seal to the same bytes. Hence whoever reaches the port can write back a value that key
  held earlier in the same job (a replay), which the MAC cannot tell apart: it can show a reader
  an older value of a key, never a name, size or handle the job did not write itself. The
  server's binding to the asked host (Note [TCPStore quirks] in ``rendezvous.store``) keeps
  other hosts off the port in the first place.
- Counters (``Store.add``) carry no tag: the server adds integers. They are checked as integers
  in range instead.
- The secret is never logged, put in a message or shown by a repr.

# Note [Store secret]
A server store takes its secret from its ``secret`` argument, else ``WARMLINK_SECRET``, else makes
a fresh random one (a job on one host: the launcher hands ``store.secret`` to the processes it
starts, as an argument). A client takes its argument, else ``WARMLINK_SECRET``, and refuses to
start with neither (ConfigError). A job across nodes binds the server to the node address the
other nodes reach (``Store(node_ip, port, is_server=True)``; loopback is the default) and sets
the same ``WARMLINK_SECRET`` on every process.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["TAG_BYTES", "Mac"]

TAG_BYTES = 32  # SHA-256
_DOMAIN = b"warmlink.rendezvous.store.v1\x00"  # a tag for this use only, should the secret serve another


def _framed(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return len(raw).to_bytes(4, "big") + raw


class Mac:
    """Seals and opens the values of one store prefix under one secret (Note [Store MAC])."""

    __slots__ = ("_base",)

    def __init__(self, secret: str, prefix: str) -> None:
        self._base = hmac.new(secret.encode("utf-8"), _DOMAIN + _framed(prefix), hashlib.sha256)

    def _tag(self, key: str, value: bytes | memoryview) -> bytes:
        h = self._base.copy()
        h.update(_framed(key))
        h.update(value)
        return h.digest()

    def seal(self, key: str, value: bytes) -> bytes:
        """``value`` as stored under ``key``: its tag, then the value."""
        return self._tag(key, value) + value

    def open(self, key: str, stored: bytes) -> bytes | None:
        """The value ``seal(key, value)`` stored, or None when ``stored`` fails the check."""
        if len(stored) < TAG_BYTES:
            return None
        view = memoryview(stored)
        value = view[TAG_BYTES:]
        if not hmac.compare_digest(self._tag(key, value), view[:TAG_BYTES]):
            return None
        return bytes(value)

    def __repr__(self) -> str:
        return "Mac(<secret hidden>)"
