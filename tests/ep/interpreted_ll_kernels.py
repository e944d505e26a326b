"""Low-latency mode's device path (ep.low_latency._device) through Triton's interpreter, against the
host path (ep.low_latency._host) on the same inputs.

Run by ``test_kernels.py`` in a child pytest with ``TRITON_INTERPRET=1``. Every rank's region is
host memory of this one process; each rank's kernels run in turn, as a stream would order them,
so a receive kernel finds its peers' signal words written. The GPU runs the same kernels across
processes in the ep GPU tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ep._interpreter import numpy_scalars_in_the_interpreter, swap_ptx_helpers
from tests.ep._ll_workers import dequantized, expert_output, ll_inputs
from warmlink.ep.low_latency._device import BOTH, RECV, SEND, DevicePath, build_kernels
from warmlink.ep.low_latency._failures import F_MISMATCH, F_REFUSED, F_TIMEOUT, F_UNMASKED
from warmlink.ep.low_latency._host import HostPath
from warmlink.ep.low_latency._layout import LowLatencyLayout
from warmlink.ep.low_latency._outputs import Outputs

triton = pytest.importorskip("triton")



@pytest.fixture(scope="module")
def kernels():
    assert triton.knobs.runtime.interpret, "run with TRITON_INTERPRET=1 (test_kernels.py does)"
    numpy_scalars_in_the_interpreter()
    from warmlink.ep.low_latency import _triton, _triton_combine, _triton_dispatch

    mp = pytest.MonkeyPatch()
    for module in (_triton, _triton_dispatch, _triton_combine):
        swap_ptx_helpers(mp, module)
    yield build_kernels(interpreted=True)
    mp.undo()


class Group:
    """``case``'s ranks twice: on the device path (interpreted) and on the host path."""

    def __init__(self, case: dict, kernels, shrink: bool = False) -> None:
        num_ranks = len(case["tokens"])
        self.case = case
        self.lay = lay = LowLatencyLayout(num_ranks, max(1, *case["tokens"]), case["hidden"], case["experts"],
                                          case["topk"])
        self.inputs = ll_inputs(case)
        self.regions = [torch.zeros(lay.region_nbytes, dtype=torch.uint8) for _ in range(num_ranks)]
        bases = {r: t.data_ptr() for r, t in enumerate(self.regions)}
        self.out = [Outputs(lay, -1) for _ in range(num_ranks)]
        self.dev = [DevicePath(lay, r, bases, torch.device("cpu"), 0.05, self.out[r], kernels, shrink=shrink)
                    for r in range(num_ranks)]
        host_regions = {r: torch.zeros(lay.region_nbytes, dtype=torch.uint8) for r in range(num_ranks)}
        self.host = [HostPath(lay, r, host_regions) for r in range(num_ranks)]
        self.host_out = [Outputs(lay, -1) for _ in range(num_ranks)]
        self.ranks = range(num_ranks)
        self.dispatched = {}  # each sender's mask of its last dispatch, [T, K] as a handle's
        # DeepEP's cumulative_local_expert_recv_stats and dispatch_wait_recv_cost_stats, by rank
        self.stats = [(torch.zeros(lay.local_experts, dtype=torch.int32), torch.zeros(num_ranks, dtype=torch.int64))
                      for _ in range(num_ranks)]

    def dispatch(self, round_: int, fp8: bool, round_scale: bool = False, ue8m0: bool = False, tags=None,
                 receivers=None, senders=None, live=None, stats: bool = False, both: bool = False):
        """Round ``round_`` on both paths (the device path alone when ``senders`` leaves ranks out,
        unless ``live`` names the ranks the host path's receivers read; with ``stats``, each rank's
        ``self.stats`` passed; with ``both``, each rank's send launches its receive too, as a call
        without a hook does); returns each receiver's device-path and host-path views."""
        lay, tokens, p = self.lay, self.lay.max_tokens, round_ % 2
        oracle = senders is None or live is not None
        live = np.array([r in (live if live is not None else self.ranks) for r in self.ranks])
        for s in senders if senders is not None else self.ranks:
            mine = self.inputs[s]
            out = self.out[s].views(p, tokens, fp8, ue8m0)
            out.dispatched.fill_(True)  # the send writes its [N, K] corner
            # a tag with its high bit set: an int32 argument that a kernel shifts must not sign-extend
            self.dev[s].dispatch(BOTH if both else SEND, p, mine["x"], mine["topk_idx"], tokens, fp8, round_scale,
                                 ue8m0, tags[s] if tags else 201, *(self.stats[s] if stats else (None, None)))
            n, num_cols = mine["topk_idx"].shape
            mask = out.dispatched.clone()
            assert torch.equal(mask[:n, :num_cols], mine["topk_idx"] >= 0)
            if oracle:
                self.host[s].send_dispatch(round_, mine["x"], mine["topk_idx"], tokens, fp8, round_scale)
            self.dispatched[s] = mask
        got = {}
        for d in receivers if receivers is not None else self.ranks:
            out = self.out[d].views(p, tokens, fp8, ue8m0)
            mine = self.inputs[d]
            if not both:
                self.dev[d].dispatch(RECV, p, mine["x"], mine["topk_idx"], tokens, fp8, round_scale, ue8m0,
                                     tags[d] if tags else 201, *(self.stats[d] if stats else (None, None)))
            want = self.host_out[d].views(p, tokens, fp8, ue8m0)
            if oracle:
                rows = self.host[d].receive_dispatch(p, self.host[d].arrived_counts(round_, live), tokens, fp8, ue8m0,
                                                     want)
                got[d] = (out, want, rows)
        return got

    def combine(self, round_: int, got: dict, tags=(7, 7, 7), live=None, both: bool = False):
        """Each rank (of ``live``) sends back expert_output of what it received (with ``both``, in a
        launch that then receives, as ``dispatch``'s); returns (device, host) combined rows."""
        lay, p = self.lay, round_ % 2
        ranks = live if live is not None else self.ranks
        alive = np.array([r in ranks for r in self.ranks])
        combined = {s: tuple(torch.full((len(self.inputs[s]["x"]), lay.hidden), 9.0, dtype=torch.bfloat16)
                             for _ in range(2)) for s in ranks}
        for d in ranks:
            out, want, rows = got[d]
            y = expert_output(dequantized((out.x, out.scales) if out.scales is not None else out.x, lay.hidden), d,
                              lay.local_experts).contiguous()
            mine = self.inputs[d]
            n, num_cols = mine["topk_idx"].shape
            handle = SimpleNamespace(layout_range=out.layout_range, comb_slot=out.comb_slot,
                                     num_max_dispatch_tokens_per_rank=lay.max_tokens, num_tokens=n, num_topk=num_cols,
                                     dispatched=self.dispatched[d][:n, :num_cols] if both else out.dispatched)
            self.dev[d].combine(BOTH if both else SEND, p, y, handle, mine["topk_idx"], mine["topk_weights"],
                                combined[d][0] if both else y, tags[d], None)
            self.host[d].send_combine(p, y, rows, want.comb_slot)
        for s in ranks:
            mine = self.inputs[s]
            a, b = combined[s]
            n, num_cols = mine["topk_idx"].shape
            handle = SimpleNamespace(layout_range=None, comb_slot=None, num_max_dispatch_tokens_per_rank=lay.max_tokens,
                                     num_tokens=n, num_topk=num_cols, dispatched=self.dispatched[s][:n, :num_cols])
            if not both:
                self.dev[s].combine(RECV, p, a, handle, mine["topk_idx"], mine["topk_weights"], a, tags[s], None)
            self.host[s].receive_combine(p, mine["topk_idx"], mine["topk_weights"], b, alive)
        return combined


