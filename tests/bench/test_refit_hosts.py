"""``warmlink bench refit --hosts``: one trainer into engines on other emulated hosts over NIXL/UCX
TCP (``bench.refit_hosts``), and its command line (``bench.refit_hosts_cli``).

The emulated hosts need root and the namespace tools, the transfers nixl: where either is missing
the tests skip and say why. Nothing here asserts on speed: the bench reports how it compares with
its bound, and the tests check what it moved and that it says so.
"""

from __future__ import annotations

import json

import pytest
import torch

from warmlink.bench.cluster import unavailable
from warmlink.bench.model_spec import qwen3_4b_like
from warmlink.bench.refit_hosts import engine_hosts
from warmlink.bench.refit_hosts_roles import version_key, version_values
from warmlink.cli.main import main


@pytest.fixture(scope="module")
def cluster_possible():
    pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install warmlink[nixl])")
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


def test_bench_refit_hosts_into_engines_on_three_other_hosts_is_bit_exact(cluster_possible, tmp_path, capsys) -> None:
    """End to end at a tiny size: a trainer on host 0, engines on hosts 1, 2 and 3 over NIXL/UCX TCP,
    every engine bit-exact at every version (two per count), the warm cycle making nothing; pulling
    from the trainer puts N copies through its link, fan-out about one whatever N."""
    path, chart = tmp_path / "hosts.json", tmp_path / "hosts.png"
    rc = main(["bench", "refit", "--hosts", "4", "--engines", "1..3", "--link-rate", "100mbit", "--scale", "0.001",
               "--cycles", "2", "--modes", "pull,fanout", "--timeout", "120", "--json", str(path), "--plot", str(chart)])
    out = capsys.readouterr().out
    assert rc == 0, out
    record = json.loads(path.read_text())
    nbytes = qwen3_4b_like(0.001).nbytes
    assert record["placement"] == [1, 2, 3] and record["link_rate_bps"] == 100_000_000 and record["nbytes"] == nbytes
    for mode in ("pull", "fanout"):
        rows = record["modes"][mode]
        assert [r["engines"] for r in rows] == [1, 2, 3] and all(r["exact"] for r in rows), (mode, rows)
        versions = [c["version"] for r in rows for c in [*r["cycles"], r["unlimited"]]]
        assert versions == list(range(versions[0], versions[0] + 9)), mode  # a new version every cycle, each checked
        for r in rows:
            assert not any(c["bad"] for c in [*r["cycles"], r["unlimited"]])
            assert r["unlimited"]["created"] == 0 and r["unlimited_s"] > 0  # the limit lifted, the same warm path
            assert r["cycles"][1]["created"] == 0  # the warm cycle registers and plans nothing
            copies = r["engines"] if mode == "pull" else 1  # through the trainer's link, plus headers
            assert all(c["trainer_sent_bytes"] >= copies * nbytes for c in r["cycles"]), (mode, r)
            assert r["bound_s"] == pytest.approx(copies * nbytes * 8 / 100e6)
        assert rows[0]["cycles"][0]["created"] > 0  # the first engine's first cycle made its plan and buffers
    fanned = [r["trainer_sent_x"] for r in record["modes"]["fanout"]]
    assert max(fanned) < 1.2 and all(r["trainer_sent_x"] >= r["engines"] for r in record["modes"]["pull"]), fanned
    assert chart.stat().st_size > 0
    assert "3 engines ready on hosts 1, 2, 3" in out and "[pull] N=3 cycle 2/2" in out  # progress while it runs
    assert "pull: every engine pulls from the trainer; bound = N x bytes / rate" in out  # the table's title
    assert "N=3 unlimited links" in out
    assert "pull: " in out and "its bound" in out  # the verdict: the links bound it, or not


@pytest.mark.parametrize("argv, message", [
    (["--link-rate", "1gbit"], "--link-rate needs --hosts"),
    (["--engines", "2", "--link-rate", "1gbit"], "--link-rate needs --hosts"),
    (["--engines", "2", "--modes", "pull,teleport"], "--modes='pull,teleport' invalid"),
    (["--engines", "2", "--scenarios", "warm"], "--scenarios does not apply with --engines"),
    (["--hosts", "3", "--devices=-1,-1"], "--devices does not apply with --hosts"),
    (["--hosts", "3", "--backend", "nixl"], "--backend does not apply with --hosts"),
    (["--hosts", "3", "--modes", "pull,teleport"], "--modes='pull,teleport' invalid"),
])
def test_bench_refit_hosts_refuses_what_does_not_apply(argv, message, capsys) -> None:
    assert main(["bench", "refit", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--hosts", "1"], "out of range"),
    (["--hosts", "3", "--engines", "3..1"], "out of range"),
    (["--hosts", "3", "--engines", "1,x"], "is not engine counts"),
    (["--hosts", "3", "--link-rate", "fast"], "is not a link rate"),
])
def test_bench_refit_hosts_checks_its_values_where_they_are_parsed(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "refit", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_engines_fill_hosts_in_blocks() -> None:
    """Engines of one host are neighbours in join order: a chain crosses each link once each way."""
    assert engine_hosts(4, 8) == [1, 1, 1, 2, 2, 2, 3, 3]
    assert engine_hosts(3, 2) == [1, 2]
    assert engine_hosts(2, 3) == [1, 1, 1]


def test_every_version_changes_every_word() -> None:
    """An engine that kept an older version, or mixed two, fails the check (refit_hosts_roles)."""
    keys = [version_key(v) for v in range(1 << 16)]
    assert len(set(keys)) == 1 << 16
    base = torch.randn(4096).to(torch.bfloat16)
    one, two = (version_values(base, v).view(torch.int16) for v in (1, 2))
    assert bool((one != two).all()) and bool((one != base.view(torch.int16)).all())


def _record(*rows: tuple[int, float, float]) -> dict:
    """A bench record of one mode whose rows are ``(engines, warm_s, unlimited_s)``, bound 1 s."""
    return {"modes": {"fanout": [{"engines": n, "warm_s": w, "bound_s": 1.0, "unlimited_s": u, "exact": True}
                                 for n, w, u in rows]}}


@pytest.mark.parametrize("rows,says", [
    ([(1, 1.05, 0.1), (8, 1.2, 0.3)], "fanout: 1.05-1.20x its bound at every N, and with the limit lifted a cycle takes "
                                      "at most 25% of the limited one: the links bound it, not the CPU"),
    ([(1, 1.05, 0.1), (8, 2.0, 0.3)], "fanout: up to 2.00x its bound (N=8), and with the limit lifted a cycle takes at "
                                      "most 15% of the limited one: the links bound it, at 50% of their rate at worst"),
    ([(1, 1.05, 0.1), (8, 1.2, 0.66)], "fanout: 1.05-1.20x its bound at every N, and at N=8 the limit lifted leaves 55% "
                                       "of the cycle (0.66 s against 1.20 s): the CPU, not only the links, bounds it there"),
    ([(1, 1.05, 0.1), (8, 4.0, 3.6)], "fanout: up to 4.00x its bound, and at N=8 the limit lifted leaves 90% of the "
                                      "cycle (3.60 s against 4.00 s)"),
])
def test_the_verdict_says_what_bounds_a_mode(rows, says) -> None:
    from warmlink.bench.refit_hosts_cli import _verdicts

    assert _verdicts(_record(*rows))[0].startswith(says)
