"""ep.Buffer over the shm backend in spawned rank processes, checked against the oracle."""

from __future__ import annotations

import pytest
import torch

from tests.ep._group import run_ranks
from warmlink.errors import ConfigError
from tests.ep._reference import (
    decode_token_pattern,
    reference_combine,
    reference_dispatch,
)
from tests.ep._workers import (
    after_an_earlier_lifecycle,
    case_inputs,
    changing_rounds,
    dispatch_combine,
    expect_error,
    gathered_ints,
    lifecycle_counts,
    warm_rounds,
)


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _rows(x, n: int):
    return tuple(t[:n] for t in x) if isinstance(x, tuple) else x[:n]


def _unpadded(case: dict, g: dict) -> dict:
    """A rank's outputs of one round without the padding rows of ``num_worst_tokens``, once those
    rows were checked (expert id -1, weight 0, DeepEP's empty per-expert list, every output padded)."""
    worst = case.get("num_worst_tokens", 0)
    if not worst:
        return g
    n = g["num_recv_tokens"]
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "cached_x"):
        for t in g.get(name, ()) if name == "cached_x" else (g[name],):
            assert (t[0] if isinstance(t, tuple) else t).shape[0] == worst, f"{name} is not padded to {worst} rows"
    assert (g["recv_topk_idx"][n:] == -1).all() and (g["recv_topk_weights"][n:] == 0).all()
    assert g["num_recv_tokens_per_expert_list"] == []
    return dict(g, recv_x=_rows(g["recv_x"], n), recv_topk_idx=g["recv_topk_idx"][:n],
                recv_topk_weights=g["recv_topk_weights"][:n], cached_x=[_rows(c, n) for c in g.get("cached_x", ())],
                num_recv_tokens_per_expert_list=g["handle_per_expert"])


def check_against_reference(case: dict, results: list[list[dict]]) -> None:
    """Every round of every rank equals the oracle: rows, sources, ids, weights, counts, sums."""
    inputs = case_inputs(case)
    ref = reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                             [i["topk_weights"] for i in inputs], case["experts"])
    align = 1 if case.get("num_worst_tokens") else case.get("expert_alignment", 1)
    for rnd in range(case.get("rounds", 1)):
        got = [_unpadded(case, results[r][rnd]) for r in range(len(inputs))]
        for d, (g, want) in enumerate(zip(got, ref, strict=True)):
            assert _equal(g["recv_x"], want["recv_x"]), f"rank {d} round {rnd}: recv_x differs"
            ranks, tokens = decode_token_pattern(g["recv_x"])
            assert list(zip(ranks.tolist(), tokens.tolist(), strict=True)) == [tuple(p) for p in want["recv_src"]]
            assert torch.equal(g["recv_topk_idx"], want["recv_topk_idx"]), f"rank {d}: recv_topk_idx differs"
            assert torch.equal(g["recv_topk_weights"], want["recv_topk_weights"]), f"rank {d}: weights differ"
            assert g["num_recv_tokens_per_expert_list"] == [-(-n // align) * align
                                                            for n in want["num_recv_tokens_per_expert_list"]]
            for i, cached in enumerate(g.get("cached_x", ())):
                expected = -want["recv_x"] if i % 2 and not isinstance(cached, tuple) else want["recv_x"]
                assert _equal(cached, expected), f"rank {d} round {rnd}: cached dispatch {i} differs"
        comb = reference_combine([g["y"] for g in got], [w["recv_src"] for w in ref], case["tokens"],
                                 [g["recv_topk_weights"] for g in got])
        for s, (g, want) in enumerate(zip(got, comb, strict=True)):
            assert torch.equal(g["combined_x"], want["out"]), f"rank {s} round {rnd}: combined_x differs"
            assert torch.allclose(g["combined_w"], want["combined_weights"]), f"rank {s}: combined weights differ"


def check_changing_rounds(case: dict, results: list[dict]) -> None:
    """Each round of ``_workers.changing_rounds`` equals the oracle over that round's inputs."""
    for rnd, sub in enumerate(case["rounds_cases"]):
        inputs = case_inputs(dict(case, **sub))
        weights = [i["topk_weights"] for i in inputs] if sub.get("weights", True) else None
        ref = reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], weights, case["experts"])
        for d, want in enumerate(ref):
            got = results[d]["rounds"][rnd]
            assert _equal(got["recv_x"], want["recv_x"]), f"rank {d} round {rnd}: recv_x differs"
            ranks, tokens = decode_token_pattern(got["recv_x"])
            assert list(zip(ranks.tolist(), tokens.tolist(), strict=True)) == [tuple(p) for p in want["recv_src"]]
            assert torch.equal(got["recv_topk_idx"], want["recv_topk_idx"]), f"rank {d} round {rnd}: ids differ"
            if weights is None:
                assert got["recv_topk_weights"] is None
            else:
                assert torch.equal(got["recv_topk_weights"], want["recv_topk_weights"]), f"rank {d} round {rnd}"
            assert got["num_recv_tokens_per_expert_list"] == want["num_recv_tokens_per_expert_list"]
            assert all(torch.equal(c, -want["recv_x"]) for c in got["cached_x"]), f"rank {d} round {rnd}: cached"


