"""The ep_ll_rank payload: a valid one round-trips, anything else is a MetadataError naming the field."""

from __future__ import annotations

import json

import pytest

from warmlink.ep.low_latency._connect import KIND
from warmlink.errors import MetadataError
from warmlink.rendezvous import schema


def good() -> dict:
    return {"schema_version": 1, "kind": KIND,
            "peer": {"schema_version": 1, "kind": "peer_info", "role": "ep", "rank": 1, "world_size": 2,
                     "generation": 3, "host": "h", "pid": 10, "start_time": 5, "device": -1, "backend": "shm"},
            "config": {"num_ranks": 2, "max_tokens": 128, "hidden": 7168, "num_experts": 256, "num_topk": 8},
            "data": {"kind": "shm", "name": "wl-1-ab-0", "offset": 0, "nbytes": 4096},
            "mailbox": {"kind": "shm", "name": "wl-1-ab-1", "offset": 0, "nbytes": 4096}}


def test_a_valid_payload_round_trips():
    assert schema.decode(schema.encode(good()), KIND, "ep-ll/1") == good()


@pytest.mark.parametrize("mutate, field", [
    (lambda p: p["config"].update(num_experts=0), "config.num_experts=0"),
    (lambda p: p["config"].update(num_experts="256"), "config.num_experts='256'"),
    (lambda p: p["config"].pop("num_topk"), "config"),
    (lambda p: p["config"].update(num_ranks=3), "differs from peer.world_size=2"),
    (lambda p: p["mailbox"].update(kind="cuda_ipc"), "mailbox"),
    (lambda p: p["peer"].update(role="publisher"), "peer.role"),
    (lambda p: p.update(kind="ep_rank"), "kind"),
    (lambda p: p.update(extra=1), "keys"),
])
def test_bad_fields_are_named(mutate, field):
    payload = good()
    mutate(payload)
    with pytest.raises(MetadataError, match="ep-ll/1") as info:
        schema.decode(json.dumps(payload).encode(), KIND, "ep-ll/1")  # raw: encode would refuse it first
    assert field in str(info.value), str(info.value)
