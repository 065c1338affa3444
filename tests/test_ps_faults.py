"""A parameter-server job whose worker or server dies (SIGKILL) or freezes (SIGSTOP) mid-run: it fails within
``timeout_s`` plus a few seconds, names the lost process, and leaves no process behind.

The job is the Hydra app with the ``popen`` launcher (as a user runs it): rank 0 is the command, rank 1 its child,
the server a process started by rank 0. Processes are found through ``/proc`` by their command lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_S = 8.0
pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return out


def _job_processes(run_dir: Path, main_pid: int) -> dict[str, int]:
    """``{"worker1": pid, "server0": pid}`` of the job's other processes (whichever exist now)."""
    found = {}
    for pid, cmd in _cmdlines().items():
        if pid != main_pid and f"hydra.run.dir={run_dir}" in cmd and "lightning_sync.train" in cmd:
            found["worker1"] = pid
        elif f"--parent-pid {main_pid}" in cmd and "--server 0" in cmd:
            found["server0"] = pid
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["worker1", "server0"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_lost_process_fails_the_job_in_time_and_leaves_no_orphan(tmp_path, target, how):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "lightning_sync.train", "strategy=ps", f"strategy.timeout_s={TIMEOUT_S}",
        "trainer.max_epochs=1000", "test=false", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run_dir / "metrics.csv").is_file():
            assert job.poll() is None, job.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # training is under way
        victims = _job_processes(run_dir, job.pid)
        assert target in victims, victims
        os.kill(victims[target], how)
        hit = time.monotonic()
        _, stderr = job.communicate(timeout=TIMEOUT_S + 30)
        elapsed = time.monotonic() - hit
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    print(f"{target} {how.name}: exit code {job.returncode} after {elapsed:.1f} s")
    assert job.returncode != 0
    assert elapsed < TIMEOUT_S + 15, elapsed
    names = {"worker1": ("worker 1", "rank 1", "[rank: 1] Child process"), "server0": ("server 0",)}[target]
    assert any(name in stderr for name in names), stderr[-3000:]
    time.sleep(1.0)
    left = _job_processes(run_dir, job.pid)
    for pid in left.values():  # do not leave a frozen process behind even when the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphans: {left}"