def changing_case(num_ranks: int, backend: str = "shm") -> dict:
    """Eleven fresh dispatches: BF16, then FP8, then BF16 again (each parity and shape at least
    twice), new token counts every call, the last without weights; BF16 rounds 1-3 and 9 re-send
    with their handles."""
    fp8 = torch.float8_e4m3fn
    rounds = [{"tokens": [(17 * (r + s) + 5 * s) % 61 for s in range(num_ranks)], "seed": 40 + r,
               "dtype": fp8 if 4 <= r < 8 else torch.bfloat16, "cached": r in (1, 2, 3, 9)} for r in range(10)]
    rounds.append(dict(rounds[9], seed=60, weights=False, cached=False))
    return {"hidden": 256, "experts": 4 * num_ranks, "topk": 3, "mask_prob": 0.1, "backend": backend,
            "rounds_cases": rounds}


def test_new_inputs_and_token_counts_every_call_match_the_reference():
    case = changing_case(3)
    check_changing_rounds(case, run_ranks(changing_rounds, 3, case=case, timeout_s=120))


CASES = {
    "1 rank": {"tokens": [16], "hidden": 128, "experts": 4, "topk": 2},
    "2 ranks even": {"tokens": [16, 16], "hidden": 128, "experts": 8, "topk": 2},
    "2 ranks, combine in four parts": {"tokens": [16, 9], "hidden": 128, "experts": 8, "topk": 2, "combine_parts": 4},
    "3 ranks uneven, masked": {"tokens": [9, 0, 23], "hidden": 256, "experts": 12, "topk": 3, "mask_prob": 0.3, "seed": 3},
    "4 ranks, top-4 of 16": {"tokens": [31, 7, 12, 40], "hidden": 128, "experts": 16, "topk": 4, "mask_prob": 0.1, "seed": 5},
    "fp8": {"tokens": [10, 17, 3], "hidden": 256, "experts": 6, "topk": 2, "dtype": torch.float8_e4m3fn, "seed": 7},
    "no layout given, cached re-dispatch": {"tokens": [12, 5], "hidden": 128, "experts": 4, "topk": 2, "layout": False, "cached": True},
    "all masked": {"tokens": [4, 6], "hidden": 128, "experts": 4, "topk": 2, "mask_prob": 1.0},
    # the largest group ep takes on one node (issue 6 runs it on 8 GPUs)
    "8 ranks, top-8 of 32, cached re-dispatch": {"tokens": [5, 0, 9, 3, 12, 1, 7, 4], "hidden": 128, "experts": 32,
                                                 "topk": 8, "mask_prob": 0.1, "seed": 11, "cached": True},
    # DeepEP's padding arguments: outputs of num_worst_tokens rows (the most any rank receives here
    # is 3 * 40 = 120), per-expert counts rounded up; events asked for
    "padded outputs, cached re-dispatch": {"tokens": [40, 13, 27], "hidden": 128, "experts": 6, "topk": 2, "seed": 15,
                                           "num_worst_tokens": 120, "cached": True, "async_finish": True},
    "per-expert counts aligned to 16": {"tokens": [40, 13, 27], "hidden": 128, "experts": 6, "topk": 2, "seed": 15,
                                        "expert_alignment": 16, "async_finish": True},
}


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_combine_match_the_reference(name):
    case = dict(CASES[name], rounds=2)
    check_against_reference(case, run_ranks(dispatch_combine, len(case["tokens"]), case=case))