def _check_dispatch(group: Group, got: dict, fp8: bool, exact: bool) -> None:
    lay = group.lay
    for d, (out, want, _) in got.items():
        assert torch.equal(out.count, want.count), d
        assert torch.equal(out.layout_range, want.layout_range), d
        for e in range(lay.local_experts):
            n = int(want.count[e])
            assert torch.equal(out.src_info[e, :n], want.src_info[e, :n]), (d, e)
            assert torch.equal(out.comb_slot[e, :n], want.comb_slot[e, :n]), (d, e)
            if exact:
                assert torch.equal(out.x[e, :n].view(torch.uint8), want.x[e, :n].view(torch.uint8)), (d, e)
                if fp8:
                    assert torch.equal(out.scales[e, :n], want.scales[e, :n]), (d, e)
            else:
                assert torch.equal(out.scales[e, :n], want.scales[e, :n]), (d, e)
                a, b = out.x[e, :n].float(), want.x[e, :n].float()
                # Triton 3.9's interpreter rounds to e4m3 its own way: ties away from zero, and a
                # mantissa that rounds up is not carried into the exponent (1.99 -> 1.0 where CUDA
                # and torch give 2.0); the GPU tests compare CUDA's cast with torch's
                step = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=2**-9))) - 3)
                carry = (b.abs() == torch.exp2(torch.log2(b.abs()).round())) & (a == b / 2)
                assert (((a - b).abs() <= step) | carry).all() and (a != b).float().mean() < 0.1, (d, e)


