"""A rank that dies (SIGKILL) or freezes (SIGSTOP) mid-run, in every collective sync mode: the job fails within
``timeout_s`` plus a fixed margin (``fault_utils.ENDED_WITHIN_S``), names the lost rank, kills a frozen one and
leaves no process behind.

The jobs are the Hydra app with the ``popen`` launcher, as a user runs them (see :mod:`fault_utils`); the
parameter server has its own (``test_ps_faults.py``). A frozen rank never reaches a timeout of its own: its peer's
collective times out after ``timeout_s`` and names it ("rank 1 did not answer within 15 s"), and the failing rank
kills it. Each case prints ``mode signal: exit code X after Y s`` (``pytest -s``).
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import run_ranks
from fault_utils import ENDED_WITHIN_S, HAS_PROC, WAIT_S, run_and_hit
from lightning.pytorch.callbacks import Callback
from lightning_utils import make_trainer

from lightning_sync import AllReduceStrategy
from lightning_sync.comm.compression import FlatBucket, NoCompression
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.peer_errors import PeerError, wait_future
from lightning_sync.examples.data import SyntheticDataModule
from lightning_sync.examples.models import SyntheticMLP

TIMEOUT_S = 15.0  # also the rendezvous timeout: rank 1 must import torch and Lightning within it (~12 s when loaded)
pytestmark = pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
MODES = {
    "ddp": ["strategy=ddp"],
    "allreduce": ["strategy=allreduce"],
    "local_sgd": ["strategy=periodic", "strategy.mode=local_sgd"],
}
# How the job names the rank it lost: the process that killed it frozen, or that saw it (or its connection) go. A
# killed child is seen by whichever looks first: rank 0's failed collective and the app's exit, or Lightning's child
# observer (every 5 s; it names the child, then SIGKILLs every process of the job, the main one included).
_NAMED = {
    (1, "SIGSTOP"): re.compile(r"rank 1 \(local\), pid \d+, is frozen"),
    (1, "SIGKILL"): re.compile(
        r"rank 1 \(local\) was lost|rank 1 closed its connection|\[rank: 1\] Child process with PID \d+ terminated"
    ),
    (0, "SIGSTOP"): re.compile(r"rank 0 \(local, the main process\), pid \d+, is frozen"),
}


def _rank_1_silent(rank: int, world_size: int, rank_0_done: Any) -> None:
    groups = [dist.new_group(timeout=timedelta(seconds=2)) for _ in range(2)]  # a timed-out group stays closed
    if rank == 1:
        # silent (alive, connections open) through both of rank 0's collectives, however long the machine takes
        assert rank_0_done.wait(60), "rank 0 did not finish its checks within 60 s"
        return
    meter = CommMeter(timeout_s=2.0)
    with pytest.raises(PeerError, match=r"^all_reduce on rank 0 failed: rank 1 did not answer within 2 s"):
        meter.all_reduce(torch.ones(8), group=groups[0])
    # A payload sent in 2 slices, as a compressor sends a large bucket: the first failed slice names the peer.
    payload = torch.ones(1 << 16)
    future = NoCompression(parallel_chunks=2, min_chunk_mb=0.01).average(
        FlatBucket(index=0, buffer=payload, shapes=[payload.shape]), meter, groups[1]
    )
    with pytest.raises(PeerError, match=r"^all_reduce on rank 0 failed: rank 1 did not answer within 2 s"):
        wait_future(future, "gradient all_reduce", groups[1])
    rank_0_done.set()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_silent_peer_is_named_by_the_collective_that_waits_for_it():
    run_ranks(_rank_1_silent, mp.get_context("fork").Event())


def _check(mode: str, how: signal.Signals, rank: int, outcome) -> None:
    print(f"{mode} {how.name} rank {rank}: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode != 0
    assert outcome.seconds < TIMEOUT_S + ENDED_WITHIN_S, outcome.seconds
    assert _NAMED[rank, how.name].search(outcome.stderr), outcome.stderr[-3000:]
    assert not outcome.left, f"left behind: {outcome.left}"


def _overrides(mode: str) -> list[str]:
    return [*MODES[mode], f"strategy.timeout_s={TIMEOUT_S}", "trainer.max_epochs=1000", "test=false"]


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_lost_rank_fails_the_job_in_time_and_leaves_no_process(tmp_path, mode, how):
    outcome = run_and_hit(_overrides(mode), tmp_path / "run", "rank1", how, wait_s=TIMEOUT_S + WAIT_S)
    _check(mode, how, 1, outcome)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_frozen_main_process_is_killed_by_its_child_rank(tmp_path):
    """Rank 0 is the command a user runs: frozen, it would hold the job open forever; rank 1 ends it."""
    outcome = run_and_hit(_overrides("allreduce"), tmp_path / "run", "rank0", signal.SIGSTOP, wait_s=TIMEOUT_S + WAIT_S)
    _check("allreduce", signal.SIGSTOP, 0, outcome)
    assert outcome.returncode == -signal.SIGKILL


class _FreezeRank1(Callback):
    """Rank 1 stops itself (SIGSTOP) at a training batch, after writing its pid and the time to ``path``."""

    def __init__(self, path: Path, batch: int) -> None:
        self.path, self.batch = path, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and batch_idx == self.batch:
            self.path.write_text(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_fork_rank_frozen_mid_run_is_named_and_killed(tmp_path, capfd):
    stamp = tmp_path / "frozen"
    strategy = AllReduceStrategy(start_method="fork", timeout_s=TIMEOUT_S)
    trainer = make_trainer(strategy, max_epochs=1000, callbacks=[_FreezeRank1(stamp, batch=3)])
    with pytest.raises(Exception) as info:
        trainer.fit(SyntheticMLP(width=32, depth=4), datamodule=SyntheticDataModule(in_features=32, num_samples=512))
    pid, frozen_at = stamp.read_text().split()
    seconds = time.time() - float(frozen_at)
    said = str(info.value) + capfd.readouterr().err
    with capfd.disabled():
        print(f"allreduce (fork) SIGSTOP rank 1: {type(info.value).__name__} after {seconds:.1f} s")
    assert seconds < TIMEOUT_S + ENDED_WITHIN_S, seconds
    assert f"rank 1 did not answer within {TIMEOUT_S:g} s" in said, said[-3000:]
    assert not Path(f"/proc/{pid}").exists(), "the frozen rank is still there"
