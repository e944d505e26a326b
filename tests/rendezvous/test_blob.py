"""Values past TCPStore's 8 MiB limit: ``Store.set`` refuses them, ``set_blob``/``get_blob`` chunk them
(Note [Blobs] in warmlink.rendezvous._blobs). A real TCPStore server on 127.0.0.1, no GPU."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest

from warmlink.errors import ConfigError, MetadataError
from warmlink.rendezvous import schema
from warmlink.rendezvous._blobs import BLOB_MAGIC
from warmlink.rendezvous.store import Store

CHUNK = schema.MIN_CHUNK_BYTES


@pytest.fixture
def server():
    with Store(is_server=True, prefix="blob", timeout_s=5) as s:
        yield s


def _header(store: Store, key: str) -> dict:
    raw = store.try_get(key)
    assert raw is not None and raw.startswith(BLOB_MAGIC)
    return json.loads(raw[len(BLOB_MAGIC):])


def _set_header(store: Store, key: str, header: dict) -> None:
    store.set(key, BLOB_MAGIC + json.dumps(header).encode())


def _chunk(key: str, header: dict, idx: int) -> str:
    return f"{key}/blob/{header['sha256']}/{idx}"


def test_value_over_the_limit_is_refused_and_the_client_lives_on(server: Store) -> None:
    with Store.connect(server.address, prefix="blob", timeout_s=5, secret=server.secret) as client:
        over = schema.MAX_VALUE_BYTES + 1
        with pytest.raises(MetadataError, match=rf"Store\.set: key='big': value of {over} bytes .* at most {over - 1}"):
            client.set("big", b"x" * (schema.MAX_VALUE_BYTES + 1))
        with pytest.raises(MetadataError, match=rf"Store\.compare_set: key='cas'.*{over} bytes"):
            client.compare_set("cas", b"", b"x" * (schema.MAX_VALUE_BYTES + 1))
        client.set("after", b"still connected")
        assert client.get("after", timeout_s=1) == b"still connected"
        assert server.try_get("big") is None and server.try_get("cas") is None
        client.set("edge", b"y" * schema.MAX_VALUE_BYTES)  # exactly the limit goes through, its MAC with it
        assert len(server.get("edge")) == schema.MAX_VALUE_BYTES


def test_blob_of_several_chunks_round_trips_across_clients(server: Store) -> None:
    data = os.urandom(5 * CHUNK + 17)
    with Store.connect(server.address, prefix="blob", timeout_s=5, secret=server.secret) as client:
        client.set_blob("m", data, chunk_nbytes=CHUNK)
        assert server.get_blob("m", timeout_s=1) == data
        assert server.try_get_blob("m") == data
    header = _header(server, "m")
    assert header == {"schema_version": 1, "kind": "blob_header", "nbytes": len(data), "chunk_nbytes": CHUNK,
                      "num_chunks": 6, "sha256": hashlib.sha256(data).hexdigest()}
    assert len(server.try_get(_chunk("m", header, 5))) == 17


def test_large_blob_past_one_store_value(server: Store) -> None:
    data = os.urandom((8 << 20) + 3)  # past one store value: 4 MiB chunks by default
    server.set_blob("big", data)
    assert server.get_blob("big") == data
    assert _header(server, "big")["num_chunks"] == 3  # 4 MiB chunks by default


def test_small_blob_is_one_plain_value(server: Store) -> None:
    server.set_blob("s", b'{"a": 1}')
    assert server.get("s") == b'{"a": 1}' and server.get_blob("s") == b'{"a": 1}'
    server.set_blob("empty", b"")
    assert server.get_blob("empty") == b""
    # Data that looks like a header is always chunked, so it is never read as one.
    fake = BLOB_MAGIC + b'{"kind": "blob_header"}'
    server.set_blob("fake", fake)
    assert server.get_blob("fake") == fake and _header(server, "fake")["num_chunks"] == 1


def test_get_blob_waits_for_the_header_and_absent_is_none(server: Store) -> None:
    assert server.try_get_blob("later") is None
    data = os.urandom(3 * CHUNK)
    timer = threading.Timer(0.05, lambda: server.set_blob("later", data, chunk_nbytes=CHUNK))
    timer.start()
    try:
        assert server.get_blob("later", timeout_s=5) == data
    finally:
        timer.join()


def test_too_large_or_bad_arguments_write_nothing(server: Store) -> None:
    with pytest.raises(MetadataError, match=r"key='huge': data of 67108865 bytes exceeds the limit; expected at most 67108864"):
        server.set_blob("huge", b"\0" * (schema.MAX_PAYLOAD_BYTES + 1))
    assert server.try_get("huge") is None
    for bad in (CHUNK - 1, schema.MAX_VALUE_BYTES + 1, 4096.0, True):
        with pytest.raises(ConfigError, match="chunk_nbytes"):
            server.set_blob("k", b"data", chunk_nbytes=bad)
    with pytest.raises(ConfigError, match="key="):
        server.set_blob("k" * 1000, b"data")
    with pytest.raises(ConfigError, match="expected bytes or str"):
        server.set_blob("k", 3)
    assert server.try_get("k") is None


def _corrupt(store: Store, key: str, header: dict, what: str) -> None:
    if what == "missing":
        store.delete(_chunk(key, header, 1))
    elif what == "extra":
        store.set(_chunk(key, header, header["num_chunks"]), b"more")
    elif what == "short":
        store.set(_chunk(key, header, 1), b"x" * (CHUNK - 1))
    elif what == "long":
        store.set(_chunk(key, header, 3), b"x" * (CHUNK + 1))
    elif what == "altered":
        store.set(_chunk(key, header, 0), b"x" * CHUNK)
    elif what == "count":
        _set_header(store, key, {**header, "num_chunks": 3})
    elif what == "fewer":
        _set_header(store, key, {**header, "nbytes": 3 * CHUNK, "num_chunks": 3})
    elif what == "digest":
        _set_header(store, key, {**header, "sha256": "0" * 64})
    elif what == "digest-format":
        _set_header(store, key, {**header, "sha256": "ABC"})
    elif what == "oversize":
        _set_header(store, key, {**header, "nbytes": schema.MAX_PAYLOAD_BYTES + 1, "num_chunks": 65537})
    elif what == "chunk-size":
        _set_header(store, key, {**header, "chunk_nbytes": schema.MAX_VALUE_BYTES + 1})
    elif what == "extra-field":
        _set_header(store, key, {**header, "nonce": 1})
    elif what == "not-json":
        store.set(key, BLOB_MAGIC + b"{not json")
    else:
        raise AssertionError(what)


@pytest.mark.parametrize("what, match", [
    ("missing", r"chunk 1 of num_chunks=4 is missing"),
    ("extra", r"a chunk 4 exists; expected num_chunks=4"),
    ("short", r"chunk 1 of num_chunks=4 is 1023 bytes; expected 1024"),
    ("long", r"chunk 3 of num_chunks=4 is 1025 bytes; expected 1000"),
    ("altered", r"SHA-256 of the chunks is [0-9a-f]{64}; expected"),
    ("count", r"num_chunks=3 does not cut nbytes=4072"),
    ("fewer", r"a chunk 3 exists; expected num_chunks=3"),
    ("digest", r"chunk 0 of num_chunks=4 is missing"),  # chunk keys are named by the digest
    ("digest-format", r"sha256='ABC' invalid"),
    ("oversize", r"nbytes=67108865 out of range"),
    ("chunk-size", rf"chunk_nbytes={schema.MAX_VALUE_BYTES + 1} out of range"),
    ("extra-field", r"unexpected key 'nonce'"),
    ("not-json", r"not valid JSON"),
])
def test_bad_chunks_or_header_are_metadata_errors_naming_the_key(server: Store, what: str, match: str) -> None:
    data = os.urandom(3 * CHUNK + 1000)
    server.set_blob("pub/0/manifest/3", data, chunk_nbytes=CHUNK)
    _corrupt(server, "pub/0/manifest/3", _header(server, "pub/0/manifest/3"), what)
    for read in (lambda: server.get_blob("pub/0/manifest/3", timeout_s=1), lambda: server.try_get_blob("pub/0/manifest/3")):
        with pytest.raises(MetadataError, match=r"key='pub/0/manifest/3'") as info:
            read()
        assert info.match(match)
    server.set_blob("pub/0/manifest/3", data, chunk_nbytes=CHUNK)  # written again, it reads whole again
    assert server.get_blob("pub/0/manifest/3") == data


def test_overwrite_never_mixes_old_and_new_chunks(server: Store) -> None:
    old, new = os.urandom(4 * CHUNK), os.urandom(4 * CHUNK)
    server.set_blob("k", old, chunk_nbytes=CHUNK)
    old_header = _header(server, "k")
    server.set_blob("k", new, chunk_nbytes=CHUNK)
    assert server.get_blob("k") == new
    # A reader holding the old header still reads the old chunks whole, never the new ones.
    _set_header(server, "k", old_header)
    assert server.get_blob("k") == old
    # Chunks of one blob under the other's header: refused, never returned.
    server.set(_chunk("k", old_header, 2), new[2 * CHUNK : 3 * CHUNK])
    with pytest.raises(MetadataError, match="SHA-256"):
        server.get_blob("k")
    # Small over large and back: one value under the key decides, whole either way.
    server.set_blob("k", b"small")
    assert server.get_blob("k") == b"small"
    server.set_blob("k", new, chunk_nbytes=CHUNK)
    assert server.get_blob("k") == new


def test_concurrent_writers_and_readers_see_whole_blobs(server: Store) -> None:
    blobs = [bytes([i]) * (3 * CHUNK + i) for i in range(1, 5)]
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with Store.connect(server.address, prefix="blob", timeout_s=5, secret=server.secret) as client:
                for _ in range(5):
                    for b in blobs:
                        client.set_blob("shared", b, chunk_nbytes=CHUNK)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    server.set_blob("shared", blobs[0], chunk_nbytes=CHUNK)
    writer = threading.Thread(target=write)
    writer.start()
    try:
        while writer.is_alive():
            assert server.get_blob("shared") in blobs
    finally:
        writer.join()
    assert not errors, errors
