"""The records a killed run leaves behind (the step clock, the groups' commit lines) and the step pacer."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_sync.apps.file_gate import FileGate
from lightning_sync.apps.ft_local import Commit, descendants, read_commits, start_process, stop_process
from lightning_sync.callbacks import StepClock, StepPacer, read_step_clock
from lightning_sync.errors import ConfigError


@pytest.mark.unit
def test_step_clock_appends_steps_and_validations_on_rank_0_and_survives_a_cut_line(tmp_path):
    path = tmp_path / "clock.txt"
    trainer = SimpleNamespace(global_rank=0, global_step=1, sanity_checking=False, callback_metrics={})
    clock = StepClock(str(path))
    clock.on_train_batch_end(trainer, None, torch.tensor(2.5), None, 0)
    trainer.global_step = 2
    clock.on_train_batch_end(trainer, None, {"loss": torch.tensor(2.25)}, None, 1)
    trainer.callback_metrics = {"val/loss": torch.tensor(2.0)}
    trainer.sanity_checking = True
    clock.on_validation_end(trainer, None)  # the sanity check: not a validation of the trained model
    trainer.sanity_checking = False
    clock.on_validation_end(trainer, None)
    StepClock(str(path)).on_train_batch_end(SimpleNamespace(global_rank=1, global_step=9), None, None, None, 0)
    clock.on_train_batch_end(SimpleNamespace(global_rank=0, global_step=3), None, None, None, 2)  # no loss returned
    clock.teardown(trainer, None, "fit")
    with open(path, "a") as f:
        f.write("1700000000.5 step 3")  # cut short by a SIGKILL: no loss, no newline
    record = read_step_clock(path)
    assert [(s, loss) for _, s, loss in record.steps[:2]] == [(1, 2.5), (2, 2.25)]
    assert record.steps[2][1] == 3 and math.isnan(record.steps[2][2]) and len(record.steps) == 3
    assert [(s, loss) for _, s, loss in record.vals] == [(2, 2.0)]
    assert all(abs(t - record.steps[0][0]) < 60 for t, _, _ in record.steps + record.vals)
    assert read_step_clock(tmp_path / "missing.txt").steps == []


@pytest.mark.unit
def test_read_commits_parses_hydra_log_lines_of_every_group_oldest_first(tmp_path):
    a, b = tmp_path / "g0.log", tmp_path / "g2.log"
    a.write_text(
        "[2026-11-26 23:02:37,043][lightning_sync.ft][INFO] - replica group 0: sync committed (step 7, commit 7, "
        "groups [0, 1, 2])\n"
        "[2026-11-26 23:02:42,623][lightning_sync.ft][WARNING] - replica group(s) [2] lost from the quorum; training "
        "on with [0, 1]\n"
        "[2026-11-26 23:02:43,100][lightning_sync.ft][INFO] - replica group 0: sync committed (step 8, commit 8, "
        "groups [0, 1])\n"
    )
    b.write_text(
        "[2026-11-26 23:02:37,041][lightning_sync.ft][INFO] - replica group 2: sync committed (step 7, commit 3, "
        "groups [0, 1, 2])\n"
    )
    commits = read_commits(a, b, tmp_path / "never_started.log")
    assert [(c.group, c.step, c.groups) for c in commits] == [(2, 7, (0, 1, 2)), (0, 7, (0, 1, 2)), (0, 8, (0, 1))]
    assert commits[1].time - commits[0].time == pytest.approx(0.002, abs=1e-6)
    assert isinstance(commits[0], Commit)


@pytest.mark.unit
def test_step_pacer_pads_a_short_batch_to_step_s_and_leaves_a_long_one_alone():
    now = [0.0]
    pacer = StepPacer(0.2, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    pacer.on_train_batch_start(None, None, None, 0)
    now[0] += 0.05  # the batch's compute
    pacer.on_train_batch_end(None, None, None, None, 0)
    assert now[0] == pytest.approx(0.2)
    pacer.on_train_batch_start(None, None, None, 1)
    now[0] += 0.5  # a slow sync: no padding on top
    pacer.on_train_batch_end(None, None, None, None, 1)
    assert now[0] == pytest.approx(0.7) and pacer.slept_s == pytest.approx(0.15)
    with pytest.raises(ConfigError, match=r"step_s=0 is not allowed; it must be > 0"):
        StepPacer(0)


@pytest.mark.unit
def test_file_gate_holds_only_its_step_and_only_until_the_file_exists(tmp_path):
    gate = FileGate(tmp_path / "go", at_step=3, timeout_s=0.3)
    gate.on_train_batch_start(SimpleNamespace(global_step=2), None, None, 0)  # another step: no wait, no file needed
    with pytest.raises(TimeoutError, match=r"go did not appear within timeout_s=0.3 s"):
        gate.on_train_batch_start(SimpleNamespace(global_step=3), None, None, 0)
    (tmp_path / "go").touch()
    gate.on_train_batch_start(SimpleNamespace(global_step=3), None, None, 0)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_stop_process_also_ends_what_it_started_in_a_session_of_its_own(tmp_path):
    # as torchrun starts its workers: each in a session of its own, out of reach of its own group's signal
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "print(child.pid, flush=True); time.sleep(60)"
    )
    process = start_process([sys.executable, "-c", script], tmp_path / "out.log")
    deadline = time.monotonic() + 20
    while not (tmp_path / "out.log").read_text().strip():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    child = int((tmp_path / "out.log").read_text().split()[0])
    assert child in descendants(process.pid)
    stop_process(process)
    deadline = time.monotonic() + 5  # the orphan is reaped by init a moment after its death
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists(), "the child in its own session outlived stop_process"
