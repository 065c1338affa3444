"""A parameter-server job whose worker or server dies (SIGKILL) or freezes (SIGSTOP) mid-run: it fails within
``timeout_s`` plus a fixed margin (``fault_utils.ENDED_WITHIN_S``), names the lost process, and leaves no process
behind; except a lost worker of ``async`` or ``ssp``, which the server drops while the job ends normally on the
others.

The job is the Hydra app with the ``popen`` launcher (as a user runs it): rank 0 is the command, rank 1 its child,
the server a process started by rank 0 (see :mod:`fault_utils`).
"""

from __future__ import annotations

import signal

import pytest
from fault_utils import ENDED_WITHIN_S, HAS_PROC, WAIT_S, run_and_hit

TIMEOUT_S = 15.0  # also the rendezvous timeout: rank 1 must import torch and Lightning within it (~12 s when loaded)
pytestmark = pytest.mark.skipif(not HAS_PROC, reason="needs /proc")


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "target, how",
    # a killed worker 1 of this sync job: the stricter test_a_lost_worker_ends_the_job_in_seconds_not_after_timeout_s
    [("worker1", signal.SIGSTOP), ("server0", signal.SIGKILL), ("server0", signal.SIGSTOP)],
    ids=["worker1-SIGSTOP", "server0-SIGKILL", "server0-SIGSTOP"],
)
def test_lost_process_fails_the_job_in_time_and_leaves_no_orphan(tmp_path, target, how):
    overrides = ["strategy=ps", f"strategy.timeout_s={TIMEOUT_S}", "trainer.max_epochs=1000", "test=false"]
    process = {"worker1": "rank1", "server0": "server0"}[target]
    outcome = run_and_hit(overrides, tmp_path / "run", process, how, wait_s=TIMEOUT_S + WAIT_S)
    print(f"{target} {how.name}: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode != 0
    assert outcome.seconds < TIMEOUT_S + ENDED_WITHIN_S, outcome.seconds
    names = {"worker1": ("worker 1", "rank 1", "[rank: 1] Child process"), "server0": ("server 0",)}[target]
    assert any(name in outcome.stderr for name in names), outcome.stderr[-3000:]
    assert not outcome.left, f"orphans: {outcome.left}"


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "mode, how", [("async", signal.SIGSTOP), ("ssp", signal.SIGKILL)], ids=["async-SIGSTOP", "ssp-SIGKILL"]
)
def test_a_lost_worker_of_an_async_job_is_dropped_and_rank_0_finishes(tmp_path, mode, how):
    """Async and ssp are elastic: the server drops the lost worker (after ``timeout_s`` when frozen, at once when its
    connection closes) and rank 0 finishes the run; the job exits 0, naming the lost worker, and leaves no process
    (the frozen one is killed at the end). The other two cases: ssp-SIGSTOP in ``tests/test_ps_elastic.py``, async-SIGKILL
    with 3 workers in ``tests/test_ps_elastic_kill.py``."""
    overrides = ["strategy=ps", f"strategy.mode={mode}", f"strategy.timeout_s={TIMEOUT_S}", "trainer.max_epochs=12"]
    overrides += ["+logger.csv.flush_logs_every_n_steps=5", "test=false"]  # metrics.csv early: the hit is mid-run
    outcome = run_and_hit(overrides, tmp_path / "run", "rank1", how, wait_s=TIMEOUT_S + WAIT_S)
    print(f"{mode} worker1 {how.name}: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert outcome.seconds < TIMEOUT_S + ENDED_WITHIN_S, outcome.seconds
    assert "lost: worker 1 (rank 1)" in outcome.stderr, outcome.stderr[-3000:]
    assert not outcome.left, f"orphans: {outcome.left}"


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_lost_worker_ends_the_job_in_seconds_not_after_timeout_s(tmp_path):
    """With ``timeout_s=120``: the server of a sync step would wait that long for the killed worker's push, and rank
    0 for the server. The server sees the killed worker's connection close and fails the step naming it, so rank 0
    hears it at once (and Lightning's child observer would end the job within seconds anyway)."""
    overrides = ["strategy=ps", "strategy.timeout_s=120", "trainer.max_epochs=1000", "test=false"]
    outcome = run_and_hit(overrides, tmp_path / "run", "rank1", signal.SIGKILL, wait_s=60)
    print(f"worker1 SIGKILL, timeout_s=120: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode != 0
    # about a second on an idle machine; never as long as the timeout it must not wait for
    assert outcome.seconds < 120 / 2, outcome.seconds
    # named by whichever reports first: this job's end, Lightning's child observer (which may end the job before
    # that), or the server that saw the worker's connection close
    names = ("rank 1 (local) was lost", "[rank: 1] Child process", "worker 1 (ps rank 1)")
    assert any(name in outcome.stderr for name in names), outcome.stderr[-3000:]
    assert not outcome.left, f"orphans: {outcome.left}"
