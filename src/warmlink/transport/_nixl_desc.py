"""Checks of a ``nixl`` region descriptor at ``NixlLink.open``, before NIXL sees any of it.

``warmlink.rendezvous.schema`` validates the same fields when a manifest is decoded; this module
repeats the checks because a Link may be handed a descriptor that never went through the store,
and transport sits below rendezvous (it cannot import it). The constants must equal the schema's
(``NIXL_AGENT_NAME``, ``MAX_NIXL_META_HEX``); tests/transport/test_nixl.py checks that they do.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from warmlink.errors import MetadataError

__all__ = ["AGENT_NAME", "MAX_META_HEX", "check_desc"]

AGENT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
MAX_META_HEX = 1 << 20
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_KEYS = ("kind", "agent", "addr", "nbytes", "device", "mem", "agent_meta")
_MAX_DEVICE = 1 << 16


def _short(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:60] + f"...<{len(text)} chars>"


def _fail(peer: str, msg: str) -> NoReturn:
    raise MetadataError(f"region descriptor from peer={peer!r}: {msg}")


def _int(peer: str, desc: dict, field: str, lo: int, hi: int) -> int:
    x = desc[field]
    if type(x) is not int:
        _fail(peer, f"region.{field}={_short(x)} has type {type(x).__name__}; expected int")
    if not lo <= x < hi:
        _fail(peer, f"region.{field}={x} out of range; expected {lo} <= {field} < {hi}")
    return x


def check_desc(desc: Any, peer: str) -> dict:
    """Raise MetadataError (naming ``peer`` and the field) unless ``desc`` is a valid nixl region."""
    if type(desc) is not dict:
        _fail(peer, f"region={_short(desc)} has type {type(desc).__name__}; expected object with keys {list(_KEYS)}")
    if set(desc) != set(_KEYS):
        _fail(peer, f"region has keys {sorted(map(str, desc))[:10]}; expected keys {list(_KEYS)}")
    if desc["kind"] != "nixl":
        _fail(peer, f"region.kind={_short(desc['kind'])} is wrong; expected 'nixl'")
    agent = desc["agent"]
    if type(agent) is not str or not AGENT_NAME.fullmatch(agent):
        _fail(peer, f"region.agent={_short(agent)} invalid; expected to match {AGENT_NAME.pattern!r}")
    addr = _int(peer, desc, "addr", 0, 1 << 64)
    nbytes = _int(peer, desc, "nbytes", 1, 1 << 63)
    if addr + nbytes > 1 << 64:
        _fail(peer, f"region.addr={addr} + nbytes={nbytes} overflows 64 bits; expected addr + nbytes <= 2**64")
    device = _int(peer, desc, "device", -1, _MAX_DEVICE)
    mem = desc["mem"]
    if mem not in ("DRAM", "VRAM") or type(mem) is not str:
        _fail(peer, f"region.mem={_short(mem)} is unknown; expected one of ['DRAM', 'VRAM']")
    if (mem == "DRAM") != (device == -1):
        _fail(peer, f"region.device={device} does not fit mem={mem!r}; expected device=-1 for DRAM, >= 0 for VRAM")
    meta = desc["agent_meta"]
    if type(meta) is not str or not 2 <= len(meta) <= MAX_META_HEX or not _HEX.fullmatch(meta):
        _fail(peer, f"region.agent_meta={_short(meta)} invalid; expected an even number (2 to {MAX_META_HEX}) "
                    "of lowercase hex characters (NIXL agent metadata)")
    return desc
