"""The ep_rank payload: valid ones pass, anything else is a MetadataError naming the peer."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.ep.wire.info import check_config, validate_ep_rank
from warmlink.errors import ConfigError, MetadataError
from warmlink.rendezvous import schema

HANDLE = "ab" * 64  # an IPC memory handle's hex


def good(kind: str = "cuda_ipc") -> dict:
    data = ({"kind": "cuda_ipc", "handle": HANDLE, "alloc_nbytes": 1 << 20, "offset": 0, "nbytes": 1 << 20, "device": 1,
             "buffer_id": 7, "device_uuid": "0123456789abcdef" * 2} if kind == "cuda_ipc" else {"kind": "shm", "name": "wl-1-ab-0", "offset": 0, "nbytes": 4096})
    return {
        "schema_version": 1, "kind": "ep_rank",
        "peer": {"schema_version": 1, "kind": "peer_info", "role": "ep", "rank": 1, "world_size": 2, "generation": 3,
                 "host": "h", "pid": 10, "start_time": 5, "device": 1 if kind == "cuda_ipc" else -1, "backend": kind},
        "config": {"num_ranks": 2, "max_tokens": 64, "hidden": 128, "num_topk": 2, "stream_channels": 0, "ring_rows": 0},
        "data": data, "mailbox": {"kind": "shm", "name": "wl-1-ab-1", "offset": 0, "nbytes": 4096},
    }


@pytest.mark.parametrize("kind", ["cuda_ipc", "shm"])
def test_valid_payloads_round_trip(kind):
    raw = schema.encode(good(kind))
    assert schema.decode(raw, "ep_rank", "ep/1") == good(kind)


@pytest.mark.parametrize("mutate, field", [
    (lambda p: p["config"].update(hidden=0), "config.hidden"),
    (lambda p: p["config"].update(num_ranks=3), "num_ranks"),
    (lambda p: p["config"].update(ring_rows=-1), "config.ring_rows"),
    (lambda p: p["config"].update(stream_channels=1 << 11), "config.stream_channels"),
    (lambda p: p.update(events={"dispatch": [HANDLE] * 4}), "keys"),  # the handles of earlier versions
    (lambda p: p.pop("mailbox"), "keys"),
    (lambda p: p["mailbox"].update(kind="cuda_ipc"), "mailbox"),
    (lambda p: p["peer"].update(role="publisher"), "peer.role"),
    (lambda p: p.update(extra=1), "keys"),
])
def test_bad_fields_are_named(mutate, field):
    payload = good()
    mutate(payload)
    with pytest.raises(MetadataError, match="ep/1") as err:
        validate_ep_rank(payload, "ep/1")
    assert field.split(".")[0] in str(err.value)


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


PATHS = list(_paths(good()))
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                 st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PATHS), JUNK)
def test_fuzzed_payloads_raise_only_metadata_errors(path, junk):
    payload = copy.deepcopy(good())
    target = payload
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = junk
    try:
        raw = json.dumps(payload).encode()
    except (TypeError, ValueError):
        return
    try:
        decoded = schema.decode(raw, "ep_rank", "ep/1")
    except MetadataError as err:
        assert "ep/1" in str(err)  # named, and no other exception type escaped
    else:  # the junk happened to be valid there: then the payload comes back unchanged
        assert decoded == json.loads(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_metadata_errors(raw):
    with pytest.raises(MetadataError):
        schema.decode(raw, "ep_rank", "ep/1")


def test_config_mismatch_names_the_field():
    mine = good()["config"]
    theirs = dict(mine, num_topk=4)
    with pytest.raises(ConfigError, match="num_topk"):
        check_config(mine, theirs, "ep/1")
    with pytest.raises(ConfigError, match="stream_channels=20, this rank stream_channels=0"):
        check_config(mine, dict(mine, stream_channels=20, ring_rows=128), "ep/1")


@pytest.mark.parametrize("variable,read,default,other", [
    ("WARMLINK_EP_COPY_STREAMS", "ep_copy_streams", "one", "per-peer"),
    ("WARMLINK_EP_SEND", "ep_send", "sm", "copy"),
    ("WARMLINK_EP_GRAPH", "ep_graph", True, False),
])
def test_ep_settings_are_validated(monkeypatch, variable, read, default, other):
    from warmlink import _env

    monkeypatch.delenv(variable, raising=False)
    assert getattr(_env, read)() == default
    monkeypatch.setenv(variable, {True: "1", False: "0"}.get(other, other))
    assert getattr(_env, read)() == other
    monkeypatch.setenv(variable, "two")
    with pytest.raises(ConfigError, match=f"{variable}='two'"):
        getattr(_env, read)()