_CASE = {"tokens": [12, 7, 0], "hidden": 256, "experts": 6, "topk": 3, "masked": 4, "seed": 5}


# 40 tokens to one expert per rank: a receive takes each source's rows of an expert in several steps
# (ROWS in ep.low_latency._triton_dispatch), the last one part-filled
_CROWDED = {"tokens": [40, 21], "hidden": 128, "experts": 2, "topk": 1, "masked": 3, "seed": 8}


@pytest.mark.parametrize("case,fp8,round_scale,ue8m0,random_x", [
    (_CASE, False, False, False, False), (_CASE, True, False, False, False), (_CASE, True, True, True, False),
    (_CASE, True, False, False, True), (_CROWDED, False, False, False, False), (_CROWDED, True, True, True, True),
    (_CROWDED, True, False, False, True)])
def test_device_path_packs_and_combines_what_the_host_path_does_over_both_parities(kernels, case, fp8, round_scale,
                                                                                    ue8m0, random_x):
    group = Group(dict(case, random_x=random_x), kernels)
    for round_ in (1, 2, 3):  # parity 1 twice: its sequence numbers and acks go on
        got = group.dispatch(round_, fp8, round_scale, ue8m0)
        _check_dispatch(group, got, fp8, exact=not random_x)
        for s, (a, b) in group.combine(round_, got).items():
            assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6), s
            assert (a[group.inputs[s]["topk_idx"].lt(0).all(1)] == 0).all()
    for path in group.dev:
        assert path.failure() is None
        assert path.state[:4].tolist() == [1, 2, 1, 2]  # dispatch, then combine sequence, by parity


@pytest.mark.parametrize("programs", [1, 2])
def test_fewer_programs_than_tokens_and_items_each_take_their_share_in_turn(kernels, programs, monkeypatch):
    """A launch of both phases has at most a program an SM, fewer than a prefill's tokens or a
    layout's (local expert, rank) items: every phase's program then takes several, one after
    another."""
    monkeypatch.setattr(DevicePath, "_grid", lambda self, phase, sends, receives: programs)
    group = Group(_CASE, kernels)
    for round_ in (1, 2, 3):
        got = group.dispatch(round_, True)
        _check_dispatch(group, got, True, exact=True)
        for s, (a, b) in group.combine(round_, got).items():
            assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6), s
    assert all(path.failure() is None for path in group.dev)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_launch_of_both_phases_sends_and_receives_what_the_host_path_does(kernels, fp8, monkeypatch):
    """A call without a hook launches the send and the receive at once (PHASE 3); in the
    interpreter, whose programs run in turn, one rank to itself with one program can: it takes
    every token and item (a combine's receive then loads each next token's routing before it sums
    this one's rows)."""
    monkeypatch.setattr(DevicePath, "_grid", lambda self, phase, sends, receives: 1)
    group = Group({"tokens": [9], "hidden": 256, "experts": 4, "topk": 3, "masked": 3, "seed": 11}, kernels)
    for round_ in (1, 2, 3):
        got = group.dispatch(round_, fp8, both=True)
        _check_dispatch(group, got, fp8, exact=True)
        for s, (a, b) in group.combine(round_, got, both=True).items():
            assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6), s
            assert (a[group.inputs[s]["topk_idx"].lt(0).all(1)] == 0).all()
    assert group.dev[0].failure() is None
    assert group.dev[0].state[:4].tolist() == [1, 2, 1, 2]


def test_the_receive_counts_each_local_experts_rows_and_its_waits_for_each_source(kernels):
    """DeepEP's cumulative_local_expert_recv_stats (each local expert's rows, summed over calls) and
    dispatch_wait_recv_cost_stats (the time each source was waited for: a clock reading per source)."""
    group = Group(_CASE, kernels)
    totals = [torch.zeros(group.lay.local_experts, dtype=torch.int32) for _ in group.ranks]
    for round_ in (1, 2, 3):
        got = group.dispatch(round_, True, stats=True)
        _check_dispatch(group, got, True, exact=True)
        for d, (_, want, _) in got.items():
            totals[d] += want.count
    for d in group.ranks:
        cumulative, waits = group.stats[d]
        assert torch.equal(cumulative, totals[d]), d
        assert (waits > 0).all(), d


