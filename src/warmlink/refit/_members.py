"""Who is in a fan-out group, and which replica each one pulls from: records in the store and a tree.

# Note [Fan-out tree]
The replicas of one engine that declare the same layout (``FanOut(group, rank=)``: the same group
name and the same rank within their engine) form one group. A receiver joins its group at its
first cycle: it takes a member number ``m = add(fanout/{group}/{rank}/members, 1)`` (1, 2, ... in
the order they join) and writes its record under ``fanout/{group}/{rank}/member/{m}``: its process
(host, pid, start time, liveness token), its backend, the random incarnation of its relay, and the
descriptors of its header (in its link's memory and in its host's shared memory) and of the
receive regions it serves (none until it has one; two with ``install="swap"``, whose cycles
alternate between the halves of a double buffer, so that a flip costs no store round trip).

Member ``m`` pulls from its parent in a tree of degree ``d`` over the member numbers:
``(m - 2) // d + 1`` in a tree (``d > 1``); in a chain (``d = 1``, the default: each link carries
the model once) from the places (host, GPU) the records of members ``1 .. m - 1`` and the
publishers' manifests give: the first earlier member on its place (the same host and GPU), else
the publishers if they are all on that GPU, else the first member of the latest earlier place on
its host, else the first member of the place of member ``m - 1``, else ``m - 1`` (and the
publishers instead of a first member on their own GPU: the same link, without its lag). So the
members of one place form a star around the first to arrive there (their copies cross no link),
and the first members of the places a chain, one hop per link between GPUs or hosts: a version
crosses each link about once whatever the order of joining, and goes through one hop per place
rather than one per replica (8 replicas on 3 hosts: 4 hops, not 8). Three replicas joining as
GPU1, GPU0, GPU1 (the trainer on GPU0) pull 1 <- publishers, 2 <- publishers (a copy within GPU0,
at HBM speed, from the start of the version rather than behind replica 1), 3 <- 1, not 3 <- 2,
which would carry the model over GPU0 -> GPU1 a second time. Member 1 pulls from the publishers.
A member that is gone (its process died, or it closed), once a member found it so, is left out of
that member's tree from then on: its parent is worked out again among the members left (a star
whose first member left gathers around its next one; a tree routes around to the gone member's
own parent), so a replica leaving does not send the others to the publishers for the rest of
the job. One that stalls is routed around for that cycle (Note [Fan-out] in ``refit._relay``). A member joining a running job is the last number: its parent is a replica
that already holds the current version. The plan is the library's: nothing but the order of
joining, the places and ``degree`` decides it, so every member works out its own sources alone (a
record it cannot read counts as a place of its own).

Records are MAC'd like every value, but anyone with the job's secret could write one, and the
store can replay an old one: a record only says where to look. What a member serves is decided by
its header, which only it writes (Note [Fan-out]), read through the link: it names the region it
serves (a digest of its descriptor), its incarnation must be the record's, its plan signature
this receiver's.
"""

from __future__ import annotations

import re
from typing import Any

from warmlink.errors import BackendUnavailable, MetadataError
from warmlink.pool import liveness
from warmlink.rendezvous import schema

__all__ = ["KIND", "members_key", "member_key", "make_record", "validate_member", "ancestors", "parent", "device_id",
           "place_of", "GROUP_NAME", "MAX_REGIONS"]

KIND = "fanout_member"
MAX_REGIONS = 2  # the halves of a swap double buffer
GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_KEYS = ("schema_version", "kind", "group", "rank", "member", "incarnation", "host", "device", "pid", "start_time",
         "token", "backend", "header", "host_header", "regions")
_MAX_RANK = 1 << 20
_MAX_MEMBER = 1 << 40


def members_key(group: str, rank: int) -> str:
    return f"fanout/{group}/{rank}/members"


def member_key(group: str, rank: int, member: int) -> str:
    return f"fanout/{group}/{rank}/member/{member}"


Place = tuple  # (host, device): where a member's buffers are (``place_of``)


def parent(member: int, degree: int, places: dict[int, Place] | None = None, gone=frozenset()) -> int:
    """The member ``member`` pulls from (0: the publishers), given the ``places`` known of it, of
    the members before it and (key 0) of the publishers, and the members known ``gone`` (a tree of
    ``degree`` > 1 routes around those in ``ancestors``). See Note [Fan-out tree]."""
    if member <= 1:
        return 0
    if degree > 1:
        return (member - 2) // degree + 1
    places = {m: p for m, p in (places or {}).items() if m not in gone}
    mine = places.get(member)
    if mine is not None:
        head = _first(member, places, lambda p: p == mine)  # on its own GPU: a star, copies within it
        if head is not None:
            return head
        if mine[1] and places.get(0) == mine:  # the publishers' GPU: a copy crossing no link
            return 0
        # else the head of the latest place on its host (a chain over its GPUs' links), or of the
        # place of the member before it (across hosts)
        near = next((m for m in range(member - 1, 0, -1) if m in places and places[m][0] == mine[0]), None)
        near = near if near is not None else (member - 1 if member - 1 in places else None)
        if near is not None:
            head = _first(member, places, lambda p: p == places[near])
            # one on the publishers' GPU crosses the same link as they, later
            return 0 if places[head][1] and places[head] == places.get(0) else head
    return next((m for m in range(member - 1, 0, -1) if m not in gone), 0)


