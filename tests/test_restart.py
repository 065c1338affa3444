"""A torchrun job with ``--max-restarts=1`` whose rank 1 is SIGKILLed mid-run: torchrun restarts the ranks, and the
Hydra app resumes from the run folder's ``last.ckpt`` on its own and finishes.

The run folder is the default one: under torchrun its stamp is torchrun's run id, so the restarted ranks find the
checkpoint the first attempt wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Enough epochs (about 0.2 s each on a quiet machine, 18 steps) that the first attempt is still training when rank 1
# is killed, 1.5 s after its first last.ckpt; the restarted attempt trains the rest.
EPOCHS = 16
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")]


def _rank_pids(local_rank: int) -> list[int]:
    """Processes of lightning_sync.train started by a torchrun agent with this LOCAL_RANK."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"lightning_sync.train" in cmd
            and b"TORCHELASTIC_RESTART_COUNT=0" in env
            and f"LOCAL_RANK={local_rank}".encode() in env
            and b"torch.distributed.run" not in cmd
        ):
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
def test_killed_rank_restarts_and_the_run_resumes_from_last_checkpoint(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        "--monitor-interval=0.5",
        "-m", "lightning_sync.train", "strategy=allreduce", f"trainer.max_epochs={EPOCHS}", "test=false",
        "strategy.timeout_s=30",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115 (closed below)
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(tmp_path.glob("outputs/*/*/checkpoints/last.ckpt")):
            assert job.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.2)
        (last,) = tmp_path.glob("outputs/*/*/checkpoints/last.ckpt")
        time.sleep(1.5)  # a few epochs in
        victims = _rank_pids(1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        code = job.wait(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert code == 0, output[-4000:]
    run_dir = last.parent.parent
    assert run_dir.name.startswith("torchrun-") and run_dir.name.endswith("_allreduce"), run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed_at = summary["resumed_at_step"]
    final = torch.load(last, weights_only=False)
    print(
        f"restarted once; resumed at step {resumed_at}; finished at epoch {final['epoch'] + 1}, step "
        f"{final['global_step']}"
    )
    assert "resumed from" in output and f"at step {resumed_at}" in output, output[-3000:]
    assert 0 < resumed_at < final["global_step"]
    assert final["epoch"] + 1 == EPOCHS and summary["optimizer_steps"] == final["global_step"]
