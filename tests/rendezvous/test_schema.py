"""Tests for warmlink.rendezvous.schema: valid payloads, one-field corruptions, fuzzing."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmlink.errors import LayoutError, MetadataError
from warmlink.refit.manifest import Shard, TensorLayout
from warmlink.rendezvous import schema

HANDLE = "ab" * 64
PEER = "pub/1"


def peer_info(**over: Any) -> dict:
    info = {
        "schema_version": 1, "kind": "peer_info", "role": "publisher", "rank": 1, "world_size": 2,
        "generation": 3, "host": "node-7", "pid": 4242, "start_time": 1_700_000_000, "device": 0, "backend": "cuda_ipc",
    }
    info.update(over)
    return info


def layouts() -> list[TensorLayout]:
    q, k, v = Shard.split((32, 16), 0, 2, 1), Shard.split((8, 16), 0, 2, 1), Shard.split((8, 16), 0, 2, 1)
    return [
        TensorLayout.plain("embed.weight", "bfloat16", (100, 16)),  # replicated
        TensorLayout.plain("down.weight", "float32", (16, 11), split_dim=1, num_shards=3, shard_idx=0),  # uneven: 4
        TensorLayout.fused("qkv.weight", "bfloat16", [("q", q), ("k", k), ("v", v)], fuse_dim=0),  # [24, 16]
        TensorLayout.fused("gate_up.weight", "float16", [("gate", Shard.split((7, 5), 0, 2, 1)), ("up", Shard.split((9, 5), 0, 2, 0))]),
        TensorLayout.plain("模型.norm", "float32", ()),  # scalar, non-ASCII name
        TensorLayout.plain("vocab.weight", "bfloat16", (10, 4), 0, 2, 1, shape=(8, 4)),  # padded: rows 5:10 + 3
    ]


def manifest() -> dict:
    regions = [
        {"kind": "cuda_ipc", "handle": HANDLE, "alloc_nbytes": 1 << 20, "offset": 512, "nbytes": 8192, "device": 0, "buffer_id": 7,
         "device_uuid": "0123456789abcdef" * 2},
        {"kind": "shm", "name": "wl_pub_1.arena", "nbytes": 4096, "offset": 1024},
        {"kind": "nixl", "agent": "pub-1", "addr": 1 << 40, "nbytes": 4096, "device": -1, "mem": "DRAM",
         "agent_meta": "0a1b" * 100},
    ]
    tensors, offsets = [], [(0, 0), (1, 0), (0, 3200), (2, 0), (1, 3000), (2, 256)]
    for layout, (region, offset) in zip(layouts(), offsets):
        tensors.append({**layout.to_json(), "region": region, "offset": offset})
    board = {"name": "wl-4242-0123abcd-7", "token": "0" * 32 + "-2a/wl-4242-0123abcd.lock"}
    return {"schema_version": 4, "kind": "publisher_manifest", "peer": peer_info(), "regions": regions, "tensors": tensors,
            "board": board, "header": {"region": 1, "offset": 64}}


def version_state() -> dict:
    return {"schema_version": 1, "kind": "version_state", "version": 5, "state": "published", "generation": 1}


VALID = {"peer_info": peer_info, "publisher_manifest": manifest, "version_state": version_state}


# -- valid payloads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(VALID))
def test_round_trip(kind: str) -> None:
    obj = VALID[kind]()
    raw = schema.encode(obj)
    assert raw == json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    assert schema.decode(raw, kind, PEER) == obj
    assert schema.decode(raw.decode(), kind, PEER) == obj
    assert schema.decode(bytearray(raw), kind, PEER) == obj


def test_nbytes_match_tensor_layout() -> None:
    obj = manifest()
    for entry, layout in zip(obj["tensors"], layouts()):
        assert schema.tensor_local_shape(entry) == layout.local_shape
        assert schema.tensor_nbytes(entry) == layout.nbytes
        assert TensorLayout.from_json(entry) == layout
    assert [schema.region_extent_bytes(r) for r in obj["regions"]] == [8192, 4096, 4096]


# -- targeted errors ------------------------------------------------------------------------------
def test_example_message() -> None:
    obj = manifest()
    obj["tensors"][3]["parts"][0]["bounds"][0] = [3, 9]
    with pytest.raises(MetadataError) as e:
        schema.decode(json.dumps(obj), "publisher_manifest", PEER)
    assert str(e.value) == (
        "publisher manifest from peer='pub/1': tensors[3]: parts[0] (logical='gate'): bounds[0]=(3, 9) out of range; "
        "expected 0 <= start <= stop <= 7"
    )


def _fails(obj: Any, kind: str, *needles: str) -> str:
    with pytest.raises(MetadataError) as e:
        schema.decode(json.dumps(obj), kind, PEER)
    msg = str(e.value)
    assert f"peer={PEER!r}" in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.mark.parametrize(
    "path,value,needle",
    [
        (("tensors", 0, "offset"), 8192 - 3199, "tensors[0].offset=4993 + nbytes=3200"),  # past cuda_ipc nbytes
        (("tensors", 1, "offset"), 4096 - 255, "exceeds regions[1] extent=4096"),  # shm: region offset is in the segment
        (("tensors", 0, "region"), 3, "tensors[0].region=3 out of range; expected 0 <= region < 3"),
        (("tensors", 1, "parts", 0, "bounds", 1), [0, 12], "bounds[1]=(0, 12) out of range; expected 0 <= start <= stop <= 11"),
        (("tensors", 1, "parts", 0, "bounds", 1), [5, 4], "bounds[1]=(5, 4) out of range"),
        (("tensors", 1, "parts", 0, "bounds"), [[0, 16]], "bounds has 1 items; expected 2 to 2"),
        (("tensors", 1, "parts", 0, "offset"), [0, 1], "offset[1]=1 + extent 4 exceeds shape[1]=4"),
        (("tensors", 1, "parts", 0, "offset"), [0], "offset has 1 items; expected 2 to 2"),
        (("tensors", 1, "shape"), [16, 3], "offset[1]=0 + extent 4 exceeds shape[1]=3"),
        (("tensors", 2, "parts", 1, "offset"), [10, 0], "parts[0] and parts[1] overlap in the physical tensor"),
        (("tensors", 2, "parts", 1, "logical"), "q", "differs from (32, 16) of an earlier part of the same logical"),
        (("tensors", 2, "parts", 2, "global_shape"), [8, 16, 1], "parts[2].bounds has 2 items; expected 3 to 3"),
        (("tensors", 5, "parts", 0, "bounds", 0), [0, 9], "offset[0]=0 + extent 9 exceeds shape[0]=8"),
        (("tensors", 4, "name"), "embed.weight", "tensors[4].name='embed.weight' appears twice"),
        (("tensors", 0, "parts", 0, "global_shape", 0), 1 << 40, "expected 0 <= global_shape[0] < 2**40"),
        (("tensors", 0, "parts", 0, "global_shape"), [1] * 9, "global_shape has 9 items; expected 0 to 8"),
        (("tensors", 0, "dtype"), "float128", "tensors[0].dtype='float128' is unknown"),
        (("board", "name"), "../../etc/passwd", "board.name='../../etc/passwd' invalid"),
        (("board", "name"), "wl-1-0123abcd-1-x", "board.name='wl-1-0123abcd-1-x' invalid"),
        (("board", "token"), "/tmp/x.lock", "board.token='/tmp/x.lock' invalid"),
        (("board",), 7, "board=7 has type int"),
        (("regions", 0, "offset"), (1 << 20) - 8191, "exceeds alloc_nbytes=1048576"),
        (("regions", 0, "handle"), "ab" * 63 + "a", "regions[0].handle="),
        (("regions", 0, "handle"), "zz" * 64, "expected 128 hex characters"),
        (("regions", 1, "name"), "..", "not only dots"),
        (("regions", 1, "name"), "a/b", "regions[1].name='a/b' invalid"),
        (("regions", 1, "offset"), (1 << 63) - 4096, "regions[1].offset=9223372036854771712 out of range"),
        (("regions", 2, "mem"), "V-RAM", "regions[2].mem='V-RAM' is unknown; expected one of ['DRAM', 'VRAM']"),
        (("regions", 2, "addr"), (1 << 64) - 1, "overflows 64 bits"),
        (("regions", 2, "kind"), "rdma", "regions[2].kind='rdma' is unknown"),
        (("regions", 0, "device_uuid"), "GPU-0123", "regions[0].device_uuid='GPU-0123' invalid"),
        (("regions", 2, "agent"), "pub 1", "regions[2].agent='pub 1' invalid; expected to match"),
        (("regions", 2, "agent"), "a" * 129, "regions[2].agent="),
        (("regions", 2, "device"), 0, "regions[2].device=0 does not fit mem='DRAM'"),
        (("regions", 2, "agent_meta"), "abc", "regions[2].agent_meta='abc' invalid; expected an even number"),
        (("regions", 2, "agent_meta"), "AB", "regions[2].agent_meta='AB' invalid"),
        (("regions", 2, "agent_meta"), "", "regions[2].agent_meta='' invalid"),
        (("regions", 2, "agent_meta"), 7, "regions[2].agent_meta=7 invalid"),
        (("regions", 2, "agent_meta"), "ab" * ((1 << 19) + 1), "regions[2].agent_meta="),
        (("peer", "role"), "receiver", "peer.role='receiver' is wrong; expected 'publisher'"),
        (("peer", "rank"), 2, "peer.rank=2 out of range; expected 0 <= rank < 2"),
        (("peer", "host"), "a\nb", "peer.host="),
        (("peer", "device"), True, "peer.device=True has type bool; expected int"),
        (("schema_version",), 2, "schema_version=2 is not supported; expected one of [4]"),
        (("kind",), "peer_info", "kind='peer_info' is wrong; expected 'publisher_manifest'"),
        (("header", "region"), 3, "header.region=3 out of range; expected 0 <= region < 3"),
        (("header", "offset"), 4096 - 63, "header.offset=4033 out of range"),
        (("header", "offset"), -1, "header.offset=-1 out of range"),
        (("header",), None, "header=None"),
    ],
)
def test_manifest_errors(path: tuple, value: Any, needle: str) -> None:
    obj = manifest()
    _set(obj, path, value)
    _fails(obj, "publisher_manifest", needle)


def test_unexpected_and_missing_keys() -> None:
    obj = manifest()
    obj["tensors"][2]["parts"][1]["stride"] = 1
    _fails(obj, "publisher_manifest", "tensors[2].parts[1]: unexpected key 'stride'")
    obj = peer_info()
    del obj["pid"]
    _fails(obj, "peer_info", "missing key 'pid'")


def test_replicated_parts_on_the_wire() -> None:
    """Note [Replicated on the wire]: an optional bool per part, written only when true; a manifest
    without it reads as it always did (no part replicated)."""
    assert not any(p.replicated for t in manifest()["tensors"] for p in TensorLayout.from_json(t).parts)
    kv = Shard.split((8, 16), 0, 4, 1)  # GQA: one of 2 KV heads, held by 2 of 4 ranks
    layout = TensorLayout.fused("kv.weight", "bfloat16", [("k", kv, True), ("v", kv, True)])
    obj = manifest()
    obj["tensors"].append({**layout.to_json(), "region": 1, "offset": 3072})
    assert [p["replicated"] for p in obj["tensors"][-1]["parts"]] == [True, True]
    decoded = schema.decode(schema.encode(obj), "publisher_manifest", PEER)
    assert decoded == obj
    assert [p.replicated for p in TensorLayout.from_json(decoded["tensors"][-1]).parts] == [True, True]
    for bad in (1, "true", None, [True]):
        wrong = copy.deepcopy(obj)
        wrong["tensors"][-1]["parts"][1]["replicated"] = bad
        _fails(wrong, "publisher_manifest", "tensors[6].parts[1].replicated=", "expected bool")
    wrong = copy.deepcopy(obj)
    wrong["tensors"][-1]["parts"][0]["stride"] = 1  # the part stays closed beside the optional key
    _fails(wrong, "publisher_manifest", "tensors[6].parts[0]: unexpected key 'stride'")


def test_wire_errors() -> None:
    good = schema.encode(version_state())
    for raw, needle in [
        (b"\xff" + good, "not valid JSON (UnicodeDecodeError"),
        (good[:-1] + b',"version":6}', "not valid JSON"),  # duplicate key
        (b'{"schema_version":1,"kind":"version_state","version":NaN,"state":"published","generation":1}', "NaN"),
        (b'{"version":' + b"9" * 5000 + b"}", "digits"),
        (b"[       " * 5_000 + b"]" * 5_000, "not valid JSON"),  # nested past the parser's depth
        (b"[" * 20_000 + b"]" * 20_000, "holds 20000 containers"),  # denser than any payload
        (b'{"a":' + b" " * (64 << 10) + b"1}", "exceeds the limit; expected at most 65536 bytes for a version_state"),
        (b"", "not valid JSON"),
        (b" " * (schema.MAX_PAYLOAD_BYTES + 1), "exceeds the limit"),
        (b"[1]", "payload=<list of 1 items> has type array"),
        (b'{"schema_version":"1"}', "schema_version='1' is not supported"),
    ]:
        with pytest.raises(MetadataError, match="version state from peer='pub/1'") as e:
            schema.decode(raw, "version_state", PEER)
        assert needle in str(e.value)
    with pytest.raises(MetadataError, match="expected_kind='nope' is unknown"):
        schema.decode(good, "nope", PEER)
    with pytest.raises(MetadataError, match="expected bytes or str"):
        schema.decode(123, "version_state", PEER)  # type: ignore[arg-type]


def test_encode_checks() -> None:
    assert schema.encode({"schema_version": 1, "kind": "ep_layout", "x": [1]}) == b'{"kind":"ep_layout","schema_version":1,"x":[1]}'
    for bad, needle in [
        ({"kind": "x"}, "schema_version=None is missing or unsupported"),
        ({"schema_version": True, "kind": "x"}, "schema_version=True"),
        ({"schema_version": 1}, "kind=None is missing"),
        ({"schema_version": 1, "kind": "x", "v": {1, 2}}, "not JSON-serializable"),
        ({"schema_version": 1, "kind": "x", "v": float("nan")}, "not JSON-serializable"),
        ({**version_state(), "state": "stale"}, "state='stale' is unknown"),
        ([1], "expected dict"),
    ]:
        with pytest.raises(MetadataError) as e:
            schema.encode(bad)  # type: ignore[arg-type]
        assert needle in str(e.value)


def test_socket_address() -> None:
    ok = [{"family": "AF_INET", "host": "10.0.0.1", "port": 1}, {"family": "AF_INET6", "host": "fe80::1", "port": 65535}]
    for addr in ok:
        assert schema.validate_socket_address(addr, PEER) is addr
    for addr, needle in [
        ({"family": "AF_INET", "host": "::1", "port": 80}, "host='::1' invalid; expected an IPv4 address"),
        ({"family": "AF_INET6", "host": "10.0.0.1", "port": 80}, "expected an IPv6 address"),
        ({"family": "AF_INET", "host": "999.0.0.1", "port": 80}, "host='999.0.0.1' invalid"),
        ({"family": "AF_UNIX", "host": "10.0.0.1", "port": 80}, "family='AF_UNIX' is unknown"),
        ({"family": "AF_INET", "host": "10.0.0.1", "port": 0}, "port=0 out of range; expected 1 <= port < 65536"),
        ({"family": "AF_INET", "host": "10.0.0.1", "port": 65536}, "port=65536 out of range"),
        ({"family": "AF_INET", "host": "10.0.0.1"}, "missing key 'port'"),
        ("10.0.0.1:80", "has type string; expected object"),
    ]:
        with pytest.raises(MetadataError, match="socket address from peer='pub/1'") as e:
            schema.validate_socket_address(addr, PEER)
        assert needle in str(e.value)


def test_validate_region_standalone() -> None:
    region = manifest()["regions"][0]
    assert schema.validate_region(region, PEER) is region
    with pytest.raises(MetadataError, match=r"region\.device=-1 out of range"):
        schema.validate_region({**region, "device": -1}, PEER)
    with pytest.raises(MetadataError, match=r"region=None has type null"):
        schema.validate_region(None, PEER)


def test_nixl_region_agent_meta_and_mem() -> None:
    region = manifest()["regions"][2]
    vram = {**region, "mem": "VRAM", "device": 3}
    assert schema.validate_region(vram, PEER) is vram
    with pytest.raises(MetadataError, match=r"region\.device=-1 does not fit mem='VRAM'"):
        schema.validate_region({**vram, "device": -1}, PEER)
    old_form = {k: v for k, v in region.items() if k != "agent_meta"}  # a descriptor without metadata
    with pytest.raises(MetadataError, match=r"peer='pub/1'.*missing key 'agent_meta'"):
        schema.validate_region(old_form, PEER)
    longest = {**region, "agent_meta": "ab" * (schema.MAX_NIXL_META_HEX // 2)}
    assert schema.validate_region(longest, PEER) is longest


def test_schema_imports_no_torch_and_no_refit() -> None:
    code = (
        "import sys, warmlink.rendezvous, warmlink.rendezvous.schema, warmlink.rendezvous.store;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'warmlink.refit'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- one field at a time --------------------------------------------------------------------------
def _set(obj: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _fmt(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _paths(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    yield path, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, path + (k,))


def _corruptions(value: Any) -> list[Any]:
    out: list[Any] = [{"bad": 1}]
    if isinstance(value, bool) or value is None:
        out.append("x")
    elif isinstance(value, int):
        out += [str(value), -2, 1 << 70, float(value), True]
    elif isinstance(value, str):
        out += [7, "", None, "x" * 1025]
    elif isinstance(value, list):
        out += ["x", None]
    elif isinstance(value, dict):
        out += [[], "x"]
    return out


@pytest.mark.parametrize("kind", sorted(VALID))
def test_every_field_corrupted(kind: str) -> None:
    for path, value in list(_paths(VALID[kind]())):
        if not path:
            continue
        for bad in _corruptions(value):
            obj = VALID[kind]()
            _set(obj, path, bad)
            _fails(obj, kind, _fmt(path))
        if isinstance(path[-1], str):  # dropping a key names the key
            obj = VALID[kind]()
            parent = obj
            for p in path[:-1]:
                parent = parent[p]
            del parent[path[-1]]
            _fails(obj, kind, repr(path[-1]))


def test_every_prefix_is_rejected() -> None:
    raw = schema.encode(manifest())
    assert "模型".encode() in raw or b"\\u" in raw
    raw_utf8 = json.dumps(manifest(), ensure_ascii=False).encode()
    for data in (raw, raw_utf8):
        for n in range(len(data)):
            with pytest.raises(MetadataError):
                schema.decode(data[:n], "publisher_manifest", PEER)


# -- fuzzing --------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=15,
)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_metadata_error(raw: Any, kind: str) -> None:
    try:
        out = schema.decode(raw, kind, PEER)
    except MetadataError:
        return
    assert isinstance(out, dict)
    assert schema.decode(schema.encode(out), kind, PEER) == out


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(sorted(VALID)))
def test_fuzz_bytes(raw: bytes, kind: str) -> None:
    _decode_or_metadata_error(raw, kind)


@FUZZ
@given(json_values, st.sampled_from(sorted(VALID)))
def test_fuzz_json(value: Any, kind: str) -> None:
    _decode_or_metadata_error(json.dumps(value), kind)
    if isinstance(value, dict):  # with a valid header, so validation goes past it
        _decode_or_metadata_error(json.dumps({**value, "schema_version": 1, "kind": kind}), kind)


MUTATIONS = ["drop", "json", "huge", "negative", "swap", "deep", "duplicate", "bool"]


@FUZZ
@given(st.data(), st.sampled_from(sorted(VALID)))
def test_fuzz_mutations(data: st.DataObject, kind: str) -> None:
    obj = VALID[kind]()
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(obj) if p]
        path = data.draw(st.sampled_from(paths))
        mutation = data.draw(st.sampled_from(MUTATIONS))
        parent = obj
        for p in path[:-1]:
            parent = parent[p]
        old = parent[path[-1]]
        if mutation == "drop":
            del parent[path[-1]]
        elif mutation == "json":
            parent[path[-1]] = data.draw(json_values)
        elif mutation == "huge":
            parent[path[-1]] = data.draw(st.sampled_from([1 << 40, 1 << 63, 1 << 64, 10**39, -(1 << 63)]))
        elif mutation == "negative":
            parent[path[-1]] = -data.draw(st.integers(1, 1 << 70))
        elif mutation == "swap":
            parent[path[-1]] = data.draw(st.sampled_from([str(old), [old], {"v": old}, None, 1.5]))
        elif mutation == "bool":
            parent[path[-1]] = data.draw(st.booleans())
        elif mutation == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(old))
        elif mutation == "deep":
            parent[path[-1]] = "__DEEP__"
            depth = data.draw(st.sampled_from([10, 1000, 100_000]))
            raw = json.dumps(obj).replace('"__DEEP__"', "[" * depth + "]" * depth)
            _decode_or_metadata_error(raw, kind)
            return
    _decode_or_metadata_error(json.dumps(obj), kind)
    _decode_or_metadata_error(json.dumps(obj).encode(), kind)


@st.composite
def raw_tensor_entries(draw: st.DrawFn) -> dict:
    ndim = draw(st.integers(0, 3))
    num_parts = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 6)) for _ in range(ndim)]
    parts = []
    for _ in range(num_parts):
        extra = draw(st.integers(0, 1))  # a part may squeeze one leading dim
        gshape = [draw(st.integers(0, 6)) for _ in range(ndim + extra)]
        bounds = []
        for size in gshape:
            a = draw(st.integers(-1, size + 1))
            bounds.append([a, draw(st.integers(-1, size + 1))])
        parts.append({
            "logical": draw(st.sampled_from(["q", "k", "v"])),
            "global_shape": gshape,
            "bounds": bounds,
            "offset": [draw(st.integers(-1, 6)) for _ in range(ndim)],
        })
        if draw(st.booleans()):  # Note [Replicated on the wire]: optional, a bool
            parts[-1]["replicated"] = draw(st.sampled_from([True, False, 1, None]))
    return {"name": "t", "dtype": draw(st.sampled_from(["bfloat16", "float32", "int8"])), "shape": shape, "parts": parts}


@settings(max_examples=300, deadline=None)
@given(raw_tensor_entries())
def test_schema_and_tensor_layout_accept_the_same_entries(entry: dict) -> None:
    try:
        layout = TensorLayout.from_json(entry)
    except LayoutError:
        layout = None
    try:
        nbytes = schema.tensor_nbytes(entry)
    except MetadataError:
        nbytes = None
    assert (layout is None) == (nbytes is None), (entry, layout)
    if layout is not None:
        assert schema.tensor_local_shape(entry) == layout.local_shape
        assert nbytes == layout.nbytes


# -- memory: Note [Decode budget] -----------------------------------------------------------------
_MEASURE = """
import json, resource, sys
from warmlink.errors import MetadataError
from warmlink.rendezvous import schema
with open(sys.argv[1], "rb") as f:
    raw = f.read()  # one allocation of the file's size: nothing transient before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    schema.decode(raw, sys.argv[2], "pub/1")
    outcome = "ok"
