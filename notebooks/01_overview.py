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
# # Every sync mode on one model
#
# Every case of the main job (`python -m lightning_sync.compare`) trains the same digits classifier on 2 CPU ranks
# (gloo), with the same seed, data and epochs: Lightning-style DDP (with its comm hooks), our bucketed all-reduce
# (with each compressor), periodic sync (local SGD, DiLoCo) and the parameter server (sync, async, ssp). We compare
#
# - training loss and validation accuracy against training batches and against wall time,
# - bytes each rank sends per optimizer step and seconds of collectives per step, as counted by the communication
#   meter every mode goes through,
# - the final test accuracy.
#
# Each case records a timeline on rank 0 (`lightning_sync.apps.study.Timeline`): the time and loss of every batch, and
# every 5 batches a probe of the validation accuracy of the parameters rank 0 holds (in `local_sgd` and `diloco`
# its own replica between syncs; about a millisecond, left out of the time axis). A second section compares the
# ways the `allreduce` mode can bucket gradients on a latency-bound model.
#
# These are single runs on a shared 2-core machine: step times vary by several percent from run to run. For a
# careful, alternating measurement of step time run `python benchmarks/step_time.py`.
#
# Set the environment variable `SMOKE=1` to run every case for a few batches only; `NOTEBOOK_OUT` names the output
# folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 15
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_overview")
SMALL = ["++trainer.limit_train_batches=4", "++trainer.limit_val_batches=1"] if SMOKE else []

# %%
from itertools import accumulate
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.compare import available_cases
from lightning_sync.apps.study import format_runs, run_cases

# %% [markdown]
# ## 1. All modes on the digits classifier

# %%
runs = run_cases(available_cases(), Path(OUT, "digits"), common=[f"trainer.max_epochs={EPOCHS}", *SMALL])
print(f"Digits classifier, 2 CPU ranks, {EPOCHS} epoch(s){' (SMOKE: 4 batches)' if SMOKE else ''}, seed 0")
print(format_runs(runs.values()))
COLORS = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(runs)}
STYLES = {name: "--" if name.startswith("ps") else ":" if name.startswith("periodic") else "-" for name in runs}

# %% [markdown]
# ### Loss and accuracy against batches and against wall time
# The loss is rank 0's training loss, a running mean over 10 batches. All modes see the same samples per batch, so
# against batches they differ only by what their sync does to the optimization; against wall time, cheaper syncs
# (or none, between periodic syncs) also move the curves left.

# %%
fig, axes = plt.subplots(2, 2, figsize=(15, 9))
for name, run in runs.items():
    style = dict(color=COLORS[name], linestyle=STYLES[name], linewidth=1, label=name)
    for col, x in enumerate(("batch", "time")):
        axes[0, col].plot(*run.loss_curve(x=x), **style)
        axes[1, col].plot(*run.accuracy_curve(x=x), marker=".", markersize=3, **style)
for col, label in enumerate(("training batches per rank", "rank 0's training time (s)")):
    axes[0, col].set(xlabel=label, ylabel="training loss (mean of 10 batches)", yscale="log")
    axes[1, col].set(xlabel=label, ylabel="validation accuracy (rank 0's parameters)", ylim=(0, 1))