def test_a_missing_sender_times_the_receive_out_and_stops_every_later_kernel(kernels):
    group = Group(_CASE, kernels)
    group.dispatch(1, True, senders=[0, 1], receivers=[0])
    assert group.dev[0].failure() == (F_TIMEOUT, "dispatch", 1, 2)
    assert group.dev[0].failure() == (F_TIMEOUT, "dispatch", 1, 2), "a timeout stays reported"
    assert group.dev[0].state[4] == 1
    before = group.regions[1].clone()
    group.dispatch(3, True, senders=[0], receivers=[])  # a failed rank sends nothing more
    assert torch.equal(group.regions[1], before)


def test_with_shrink_a_rank_that_never_sends_is_masked_and_the_others_go_on_without_its_rows(kernels):
    """DeepEP's enable_shrink: rank 2 is gone. Its peers' receives time out on it, mask it and
    complete with its rows absent (the host path with rank 2 masked is the oracle); their combines
    sum each token without rank 2's experts; the next rounds of both parities neither wait for
    rank 2's acks nor write into its region."""
    group = Group(_CASE, kernels, shrink=True)
    group.inputs[2]["topk_idx"][:] = -1  # the host oracle's rank 2 sends nothing either
    alive = [0, 1]
    for round_ in (1, 2, 3):
        before = group.regions[2].clone()
        got = group.dispatch(round_, False, senders=alive, receivers=alive, live=alive)
        _check_dispatch(group, got, False, exact=True)
        for s, (a, b) in group.combine(round_, got, live=alive).items():
            assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6), s
        if round_ > 1:
            assert torch.equal(group.regions[2], before), "nothing is written into a masked rank"
        for d in alive:
            assert group.dev[d].failure() is None
            assert group.dev[d].mask.tolist() == [0, 0, 1]
    mask = torch.full((3,), 7, dtype=torch.int32)
    group.dev[0].query_mask(mask)
    assert mask.tolist() == [0, 0, 1]
    group.dev[0].update_mask(1, True)
    group.dev[0].query_mask(mask)
    assert mask.tolist() == [0, 1, 1]
    group.dev[0].clean_mask()
    assert group.dev[0].mask.tolist() == [0, 0, 0]


def test_a_sender_waits_for_the_ack_of_its_parity_before_it_overwrites(kernels):
    group = Group(_CASE, kernels)
    group.dispatch(1, False, senders=[0], receivers=[])  # nobody received round 1 (parity 1)
    group.dispatch(3, False, senders=[0], receivers=[])  # parity 1 again: rank 0 must wait for the acks
    code, phase, seq, rank = group.dev[0].failure()
    assert (code, phase, seq) == (F_TIMEOUT, "dispatch", 2) and rank in (0, 1, 2)


@pytest.mark.parametrize("slot", ["a token's", "an empty"])
def test_one_unread_slot_stops_its_sender_whether_a_token_goes_there_or_not(kernels, slot, monkeypatch):
    """The acks are per (rank, local expert): rank 1 not having read rank 0's slot of its expert 2
    in round 1 stops rank 0's round 3 (parity 1 again), before any row lands in that slot, though
    every other slot was read; an empty slot too (the last program rewrites every slot's signal
    word). The programs run in turn here, so each waits for a share of one ack word: the slot's is
    program 2's, and token 1's own wait (program 1) must catch it first."""
    from warmlink.ep.low_latency import _triton_dispatch

    monkeypatch.setattr(_triton_dispatch, "ACK_BLOCK", triton.language.constexpr(1))
    group = Group(_CASE, kernels)
    lay, tokens = group.lay, group.lay.max_tokens
    for round_ in (1, 2):
        group.dispatch(round_, False)
    idx, x = group.inputs[0]["topk_idx"], group.inputs[0]["x"]
    idx[idx == 2] = -1
    if slot == "a token's":
        idx[1, 0] = 2  # token 1's (program 1's) first column
    x += 1  # other rows this time: a row stored into the slot would show
    ack = lay.offset("words.1") + 8 * (2 * lay.num_ranks + 1 * lay.local_experts + 0)  # of (rank 1, expert 2)
    group.regions[0][ack:ack + 8].zero_()
    rows = lay.offset("disp.1")  # slot (local expert 0, source 0) at rank 1: the area's first T rows
    before = group.regions[1][rows:rows + tokens * lay.row_bytes].clone()
    group.dispatch(3, False, senders=[0], receivers=[])
    assert group.dev[0].failure() == (F_TIMEOUT, "dispatch", 2, 1)
    assert torch.equal(group.regions[1][rows:rows + tokens * lay.row_bytes], before)