@pytest.mark.parametrize("delay_s", [0.001, 0.01, 0.1])
def test_late_hooks_are_still_correct(delay_s):
    case = {"tokens": [20, 11, 6], "hidden": 128, "experts": 6, "topk": 2, "mask_prob": 0.2, "hook_delay_s": delay_s, "rounds": 2, "seed": 11}
    check_against_reference(case, run_ranks(dispatch_combine, 3, case=case))


def test_padded_hook_dispatches_match_the_reference():
    case = {"tokens": [20, 11, 6], "hidden": 128, "experts": 6, "topk": 2, "mask_prob": 0.2, "hook_delay_s": 0.01,
            "rounds": 2, "seed": 16, "num_worst_tokens": 37, "cached": True}
    check_against_reference(case, run_ranks(dispatch_combine, 3, case=case))


def test_too_few_worst_tokens_make_every_rank_refuse_the_round_and_the_next_one_works():
    case = {"tokens": [6, 9], "hidden": 128, "experts": 4, "topk": 2, "fault": "worst_too_small_then_exact", "seed": 17}
    results = run_ranks(expect_error, 2, case=case)
    for first, _, padded_ids in results:  # host copies: the call itself raises
        assert first.startswith("ConfigError") and "num_worst_tokens=1" in first and padded_ids is None, first
    ref = reference_dispatch([i["x"] for i in case_inputs(case)], [i["topk_idx"] for i in case_inputs(case)], None, 4)
    assert all(torch.equal(recv_x, want["recv_x"]) for (_, recv_x, _), want in zip(results, ref, strict=True))


def test_deepep_arguments_are_checked_before_any_byte_moves():
    from warmlink.ep import Buffer, EventOverlap
    from warmlink.rendezvous import Store

    store = Store(is_server=True, prefix="ep-args", timeout_s=10)
    x, idx = torch.ones(4, 128, dtype=torch.bfloat16), torch.tensor([[0, 1], [1, -1], [0, 0], [1, 1]])
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=128, num_topk=2, timeout_s=10) as buf:
            for kwargs, match in (({"expert_alignment": 0}, "expert_alignment=0"),
                                  ({"num_worst_tokens": 9}, r"num_worst_tokens=9; expected an int in \[0, 8\]"),
                                  ({"num_worst_tokens": -1}, "num_worst_tokens=-1"),
                                  ({"previous_event": "event"}, "previous_event is a str")):
                with pytest.raises(ConfigError, match=match):
                    buf.dispatch(x, topk_idx=idx, num_experts=2, **kwargs)
            out = buf.dispatch(x, topk_idx=idx, num_experts=2, num_worst_tokens=6, async_finish=True)
            assert out[0].shape[0] == 6 and out[3] == [] and isinstance(out[5], EventOverlap)
            with pytest.raises(ConfigError, match="pads its outputs as the dispatch that made its handle did"):
                buf.dispatch(x, handle=out[4], num_worst_tokens=5)
            again = buf.dispatch(x, handle=out[4], previous_event=out[5])  # pads as the handle's dispatch did
            assert again[0].shape[0] == 6 and torch.equal(again[0][:4], out[0][:4])
            with pytest.raises(ConfigError, match="x has 5 rows; expected 6"):
                buf.combine(out[0][:5].clone(), out[4])
            combined, _, event = buf.combine(out[0].clone(), out[4], async_finish=True)
            event.current_stream_wait()  # on host memory the outputs are complete: nothing to wait for
            assert torch.equal(combined, x * 1)  # one rank: each token's single copy comes back
            with pytest.raises(ConfigError, match="a host-memory Buffer has no stream"):
                buf.get_comm_stream()
    finally:
        store.close()


