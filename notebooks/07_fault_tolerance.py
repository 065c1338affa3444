# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fault tolerance: three replica groups, one killed and restarted
#
# With `ft=torchft`, a run of the Hydra app is one *replica group* of a larger job. The groups meet at torchft's
# lighthouse, and every outer sync of DiLoCo is a torchft quorum over the groups that are alive. A group that is lost
# drops out of the next quorum while the others train on, and a group started again with its original command heals
# from a live one: it pulls the model, both optimizers' state and the step, then trains on with the others.
#
# This notebook starts a lighthouse and three groups of one rank on this machine (`experiment=char_lm`, DiLoCo every
# 8 steps), SIGKILLs group 2 partway through, starts it again with the same command, and plots the training loss
# and the quorum size against time, with the kill and the restart marked. Guide: `docs/guide/fault-tolerance.md`.
#
# Set the environment variable `SMOKE=1` for a short run; `NOTEBOOK_OUT` names the output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
GROUPS = 3
SYNC_EVERY = 8
# Every group ends at MAX_STEPS (for a healed group: the live step count).
MAX_STEPS = 160 if SMOKE else 800
KILL_AT_STEP = 40 if SMOKE else 200  # group 2 is SIGKILLed once its clock shows this step
RESTART_AFTER_S = 1.0 if SMOKE else 10.0
# The survivors hold at HOLD_AT_STEP until the restarted group trains (a FileGate): the demo then does not depend
# on how fast a fresh interpreter starts up (seconds of imports and Lightning's set-up) beside two training ones.
HOLD_AT_STEP = 80 if SMOKE else 480
# SMOKE: a model a few times smaller, each batch paced to 0.05 s (StepPacer), at a fraction of the CPU
SMOKE_APP = ["model.d_model=32", "model.n_layer=1", "callbacks.pacer.step_s=0.05"]
CALLBACKS = "default,step_clock,pacer" if SMOKE else "default,step_clock"
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_fault_tolerance")

# %%
import re
import shutil
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from lightning_sync.apps.file_gate import FileGate
from lightning_sync.apps.ft_local import (
    group_command,
    read_commits,
    start_lighthouse,
    start_process,
    stop_process,
)
from lightning_sync.apps.markdown import markdown_table
from lightning_sync.apps.provenance import provenance, summary_line
from lightning_sync.callbacks import read_step_clock

out = Path(OUT)
shutil.rmtree(out, ignore_errors=True)
APP = [
    "experiment=char_lm",
    "strategy=periodic",
    "strategy.mode=diloco",
    f"strategy.sync_every={SYNC_EVERY}",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.limit_val_batches=0",
    "test=false",
    f"callbacks=[{CALLBACKS}]",
    f"+callbacks.gate._target_={FileGate.__module__}.FileGate",
    f"+callbacks.gate.path={out / 'restarted'}",
    f"+callbacks.gate.at_step={HOLD_AT_STEP}",
    *(SMOKE_APP if SMOKE else []),
]


def clock_file(group):
    return out / f"group{group}.clock"


def start_group(group, attempt):
    """Starts replica group ``group`` with the same command every time; ``attempt`` only names its run folder."""
    run_dir = out / f"group{group}.{attempt}"
    command = group_command(
        lighthouse.address, group, GROUPS, run_dir, *APP, f"callbacks.step_clock.path={clock_file(group)}"
    )
    return run_dir, start_process(command, run_dir / "stdout.log")


# %% [markdown]
# ## The run
# The lighthouse drops a group whose heartbeat is 1 s old; a quorum waits for every live group of the last one, or,
# once 2 groups are in (`--min_replicas 2`), up to 5 s for a late one (`--join_timeout_ms 5000`). Each group runs
# with `ft.min_replicas=2` and `ft.timeout_s=5`. The survivors wait at step `HOLD_AT_STEP` until the restarted group
# has taken its first step (a `FileGate` on a file this notebook writes), so that they are still training when it
# comes back however long its start takes.


# %%
def last_step(group):
    steps = read_step_clock(clock_file(group)).steps
    return steps[-1][1] if steps else -1


def time_to_kill():
    """Group 2 has reached KILL_AT_STEP, or it has trained while both survivors wait at HOLD_AT_STEP: a group 2 that
    started late would wait for a quorum that they never join."""
    survivors_wait = all(last_step(g) >= HOLD_AT_STEP for g in range(GROUPS - 1))
    return last_step(2) >= KILL_AT_STEP or (survivors_wait and last_step(2) >= 1)


