"""Tests for warmlink.transport._nixl_probe: the UCX_PROTO_INFO parser (real output, fuzzed junk),
the GPU-over-TCP warning, and the probe subprocess on this machine (skipped without nixl-cu13)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmlink.transport import _nixl_probe
from warmlink.transport._nixl_probe import parse_proto_info, probe, summarize

# Lines as UCX 1.x prints them with UCX_PROTO_INFO=y (prefix: [timestamp] [host:pid:thread]).
SAMPLE = """\
[1795314650.531251] [vm:861  :0]   +---------------------------+---------------------------------------------------------+
[1795314650.531251] [vm:861  :0]   | probe-initiator self cfg#1 | remote memory write by ucp_put* from host memory to host |
[1795314650.531251] [vm:861  :0]   +---------------+-------------+----------------------------+
[1795314650.531251] [vm:861  :0]   | 0..4294967295 | short       | cuda_copy/cuda             |
[1795314650.532496] [vm:861  :0]   | remote memory write by ucp_put* from host memory to host |
[1795314650.532496] [vm:861  :0]   | 0..inf | zero-copy   | cma/memory                        |
[1795314650.534173] [vm:861  :0]   | remote memory write by ucp_put* from host memory to cuda/dev[4] |
[1795314650.534173] [vm:861  :0]   | 0..inf | software emulation | tcp/lo                            |
[...]   |   8185..65528 | zero-copy          | tcp/lo              |
[...]   |  65529..inf | multi-frag copy-in | tcp/lo              |
"""


def _entry(op, src, dst, rng, proto, tl, dev, scope="self"):
    return {"operation": op, "from": src, "to": dst, "range": rng, "protocol": proto, "transport": tl, "device": dev,
            "scope": scope}


def test_parser_reads_the_sample_exactly():
    assert parse_proto_info(SAMPLE) == [
        _entry("put", "host", "host", "0..4294967295", "short", "cuda_copy", "cuda"),
        _entry("put", "host", "host", "0..inf", "zero-copy", "cma", "memory"),
        _entry("put", "host", "cuda", "0..inf", "software emulation", "tcp", "lo"),
        _entry("put", "host", "cuda", "8185..65528", "zero-copy", "tcp", "lo"),
        _entry("put", "host", "cuda", "65529..inf", "multi-frag copy-in", "tcp", "lo"),
    ]
    assert parse_proto_info(SAMPLE + SAMPLE) == parse_proto_info(SAMPLE)  # deduplicated
    assert summarize(parse_proto_info(SAMPLE)) == {"put host->host": ["cma"], "put host->cuda": ["tcp"]}


def test_get_reads_into_local_from_remote_and_self_tables_yield_to_links():
    text = """\
[1.0] [h:1:0]   | a self cfg#0                                              |
[1.0] [h:1:0]   | remote memory read by ucp_get*(multi) into cuda memory from cuda |
[1.0] [h:1:0]   |  Range | Description | Config |
[1.0] [h:1:0]   | 0..inf | zero-copy   | cuda_copy/cuda |
[1.0] [h:1:0]   | a intra-node cfg#1                                        |
[1.0] [h:1:0]   | remote memory read by ucp_get*(multi) into cuda memory from cuda |
[1.0] [h:1:0]   | 0..8K  | zero-copy   | cuda_ipc/cuda |
[1.0] [h:1:0]   | 8K..inf | zero-copy  | 50% on cuda_ipc/cuda and 50% on rc_mlx5/mlx5_0:1 |
[1.0] [h:1:0]   | active message by ucp_am_send* from host memory |
[1.0] [h:1:0]   | 0..inf | multi-frag copy-in | tcp/lo |
"""
    entries = parse_proto_info(text)
    assert entries[0] == _entry("get", "cuda", "cuda", "0..inf", "zero-copy", "cuda_copy", "cuda")
    assert summarize(entries) == {"get cuda->cuda": ["cuda_ipc", "rc_mlx5"], "am from host": ["tcp"]}
    assert _nixl_probe._tcp_warnings(entries) == []


def test_gpu_memory_over_tcp_is_warned():
    text = """\
[1.0] [h:1:0]   | b intra-node cfg#1 | remote memory write by ucp_put* from cuda memory to cuda |
[1.0] [h:1:0]   | 0..inf | software emulation | tcp/eth0 |
"""
    (warning,) = _nixl_probe._tcp_warnings(parse_proto_info(text))
    assert "over TCP" in warning and "put cuda->cuda: tcp/eth0 software emulation" in warning and "UCX_TLS" in warning


_FRAGMENTS = st.sampled_from(["|", " | ", "by ucp_", "put*", "get*", "am_send*", " from ", " into ", " to ", "host",
                              "cuda/dev[4]", " memory", "0..inf", "8185..", "65529", "..", "inf", "tcp/lo", "cma/memory",
                              "/", "[", "]", "[1.0] [h:1:0] ", "self cfg#0", "\n", "\r", "1e400", "\x00", "é"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(_FRAGMENTS, max_size=40).map("".join)))
def test_parser_never_raises_on_junk(text):
    entries = parse_proto_info(text)
    assert isinstance(entries, list)
    assert isinstance(summarize(entries), dict)
    assert isinstance(_nixl_probe._tcp_warnings(entries), list)


def test_not_installed_starts_no_subprocess(monkeypatch):
    from warmlink.transport import _nixl_agent

    monkeypatch.setattr(_nixl_agent, "installed_package", lambda: None)
    monkeypatch.setattr(_nixl_probe.subprocess, "Popen", lambda *a, **k: pytest.fail("started a subprocess"))
    out = probe()
    assert out["loads"] is False and "pip install warmlink[nixl]" in out["error"]


def test_probe_moves_host_memory_and_names_its_transport():
    pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")
    out = probe(timeout_s=60)
    assert out["loads"], out
    assert out["dram"]["ok"], out["dram"]
    assert out["dram"]["transports"].get("put host->host"), out
    assert out["agent_create_s"] > 0 and isinstance(out["warnings"], list)