def test_skewed_ranks_running_ahead_never_overwrite_what_a_peer_reads():
    """Cached dispatches and combines do not wait for their peers (Note [Two parities]): with a
    different rank slowest at every call, each output still equals the reference."""
    case = {"tokens": [14, 9, 17], "hidden": 128, "experts": 6, "topk": 2, "rounds": 3, "seed": 17, "cached": True,
            "cached_repeats": 3, "skew_s": 0.02}
    check_against_reference(case, run_ranks(dispatch_combine, 3, case=case, timeout_s=120))


def test_twenty_reruns_are_identical():
    case = {"tokens": [25, 19], "hidden": 128, "experts": 8, "topk": 3, "rounds": 20, "seed": 13}
    results = run_ranks(dispatch_combine, 2, case=case, timeout_s=120)
    check_against_reference(case, results)
    for rank in results:
        for rnd in rank[1:]:
            assert torch.equal(rnd["recv_x"], rank[0]["recv_x"]) and torch.equal(rnd["combined_x"], rank[0]["combined_x"])


def test_rounds_after_the_first_create_nothing():
    case = {"tokens": [8, 8], "hidden": 128, "experts": 4, "topk": 2}
    for rounds in run_ranks(warm_rounds, 2, case=case):
        assert rounds[1] == {} and rounds[2] == {}, rounds


def test_buffer_lifecycles_reuse_everything_and_grow_nothing():
    case = {"tokens": [8, 8], "hidden": 128, "experts": 4, "topk": 2, "lifecycles": 30}
    for out in run_ranks(lifecycle_counts, 2, case=case, timeout_s=120):
        assert out["created"][0], "the first lifecycle creates the buffer's resources"
        assert all(c == {} for c in out["created"][2:]), out["created"]
        assert len(set(out["mappings"][2:])) == 1, out["mappings"]


def test_a_new_buffers_count_boards_are_zero_though_its_pooled_region_is_not(monkeypatch):
    """The pool hands a region back with a closed Buffer's bytes (not zeroed); the boards, whose
    round tags the SM exchange trusts, are cleared before the rank info is published."""
    from warmlink.ep.paths import setup as _setup

    seen = []
    real = _setup.Resources._clear_boards

    def dirty_then_clear(self):
        self._region.tensor.fill_(0x5A)  # what an earlier Buffer may have left
        real(self)
        lay = self.layout
        seen.append([bool(self._region.tensor[lay.offsets()[f"board.{p}"]:][:lay.area_rows(f"board.{p}") *
                                               lay.row_bytes(f"board.{p}")].eq(0).all()) for p in (0, 1)])

    monkeypatch.setattr(_setup.Resources, "_clear_boards", dirty_then_clear)
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    store = Store(is_server=True, prefix="ep-boards", timeout_s=10)
    try:
        with Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=128, num_topk=2, timeout_s=10) as buf:
            assert buf.layout.num_ranks == 1
    finally:
        store.close()
    assert seen == [[True, True]]


def test_a_second_lifecycle_with_late_peers_matches_the_reference():
    case = {"tokens": [40, 70], "hidden": 128, "experts": 4, "topk": 2, "seed": 13, "max_tokens": 128,
            "late_start_s": 0.2, "before": {"tokens": [100, 20], "seed": 14}}
    check_against_reference(case, run_ranks(after_an_earlier_lifecycle, 2, case=case, timeout_s=120))