except MetadataError as e:
    outcome = str(e)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps({"nbytes": len(raw), "grew_bytes": grew * 1024, "outcome": outcome[:400]}))
"""


def _decode_in_child(tmp_path, head: bytes, unit: bytes, tail: bytes, nbytes: int, kind: str) -> dict:
    """Decode ``head + unit * n + tail`` of about ``nbytes`` in a fresh process; its peak RSS
    growth (``ru_maxrss``, KiB on Linux) over the payload it read."""
    path = tmp_path / "payload.json"
    with open(path, "wb") as f:
        f.write(head + unit * (nbytes // len(unit)) + tail)
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(path), kind], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
def test_a_payload_of_empty_lists_is_refused_before_it_is_parsed(tmp_path) -> None:
    got = _decode_in_child(tmp_path, b'{"schema_version":2,"kind":"publisher_manifest","tensors":[', b"[],", b"[]]}",
                           63_000_000, "publisher_manifest")
    assert "holds 21000003 containers" in got["outcome"] and "refused before parsing" in got["outcome"], got
    assert got["grew_bytes"] < got["nbytes"] // 8, got  # nothing built: a few MB of noise at most


# Each as dense as Note [Decode budget] allows in one respect: the worst that passes the pre-scan.
_AT_THE_LIMITS = {
    "lists": (b"[", b"[      ],", b"[]]"),
    "objects": (b"[", b'{"a":[                       ]},', b"{}]"),
    "short strings": (b"[", b'"abc",', b'"a"]'),
    "floats": (b"[", b"1e5,", b"1]"),
    "ints": (b"[", b"1000,", b"1]"),
}


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
@pytest.mark.parametrize("shape", sorted(_AT_THE_LIMITS))
def test_decoding_memory_is_a_small_multiple_of_the_payload(tmp_path, shape) -> None:
    head, unit, tail = _AT_THE_LIMITS[shape]
    got = _decode_in_child(tmp_path, head, unit, tail, 16 << 20, "publisher_manifest")
    assert "has type array; expected object" in got["outcome"], got  # parsed, then refused by the validator
    assert got["grew_bytes"] < 16 * got["nbytes"], got  # ~11x at most (a real manifest: 5-7x)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
def test_one_object_of_a_million_distinct_keys_costs_a_small_multiple_of_its_bytes(tmp_path) -> None:
    path = tmp_path / "payload.json"
    chars = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    with open(path, "wb") as f:  # distinct 4-character keys, 9 bytes each (``"abcd":0,``): the densest allowed
        f.write(b"{" + b",".join(b'"%c%c%c%c":0' % (chars[i & 63], chars[i >> 6 & 63], chars[i >> 12 & 63], chars[i >> 18])
                                 for i in range(1_500_000)) + b"}")
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(path), "publisher_manifest"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert "missing key 'schema_version'" in got["outcome"], got
    assert got["grew_bytes"] < 16 * got["nbytes"], got


def test_small_kinds_are_capped_and_registered_kinds_carry_their_own_cap() -> None:
    padded = b'{"schema_version":1,' + b" " * (64 << 10) + b'"kind":"peer_info"}'
    with pytest.raises(MetadataError, match="expected at most 65536 bytes for a peer_info"):
        schema.decode(padded, "peer_info", PEER)
    with pytest.raises(MetadataError, match="max_bytes=0 out of range"):
        schema.register_kind("test_kind", lambda obj, peer: obj, max_bytes=0)
    assert "test_kind" not in schema._VALIDATORS