axes[0, 0].set_title("loss against batches")
axes[0, 1].set_title("loss against wall time")
axes[1, 0].set_title("accuracy against batches")
axes[1, 1].set_title("accuracy against wall time")
axes[0, 1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# ### Bytes and seconds of communication per step
# Bytes each rank sends per optimizer step in training (a dense ring all-reduce of S bytes on 2 ranks sends S per
# rank: 104,488 for this model's fp32 gradients); the parameter server's workers push their gradient and get the
# parameters back. Comm seconds are the time collectives are in flight on rank 0, per optimizer step (a periodic
# mode spends it all on every 8th step); a parameter-server push waits for its reply, so its round trip includes
# the server's work and, in `sync` and `ssp`, the wait for the other worker. Below, the same as running totals:
# bytes against optimizer steps (PowerSGD sends uncompressed for its first `powersgd_start_iter` = 10 steps,
# periodic modes send only at syncs) and seconds in collectives against batches.

# %%
names = list(runs)
fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
sent = [runs[n].bytes_sent_per_step or 0 for n in names]
comm_ms = [1e3 * (runs[n].comm_seconds_per_step or 0) for n in names]
axes[0].barh(names, [b / 1e3 for b in sent], color=[COLORS[n] for n in names])
axes[0].set(xlabel="kB sent per rank per optimizer step", xscale="log", title="bytes per step")
axes[1].barh(names, comm_ms, color=[COLORS[n] for n in names])
axes[1].set(xlabel="ms of collectives per optimizer step (rank 0)", title="comm time per step")
for ax in axes:
    ax.invert_yaxis()
fig.tight_layout()
plt.show()

fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
for name, run in runs.items():
    style = dict(color=COLORS[name], linestyle=STYLES[name], linewidth=1, label=name)
    steps, sent = run.metric("comm/bytes_sent")
    axes[0].plot(steps, [b / 1e6 for b in accumulate(sent)], **style)
    batches, comm = run.series("comm_s", x="batch")
    axes[1].plot(batches, list(accumulate(comm)), **style)
axes[0].set(xlabel="optimizer step", ylabel="MB sent by rank 0 so far", yscale="log", title="bytes, running total")
axes[1].set(
    xlabel="training batches per rank",
    ylabel="seconds in collectives so far (rank 0)",
    title="comm time, running total",
)
axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# ### Final test accuracy
# The test split (20% of the digits) with the final model; after `local_sgd` and `diloco` the ranks' last local
# steps are synced once more, so every rank ends with the same model.

# %%
tested = [n for n in names if runs[n].test_accuracy is not None]
fig, ax = plt.subplots(figsize=(10, 4.5))
bars = ax.barh(tested, [100 * runs[n].test_accuracy for n in tested], color=[COLORS[n] for n in tested])
ax.bar_label(bars, fmt="%.2f%%", fontsize=8)
lowest = min(100 * runs[n].test_accuracy for n in tested)
ax.set(xlabel="test accuracy (%)", xlim=(max(0, lowest - 5), 100), title="final test accuracy (axis cut)")
ax.invert_yaxis()
fig.tight_layout()
plt.show()
print(format_runs(runs.values(), columns=("test acc", "bytes sent/step", "comm ms/step")))

# %% [markdown]
# ## 2. Bucketing on a latency-bound model
# 40 layers of 256 (82 small tensors), one epoch of 40 batches. `naive` is the textbook loop (one blocking
# all-reduce per parameter), `flat` packs all gradients into one buffer after backward, `overlap` launches buckets
# during backward, and `auto` (the default) times launching during and after backward on the first steps, then
# keeps the faster. For a careful, alternating measurement against torch DDP and the compute-only floor, run
# `python benchmarks/step_time.py`.

# %%
BUCKETINGS = ("naive", "flat", "overlap", "auto")
bucket_cases = {b: ["experiment=latency_bound", "strategy=allreduce", f"strategy.bucketing={b}"] for b in BUCKETINGS}
bucketing = run_cases(
    bucket_cases,
    Path(OUT, "bucketing"),
    probe_every_batches=None,
    common=["trainer.max_epochs=1", "++trainer.limit_train_batches=" + ("4" if SMOKE else "40"), "test=false"],
)
print(format_runs(bucketing.values(), columns=("ms/step", "comm ms/step", "calls/step", "bytes sent/step")))
for name, run in bucketing.items():
    print(f"{name:<8} buckets launched: {run.summary.get('launch_point')}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.bar(BUCKETINGS, [bucketing[b].step_time_ms for b in BUCKETINGS], color="tab:blue", label="median batch")
ax.bar(
    BUCKETINGS,
    [1e3 * bucketing[b].comm_seconds_per_step for b in BUCKETINGS],
    color="tab:orange",
    width=0.5,
    label="collectives in flight",
)
ax.set(ylabel="ms per step", title="allreduce bucketing, latency-bound MLP, 2 ranks")
ax.legend()
fig.tight_layout()
plt.show()
