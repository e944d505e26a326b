"""Fixtures of the ep tests."""

from __future__ import annotations

from importlib import resources

import pytest

from warmlink import _cpp
from warmlink.ep.kernels import host


@pytest.fixture(scope="session")
def compiled():
    """ep's compiled host steps (``host.cpp``), built here by the machine's C++ compiler as
    ep.kernels.host builds them (skipped only where there is none)."""
    if _cpp.compiler() is None:
        pytest.skip("no C++ compiler on this machine ($CXX, or c++)")
    return _cpp.load(resources.files("warmlink.ep.kernels").joinpath("host.cpp").read_text(), host.NAME)
