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
# # Syncing every N steps: gradient accumulation, local SGD and DiLoCo
#
# `strategy=periodic` talks to the other ranks only every `sync_every` steps, in one of three modes:
#
# - `gradient`: each rank accumulates its gradients over `sync_every` batches, then one all-reduce and one optimizer
#   step (= DDP with `accumulate_grad_batches x sync_every`: fewer, larger steps);
# - `local_sgd`: every rank steps alone on its own batches, and every `sync_every` steps the parameters (and
#   buffers) are averaged;
# - `diloco`: as local SGD, but at each sync an outer Nesterov SGD (lr 0.7, momentum 0.9) applies the averaged
#   change since the last sync to a global copy, which every replica then loads. It runs with AdamW inside
#   (`experiment=diloco`, the pairing of its paper); the other two keep the model's SGD (lr 0.1, momentum 0.9).
#
# The digits classifier on 2 CPU ranks, the same seed and epochs for every case. We sweep `sync_every` over
# 1, 2, 4, 8, 16 and 32 and look at (a) test accuracy and bytes sent against the period, (b) how far the replicas
# drift apart between syncs, and (c) the adaptive period (`sync_every=auto`) at work.
#
# Set the environment variable `SMOKE=1` to run a short sweep for a few batches only; `NOTEBOOK_OUT` names the
# output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 10
PERIODS = (1, 4) if SMOKE else (1, 2, 4, 8, 16, 32)
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_periodic")
SMALL = ["++trainer.limit_train_batches=8", "++trainer.limit_val_batches=1"] if SMOKE else []

# %%
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.study import format_runs, periodic_cases, run_cases

MODES = ("gradient", "local_sgd", "diloco")
COLORS = {"gradient": "tab:blue", "local_sgd": "tab:orange", "diloco": "tab:green"}

# %% [markdown]
# ## (a) Accuracy and bytes against `sync_every`
# Bytes are per training batch (not per optimizer step: `gradient` mode takes one optimizer step per
# `sync_every` batches), each rank's share of the ring all-reduce, as the meter counts them. Lightning ends an
# accumulation at the end of an epoch: with 18 batches per epoch per rank, `gradient` at 16 steps after 16 and
# then 2 batches, and at 32 once per epoch, after 18 (hence its bytes above the 1 / `sync_every` line). A run whose
# loss collapses is stopped by the divergence guard and drawn as an x at 0.

# %%
sweep = run_cases(periodic_cases(MODES, PERIODS), Path(OUT, "sweep"), common=[f"trainer.max_epochs={EPOCHS}", *SMALL])
print(f"Digits classifier, 2 CPU ranks, {EPOCHS} epoch(s){' (SMOKE: 8 batches)' if SMOKE else ''}, seed 0")
print(
    format_runs(
        sweep.values(), columns=("test acc", "bytes sent/batch", "syncs", "mean divergence", "comm share", "training s")
    )
)

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
for mode in MODES:
    cases = [sweep[f"{mode}/{p}"] for p in PERIODS]
    tested = [(p, 100 * run.test_accuracy) for p, run in zip(PERIODS, cases) if run.test_accuracy is not None]
    axes[0].plot(*zip(*tested), marker="o", color=COLORS[mode], label=mode)
    failed = [p for p, run in zip(PERIODS, cases) if run.diverged]
    if failed:
        axes[0].plot(failed, [0] * len(failed), "x", color=COLORS[mode], markersize=10, label=f"{mode}: diverged")
    axes[1].plot(PERIODS, [run.bytes_sent_per_batch / 1e3 for run in cases], marker="o", color=COLORS[mode], label=mode)
first = sweep[f"local_sgd/{PERIODS[0]}"].bytes_sent_per_batch / 1e3
axes[1].plot(PERIODS, [first / p for p in PERIODS], "k:", label="1 / sync_every")
axes[0].set(xlabel="sync_every", ylabel="test accuracy (%)", xscale="log", title="test accuracy")
axes[1].set(
    xlabel="sync_every", ylabel="kB sent per rank per batch", xscale="log", yscale="log", title="bytes per batch"
)
for ax in axes:
    ax.set_xticks(PERIODS, [str(p) for p in PERIODS])
    ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# `local_sgd` sends parameters and buffers at each sync, `gradient` the gradients, `diloco` the pseudo-gradient
