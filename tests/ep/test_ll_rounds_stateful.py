"""The low-latency rounds under any sequence of calls (hypothesis' stateful testing), on CPU, against
a model of Note [Low-latency rounds]: each call takes the next round of its phase and that round's
parity; at most two rounds of a phase await their hooks; hooks may come in any order and run once;
a combine takes only a received handle of one of the last two dispatches; a call with a tensor of
the wrong dtype is refused by name; a refused call spends no round. Two paths of a one-rank
runtime: the shm host path itself, and the device path launching into ctypes stand-ins for
``cuLaunchKernel`` (``_ll_stand_in``: the kernels do not run, their launches are recorded),
where a refused call launches nothing, an accepted one its send (or both phases at once) with its
parity's plan and its own tensors, and its hook the receive its send packed, once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.ep._launch_driver import Driver
from tests.ep._ll_stand_in import ARGS, FUNCTIONS, HIDDEN, E, K, Kernel, T, device_runtime, plan, sizes
from warmlink.ep.low_latency import _device
from warmlink.ep.low_latency._device import BOTH, RECV, SEND
from warmlink.ep.low_latency._runtime import LowLatencyRuntime
from warmlink.errors import ConfigError
from warmlink.rendezvous import Store

PARITY = 0x10000  # a plan's function: FUNCTIONS[kernel, phase] + PARITY * parity
DISPATCH_KIND, COMBINE_KIND = (True, False, False, False, False), (False,)  # (FP8, no stats; no stats)


def _address(t: torch.Tensor) -> bytes:
    return t.data_ptr().to_bytes(8, "little")


@pytest.mark.parametrize("on_device", [True, False], ids=["device path", "host path"])
def test_the_rounds_hold_under_any_sequence_of_calls_hooks_and_refusals(compiled, monkeypatch, on_device):
    monkeypatch.setattr(_device, "current_stream", lambda device: 0x5EA)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, HIDDEN, generator=gen).bfloat16()
    idx = torch.rand(T, E, generator=gen).topk(K, 1).indices
    w, y = torch.rand(T, K, generator=gen), torch.randn(E, T, HIDDEN, generator=gen).bfloat16()

    class Rounds(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # the model: each phase's last round and its received rounds; hooks not called; handles made
            self.last = {"dispatch": 0, "combine": 0}
            self.received: dict[str, set[int]] = {"dispatch": set(), "combine": set()}
            self.pending: list[tuple[str, int, object]] = []
            self.handles: list = []
            self.store = Store(is_server=True, prefix="ll-rounds", timeout_s=30)
            self.drivers = {name: Driver(sizes(name)) for name in ARGS}
            if not on_device:  # the shm host path itself: its rows move, and its refusals are the model's
                self.rt = LowLatencyRuntime(self.store, 0, 1, max_tokens=T, hidden=HIDDEN, num_experts=E, num_topk=K,
                                            device=-1, backend="shm", timeout_s=30)
                self.kernels = SimpleNamespace(dispatch=Kernel("dispatch"), combine=Kernel("combine"))
                return
            self.rt, self.kernels = device_runtime(self.store)
            path = self.rt._path
            for p in (0, 1):
                for name, kind in (("dispatch", DISPATCH_KIND), ("combine", COMBINE_KIND)):
                    for phase in (SEND, RECV, BOTH):
                        path._prepared[(name, phase, *kind, p, torch.int64)] = plan(self.drivers[name], compiled,
                                                                                    name, phase, PARITY * p)
                    path._receives[(name, SEND, *kind, p, torch.int64)] = path._prepared[(name, RECV, *kind, p,
                                                                                          torch.int64)]

        def teardown(self) -> None:
            self.rt.close()
            self.store.close()

        def _free(self, phase: str) -> bool:
            """Whether a new round of ``phase`` may start: the one two before it was received."""
            round_ = self.last[phase] + 1
            return all(r in self.received[phase] for r in range(1, round_ - 1))

        def _launched(self, name: str, before: int) -> list:
            return self.drivers[name].launches[before:]

        @rule(hook=st.booleans(), bad=st.sampled_from([False] * 5 + [True]))
        def dispatch(self, hook: bool, bad: bool) -> None:
            before, given = len(self.drivers["dispatch"].launches), (x.float() if bad else x)
            if bad or not self._free("dispatch"):
                # (both wrong: the device path asks for the round first, the host path checks the tensors first)
                with pytest.raises(ConfigError, match="x.dtype|were not called" if bad else "were not called"):
                    self.rt.dispatch(given, idx, T, E, None, None, True, False, False, False, hook)
                assert self._launched("dispatch", before) == []
                return
            round_ = self.last["dispatch"] = self.last["dispatch"] + 1
            _, count, handle, _, h = self.rt.dispatch(x, idx, T, E, None, None, True, False, False, False, hook)
            assert handle.round == round_
            if on_device:
                (launch,) = self._launched("dispatch", before)
                assert launch[0] == FUNCTIONS["dispatch", SEND if hook else BOTH] + PARITY * (round_ % 2)
                assert launch[5][0] == _address(x)
            self.handles.append(handle)
            if hook:
                assert handle.rows_by_source is None
                self.pending.append(("dispatch", round_, h))
            else:
                assert h is None
                self.received["dispatch"].add(round_)

        @precondition(lambda self: self.handles)
        @rule(data=st.data(), hook=st.booleans(), bad=st.sampled_from([False] * 5 + [True]))
        def combine(self, data, hook: bool, bad: bool) -> None:
            handle = data.draw(st.sampled_from(self.handles))
            weights = w.double() if bad else w
            before = len(self.drivers["combine"].launches)
            usable = handle.round >= self.last["dispatch"] - 1 and handle.round in self.received["dispatch"]
            if bad or not usable or not self._free("combine"):
                with pytest.raises(ConfigError):
                    self.rt.combine(y, idx, weights, handle, False, False, False, hook, None, None)
                assert self._launched("combine", before) == []
                return
            round_ = self.last["combine"] = self.last["combine"] + 1
            combined, _, h = self.rt.combine(y, idx, weights, handle, False, False, False, hook, None, None)
            assert combined.shape == (T, HIDDEN) and combined.dtype == torch.bfloat16
            if on_device:
                (launch,) = self._launched("combine", before)
                assert launch[0] == FUNCTIONS["combine", SEND if hook else BOTH] + PARITY * (round_ % 2)
                assert launch[5][0] == _address(y) and launch[5][6] == _address(combined)
            if hook:
                self.pending.append(("combine", round_, h))
            else:
                assert h is None
                self.received["combine"].add(round_)

        @precondition(lambda self: self.pending)
        @rule(data=st.data())
        def call_a_hook(self, data) -> None:
            phase, round_, h = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            before = len(self.drivers[phase].launches)
            h()
            h()  # a hook runs once
            if on_device:
                (launch,) = self._launched(phase, before)
                assert launch[0] == FUNCTIONS[phase, RECV] + PARITY * (round_ % 2)
            self.received[phase].add(round_)

        @invariant()
        def nothing_went_through_the_kernels_own_launcher(self) -> None:
            assert self.kernels.dispatch.launches == self.kernels.combine.launches == []

    run_state_machine_as_test(Rounds, settings=settings(max_examples=80, stateful_step_count=30, deadline=None))