@pytest.mark.parametrize("refusal, says", [
    ("bad_expert", "outside [-1, 4)"), ("bad_counts", "is_token_in_rank holds"), ("oversize", "max_tokens_per_rank=6"),
    ("bad_shape", "is_token_in_rank has shape"), ("bad_worst", "num_worst_tokens=1000000")])
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_refusing_its_arguments_makes_every_rank_raise_at_once_and_the_next_call_works(refusal, says, ranks):
    """Rank 0's fresh dispatch fails one of its own checks: it takes part in the round without tokens,
    refused (ep.protocol.normal, Note [Refused dispatch]), so every peer raises RefusedRound (a
    ConfigError) naming it at
    once, instead of waiting out its timeout (600 s here: a wait would fail the test's own limit,
    which leaves a loaded machine minutes to start and run the ranks), and the next dispatch of
    every rank equals the reference."""
    case = {"tokens": [6] * ranks, "hidden": 128, "experts": 4 * ranks, "topk": 2, "fault": "refused_then_valid",
            "refusal": refusal, "timeout_s": 600.0, "seed": 5}
    results = run_ranks(expect_error, ranks, case=case, timeout_s=240)
    first = [r[0] for r in results]
    assert first[0].startswith("ConfigError") and says.replace("[-1, 4)", f"[-1, {4 * ranks})") in first[0], first[0]
    assert all(e.startswith("RefusedRound") and "ranks [0] refused their dispatch arguments" in e for e in first[1:]), first
    inputs = case_inputs(case)
    ref = reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], None, case["experts"])
    for d, (_, recv_x, _) in enumerate(results):
        assert torch.equal(recv_x, ref[d]["recv_x"]), f"rank {d}: the dispatch after the refused one differs"


def test_dead_peer_raises_peer_lost_not_a_hang():
    case = {"tokens": [6, 6, 6], "hidden": 128, "experts": 6, "topk": 2, "fault": "dead_peer", "timeout_s": 20.0}
    errors = run_ranks(expect_error, 3, case=case, timeout_s=60)
    for r in (0, 2):
        assert errors[r].startswith("PeerLostError") and "rank 1" in errors[r], errors[r]


def test_mismatched_sizes_are_refused_naming_the_peer():
    case = {"tokens": [6, 6], "hidden": 128, "experts": 4, "topk": 2, "fault": "none", "timeout_s": 5.0, "per_rank": {1: {"hidden": 256}}}
    errors = run_ranks(expect_error, 2, case=case)
    assert all(e.startswith("ConfigError") and "hidden" in e for e in errors), errors


def test_skipping_a_hook_is_an_error_not_corruption():
    case = {"tokens": [6, 6], "hidden": 128, "experts": 4, "topk": 2, "fault": "hook_skipped", "timeout_s": 5.0}
    errors = run_ranks(expect_error, 2, case=case)
    assert all(e.startswith("ConfigError") and "hook" in e for e in errors), errors


def test_combining_with_different_dispatches_handles_is_refused():
    case = dict(tokens=[6, 6], hidden=128, experts=4, topk=2, fault="stale_handle", timeout_s=5.0)
    errors = run_ranks(expect_error, 2, case=case)
    assert all(e.startswith("ConfigError") and "handle of dispatch round" in e for e in errors), errors


def test_buffer_from_a_torch_distributed_group():
    import socket

    from tests.ep._workers import from_group_round

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    case = {"tokens": [9, 14], "hidden": 128, "experts": 4, "topk": 2, "seed": 21, "dist_port": port}
    check_against_reference(case, run_ranks(from_group_round, 2, case=case))


def test_from_group_refuses_a_group_across_machines_on_every_rank():
    """ep runs within one node: a rank on another machine (another kernel boot id) makes every rank
    raise before any store or region is used, instead of the others waiting out their timeout."""
    from tests.ep._deep_ep_workers import free_port
    from tests.ep._workers import from_group_across_hosts

    for got in run_ranks(from_group_across_hosts, 3, case={"dist_port": free_port()}, timeout_s=120):
        assert got.startswith("ConfigError") and "ranks [2]" in got and "one node" in got, got