def test_ranks_with_other_arguments_are_refused_once_and_the_next_round_goes_on(kernels):
    group = Group(_CASE, kernels)
    group.dispatch(1, True, tags=[1, 2, 1])
    for d in group.ranks:
        code, phase, seq, rank = group.dev[d].failure()
        assert (code, phase, seq) == (F_MISMATCH, "dispatch", 1) and rank in (0, 1), d
        assert group.dev[d].failure() is None, "reported once"
    _check_dispatch(group, group.dispatch(3, True), True, exact=True)  # parity 1 again: the acks came


def test_an_expert_id_out_of_range_moves_no_row_and_every_rank_refuses_the_round(kernels):
    group = Group(_CASE, kernels)
    group.inputs[1]["topk_idx"][2, 0] = group.lay.num_experts
    lay = group.lay
    at, nbytes = lay.offset("disp.1"), lay.area_bytes("disp")
    group.dispatch(1, True, senders=[1], receivers=[])
    assert all(bool((r[at:at + nbytes] == 0).all()) for r in group.regions)
    for s in (0, 2):
        group.dispatch(1, True, senders=[s], receivers=[])
    for d in group.ranks:
        mine = group.inputs[d]
        group.dev[d].dispatch(RECV, 1, mine["x"], mine["topk_idx"], lay.max_tokens, True, False, False, 201, None,
                              None)
        assert group.dev[d].failure() == (F_REFUSED, "dispatch", 1, 1), d


def test_a_combine_that_unmasks_an_entry_is_reported_and_ranks_combining_other_dispatches_refuse(kernels):
    group = Group(_CASE, kernels)
    got = group.dispatch(1, False)
    t = int((group.inputs[0]["topk_idx"] < 0).any(1).nonzero()[-1])
    k = int((group.inputs[0]["topk_idx"][t] < 0).nonzero()[0])
    group.inputs[0]["topk_idx"][t, k] = 0  # an entry the dispatch did not send
    group.combine(1, got)
    assert group.dev[0].failure() == (F_UNMASKED, "combine", 1, 0)
    group.inputs[0]["topk_idx"][t, k] = -1
    got = group.dispatch(2, False)
    group.combine(2, got, tags=(3, 4, 3))  # rank 1 combines another dispatch's handle
    for d in group.ranks:
        code, phase, seq, rank = group.dev[d].failure()
        assert (code, phase, seq) == (F_MISMATCH, "combine", 1) and rank in (0, 1), d


@st.composite
def _cases(draw) -> dict:
    num_ranks, local = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    experts = num_ranks * local
    return {"tokens": draw(st.lists(st.integers(0, 9), min_size=num_ranks, max_size=num_ranks)),
            "hidden": draw(st.sampled_from([128, 384])), "experts": experts,
            "topk": draw(st.integers(1, min(experts, 4))), "masked": draw(st.integers(0, 6)),
            "seed": draw(st.integers(0, 10**6)), "fp8": draw(st.booleans()), "round_scale": draw(st.booleans())}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_any_routing_packs_and_combines_as_the_host_path_does(kernels, case):
    """Random groups (1-4 ranks, ranks without tokens, every entry of a token masked, top-1 to
    top-4): both parities, the device path against the host path."""
    group = Group(case, kernels)
    fp8, round_scale = case["fp8"], case["fp8"] and case["round_scale"]
    for round_ in (1, 2):
        got = group.dispatch(round_, fp8, round_scale, ue8m0=round_scale)
        _check_dispatch(group, got, fp8, exact=not round_scale)
        for s, (a, b) in group.combine(round_, got, tags=(7,) * len(case["tokens"])).items():
            assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6), s
    assert all(path.failure() is None for path in group.dev)
