"""The elastic parameter server through the Hydra app, where a worker is killed: the servers see its connection close
and drop it at once, so nothing here waits out a timer (the frozen worker, dropped after ``timeout_s``, is
``test_ps_elastic.py``'s, one of the timed files of ``conftest.py``).

The app runs with the ``popen`` launcher as a user runs it (rank 0 is the command, ranks 1 and 2 its children, the
server a process of rank 0; see :mod:`fault_utils`).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import signal  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from fault_utils import HAS_PROC, _start_training, fork_train, job_processes, job_stderr, run_and_hit  # noqa: E402
from test_ps_elastic import _summary  # noqa: E402

from lightning_sync.apps.bench.launch import free_port  # noqa: E402

# Nothing here waits out timeout_s: a killed worker's connection closes at once.
TIMEOUT_S = 15.0


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_killing_an_async_worker_leaves_the_job_to_finish_on_the_others(tmp_path):
    """3 workers, 1 dedicated server, async: worker 2 is SIGKILLed about a third into the run. Workers 0 and 1
    finish, the job exits 0, worker 2 is named in a warning and in summary.json, the checkpoint is written (by
    rank 0, with the servers' state), and no process is left."""
    run_dir = tmp_path / "run"
    overrides = [
        "strategy=ps",
        "strategy.mode=async",
        f"strategy.timeout_s={TIMEOUT_S}",
        "trainer.devices=3",
        "trainer.max_epochs=20",
        "+logger.csv.flush_logs_every_n_steps=5",  # metrics.csv early: the hit comes a third into the run
        "test=true",
    ]
    outcome = run_and_hit(overrides, run_dir, "rank2", signal.SIGKILL, wait_s=180.0, after_s=1.2)
    print(f"async worker 2 SIGKILL: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode == 0, outcome.stderr[-4000:]
    assert "rank 2 (local) was lost" in outcome.stderr, outcome.stderr[-4000:]
    assert "worker 2 (rank 2)" in outcome.stderr, outcome.stderr[-4000:]  # the strategy's warning, with the reason
    summary = _summary(run_dir)
    assert list(summary.get("lost_workers", {})) == ["2"], summary
    assert "closed its connection" in summary["lost_workers"]["2"], summary
    assert summary["world_size"] == 3, summary  # the job's ranks, not the one each survivor is left with
    assert summary["test"]["test/acc"] > 0.5, summary  # the survivors trained (and rank 0 tested alone)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    state = torch.load(run_dir / "checkpoints" / "last.ckpt.rank0.pt", weights_only=False, map_location="cpu")
    clocks = state["servers"][0]["clocks"]  # rank 0 kept the servers' state after the loss
    print(f"pushes applied per worker: {clocks}")
    assert 0 < clocks[2] < 0.7 * min(clocks[0], clocks[1]), clocks  # worker 2 was lost early in the run
    assert not outcome.left, f"orphans: {outcome.left}"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_elastic_sync_finishes_on_the_live_workers(tmp_path):
    """``sync`` with ``strategy.elastic=true``: worker 2 of 3 is SIGKILLed; the server drops it, each later step
    averages the two live workers' pushes, and the job exits 0 naming it."""
    run_dir = tmp_path / "run"
    overrides = [
        "strategy=ps",
        "strategy.elastic=true",
        f"strategy.timeout_s={TIMEOUT_S}",
        "trainer.devices=3",
        "trainer.max_epochs=10",
        "+logger.csv.flush_logs_every_n_steps=5",
        "test=false",
    ]
    outcome = run_and_hit(overrides, run_dir, "rank2", signal.SIGKILL, wait_s=180.0, after_s=1.5)
    print(f"elastic sync worker 2 SIGKILL: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode == 0, outcome.stderr[-4000:]
    summary = _summary(run_dir)
    assert list(summary.get("lost_workers", {})) == ["2"], summary.get("lost_workers")
    state = torch.load(run_dir / "checkpoints" / "last.ckpt.rank0.pt", weights_only=False, map_location="cpu")
    server = state["servers"][0]
    assert server["version"] == server["clocks"][0] == server["clocks"][1] > server["clocks"][2], server["clocks"]
    assert not outcome.left, f"orphans: {outcome.left}"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_a_killed_worker_is_replaced_by_running_the_join_command(tmp_path):
    """How a lost worker comes back: its supervisor (torchrun, SLURM ``--requeue``, Kubernetes) runs the job's
    command with ``strategy.join=true``. 2 workers and a spare slot: worker 1 is SIGKILLed, the servers drop it, and
    the join command's worker takes the spare slot (rank 2; a slot is never reused), pulls the current parameters and
    trains to the end with worker 0. The summary names worker 1 lost and worker 2 added, and the added worker's pushes
    were applied. Both commands exit 0 and no process of the job is left.

    The job's ranks hold at step 10 (``FileGate``) until the added worker has trained a few steps, so the test
    does not race the added worker's start against the job's end."""
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    overrides = [
        "strategy=ps",
        "strategy.mode=async",
        "strategy.spare_workers=1",
        "strategy.timeout_s=120",  # the job's ranks send nothing while they wait at the gate
        "trainer.devices=2",
        "trainer.max_epochs=8",
        "callbacks=[default,pacer]",
        "callbacks.pacer.step_s=0.05",
        "+logger.csv.flush_logs_every_n_steps=5",
        "test=false",
    ]
    run_dir, joined_dir, gate = tmp_path / "run", tmp_path / "joined", tmp_path / "gate"
    gated = ["+callbacks.gate._target_=lightning_sync.apps.file_gate.FileGate", f"+callbacks.gate.path={gate}"]
    job, joiner = _start_training([*overrides, *gated], run_dir, after_s=0.0, env=env), None
    try:
        victims = job_processes(run_dir, job.pid)
        assert "rank1" in victims, victims
        os.kill(victims["rank1"], signal.SIGKILL)
        joiner = fork_train([*overrides, "strategy.join=true", f"hydra.run.dir={joined_dir}"], tmp_path / "joiner", env)
        deadline = time.monotonic() + 100
        while not (joined_dir / "metrics.csv").is_file() and joiner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the added worker has trained 5 steps once its metrics.csv exists
        gate.touch()
        joiner.wait(180.0)
        job.wait(180.0)
    finally:
        for process in (job, joiner):
            if process is not None and process.poll() is None:
                process.kill()
    stderr = job_stderr(job)
    assert joiner is not None and joiner.returncode == 0, job_stderr(joiner)[-4000:]
    assert job.returncode == 0, stderr[-4000:]
    assert _summary(joined_dir)["optimizer_steps"] > 0, _summary(joined_dir)
    assert not job_processes(run_dir, job.pid), "a process of the job was left behind"
    state = torch.load(run_dir / "checkpoints" / "last.ckpt.rank0.pt", weights_only=False, map_location="cpu")
    applied = [sum(counts.values()) for counts in state["servers"][0]["staleness_counts"]]  # its clock was raised
    print(f"pushes applied per worker: {applied}")  # at the join: its own pushes are the ones counted here
    summary = _summary(run_dir)
    assert "rank 1 (local) was lost (killed by SIGKILL); the job goes on" in stderr, stderr[-4000:]
    assert "worker 2 (ps rank 2) joined (a spare slot" in stderr, stderr[-4000:]
    assert list(summary.get("lost_workers", {})) == ["1"] and summary.get("added_workers") == [2], summary
    assert applied[2] > 0.1 * applied[0], applied
