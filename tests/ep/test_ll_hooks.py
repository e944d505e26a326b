"""A low-latency call's receive hook on the device path, on CPU: a one-rank runtime whose
``DevicePath`` launches through ``PackedLaunch``es into a ctypes stand-in for ``cuLaunchKernel``
(the kernels do not run; their launches are recorded). A send packs its receive's launch, and its
hook makes that launch once: the receive's function and grid with the send's values. Before the
kind's receive has a prepared launch, the hook launches through the kernel's own launcher instead.
A hook called after its Buffer closed raises ``ConfigError``; either way its round is received. A
device path built without shrink refuses to mask a rank (its kernels do not read the mask then)."""

from __future__ import annotations

import pytest
import torch

from tests.ep._launch_driver import Driver
from tests.ep._ll_stand_in import ARGS, FUNCTIONS, HIDDEN, E, K, T, device_runtime, plan, sizes
from warmlink.ep.low_latency import _device
from warmlink.ep.low_latency._device import BOTH, RECV, SEND
from warmlink.errors import ConfigError
from warmlink.rendezvous import Store


@pytest.fixture
def runtime(compiled, monkeypatch):
    """``(runtime, drivers, kernels)``: the device path's launches, prepared ones into
    ``drivers[kernel]``, the others into ``kernels``; ``runtime.prepare(receives)`` gives every kind of call its prepared
    launch, the receives' too when ``receives``."""
    monkeypatch.setattr(_device, "current_stream", lambda device: 0x5EA)
    store = Store(is_server=True, prefix="ll-hooks", timeout_s=30)
    rt, kernels = device_runtime(store)
    path = rt._path
    drivers = {name: Driver(sizes(name)) for name in ARGS}

    def prepare(receives: bool) -> None:
        for p in (0, 1):
            for phase in (SEND, BOTH) + ((RECV,) if receives else ()):
                path._prepared[("dispatch", phase, True, False, False, False, False, p, torch.int64)] = \
                    plan(drivers["dispatch"], compiled, "dispatch", phase)
                path._prepared[("combine", phase, False, p, torch.int64)] = \
                    plan(drivers["combine"], compiled, "combine", phase)
            if receives:
                path._receives[("dispatch", SEND, True, False, False, False, False, p, torch.int64)] = \
                    path._prepared[("dispatch", RECV, True, False, False, False, False, p, torch.int64)]
                path._receives[("combine", SEND, False, p, torch.int64)] = \
                    path._prepared[("combine", RECV, False, p, torch.int64)]

    rt.prepare = prepare
    yield rt, drivers, kernels
    rt.close()
    store.close()


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, HIDDEN, generator=gen).bfloat16()
    idx = torch.rand(T, E, generator=gen).topk(K, 1).indices
    return x, idx, torch.rand(T, K, generator=gen), torch.randn(E, T, HIDDEN).bfloat16()


def test_a_hook_makes_the_receive_its_send_packed_once_with_the_sends_values(runtime):
    rt, drivers, kernels = runtime
    rt.prepare(receives=True)
    x, idx, w, y = _inputs()
    for _ in range(3):  # both parities, then the first again
        for driver in drivers.values():
            driver.launches.clear()
        _, _, handle, _, hook = rt.dispatch(x, idx, T, E, None, None, True, False, False, False, True)
        assert [launch[0] for launch in drivers["dispatch"].launches] == [FUNCTIONS["dispatch", SEND]]
        hook()
        hook()  # a hook runs once
        send, receive = drivers["dispatch"].launches
        assert not any(plan.launch_pending(0) for plan in rt._path._receives.values())  # the one packed: made
        assert receive[:2] == (FUNCTIONS["dispatch", RECV], (E, 1, 1))  # a program per (local expert, rank)
        assert receive[5] == send[5] and send[5][0] == x.data_ptr().to_bytes(8, "little")
        assert handle.rows_by_source == ()
        combined, _, hook = rt.combine(y, idx, w, handle, False, False, False, True, None, None)
        hook()
        hook()
        send, receive = drivers["combine"].launches
        assert not any(plan.launch_pending(0) for plan in rt._path._receives.values())
        assert (send[0], receive[0], receive[1]) == (FUNCTIONS["combine", SEND], FUNCTIONS["combine", RECV], (T, 1, 1))
        assert receive[5] == send[5] and combined.data_ptr().to_bytes(8, "little") in send[5]
    assert kernels.dispatch.launches == kernels.combine.launches == []
    assert rt._received == {"dispatch": 3, "combine": 3}


def test_before_the_receive_has_a_prepared_launch_the_hook_launches_through_the_kernel(runtime):
    rt, drivers, kernels = runtime
    rt.prepare(receives=False)
    x, idx, w, y = _inputs()
    _, _, handle, _, hook = rt.dispatch(x, idx, T, E, None, None, True, False, False, False, True)
    hook()
    (grid, args, consts), = kernels.dispatch.launches
    assert consts["PHASE"] == RECV and grid == (E,) and args[0] is x
    assert [launch[0] for launch in drivers["dispatch"].launches] == [FUNCTIONS["dispatch", SEND]]


def test_a_hook_called_after_close_raises_and_its_round_is_received(runtime):
    rt, drivers, kernels = runtime
    rt.prepare(receives=True)
    x, idx, _, _ = _inputs()
    hook = rt.dispatch(x, idx, T, E, None, None, True, False, False, False, True)[4]
    rt.close()
    with pytest.raises(ConfigError, match="called after the Buffer was closed"):
        hook()
    hook()  # spent: nothing more
    assert rt._received["dispatch"] == 1
    assert [launch[0] for launch in drivers["dispatch"].launches] == [FUNCTIONS["dispatch", SEND]]
    assert kernels.dispatch.launches == []



def test_a_device_path_without_shrink_refuses_to_mask_a_rank(runtime):
    """Its kernels do not read the mask without shrink (it stays zero): masking a rank there would
    be ignored, so it is refused (the Buffer refuses the mask calls before they get here)."""
    rt, drivers, kernels = runtime
    with pytest.raises(ConfigError, match="rank 0 cannot be masked on a device path built without shrink"):
        rt._path.update_mask(0, True)
    assert rt._path.mask.tolist() == [0]
