"""Validation of every JSON payload that travels through the rendezvous store.

Nothing read from the store is trusted: ``decode`` turns raw bytes into a plain ``dict`` only
after checking every field, and raises ``MetadataError`` naming the peer and the field otherwise,
e.g. ``"publisher manifest from peer='pub/1': tensors[3].parts[0].split_dim=7 out of range;
expected 0 <= split_dim < 2"``. No other exception type escapes (parse errors, bad UTF-8, deep
nesting, wrong types, missing keys). Nothing is unpickled, ever.

Objects are closed: a missing key or an unexpected key is an error, so that ``schema_version``
means something (one optional key: Note [Replicated on the wire]). The manifest's tensor entries
are exactly ``warmlink.refit.manifest.TensorLayout.to_json()`` plus ``region`` and ``offset``,
checked by the same rules as ``TensorLayout`` itself (Note [Layout rules] in ``warmlink._geometry``,
which both import: this module sits below ``refit``).

# Note [Region extent]
Every region descriptor exports ``nbytes`` bytes, and a tensor's ``offset`` counts from the first
of them: a tensor fits when ``offset + tensor nbytes <= region nbytes``. A region's own ``offset``
says where those bytes start in what the peer opens: inside the ``/dev/shm`` segment ``name``
for ``shm`` (whose size only the opener can check, with ``fstat``), inside the allocation of
``alloc_nbytes`` for ``cuda_ipc`` (checked here). ``nixl`` regions are ``[addr, addr + nbytes)``
in the address space of the peer's agent ``agent``; ``agent_meta`` is that agent's (partial) NIXL
metadata as hex, which the opener loads with ``add_remote_agent``: at most ``MAX_NIXL_META_HEX``
characters. ``mem="DRAM"`` goes with ``device=-1``, ``mem="VRAM"`` with a device index >= 0.

# Note [Blob header]
A value larger than one store value (``MAX_VALUE_BYTES``) travels as chunks under sub-keys and a
``blob_header`` under its key (Note [Blobs] in ``rendezvous._blobs``): ``nbytes`` of data, at
most ``MAX_PAYLOAD_BYTES``, cut into ``num_chunks`` chunks of ``chunk_nbytes`` (the last one
shorter), and the lowercase hex SHA-256 of the whole. The counts must agree before a reader
fetches any chunk, so the header alone bounds what a reader buffers.

# Note [Replicated on the wire]
A part may carry ``"replicated": true`` (Note [Replicated parts] in ``refit.manifest``): the
publisher says other ranks hold that box too, and receivers accept the overlap. The key is optional
and ``TensorLayout.to_json`` writes it only when true, so the manifest schema stays version 3: a
manifest from before the flag reads as it always did (no part replicated; a whole tensor is
replicated by nature), except that duplicated shards it announces are now refused at plan time;
and a receiver from before the flag refuses a manifest with the key (an unexpected key) instead of
planning over replicas it cannot tell from a duplicated rank. Anything but a bool is refused.

# Note [Decode budget]
``json.loads`` makes a Python object of every value before any validator looks: an empty list
costs 64 bytes for the 3 of ``[],``, an object 200 and more, a key or a short string about 60. A
payload of 63 MB of empty lists would take 1.5 GB and seconds. So ``decode`` first caps the size
per kind (``register_kind``'s ``max_bytes``: the small kinds are far below 64 KiB) and counts the
bytes that open containers, objects, keys and strings (``bytes.count``, about 1 ms per MB; bytes
inside strings count too), and refuses a payload denser than ``_DENSITY`` allows before parsing
it. No valid payload comes near: every key of every kind is a word, and a manifest tensor spends
at least 14 bytes per container, 58 per object, 12 per key and 4.9 per quote (a 40,000-tensor
manifest: 28, 128, 26 and 10). What passes costs at most about 11 times its size to parse (a
manifest 5 to 7), the worst being short strings and distinct short keys.

Imports neither torch nor anything above ``warmlink.errors``, ``warmlink._dtypes`` and ``warmlink._geometry``.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
from typing import Any, Callable, NoReturn

from warmlink._dtypes import DTYPE_SIZES
from warmlink._geometry import layout_problem
from warmlink.errors import MetadataError
from warmlink.pool import liveness

__all__ = [
    "SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "MANIFEST_SCHEMA_VERSION", "MAX_PAYLOAD_BYTES", "decode", "encode",
    "validate_peer_info", "validate_region", "validate_socket_address", "validate_publisher_manifest",
    "validate_version_state", "tensor_local_shape", "tensor_nbytes", "region_extent_bytes", "register_kind",
    "MAX_VALUE_BYTES", "MIN_CHUNK_BYTES", "validate_blob_header",
]

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
# Manifests changed on their own when layouts became boxes with offsets (Note [Layout rules]); a
# version-1 manifest from an older publisher is refused by name, never misread.
MANIFEST_SCHEMA_VERSION = 4
# A publisher's version header (Note [Version header] in refit._header), bytes.
VERSION_HEADER_NBYTES = 64
MAX_PAYLOAD_BYTES = 64 << 20
# One store value as its writer gives it: TCPStore's libuv server drops the connection of a client
# that sends more than 8 MiB, and the store adds a MAC (Note [Store MAC] in rendezvous._mac).
MAX_VALUE_BYTES = (8 << 20) - 64
MIN_CHUNK_BYTES = 1 << 10  # with MAX_PAYLOAD_BYTES, at most 65536 chunks per blob
MAX_NAME_CHARS = 1024
MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_INT = 1 << 63  # byte counts, offsets, ids, generations: int64
MAX_REGIONS = 1 << 16
MAX_TENSORS = 1 << 20
MAX_PARTS = 4096
MAX_WORLD_SIZE = 1 << 20
MAX_DEVICE = 1 << 16
_MAX_INT_DIGITS = 40
_CPYTHON_MAX_DIGITS = 4300

ROLES = ("publisher", "receiver", "ep")
BACKENDS = ("shm", "cuda_ipc", "nixl")
VERSION_STATES = ("published", "updating")
NIXL_MEMS = ("DRAM", "VRAM")
FAMILIES = ("AF_INET", "AF_INET6")

_SHM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_IPC_HANDLE = re.compile(r"[0-9a-fA-F]{128}")
NIXL_AGENT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
MAX_NIXL_META_HEX = 1 << 20  # 512 KiB of agent metadata; one region's partial metadata is ~0.5 KiB
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DEVICE_UUID = re.compile(r"[0-9a-f]{32}")
_PEER_INFO_KEYS = (
    "schema_version", "kind", "role", "rank", "world_size", "generation", "host", "pid", "start_time",
    "device", "backend",
)
_REGION_KEYS = {
    "shm": ("kind", "name", "nbytes", "offset"),
    "cuda_ipc": ("kind", "handle", "alloc_nbytes", "offset", "nbytes", "device", "buffer_id", "device_uuid"),
    "nixl": ("kind", "agent", "addr", "nbytes", "device", "mem", "agent_meta"),
}
_TENSOR_KEYS = ("name", "dtype", "shape", "parts", "region", "offset")
_PART_KEYS = ("logical", "global_shape", "bounds", "offset")
_REPLICATED_PART_KEYS = _PART_KEYS + ("replicated",)  # Note [Replicated on the wire]
_SMALL_BYTES = 64 << 10  # peer_info, version_state, blob_header: under 2 KiB as encoded, 64 KiB allowed
# Note [Decode budget]: (what, the bytes counted, the fewest bytes of payload allowed per count)
_DENSITY = (("containers", (b"[", b"{"), 8), ("objects", (b"{",), 32), ("keys", (b":",), 9), ("quotes", (b'"',), 3))
_DENSITY_SLACK = 16  # counts allowed on top, so that a tiny payload reaches the validator's own message


def _short(value: Any) -> str:
    """A bounded ``repr`` that cannot recurse or explode on hostile input."""
    if isinstance(value, (dict, list, tuple)):
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, int) and value.bit_length() > 256:  # repr of huge ints is slow or refused
        return f"<int of {value.bit_length()} bits>"
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:60] + f"...<{len(text)} chars>"


def _bound(n: int) -> str:
    return f"2**{n.bit_length() - 1}" if n >= 1 << 20 and n & (n - 1) == 0 else str(n)


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "bool", int: "int", float: "float"}
    return names.get(type(value), type(value).__name__) if value is not None else "null"


class _V:
    """Validation context: knows what is checked and from which peer, builds the messages."""

    __slots__ = ("prefix",)

    def __init__(self, what: str, peer: Any) -> None:
        self.prefix = f"{what} from peer={_short(peer)}"

    def fail(self, msg: str) -> NoReturn:
        raise MetadataError(f"{self.prefix}: {msg}")

    def obj(self, x: Any, path: str, keys: tuple[str, ...]) -> dict:
        if type(x) is dict and len(x) == len(keys):  # the usual case, first: exactly the keys
            for k in keys:
                if k not in x:
                    break
            else:
                return x
        where = path or "payload"
        if type(x) is not dict:
            self.fail(f"{where}={_short(x)} has type {_json_type(x)}; expected object with keys {list(keys)}")
        for k in keys:
            if k not in x:
                self.fail(f"{where}: missing key {k!r}; expected keys {list(keys)}")
        for k in x:
            if k not in keys:
                self.fail(f"{where}: unexpected key {_short(k)}; expected keys {list(keys)}")
        return x

    def int_(self, x: Any, path: str, lo: int, hi: int) -> int:
        """An int (not bool) with ``lo <= x < hi``."""
        if type(x) is not int:
            self.fail(f"{path}={_short(x)} has type {_json_type(x)}; expected int")
        if not lo <= x < hi:
            self.fail(f"{path}={_short(x)} out of range; expected {lo} <= {_leaf(path)} < {_bound(hi)}")
        return x

    def str_(self, x: Any, path: str, pattern: re.Pattern | None = None) -> str:
        if type(x) is not str:
            self.fail(f"{path}={_short(x)} has type {_json_type(x)}; expected string")
        if not 1 <= len(x) <= MAX_NAME_CHARS or not x.isprintable():
            self.fail(f"{path}={_short(x)} invalid; expected 1 to {MAX_NAME_CHARS} printable characters")
        if pattern is not None and not pattern.fullmatch(x):
            self.fail(f"{path}={_short(x)} invalid; expected to match {pattern.pattern!r}")
        return x

    def enum(self, x: Any, path: str, choices: tuple[Any, ...]) -> Any:
        if type(x) is not type(choices[0]) or x not in choices:
            self.fail(f"{path}={_short(x)} is unknown; expected one of {list(choices)}")
        return x

    def list_(self, x: Any, path: str, lo: int, hi: int) -> list:
        if type(x) is not list:
            self.fail(f"{path}={_short(x)} has type {_json_type(x)}; expected array")
        if not lo <= len(x) <= hi:
            self.fail(f"{path} has {len(x)} items; expected {lo} to {hi}")
        return x


# -- leaf objects -------------------------------------------------------------------------------
def _header(v: _V, x: Any, keys: tuple[str, ...], kind: str, versions: tuple[int, ...] = SUPPORTED_SCHEMA_VERSIONS) -> dict:
    if type(x) is not dict:
        v.fail(f"payload={_short(x)} has type {_json_type(x)}; expected object")
    if "schema_version" not in x:
        v.fail(f"payload: missing key 'schema_version'; expected keys {list(keys)}")
    version = x["schema_version"]
    if type(version) is not int or version not in versions:
        v.fail(f"schema_version={_short(version)} is not supported; expected one of {list(versions)} "
               "(do both sides run the same warmlink version?)")
    if "kind" not in x:
        v.fail(f"payload: missing key 'kind'; expected keys {list(keys)}")
    if x["kind"] != kind:
        v.fail(f"kind={_short(x.get('kind'))} is wrong; expected {kind!r}")
    return v.obj(x, "", keys)


def _peer_info(v: _V, x: Any, path: str, nested: bool) -> dict:
    p = f"{path}." if path else ""
    if nested:
        v.obj(x, path, _PEER_INFO_KEYS)
        v.enum(x["schema_version"], f"{p}schema_version", SUPPORTED_SCHEMA_VERSIONS)
        v.enum(x["kind"], f"{p}kind", ("peer_info",))
    else:
        _header(v, x, _PEER_INFO_KEYS, "peer_info")
    v.enum(x["role"], f"{p}role", ROLES)
    world_size = v.int_(x["world_size"], f"{p}world_size", 1, MAX_WORLD_SIZE + 1)
    v.int_(x["rank"], f"{p}rank", 0, world_size)
    v.int_(x["generation"], f"{p}generation", 1, MAX_INT)
    v.str_(x["host"], f"{p}host")
    v.int_(x["pid"], f"{p}pid", 1, 1 << 31)
    v.int_(x["start_time"], f"{p}start_time", 0, MAX_INT)
    v.int_(x["device"], f"{p}device", -1, MAX_DEVICE)
    v.enum(x["backend"], f"{p}backend", BACKENDS)
    return x


def _region(v: _V, x: Any, path: str) -> dict:
    if type(x) is not dict or "kind" not in x:
        v.obj(x, path, ("kind",))  # raises: not an object, or no kind
    kind = x["kind"]
    if type(kind) is not str or kind not in _REGION_KEYS:
        v.fail(f"{path}.kind={_short(kind)} is unknown; expected one of {list(_REGION_KEYS)}")
    v.obj(x, path, _REGION_KEYS[kind])
    if kind == "shm":
        name = v.str_(x["name"], f"{path}.name", _SHM_NAME)
        if name.strip(".") == "":
            v.fail(f"{path}.name={name!r} invalid; expected a name that is not only dots")
        nbytes = v.int_(x["nbytes"], f"{path}.nbytes", 1, MAX_INT)
        v.int_(x["offset"], f"{path}.offset", 0, MAX_INT - nbytes)
    elif kind == "cuda_ipc":
        handle = x["handle"]
        if type(handle) is not str or not _IPC_HANDLE.fullmatch(handle):
            v.fail(f"{path}.handle={_short(handle)} invalid; expected 128 hex characters (64-byte cudaIpcMemHandle_t)")
        alloc = v.int_(x["alloc_nbytes"], f"{path}.alloc_nbytes", 1, MAX_INT)
        offset = v.int_(x["offset"], f"{path}.offset", 0, MAX_INT)
        nbytes = v.int_(x["nbytes"], f"{path}.nbytes", 1, MAX_INT)
        if offset + nbytes > alloc:
            v.fail(
                f"{path}.offset={offset} + nbytes={nbytes} = {offset + nbytes} exceeds alloc_nbytes={alloc}; "
                "expected offset + nbytes <= alloc_nbytes"
            )
        v.int_(x["device"], f"{path}.device", 0, MAX_DEVICE)
        v.int_(x["buffer_id"], f"{path}.buffer_id", 0, MAX_INT)
        v.str_(x["device_uuid"], f"{path}.device_uuid", _DEVICE_UUID)
    else:
        v.str_(x["agent"], f"{path}.agent", NIXL_AGENT_NAME)
        addr = v.int_(x["addr"], f"{path}.addr", 0, 1 << 64)
        nbytes = v.int_(x["nbytes"], f"{path}.nbytes", 1, MAX_INT)
        if addr + nbytes > 1 << 64:
            v.fail(f"{path}.addr={addr} + nbytes={nbytes} overflows 64 bits; expected addr + nbytes <= 2**64")
        device = v.int_(x["device"], f"{path}.device", -1, MAX_DEVICE)
        mem = v.enum(x["mem"], f"{path}.mem", NIXL_MEMS)
        if (mem == "DRAM") != (device == -1):
            v.fail(f"{path}.device={device} does not fit mem={mem!r}; expected device=-1 for DRAM, >= 0 for VRAM")
        meta = x["agent_meta"]
        if type(meta) is not str or not 2 <= len(meta) <= MAX_NIXL_META_HEX or not _HEX.fullmatch(meta):
            v.fail(
                f"{path}.agent_meta={_short(meta)} invalid; expected an even number (2 to {MAX_NIXL_META_HEX}) "
                "of lowercase hex characters (NIXL agent metadata)"
            )
    return x


def region_extent_bytes(region: dict) -> int:
    """Bytes usable for tensors in a validated region descriptor. See Note [Region extent]."""
    return region["nbytes"]


# -- tensors ------------------------------------------------------------------------------------
def _is_name(x: Any) -> bool:
    """What ``_V.str_`` accepts without a pattern."""
    return type(x) is str and 1 <= len(x) <= MAX_NAME_CHARS and x.isprintable()


def _are_ints(xs: list, hi: int) -> bool:
    """Every item an int (not bool) in ``[0, hi)``: what ``_V.int_`` accepts."""
    for d in xs:
        if type(d) is not int or not 0 <= d < hi:
            return False
    return True


def _part_fast(x: dict, ndim: int) -> tuple | None:
    """``_part``'s result when every field is valid, else None; builds no path or message: a
    manifest has a part per tensor and a field path per int, and formatting them all cost more than
    checking them (``_part`` then finds and names the bad field)."""
    logical, dims, raw_bounds, offset = x["logical"], x["global_shape"], x["bounds"], x["offset"]
    if not (_is_name(logical) and type(dims) is list and len(dims) <= MAX_NDIM and _are_ints(dims, MAX_DIM)
            and type(raw_bounds) is list and len(raw_bounds) == len(dims) and type(offset) is list
            and len(offset) == ndim and _are_ints(offset, MAX_DIM)):
        return None
    bounds = []
    for b in raw_bounds:
        if type(b) is not list or len(b) != 2 or not _are_ints(b, MAX_DIM + 1):
            return None
        bounds.append((b[0], b[1]))
    return logical, tuple(dims), tuple(bounds), tuple(offset)


def _part(v: _V, x: Any, path: str, ndim: int) -> tuple[str, tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
    if type(x) is dict and "replicated" in x:  # See Note [Replicated on the wire]
        v.obj(x, path, _REPLICATED_PART_KEYS)
        if type(x["replicated"]) is not bool:
            v.fail(f"{path}.replicated={_short(x['replicated'])} has type {_json_type(x['replicated'])}; expected bool")
    else:
        v.obj(x, path, _PART_KEYS)
    fast = _part_fast(x, ndim)
    if fast is not None:
        return fast
    logical = v.str_(x["logical"], f"{path}.logical")
    dims = v.list_(x["global_shape"], f"{path}.global_shape", 0, MAX_NDIM)
    shape = tuple(v.int_(d, f"{path}.global_shape[{i}]", 0, MAX_DIM) for i, d in enumerate(dims))
    raw_bounds = v.list_(x["bounds"], f"{path}.bounds", len(shape), len(shape))
    bounds = []
    for i, b in enumerate(raw_bounds):
        pair = v.list_(b, f"{path}.bounds[{i}]", 2, 2)
        bounds.append((v.int_(pair[0], f"{path}.bounds[{i}][0]", 0, MAX_DIM + 1),
                       v.int_(pair[1], f"{path}.bounds[{i}][1]", 0, MAX_DIM + 1)))
    raw_offset = v.list_(x["offset"], f"{path}.offset", ndim, ndim)
    offset = tuple(v.int_(o, f"{path}.offset[{i}]", 0, MAX_DIM) for i, o in enumerate(raw_offset))
    return logical, shape, tuple(bounds), offset


def _tensor_shape(v: _V, x: dict, path: str) -> tuple[int, ...]:
    dims = x["shape"]
    if type(dims) is list and len(dims) <= MAX_NDIM and _are_ints(dims, MAX_DIM):
        shape = tuple(dims)
    else:  # names the bad field
        dims = v.list_(dims, f"{path}.shape", 0, MAX_NDIM)
        shape = tuple(v.int_(d, f"{path}.shape[{i}]", 0, MAX_DIM) for i, d in enumerate(dims))
    raw = v.list_(x["parts"], f"{path}.parts", 1, MAX_PARTS)
    parts = [_part(v, p, f"{path}.parts[{i}]", len(shape)) for i, p in enumerate(raw)]
    problem = layout_problem(shape, parts)  # See Note [Layout rules] in warmlink._geometry
    if problem is not None:
        v.fail(f"{path}: {problem}")
    return shape


def tensor_local_shape(tensor: dict) -> tuple[int, ...]:
    """Local (this rank's) shape of a manifest tensor entry, as ``TensorLayout.local_shape``.

    Raises:
        MetadataError: the entry's shape or parts are invalid.
    """
    v = _V("tensor entry", "local")
    if type(tensor) is not dict or "parts" not in tensor or "shape" not in tensor:
        v.fail(f"tensor={_short(tensor)} invalid; expected an object with 'shape' and 'parts'")
    return _tensor_shape(v, tensor, "tensor")


def tensor_nbytes(tensor: dict) -> int:
    """Bytes of a manifest tensor entry: numel of its local shape times its dtype's size."""
    dtype = tensor.get("dtype") if type(tensor) is dict else None
    n = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if n is None:
        raise MetadataError(f"tensor entry from peer='local': dtype={_short(dtype)} is unknown")
    for d in tensor_local_shape(tensor):
        n *= d
    return n


def _manifest(v: _V, x: Any) -> dict:
    _header(v, x, ("schema_version", "kind", "peer", "regions", "tensors", "board", "header"), "publisher_manifest",
            (MANIFEST_SCHEMA_VERSION,))
    _peer_info(v, x["peer"], "peer", nested=True)
    if x["peer"]["role"] != "publisher":
        v.fail(f"peer.role={x['peer']['role']!r} is wrong; expected 'publisher'")
    board = x["board"]
    if board is not None:  # Note [Version board] in refit._board
        v.obj(board, "board", ("name", "token"))
        v.str_(board["name"], "board.name", liveness.TAGGED_NAME)
        v.str_(board["token"], "board.token", liveness.TOKEN)
    regions = v.list_(x["regions"], "regions", 0, MAX_REGIONS)
    extents = [region_extent_bytes(_region(v, r, f"regions[{i}]")) for i, r in enumerate(regions)]
    header = x["header"]  # Note [Version header] in refit._header
    v.obj(header, "header", ("region", "offset"))
    v.int_(header["region"], "header.region", 0, len(regions))
    if extents[header["region"]] < VERSION_HEADER_NBYTES:
        v.fail(f"header.region={header['region']} holds {extents[header['region']]} bytes; expected at least "
               f"{VERSION_HEADER_NBYTES} for the version header")
    v.int_(header["offset"], "header.offset", 0, extents[header["region"]] - VERSION_HEADER_NBYTES + 1)
    tensors = v.list_(x["tensors"], "tensors", 0, MAX_TENSORS)
    names: set[str] = set()
    dtypes = tuple(DTYPE_SIZES)
    # each field is checked inline first, and through ``v`` (which formats its path) only to name
    # what is wrong: see ``_part_fast``
    for i, t in enumerate(tensors):
        path = f"tensors[{i}]"
        v.obj(t, path, _TENSOR_KEYS)
        name = t["name"]
        if not _is_name(name):
            v.str_(name, f"{path}.name")
        if name in names:
            v.fail(f"{path}.name={name!r} appears twice; expected unique tensor names")
        names.add(name)
        dtype = t["dtype"]
        size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
        if size is None:
            v.enum(dtype, f"{path}.dtype", dtypes)
        numel = 1
        for d in _tensor_shape(v, t, path):
            numel *= d
        if not regions:
            v.fail(f"{path}.region={_short(t['region'])} out of range; regions=[] is empty")
        region_idx, offset = t["region"], t["offset"]
        if type(region_idx) is not int or not 0 <= region_idx < len(regions):
            v.int_(region_idx, f"{path}.region", 0, len(regions))
        if type(offset) is not int or not 0 <= offset < MAX_INT:
            v.int_(offset, f"{path}.offset", 0, MAX_INT)
        nbytes = numel * size
        if offset + nbytes > extents[region_idx]:
            v.fail(
                f"{path}.offset={offset} + nbytes={nbytes} = {offset + nbytes} exceeds "
                f"regions[{region_idx}] extent={extents[region_idx]} bytes; expected the tensor inside its region"
            )
    return x


def _version_state(v: _V, x: Any) -> dict:
    _header(v, x, ("schema_version", "kind", "version", "state", "generation"), "version_state")
    v.int_(x["version"], "version", 0, MAX_INT)
    v.enum(x["state"], "state", VERSION_STATES)
    v.int_(x["generation"], "generation", 1, MAX_INT)
    return x


def _blob_header(v: _V, x: Any) -> dict:
    _header(v, x, ("schema_version", "kind", "nbytes", "chunk_nbytes", "num_chunks", "sha256"), "blob_header")
    nbytes = v.int_(x["nbytes"], "nbytes", 0, MAX_PAYLOAD_BYTES + 1)
    chunk = v.int_(x["chunk_nbytes"], "chunk_nbytes", MIN_CHUNK_BYTES, MAX_VALUE_BYTES + 1)
    num = v.int_(x["num_chunks"], "num_chunks", 0, MAX_PAYLOAD_BYTES // MIN_CHUNK_BYTES + 1)
    if num != -(-nbytes // chunk):
        v.fail(f"num_chunks={num} does not cut nbytes={nbytes} into chunks of chunk_nbytes={chunk}; "
               f"expected num_chunks={-(-nbytes // chunk)}")
    if type(x["sha256"]) is not str or not _SHA256.fullmatch(x["sha256"]):
        v.fail(f"sha256={_short(x['sha256'])} invalid; expected 64 lowercase hex characters")
    return x


# -- public validators --------------------------------------------------------------------------
def validate_peer_info(obj: Any, peer: str) -> dict:
    """Check a parsed ``peer_info`` payload; returns it unchanged. Raises MetadataError."""
    return _peer_info(_V("peer info", peer), obj, "", nested=False)


def validate_region(obj: Any, peer: str, field: str = "region") -> dict:
    """Check one region descriptor (``shm``, ``cuda_ipc`` or ``nixl``); ``field`` names it in errors."""
    return _region(_V("region descriptor", peer), obj, field)


def validate_socket_address(obj: Any, peer: str) -> dict:
    """Check ``{"family": "AF_INET"|"AF_INET6", "host": <ip literal>, "port": 1..65535}``."""
    v = _V("socket address", peer)
    v.obj(obj, "", ("family", "host", "port"))
    family = v.enum(obj["family"], "family", FAMILIES)
    host = v.str_(obj["host"], "host")
    try:
        (ipaddress.IPv4Address if family == "AF_INET" else ipaddress.IPv6Address)(host)
    except ValueError:
        v.fail(f"host={host!r} invalid; expected an {'IPv4' if family == 'AF_INET' else 'IPv6'} address for {family}")
    v.int_(obj["port"], "port", 1, 65536)
    return obj


def validate_publisher_manifest(obj: Any, peer: str) -> dict:
    """Check a parsed ``publisher_manifest``: regions, shards, and every tensor inside its region."""
    return _manifest(_V("publisher manifest", peer), obj)


def validate_version_state(obj: Any, peer: str) -> dict:
    """Check a parsed ``version_state`` payload; returns it unchanged. Raises MetadataError."""
    return _version_state(_V("version state", peer), obj)


def validate_blob_header(obj: Any, peer: str) -> dict:
    """Check a parsed ``blob_header`` (Note [Blob header]); returns it unchanged. Raises MetadataError."""
    return _blob_header(_V("blob header", peer), obj)


_VALIDATORS: dict[str, Callable[[Any, str], dict]] = {
    "blob_header": validate_blob_header,
    "peer_info": validate_peer_info,
    "publisher_manifest": validate_publisher_manifest,
    "version_state": validate_version_state,
}


_MAX_BYTES = {"blob_header": _SMALL_BYTES, "peer_info": _SMALL_BYTES, "version_state": _SMALL_BYTES,
              "publisher_manifest": MAX_PAYLOAD_BYTES}


def register_kind(kind: str, validator: Callable[[Any, str], dict], max_bytes: int = MAX_PAYLOAD_BYTES) -> None:
    """Let a workload above this layer (ep) add a payload kind; ``decode`` and ``encode`` then
    validate it like the built-in ones. ``validator(obj, peer)`` raises ``MetadataError``;
    ``decode`` refuses a payload of more than ``max_bytes`` (at most ``MAX_PAYLOAD_BYTES``) or one
    denser than Note [Decode budget] allows, before parsing it."""
    if kind in _VALIDATORS and _VALIDATORS[kind] is not validator:
        raise MetadataError(f"schema.register_kind: kind {kind!r} is already registered")
    if type(max_bytes) is not int or not 1 <= max_bytes <= MAX_PAYLOAD_BYTES:
        raise MetadataError(f"schema.register_kind: max_bytes={max_bytes!r} out of range; expected an int in "
                            f"[1, {_bound(MAX_PAYLOAD_BYTES)}]")
    _VALIDATORS[kind] = validator
    _MAX_BYTES[kind] = max_bytes


# -- wire ---------------------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in object")
    return out


def _parse_int(text: str) -> int:
    if len(text) > _MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text)} digits")
    return int(text)


def _int_hook() -> Callable[[str], int] | None:
    """``json.loads``'s ``parse_int``: None (the parser's own ints, without a Python call per
    literal: a tenth of a manifest's decode) where the interpreter itself refuses a literal of more
    than 4300 digits (``sys.get_int_max_str_digits``, CPython's default), else ``_parse_int``: a
    literal costs time quadratic in its digits."""
    limit = getattr(sys, "get_int_max_str_digits", None)
    return None if limit is not None and 0 < limit() <= _CPYTHON_MAX_DIGITS else _parse_int


def _reject_constant(text: str) -> NoReturn:
    raise ValueError(f"non-standard JSON constant {text}")


def _check_density(v: _V, data: bytes | str, kind: str) -> None:
    """Refuse ``data`` before parsing when it holds more containers, objects, keys or quotes than
    any valid payload of its size (Note [Decode budget])."""
    n = len(data)
    text = isinstance(data, str)
    for what, chars, min_bytes in _DENSITY:
        count = sum(data.count(c.decode() if text else c) for c in chars)
        if count > n // min_bytes + _DENSITY_SLACK:
            shown = " and ".join(repr(c.decode()) for c in chars)
            v.fail(f"payload of {n} bytes holds {count} {what} ({shown}, counted in strings too); expected at most "
                   f"one per {min_bytes} bytes: no valid {kind} is that dense (refused before parsing)")


def decode(raw: bytes | bytearray | memoryview | str, expected_kind: str, peer: str) -> dict:
    """Parse and validate one payload read from the store.

    Args:
        raw: the bytes (UTF-8 JSON) or text read from the store: at most ``MAX_PAYLOAD_BYTES``,
            64 KiB for ``peer_info``, ``version_state`` and ``blob_header``.
        expected_kind: ``"peer_info"``, ``"publisher_manifest"``, ``"version_state"``,
            ``"blob_header"`` or a kind given to ``register_kind``.
        peer: who wrote it (e.g. ``"pub/1"``), named in every error.

    Returns:
        The validated payload as a plain ``dict`` (JSON types only), owned by the caller.

    Raises:
        MetadataError: on any problem at all, naming the peer and the field.

    Blocking? No (pure CPU). Memory: parsing takes at most about 11 times ``len(raw)`` (Note
    [Decode budget]). Warm path? Called once per peer join or version, not per byte.
    """
    v = _V(expected_kind.replace("_", " ") if isinstance(expected_kind, str) else "payload", peer)
    validator = _VALIDATORS.get(expected_kind) if isinstance(expected_kind, str) else None
    if validator is None:
        v.fail(f"expected_kind={_short(expected_kind)} is unknown; expected one of {list(_VALIDATORS)}")
    if not isinstance(raw, (bytes, bytearray, memoryview, str)):
        v.fail(f"raw payload has type {type(raw).__name__}; expected bytes or str")
    limit = _MAX_BYTES.get(expected_kind, MAX_PAYLOAD_BYTES)
    size = raw.nbytes if isinstance(raw, memoryview) else len(raw)
    if size > limit:
        v.fail(f"payload of {size} bytes exceeds the limit; expected at most {_bound(limit)} bytes for a {expected_kind}")
    data = raw if isinstance(raw, (bytes, str)) else bytes(raw)
    _check_density(v, data, expected_kind)
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_int_hook(), parse_constant=_reject_constant)
    except (ValueError, RecursionError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        v.fail(f"payload is not valid JSON ({type(e).__name__}: {str(e)[:200]})")
    return validator(obj, peer)  # walks only the closed schema: no recursion into hostile nesting


def encode(obj: dict) -> bytes:
    """Serialize a payload as compact, key-sorted UTF-8 JSON for the store.

    Known kinds are fully validated first (a bad payload is refused before it is published);
    other kinds must still carry a supported ``schema_version`` and a string ``kind``.

    Returns:
        New ``bytes`` of at most ``MAX_PAYLOAD_BYTES``.

    Raises:
        MetadataError: missing/unsupported header, invalid content, or not JSON-serializable.
    """
    v = _V("outgoing payload", "local")
    if type(obj) is not dict:
        v.fail(f"payload has type {type(obj).__name__}; expected dict")
    if obj.get("schema_version") not in (*SUPPORTED_SCHEMA_VERSIONS, MANIFEST_SCHEMA_VERSION) or type(obj.get("schema_version")) is not int:
        v.fail(
            f"schema_version={_short(obj.get('schema_version'))} is missing or unsupported; "
            f"expected one of {list(SUPPORTED_SCHEMA_VERSIONS)}"
        )
    kind = obj.get("kind")
    if type(kind) is not str or not kind:
        v.fail(f"kind={_short(kind)} is missing; expected a non-empty string")
    if kind in _VALIDATORS:
        _VALIDATORS[kind](obj, "local")
    try:
        data = json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:
        v.fail(f"payload of kind {kind!r} is not JSON-serializable ({type(e).__name__}: {str(e)[:200]})")
    if len(data) > MAX_PAYLOAD_BYTES:
        v.fail(f"payload of kind {kind!r} is {len(data)} bytes; expected at most {_bound(MAX_PAYLOAD_BYTES)}")
    return data
