"""``torch.set_default_device`` (DeepEP's test harness and many trainers set "cuda") does not
reach the library's own tensors: host words stay on the CPU, and a Buffer builds and runs a round.

On the CPU the default device is "meta": a tensor made without naming its device then lands
where no operation on real data works, which is the failure "cuda" causes for pinned host memory
("Only dense CPU tensors can be pinned"), found without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.ep._default_device import round_under_default_device
from tests.ep._group import run_ranks
from tests.ep.test_buffer import check_against_reference
from warmlink.ep.paths import cuda_mover as _cuda_mover
from warmlink.ep.paths import host_mover as _movers
from warmlink.ep.wire.regions import RegionLayout
from warmlink.transport.cuda_ipc import CopyEngines

_HAS_CUDA = torch.cuda.is_available()


class _Stream:
    handle = cuda_stream = 0

    def torch_stream(self):
        return self


def test_a_cuda_movers_host_words_are_on_the_cpu_whatever_the_default_device():
    layout = RegionLayout(2, 4, 128, 2)
    own = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cpu")
    torch.set_default_device("meta")
    try:
        mover = _cuda_mover.CudaMover(layout, 0, 0, own, {1: 0}, CopyEngines([_Stream()], 0, [], batched=True), _Stream(),
                                      [0] * _cuda_mover.CudaMover.LOCAL_EVENTS,
                                      {}, {}, {})
    finally:
        torch.set_default_device(None)
    host = {name: t for name, t in vars(mover).items() if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    elsewhere = {name: t.device for name, t in vars(mover).items() if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
    assert not elsewhere, f"tensors the mover made off the CPU: {elsewhere}"
    # the host words it reads back with numpy: the count words, the board, the call blocks, the counts
    assert {"_host", "_board_host", "_abort", "_call_host", "_cached_host", "_counts_host"} <= set(host)


def test_a_host_movers_combine_counts_are_on_the_cpu_whatever_the_default_device():
    mover = _movers.HostMover(RegionLayout(2, 4, 128, 2), 0, torch.zeros(1, dtype=torch.uint8), {})
    torch.set_default_device("meta")
    try:
        counts = mover.combine_counts([3, 4], 0, 1.0)
    finally:
        torch.set_default_device(None)
    assert counts.device.type == "cpu" and counts.tolist() == [3, 4]


def test_buffer_builds_and_runs_a_round_with_a_default_device_set():
    case = {"tokens": [13, 6], "hidden": 256, "experts": 8, "topk": 2, "seed": 3, "default_device": "meta"}
    check_against_reference(case, run_ranks(round_under_default_device, 2, case=case))


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_buffer_builds_and_runs_a_round_with_cuda_as_the_default_device(ranks):
    case = {"tokens": [64, 17, 40, 0][:ranks], "hidden": 7168, "experts": 32, "topk": 8, "seed": 5,
            "default_device": "cuda", "backend": "cuda_ipc"}
    check_against_reference(case, run_ranks(round_under_default_device, ranks, case=case, timeout_s=180))
