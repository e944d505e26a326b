"""The install strategies (``refit._install``, Note [Install modes]): what each says about itself and
what a failure after the pull was issued means for each, unit by unit and over shm in this process.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch

from warmlink.bench.refit import build_physical
from warmlink.errors import ConfigError, TransferError
from warmlink.refit import PartialLoadError, Publisher, Receiver
from warmlink.refit._install import MODES, CopyInstall, DirectInstall, SwapInstall, install_mode
from warmlink.refit.manifest import TensorLayout
from warmlink.rendezvous import Store
from warmlink.transport import shm

W = TensorLayout.plain("w", "float32", (128, 64))  # 32 KiB: 8 chunks of 4 KiB below


# -- each strategy, alone -----------------------------------------------------------------------------
def test_each_mode_is_a_strategy_with_its_traits() -> None:
    assert list(MODES) == ["copy", "swap", "direct"]
    modes = {name: install_mode(name) for name in MODES}
    assert [type(m) for m in modes.values()] == [CopyInstall, SwapInstall, DirectInstall]
    assert {n: m.parks for n, m in modes.items()} == {"copy": True, "swap": False, "direct": False}
    assert {n: m.double_buffered for n, m in modes.items()} == {"copy": False, "swap": True, "direct": False}
    assert install_mode("swap") is not install_mode("swap")  # per receiver: swap keeps its parity


@pytest.mark.parametrize("name", ["move", ["copy"], None])
def test_an_unknown_mode_is_refused_before_anything_is_made(name) -> None:
    with pytest.raises(ConfigError, match=r"install=.* is unknown; expected one of \['copy', 'swap', 'direct'\]"):
        Receiver(object(), num_publishers=1, install=name)


def _plan_and_bufs(direct: list[bool]):
    plan = SimpleNamespace(tensors=[SimpleNamespace(dst=f"t{i}") for i in range(len(direct))])
    return plan, SimpleNamespace(direct=[object() if d else None for d in direct])


@pytest.mark.parametrize("name", ["copy", "swap"])
def test_copy_and_swap_failures_leave_the_old_version(name: str) -> None:
    plan, bufs = _plan_and_bufs([False, False])
    assert install_mode(name).failure(plan, bufs, 3, TransferError("down")) is None


def test_a_direct_failure_names_the_targets_it_pulled_into() -> None:
    plan, bufs = _plan_and_bufs([True, False, True])
    exc = install_mode("direct").failure(plan, bufs, 3, TransferError("down"))
    assert isinstance(exc, PartialLoadError) and exc.handed == ["t0", "t2"] and exc.version == 3
    assert "failed after its copies into 2 target(s) started (install='direct')" in str(exc) and "(down)" in str(exc)
    plan, bufs = _plan_and_bufs([False])  # every tensor went through receive memory (a cast): old version kept
    assert install_mode("direct").failure(plan, bufs, 3, TransferError("down")) is None


class _State:
    """Records what a strategy asks of a receive state."""

    def __init__(self) -> None:
        self.calls: list = []

    def buffers(self, plan, parity=0, targets=None, where=None):
        self.calls.append(("buffers", parity, targets, where))
        return f"bufs{parity}", f"token{parity}"

    def preload_buffers(self, plan, parity):
        self.calls.append(("preload", parity))
        return f"twin{parity}"

    def release_buffers(self, token):
        self.calls.append(("release", token))

    def keep_installed(self, token):
        self.calls.append(("keep", token))


def test_swap_flips_its_half_only_when_an_install_succeeds() -> None:
    swap, state, plan = install_mode("swap"), _State(), SimpleNamespace()
    assert swap.buffers(state, plan, {}) == ("bufs1", "token1", "twin0")
    assert swap.buffers(state, plan, {}) == ("bufs1", "token1", "twin0")  # the first cycle failed: same half
    swap.installed(state, "token1")
    assert swap.buffers(state, plan, {})[:2] == ("bufs0", "token0")
    assert ("keep", "token1") in state.calls and not any(c[0] == "release" for c in state.calls)


def test_copy_releases_its_buffers_after_an_install() -> None:
    copy, state = install_mode("copy"), _State()
    assert copy.buffers(state, SimpleNamespace(), {}) == ("bufs0", "token0", None)
    copy.installed(state, "token0")
    assert state.calls == [("buffers", 0, None, None), ("release", "token0")]


# -- over shm: a pull that breaks after it was issued ---------------------------------------------------
@pytest.fixture
def store():
    with Store("127.0.0.1", 0, is_server=True, prefix=f"modes-{uuid.uuid4().hex[:8]}", timeout_s=10) as s:
        yield s


@pytest.mark.parametrize("install, dtype, partial", [("copy", "float32", False), ("swap", "float32", False),
                                                     ("direct", "float32", True), ("direct", "bfloat16", False)])
def test_a_broken_pull_fails_as_its_mode_says(store, monkeypatch, install: str, dtype: str, partial: bool) -> None:
    """copy and swap (and direct through receive memory: a cast) keep the old version and raise the
    cause; direct into the targets says they are mixed."""
    w = build_physical(W, "cpu", 1)
    pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=5)
    pub.add("w", w, W)
    pub.export()
    mine = TensorLayout.plain("w", dtype, W.shape)
    target = torch.zeros(mine.local_shape, dtype=getattr(torch, dtype))
    rec = Receiver(store, num_publishers=1, backend="shm", install=install, timeout_s=5)
    rec.add("w", mine, target)
    try:
        rec.refit()
        before = target.clone()
        with pub.update():
            w.add_(1)
        monkeypatch.setattr(shm, "CHUNK_NBYTES", 4096)
        calls: list[int] = []

        def broken(nbytes: int) -> None:
            calls.append(nbytes)
            if len(calls) == 3:
                raise OSError("link went down")

        monkeypatch.setattr(shm, "fault_hook", broken)
        with pytest.raises(PartialLoadError if partial else TransferError) as info:
            rec.refit()
        monkeypatch.setattr(shm, "fault_hook", None)
        if partial:
            assert "install='direct'" in str(info.value) and info.value.handed == ["w"]
            assert isinstance(info.value.__cause__, TransferError) and rec.installed_version is None
        else:
            assert rec.installed_version == 1 and torch.equal(target, before)
        assert pub.begin_update(timeout_s=1.0) < 0.5  # the failed cycle left no reader behind
        pub.publish()
        assert rec.refit().version == 3 and torch.equal(target, (w if dtype == "float32" else w.to(torch.bfloat16)))
    finally:
        rec.close()
        pub.close()
