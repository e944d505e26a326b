"""Refit between Ray actors on CPU over shm (issue 5, item 3): TP=2 trainer ranks and one engine,
bit-exact after every refit and warm after the first; a killed engine neither blocks the trainers'
next update nor hangs the driver."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from warmlink.errors import PeerLostError, TransferTimeout
from warmlink.integrations.ray import RefitJob, get

STEPS = 3


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_import_does_not_need_ray():
    import subprocess
    import sys

    code = "import sys, warmlink.integrations.ray; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_tp2_trainers_refit_one_engine_bit_exact_and_warm(ray_cluster):
    with RefitJob(trainers=2, engines=1, timeout_s=20) as job:
        exported = job.export()
        assert [e["version"] for e in exported] == [1, 1]
        checksums = []
        for step in range(STEPS + 1):
            (result,) = job.refit()
            assert result["version"] == step + 1
            assert result["exact"], f"engine weights differ from the trainers' after refit {step}"
            created = result["report"]["created"]
            if step == 0:
                assert created["plan"] >= 1, created
            else:
                assert not any(created.values()), f"refit {step} created {created}"
            checksums.append(result["checksum"])
            if step < STEPS:
                assert [s["version"] for s in job.step()] == [step + 2] * 2
        assert len(set(checksums)) == len(checksums)  # every step changed the weights


def test_engine_killed_mid_pull_is_reaped_and_the_driver_gets_an_error(ray_cluster):
    with RefitJob(trainers=2, engines=2, timeout_s=5, call_margin_s=10) as job:
        job.export()
        assert all(r["exact"] for r in job.refit())
        dead = job.engines[0]
        started = get(dead.start_refit.remote(), timeout_s=15, what="engine start_refit")
        assert started["version"] == 1  # it now counts as a reader of version 1 at both ranks
        job.kill_engine(0)  # returns once Ray says so and the process has exited

        t0 = time.monotonic()
        steps = job.step()  # each publisher reaps the dead reader; no wait for the timeout
        assert [s["version"] for s in steps] == [2, 2]
        assert time.monotonic() - t0 < 5, steps

        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="actor died"):
            get(dead.finish_refit.remote(), timeout_s=15, what="engine finish_refit")
        assert time.monotonic() - t0 < 5

        (survivor,) = job.refit()  # the other engine goes on, bit-exact
        assert survivor["index"] == 1 and survivor["version"] == 2 and survivor["exact"]


def test_update_racing_the_exit_of_a_killed_engine_times_out_then_reaps(ray_cluster):
    """ray.kill returns, and Ray may call the actor dead, before its process exits; a publisher
    that looks at the reader then finds it alive and times out. Its retry reaps it."""
    with RefitJob(trainers=1, engines=1, timeout_s=2, call_margin_s=10) as job:
        job.export()
        get(job.engines[0].start_refit.remote(), timeout_s=15, what="engine start_refit")
        ray.kill(job.engines[0], no_restart=True)
        outcomes = []
        for _ in range(3):
            try:
                outcomes.append(job.step()[0]["version"])
                break
            except TransferTimeout as e:
                assert "still has 1 reader(s)" in str(e)
                outcomes.append("timeout")
        assert outcomes[-1] == 2, outcomes


def test_a_hung_call_times_out_instead_of_hanging(ray_cluster):
    # No export: the engine waits for a version that is never published. Only the hung call has a
    # short deadline: starting the actors took over 11 s once on a loaded 2-core CI host.
    with RefitJob(trainers=1, engines=1, timeout_s=1, call_margin_s=60) as job:
        with pytest.raises(TransferTimeout, match="engine refit did not return"):
            get(job.engines[0].refit.remote(), timeout_s=0.5, what="engine refit")
