"""A Buffer's choices (ep.api.options): each from its argument, the environment only when the argument
is None, and a bad value refused before anything is leased, naming the argument and the choices."""

from __future__ import annotations

import pytest

from warmlink.ep.api.options import SENDS, Options, resolve_options, resolve_stream, stream_defaults
from warmlink.ep.paths.senders import PATHS, CopyEnginePath, HostPath, SmPath
from warmlink.ep.paths.streamed import StreamPath
from warmlink.errors import ConfigError

EP_VARIABLES = ("WARMLINK_EP_SEND", "WARMLINK_EP_GRAPH", "WARMLINK_EP_COPY_STREAMS")


@pytest.fixture(autouse=True)
def _no_ep_variables(monkeypatch):
    for name in EP_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_follow_the_backend_and_the_group_size():
    assert resolve_options(4, "cuda_ipc") == Options(send="sm", graphs=True, copy_streams="one", combine_parts=4)
    assert resolve_options(2, "cuda_ipc").combine_parts == 1
    assert resolve_options(4, "shm") == Options(send="host", graphs=False, copy_streams="one", combine_parts=4)


def test_the_environment_supplies_a_default_only_when_the_argument_is_none(monkeypatch):
    monkeypatch.setenv("WARMLINK_EP_SEND", "copy")
    monkeypatch.setenv("WARMLINK_EP_GRAPH", "0")
    monkeypatch.setenv("WARMLINK_EP_COPY_STREAMS", "per-peer")
    assert resolve_options(4, "cuda_ipc") == Options(send="copy", graphs=False, copy_streams="per-peer", combine_parts=4)
    assert resolve_options(4, "cuda_ipc", send="sm", graphs=True, copy_streams="one") == Options(
        send="sm", graphs=True, copy_streams="one", combine_parts=4)


def test_an_argument_given_never_reads_its_variable(monkeypatch):
    for name in EP_VARIABLES:
        monkeypatch.setenv(name, "bogus")
    chosen = resolve_options(3, "cuda_ipc", send="copy", graphs=False, copy_streams="per-peer", combine_parts=2)
    assert chosen == Options(send="copy", graphs=False, copy_streams="per-peer", combine_parts=2)
    with pytest.raises(ConfigError, match="WARMLINK_EP_SEND='bogus'"):
        resolve_options(3, "cuda_ipc", graphs=False, copy_streams="per-peer")


def test_shm_reads_none_of_the_cuda_variables(monkeypatch):
    for name in EP_VARIABLES:
        monkeypatch.setenv(name, "bogus")
    assert resolve_options(2, "shm") == Options(send="host", graphs=False, copy_streams="one", combine_parts=1)


@pytest.mark.parametrize("kwargs, match", [
    ({"send": "dma"}, r"send='dma' is unknown; expected one of \['sm', 'copy', 'host', 'stream'\]"),
    ({"send": "host"}, r"send='host' does not fit backend='cuda_ipc'; expected one of \['sm', 'copy', 'stream'\]"),
    ({"graphs": 1}, r"graphs=1; expected True, False or None"),
    ({"graphs": "yes"}, r"graphs='yes'; expected True, False or None"),
    ({"copy_streams": "two"}, r"copy_streams='two' is unknown; expected one of \['one', 'per-peer'\]"),
    ({"combine_parts": 0}, r"combine_parts=0; expected an int in \[1, 4\]"),
    ({"combine_parts": 5}, r"combine_parts=5; expected an int in \[1, 4\]"),
    ({"combine_parts": True}, r"combine_parts=True; expected an int in \[1, 4\]"),
])
def test_a_bad_value_names_the_argument_and_the_choices(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        resolve_options(4, "cuda_ipc", **kwargs)


@pytest.mark.parametrize("send", ["sm", "copy", "stream"])
def test_a_cuda_sender_on_shm_is_refused(send):
    with pytest.raises(ConfigError, match=rf"send='{send}' does not fit backend='shm'; expected one of \['host'\]"):
        resolve_options(2, "shm", send=send)


def test_every_choice_has_its_path():
    assert PATHS == {"sm": SmPath, "copy": CopyEnginePath, "host": HostPath}
    assert set(SENDS) == {*PATHS, StreamPath.name}  # the streamed path has a protocol of its own
    assert {name: cls.name for name, cls in PATHS.items()} == {name: name for name in PATHS}
    assert SmPath.by_sm(None, hook=False)
    assert not SmPath.by_sm(None, hook=True)  # a call with a hook goes through the copy engines
    assert not CopyEnginePath.by_sm(None, hook=False) and not HostPath.by_sm(None, hook=False)


def test_a_streamed_buffer_sizes_its_space_from_its_two_arguments_or_their_defaults():
    assert resolve_stream("sm", 2, None, None) == (0, 0)
    assert resolve_stream("stream", 2, None, None) == stream_defaults(2) == (20, 128)
    for ranks in (3, 4, 8):  # fewer channels of longer rings from 3 ranks on, the same rows a source
        assert resolve_stream("stream", ranks, None, None) == stream_defaults(ranks) == (10, 256)
    assert resolve_stream("stream", 4, 4, None) == (4, 256)
    assert resolve_stream("stream", 2, 4, 8) == (4, 8)
    with pytest.raises(ConfigError, match=r"stream_channels=4, ring_rows=None with send='sm'; they size"):
        resolve_stream("sm", 2, 4, None)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match=rf"ring_rows={bad!r}; expected an int >= 1"):
            resolve_stream("stream", 2, 4, bad)


def test_a_buffer_refuses_a_bad_choice_before_it_leases_anything():
    from warmlink import pool
    from warmlink.ep import Buffer

    before = {k: v["created"] for k, v in pool.stats().items()}
    with pytest.raises(ConfigError, match=r"ep.Buffer: send='dma' is unknown"):
        Buffer(None, 0, 1, max_tokens_per_rank=8, hidden=128, num_topk=2, backend="shm", send="dma")
    assert {k: v["created"] for k, v in pool.stats().items()} == before


def test_a_buffer_reports_its_choices():
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    store = Store(is_server=True, prefix="ep-options", timeout_s=10)
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=128, num_topk=2, backend="shm", timeout_s=10,
                    combine_parts=2) as buf:
            assert (buf.send, buf.graphs, buf.copy_streams, buf.combine_parts) == ("host", False, "one", 2)
            assert "send='host'" in repr(buf)
    finally:
        store.close()