def _first(member: int, places: dict[int, Place], same) -> int | None:
    """The first member before ``member`` whose place is ``same``, or None."""
    return next((m for m in range(1, member) if m in places and same(places[m])), None)


def ancestors(member: int, degree: int, places: dict[int, Place] | None = None, gone=frozenset()) -> list[int]:
    """``member``'s parent, its parent's parent, ... down to 0 (the publishers), leaving out the
    members known ``gone``."""
    out = []
    while member > 0:
        member = parent(member, degree, places, gone)
        if member not in gone:
            out.append(member)
    return out


def device_id(device: int) -> str:
    """What tells a GPU apart across processes (its UUID as 32 hex characters, as CUDA IPC region
    descriptors name it; an ordinal depends on CUDA_VISIBLE_DEVICES), '' for the CPU."""
    if device < 0:
        return ""
    from warmlink import _cuda

    try:
        return _cuda.device_uuid(device)
    except BackendUnavailable:  # no cuda-bindings (a NIXL-only GPU setup): torch's spelling of the same UUID
        import torch

        return str(torch.cuda.get_device_properties(device).uuid).removeprefix("GPU-").replace("-", "").lower()


def place_of(record: dict) -> Place:
    return record["host"], record["device"]


def make_record(*, group: str, rank: int, member: int, incarnation: int, identity: tuple[str, int, int], device: str,
                token: str | None, backend: str, header: dict, host_header: dict | None, regions: list) -> dict:
    """A member's record (Note [Fan-out tree]), for ``Store.set_json``; ``device`` is ``device_id``'s,
    ``host_header`` the shared-memory region of its header on its host (Note [Relay header in host
    memory] in ``refit._relay_header``), or None; ``regions`` the receive regions it serves (0 to
    ``MAX_REGIONS``; its header names the one a cycle fills by its descriptor's digest)."""
    host, pid, start = identity
    return {"schema_version": 1, "kind": KIND, "group": group, "rank": rank, "member": member, "incarnation": incarnation,
            "host": host, "device": device, "pid": pid, "start_time": start, "token": token or "", "backend": backend,
            "header": header, "host_header": host_header, "regions": list(regions)}


def _fail(peer: str, msg: str):
    raise MetadataError(f"fan-out member record from peer={peer!r}: {msg}")


def _int(obj: dict, key: str, lo: int, hi: int, peer: str) -> int:
    value = obj[key]
    if type(value) is not int or not lo <= value < hi:
        _fail(peer, f"{key}={value!r}; expected an int in [{lo}, {hi})")
    return value


def validate_member(obj: Any, peer: str) -> dict:
    """Check a parsed ``fanout_member`` payload; returns it unchanged. Raises ``MetadataError``."""
    if type(obj) is not dict or set(obj) != set(_KEYS):
        _fail(peer, f"keys {sorted(obj) if type(obj) is dict else type(obj).__name__}; expected exactly {sorted(_KEYS)}")
    if obj["schema_version"] not in schema.SUPPORTED_SCHEMA_VERSIONS or type(obj["schema_version"]) is not int:
        _fail(peer, f"schema_version={obj['schema_version']!r} is not supported")
    if obj["kind"] != KIND:
        _fail(peer, f"kind={obj['kind']!r}; expected {KIND!r}")
    if type(obj["group"]) is not str or not GROUP_NAME.fullmatch(obj["group"]):
        _fail(peer, f"group={obj['group']!r}; expected {GROUP_NAME.pattern}")
    _int(obj, "rank", 0, _MAX_RANK, peer)
    _int(obj, "member", 1, _MAX_MEMBER, peer)
    _int(obj, "incarnation", 0, 1 << 63, peer)
    _int(obj, "pid", 1, 1 << 31, peer)
    _int(obj, "start_time", 0, 1 << 63, peer)
    host = obj["host"]
    if type(host) is not str or not 1 <= len(host) <= 255 or not host.isprintable():
        _fail(peer, f"host={host!r}; expected 1 to 255 printable characters")
    device = obj["device"]
    if type(device) is not str or len(device) > 100 or not device.isprintable():
        _fail(peer, f"device={device!r}; expected up to 100 printable characters ('' for the CPU)")
    token = obj["token"]
    if type(token) is not str or (token and not liveness.TOKEN.fullmatch(token)):
        _fail(peer, f"token={token!r}; expected '' or a process lock token")
    if obj["backend"] not in schema.BACKENDS:
        _fail(peer, f"backend={obj['backend']!r}; expected one of {list(schema.BACKENDS)}")
    schema.validate_region(obj["header"], peer, "header")
    if obj["host_header"] is not None:
        schema.validate_region(obj["host_header"], peer, "host_header")
        if obj["host_header"]["kind"] != "shm":
            _fail(peer, f"host_header.kind={obj['host_header']['kind']!r}; expected 'shm'")
    regions = obj["regions"]
    if type(regions) is not list or len(regions) > MAX_REGIONS:
        _fail(peer, f"regions: {type(regions).__name__} of {len(regions) if type(regions) is list else '?'}; expected a "
                    f"list of at most {MAX_REGIONS} region descriptors")
    for i, region in enumerate(regions):
        schema.validate_region(region, peer, f"regions[{i}]")
    return obj


# a record is under 2 KB but for a NIXL agent's metadata, which each link region's descriptor carries
schema.register_kind(KIND, validate_member, max_bytes=(2 + MAX_REGIONS) * schema.MAX_NIXL_META_HEX)