lighthouse = start_lighthouse(out / "lighthouse.log", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=1000)
started = time.time()
runs = {g: [start_group(g, 0)] for g in range(GROUPS)}
try:
    deadline = time.monotonic() + 300
    while not time_to_kill():
        assert all(p.poll() is None for _, p in (r[-1] for r in runs.values())), "a group ended before the kill"
        assert time.monotonic() < deadline, "group 2 did not reach the step of the kill"
        time.sleep(0.1)
    stop_process(runs[2][-1][1])  # SIGKILL
    killed = time.time()
    time.sleep(RESTART_AFTER_S)
    runs[2].append(start_group(2, 1))
    restarted = time.time()
    while not any(t > restarted for t, _, _ in read_step_clock(clock_file(2)).steps):  # its first step
        assert runs[2][-1][1].poll() is None, "the restarted group ended before its first step"
        assert time.monotonic() < deadline, "the restarted group did not train"
        time.sleep(0.1)
    (out / "restarted").touch()  # lets the survivors on past HOLD_AT_STEP
    codes = {g: r[-1][1].wait(timeout=900) for g, r in runs.items()}
finally:
    for group_runs in runs.values():
        for _, process in group_runs:
            stop_process(process)
    lighthouse.stop()
finished = time.time()
record = provenance()
print(summary_line(record) + f"; load average {record['load_average']}{' (SMOKE)' if SMOKE else ''}")
print(
    f"group 2 killed at {killed - started:.1f} s, restarted at {restarted - started:.1f} s; all done at {finished - started:.1f} s"
)

# %% [markdown]
# ## What each group did
# Commits are the syncs each process logged as committed. The restarted group's log names the heal:
# the step it came back at and the live step it took.

# %%
heal_line = re.compile(r"healed from a live group: step (\d+) -> (\d+) in ([\d.]+) s")
lost_line = re.compile(r"replica group\(s\) \[([\d, ]+)\] lost from the quorum")
rows, commits = [], []
for g, group_runs in runs.items():
    for attempt, (run_dir, _) in enumerate(group_runs):
        log = run_dir / "train.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        mine = read_commits(log)
        commits += mine
        heal, lost = heal_line.search(text), lost_line.search(text)
        rows.append(
            (
                f"{g}" + (" (restarted)" if attempt else ""),
                "SIGKILL" if attempt < len(group_runs) - 1 else str(codes[g]),
                str(len(mine)),
                f"step {heal[1]} -> {heal[2]} in {heal[3]} s" if heal else "-",
                f"group(s) [{lost[1]}] lost" if lost else "-",
            )
        )
commits.sort(key=lambda c: c.time)
print(markdown_table(("group", "exit code", "commits", "heal", "logged"), rows))

# %% [markdown]
# ## The final parameters
# Every group ends at the same sync, so their parameters must be equal: the restarted group's too.

# %%
failed = {g: r[-1][0] for g, r in runs.items() if codes[g] != 0}
for g, run_dir in failed.items():  # the end of a failed group's log says why, before its missing checkpoint would
    log = run_dir / "stdout.log"
    print(
        f"group {g} exited {codes[g]}; the end of {log}:\n"
        + (log.read_text(errors="replace")[-2000:] if log.exists() else "-")
    )
assert not failed, {g: codes[g] for g in failed}
finals = [
    torch.load(r[-1][0] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    for r in runs.values()
]
equal = all(torch.equal(finals[0][k], other[k]) for other in finals[1:] for k in finals[0])
print(f"final parameters of the {GROUPS} groups equal: {equal}")
assert equal, "the groups' final parameters differ"

# %% [markdown]
# ## Loss and quorum size against time
# Each group's training loss per batch (its own shard; a faint line, and the mean of 16 batches on top), and the
# number of groups in each committed sync. The red line is the kill, the green one the restart. The restarted group
# starts from fresh weights and takes a few steps of its own before its first sync, where it heals.

# %%
by_step = {}
for commit in commits:
    by_step.setdefault(commit.step, commit)
fig, (ax_loss, ax_quorum) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1))
for g in range(GROUPS):
    steps = read_step_clock(clock_file(g)).steps
    # one line per process: a restarted one starts its own count again (the heal then takes the live step)
    cuts = [0, *(i for i in range(1, len(steps)) if steps[i][1] < steps[i - 1][1]), len(steps)]
    color = f"C{g}"
    for a, b in zip(cuts, cuts[1:]):
        t = [s[0] - started for s in steps[a:b]]
        loss = [s[2] for s in steps[a:b]]
        smooth = [sum(loss[max(0, i - 15) : i + 1]) / len(loss[max(0, i - 15) : i + 1]) for i in range(len(loss))]
        ax_loss.plot(t, loss, color=color, alpha=0.2)
        ax_loss.plot(t, smooth, color=color, label=f"group {g}" if a == 0 else None)
times = [c.time - started for c in by_step.values()]
ax_quorum.step(times, [len(c.groups) for c in by_step.values()], where="post")
for ax in (ax_loss, ax_quorum):
    ax.axvline(killed - started, color="red", linestyle="--")
    ax.axvline(restarted - started, color="green", linestyle="--")
ax_loss.set(ylabel="training loss (nats/char)", title="three replica groups, group 2 killed and restarted")
ax_loss.legend()
ax_quorum.set(xlabel="seconds since start", ylabel="groups in the sync", ylim=(0, GROUPS + 0.5))
fig.tight_layout()
plt.show()
