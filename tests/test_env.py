"""warmlink._env: every WARMLINK_* variable parsed in one place, and all of them checked at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from warmlink import _env
from warmlink.errors import ConfigError

BAD = {"WARMLINK_POOL": "2", "WARMLINK_BACKEND": "bogus", "WARMLINK_TIMEOUT_S": "inf", "WARMLINK_LOG_LEVEL": "LOUD",
       "WARMLINK_NIXL_THREADS": "65", "WARMLINK_EP_COPY_STREAMS": "two", "WARMLINK_EP_SEND": "dma",
       "WARMLINK_EP_GRAPH": "yes", "WARMLINK_EP_STREAM_KERNEL": "cutlass",
       "WARMLINK_EP_HOST": "rust", "WARMLINK_CACHE_DIR": "relative/dir",
       "WARMLINK_SECRET": "short-secret"}
HIDDEN = {"WARMLINK_SECRET"}  # never shown: the message names the variable, not its value


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    import os

    for name in [k for k in os.environ if k.startswith("WARMLINK_")]:
        monkeypatch.delenv(name)
    _env.clear_cache()
    yield
    _env.clear_cache()


def test_every_variable_read_here_is_checked_by_check_all():
    source = Path(_env.__file__).read_text()
    assert set(re.findall(r'_raw\("(WARMLINK_[A-Z0-9_]+)"\)', source)) == set(_env.VARIABLES) == set(BAD)


def test_nothing_set_is_no_error():
    assert _env.check_all(unknown=True) == {}


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_all_names_each_bad_value_in_one_line_whatever_was_cached(name, monkeypatch):
    for parse in _env.VARIABLES.values():
        parse()  # cached while the environment was good
    monkeypatch.setenv(name, BAD[name])
    errors = _env.check_all()
    assert list(errors) == [name] and isinstance(errors[name], ConfigError)
    message = str(errors[name])
    shown = f"{name}='<hidden, " if name in HIDDEN else f"{name}={BAD[name]!r} "
    assert message.startswith(shown) and "; expected " in message and "\n" not in message
    assert name not in HIDDEN or BAD[name] not in message


def test_secret_is_read_validated_and_never_shown(monkeypatch):
    assert _env.secret() is None
    good = "s3cret-" * 4
    monkeypatch.setenv("WARMLINK_SECRET", f"  {good}\n")
    _env.clear_cache()
    assert _env.secret() == good  # surrounding whitespace is not part of it
    for bad in (None, 5, b"x" * 32, "x" * 15, "x" * 1025, "\ud800" * 16):
        with pytest.raises(ConfigError, match="expected") as info:
            _env.check_secret(bad, "Store")
        assert "x" * 15 not in str(info.value)
    assert _env.check_secret("é" * 8, "Store") == "é" * 8  # 16 bytes of UTF-8
    assert _env.shown("WARMLINK_SECRET", good) == f"<hidden, {len(good)} characters>"
    assert _env.shown("WARMLINK_SECRETS", good) != good and _env.shown("WARMLINK_POOL", "1") == "1"
    monkeypatch.setenv("WARMLINK_SECRETS", good)  # misspelled: reported, its value still hidden
    assert good not in str(_env.check_all(unknown=True)["WARMLINK_SECRETS"])


def test_unknown_names_are_reported_only_when_asked(monkeypatch):
    monkeypatch.setenv("WARMLINK_TIMEOUT", "5")
    assert _env.check_all() == {}
    assert "is not a warmlink variable" in str(_env.check_all(unknown=True)["WARMLINK_TIMEOUT"])
