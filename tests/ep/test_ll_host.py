"""The low-latency host path on one rank's region, without a Buffer: rows land in their slots in
token order, the signal words carry the round, and a word of another round is refused."""

from __future__ import annotations

import pytest
import torch

from warmlink.ep.low_latency._host import HostPath
from warmlink.ep.low_latency._layout import LowLatencyLayout
from warmlink.ep.low_latency._outputs import Outputs
from warmlink.errors import MetadataError


def test_rows_signals_and_packing_on_one_rank():
    lay = LowLatencyLayout(num_ranks=1, max_tokens=4, hidden=128, num_experts=3, num_topk=2)
    path = HostPath(lay, 0, {0: torch.zeros(lay.region_nbytes, dtype=torch.uint8)})
    x = torch.arange(4 * 128, dtype=torch.float32).view(4, 128).remainder(5).to(torch.bfloat16)
    idx = torch.tensor([[2, 0], [-1, 2], [0, -1], [1, 2]])
    path.send_dispatch(1, x, idx, 4, fp8=False, round_scale=False)
    counts = path.arrived_counts(1)
    assert counts.tolist() == [[2, 1, 3]]  # [source, local expert]
    with pytest.raises(MetadataError, match="holds round 1; expected 3"):
        path.arrived_counts(3)  # the same parity, a later round no source wrote
    out = Outputs(lay, -1).views(1, 4, fp8=False, ue8m0=False)
    rows_by_source = path.receive_dispatch(1, counts, 4, False, False, out)
    assert torch.equal(out.x[2, :3], x[[0, 1, 3]]) and torch.equal(out.x[0, :2], x[[0, 2]])
    assert out.src_info[2, :3].tolist() == [0, 1, 3] and out.comb_slot[2, :3].tolist() == [0, 3, 7]
    assert out.count.tolist() == [2, 1, 3] and out.layout_range[:, 0].tolist() == [2, 1, 3]
    assert rows_by_source[0].tolist() == [0, 1, 4, 8, 9, 10]
    # combine: expert e sends its rows back times (e + 1); token t sums w * (e + 1) * x[t]
    y = (out.x.float() * torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)).to(torch.bfloat16)
    path.send_combine(1, y, rows_by_source, out.comb_slot)
    w = torch.tensor([[0.5, 1.0], [1.0, 0.25], [2.0, 1.0], [1.0, 1.0]])
    combined = torch.empty(4, 128, dtype=torch.bfloat16)
    path.receive_combine(1, idx, w, combined)
    factor = torch.tensor([0.5 * 3 + 1.0 * 1, 0.25 * 3, 2.0 * 1, 1.0 * 2 + 1.0 * 3])
    assert torch.equal(combined, (x.float() * factor.view(4, 1)).to(torch.bfloat16))


def test_a_rank_without_tokens_sends_fp8_with_one_scale_per_row():
    """No tokens, FP8, hidden 128: torch's empty [0, 1] scales may have stride 0, which no byte
    view takes; the send still writes its signal words (found by the interpreted device-path fuzz)."""
    lay = LowLatencyLayout(num_ranks=1, max_tokens=2, hidden=128, num_experts=1, num_topk=1)
    path = HostPath(lay, 0, {0: torch.zeros(lay.region_nbytes, dtype=torch.uint8)})
    path.send_dispatch(1, torch.zeros(0, 128, dtype=torch.bfloat16), torch.zeros(0, 1, dtype=torch.int64), 2, fp8=True,
                       round_scale=False)
    assert path.arrived_counts(1).tolist() == [[0]]