# (the change since the last sync); all are the model's size, so the bytes fall as 1 / `sync_every` in every mode.
#
# What it costs in accuracy differs by mode. `gradient` mode pays most: a period of P is P times fewer optimizer
# steps at the same learning rate (at 32, ten steps in ten epochs). `local_sgd` steps every batch and only
# averages less often; on this small problem its replicas stay close enough (b) that it holds its accuracy up to
# the longest period. `diloco`, with its paper's outer optimizer (lr 0.7, Nesterov momentum 0.9) over AdamW, is
# uneven here; at `sync_every=1` the outer momentum acts at every step and the run collapsed (stopped by the
# divergence guard). These are single runs with one seed (the runs are deterministic for a seed; the spread over
# seeds is not measured here), so read differences of a point or two with care.

# %% [markdown]
# ## (b) How far the replicas drift apart between syncs
# At every sync the averager measures each rank's divergence: the distance between its parameters and the average
# of all ranks', just before they are replaced, i.e. how far it drifted during the last period (on 2 ranks the
# replicas are twice that apart). The strategy logs it as `sync/divergence`; the timeline reads it from the
# strategy after every batch, so each point below is one sync of rank 0. `gradient` mode keeps one model (0 by
# construction) and measures none. For DiLoCo it is the drift of the inner AdamW steps since the global copy.

# %%
LOCAL = ("local_sgd", "diloco")
fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
shades = plt.get_cmap("viridis")
for ax, mode in zip(axes, LOCAL):
    for i, period in enumerate(PERIODS):
        ax.plot(
            *sweep[f"{mode}/{period}"].series("divergence"),
            marker=".",
            markersize=3,
            linewidth=0.8,
            color=shades(i / len(PERIODS)),
            label=f"sync_every={period}",
        )
    ax.set(xlabel="optimizer step", ylabel="||rank 0 - average|| at sync", yscale="log", title=f"{mode}: drift")
    ax.legend(fontsize=8)
for mode in LOCAL:
    means = [sweep[f"{mode}/{p}"].mean_divergence for p in PERIODS]
    axes[2].plot(PERIODS, means, marker="o", color=COLORS[mode], label=mode)
axes[2].set(
    xlabel="sync_every", ylabel="mean drift per sync", xscale="log", yscale="log", title="drift against the period"
)
axes[2].set_xticks(PERIODS, [str(p) for p in PERIODS])
axes[2].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (c) The adaptive period
# With `sync_every=auto` (`local_sgd`/`diloco`) the averager measures, at every sync, the compute time per step and
# the time the sync took (the slowest rank's, identical on every rank), smooths both, and picks the smallest period
# that spends at most `target_comm_fraction` of the time communicating, within [`min_sync_every`,
# `max_sync_every`] (1 and 64 by default; it starts at `min_sync_every`). The strategy logs the period as
# `sync/period`; below, the period in force after each of rank 0's batches (the first sync, after step 1, already
# sets it from its measurements). Three targets, `local_sgd`:

# %%
TARGETS = (0.02, 0.1, 0.3)
adaptive_cases = {
    f"auto, target {t:.0%}": [
        "strategy=periodic",
        "strategy.mode=local_sgd",
        "strategy.sync_every=auto",
        f"strategy.target_comm_fraction={t}",
    ]
    for t in TARGETS
}
adaptive = run_cases(adaptive_cases, Path(OUT, "adaptive"), common=[f"trainer.max_epochs={EPOCHS}", *SMALL])
print(format_runs(adaptive.values(), columns=("test acc", "syncs", "bytes sent/batch", "comm share", "training s")))

# %%
fig, ax = plt.subplots(figsize=(9, 4))
for i, (name, run) in enumerate(adaptive.items()):
    ax.step(*run.series("period"), where="post", color=plt.get_cmap("tab10")(i), label=name)
ax.set(
    xlabel="optimizer step",
    ylabel="sync/period (steps between syncs)",
    yscale="log",
    title="local_sgd, sync_every=auto: the period in force",
)
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The period follows the measured times: a tighter target needs longer periods, and the "comm share" column is
# what it came to over the whole run (rank 0's collectives over its training time; here below each target). On
# this loopback machine a sync of the 104 kB model costs about as much as a compute step, so short periods meet a
# loose target; on a slower link the same rule picks longer ones. The machine is shared and its timings are noisy,
# which is why the period moves during a run: the averager smooths its measurements, but a burst of load on one
# rank still shifts them.