def test_as_words_views_rows_as_int64_words_or_bytes_without_copying():
    from warmlink.ep.paths.host_mover import as_words

    x = torch.arange(24, dtype=torch.bfloat16).view(3, 8)
    words = as_words(x)
    assert words.shape == (3, 2) and words.dtype == torch.int64 and words.data_ptr() == x.data_ptr()
    assert torch.equal(words.view(torch.bfloat16), x)
    assert as_words(torch.empty(0, 8, dtype=torch.bfloat16)).shape == (0, 2)
    fp8 = torch.zeros(2, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert as_words(fp8).shape == (2, 2)
    odd = torch.zeros(2, 3, dtype=torch.bfloat16)  # 6-byte rows: bytes
    assert as_words(odd).dtype == torch.uint8 and as_words(odd).shape == (2, 6)
    cube = torch.zeros(2, 2, 4, dtype=torch.bfloat16)  # rows of more than one dimension
    assert as_words(cube).shape == (2, 2) and as_words(cube).dtype == torch.int64


def test_a_nan_or_inf_in_one_token_leaves_every_other_token_exact_on_every_rank():
    from tests.ep._workers import poisoned_rounds

    case = {"tokens": [9, 7], "hidden": 128, "experts": 4, "topk": 2, "seed": 31,
            "poisons": [float("nan"), float("inf")]}
    results = run_ranks(poisoned_rounds, 2, case=case)
    for rank, rounds in enumerate(results):
        clean = rounds[0]
        for rnd, got in enumerate(rounds[1:], 1):
            bad = 1 if rank == 0 else 0  # rank 0's token 0 holds the bad value; its copies come back to it
            for name in ("combined_x", "combined_w"):
                assert torch.equal(got[name][bad:], clean[name][bad:]), f"rank {rank} round {rnd}: {name} spread"
            if bad:
                x, w = got["combined_x"][0], got["combined_w"][0]
                assert not torch.isfinite(x[5]) and not torch.isfinite(w[0]), f"round {rnd}: the bad value vanished"
                assert torch.equal(x[6:], clean["combined_x"][0, 6:]) and torch.equal(w[1:], clean["combined_w"][0, 1:])


@pytest.mark.parametrize("disagree,field", [
    ("x_dtype", "x_dtype=torch.float16"), ("dispatch_weights", "topk_weights=False"),
    ("cached_x_dtype", "x_dtype=torch.float16"), ("combine_dtype", "x_dtype=torch.float16"),
    ("combine_weights", "topk_weights=None"), ("combine_weight_columns", "topk_weights=1 columns")])
def test_ranks_that_disagree_on_dtype_or_weights_all_refuse_the_call_and_the_next_one_works(disagree, field):
    from tests.ep._workers import disagree_then_agree

    case = {"tokens": [7, 9], "hidden": 128, "experts": 4, "topk": 2, "seed": 17, "timeout_s": 10.0,
            "disagree": disagree}
    results = run_ranks(disagree_then_agree, 2, case=case)
    for rank, r in enumerate(results):
        assert r["error"].startswith("ConfigError") and field in r["error"], (rank, r["error"])
    check_against_reference(case, [[r["got"]] for r in results])


def test_a_buffer_left_open_is_closed_when_collected():
    """``Closing.__del__`` closes (with a ResourceWarning) an engine that still holds a link
    (``_link``): a Buffer dropped without ``close`` gives its regions, mappings, streams and events
    back to the pool, as deep_ep.Buffer(explicitly_destroy=False) relies on."""
    import gc
    import warnings

    from warmlink import pool
    from warmlink.ep import Buffer
    from warmlink.rendezvous import Store

    def held() -> dict:  # leased and not given back (the pool keeps what was given back idle)
        return {kind: c["live"] - c["idle"] for kind, c in pool.stats().items() if c["live"] - c["idle"]}

    store = Store(is_server=True, prefix="ep-collected", timeout_s=10)
    try:
        before = held()
        buf = Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=128, num_topk=2, backend="shm", timeout_s=10)
        assert held() != before  # it holds leases
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del buf
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) and "was not closed" in str(w.message) for w in caught)
        assert held() == before
    finally:
        store.close()


def test_all_gather_int_gives_every_ranks_value_in_order_and_a_lone_caller_times_out():
    """Host-only meets through the mailboxes, 60 in a row with one rank late now and then: no
    value is read from the wrong meet; a bad value is refused; a meet no peer joins raises, and
    waiting for it again (``again=True``) gives the values of the peers that join it late."""
    results = run_ranks(gathered_ints, 3, case={"meets": 60, "linger_s": 3.0}, timeout_s=120)
    for got in results:
        assert got["wrong"] == [], got["wrong"][:3]
        assert "value=-1; expected an int in [0, 2**63)" in got["refused"]
    assert results[0]["alone"] == "TransferTimeout"  # its peers were alive and not meeting
    assert [got["again"] for got in results] == [[5, 8, 9]] * 3  # the timed-out meet, joined late
