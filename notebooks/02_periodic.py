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
# - `diloco`: as local SGD, but at each sync an outer SGD (lr 0.7, no momentum) applies the averaged change since
#   the last sync to a global copy, which every replica then loads. It runs with AdamW inside
#   (`experiment=diloco`, the pairing of its paper); the other two keep the model's SGD (lr 0.1, momentum 0.9).
#
# The digits classifier on 2 CPU ranks, the same epochs for every case, and every case over 3 seeds (a seed sets
# the initial weights and the data order): tables give each figure as the mean and the range [min, max] over the
# seeds, curves the mean with the seeds' range as a band. We sweep `sync_every` over 1, 4, 8 and 32 and look at
# (a) test accuracy and bytes sent against the period, (b) how far the replicas drift apart between syncs, and
# (c) the adaptive period (`sync_every=auto`) at work. The sweep once had periods 2 and 16 as well: without them
# it still spans the same factor of 32 in bytes, with 8 (the comparison job's period) in it, and the 45 runs
# (15 cases x 3 seeds) stay within about 5 minutes on this 2-core machine.
#
# Set the environment variable `SMOKE=1` to run a short sweep for a few batches only, with one seed;
# `NOTEBOOK_OUT` names the output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 10
PERIODS = (1, 4) if SMOKE else (1, 4, 8, 32)
SEEDS = (0,) if SMOKE else (0, 1, 2)
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_periodic")
SMALL = ["++trainer.limit_train_batches=8", "++trainer.limit_val_batches=1"] if SMOKE else []

# %%
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.cases import periodic_cases
from lightning_sync.apps.stats import error_bar, seed_band
from lightning_sync.apps.study import by_case, format_seed_runs, run_cases, seed_cases

MODES = ("gradient", "local_sgd", "diloco")
COLORS = {"gradient": "tab:blue", "local_sgd": "tab:orange", "diloco": "tab:green"}

# %% [markdown]
# ## (a) Accuracy and bytes against `sync_every`
# Bytes are per training batch (not per optimizer step: `gradient` mode takes one optimizer step per
# `sync_every` batches), each rank's share of the ring all-reduce, as the meter counts them. Lightning ends an
# accumulation at the end of an epoch: with 18 batches per epoch per rank, `gradient` at 32 steps once per epoch,
# after 18 batches (hence its bytes above the 1 / `sync_every` line). `vs gradient/1` compares each case's test
# accuracy with syncing the gradients every step (= DDP): `tie` when the ranges over the seeds overlap. A run whose
# loss collapses is stopped by the divergence guard: it has no test accuracy (`(k of n)` counts the seeds that have
# one), and a period where any seed collapsed is drawn with an x at 0.

# %%
sweep_runs = run_cases(
    seed_cases(periodic_cases(MODES, PERIODS), SEEDS),
    Path(OUT, "sweep"),
    common=[f"trainer.max_epochs={EPOCHS}", *SMALL],
)
sweep = by_case(sweep_runs)
print(
    f"Digits classifier, 2 CPU ranks, {EPOCHS} epoch(s){' (SMOKE: 8 batches)' if SMOKE else ''}, "
    f"seeds {', '.join(map(str, SEEDS))}"
)
print(
    format_seed_runs(
        sweep,
        columns=("test acc", "bytes sent/batch", "syncs", "mean divergence", "comm share", "training s"),
        reference="gradient/1",
    )
)

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
for mode in MODES:
    groups = [sweep[f"{mode}/{p}"] for p in PERIODS]
    tested = [(p, error_bar([r.test_accuracy and 100 * r.test_accuracy for r in g])) for p, g in zip(PERIODS, groups)]
    tested = [(p, band) for p, band in tested if band is not None]
    axes[0].plot([p for p, _ in tested], [band[0] for _, band in tested], marker="o", color=COLORS[mode], label=mode)
    for p, (mean, yerr) in tested:
        axes[0].errorbar(p, mean, yerr=yerr, color=COLORS[mode], capsize=3)
    failed = [p for p, g in zip(PERIODS, groups) if any(r.diverged for r in g)]
    if failed:
        axes[0].plot(failed, [0] * len(failed), "x", color=COLORS[mode], markersize=10, label=f"{mode}: diverged")
    sent = [sum(r.bytes_sent_per_batch for r in g) / len(g) / 1e3 for g in groups]
    axes[1].plot(PERIODS, sent, marker="o", color=COLORS[mode], label=mode)
first = sweep[f"local_sgd/{PERIODS[0]}"][0].bytes_sent_per_batch / 1e3
axes[1].plot(PERIODS, [first / p for p in PERIODS], "k:", label="1 / sync_every")
axes[0].set(xlabel="sync_every", ylabel="test accuracy (%), mean [min, max]", xscale="log", title="test accuracy")
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
# averages less often; on this small problem its replicas stay close (b). `diloco` runs its outer SGD (lr 0.7, no
# momentum) over AdamW: in these ten epochs it ends below the SGD-based modes, at about the same accuracy for every
# period from 1 to 32. Read the table's verdicts, not single numbers: a difference inside the seeds' range is a
# tie.

# %% [markdown]
# ## (b) How far the replicas drift apart between syncs
# At every sync the averager measures each rank's divergence: the distance between its parameters and the average
# of all ranks', just before they are replaced, i.e. how far it drifted during the last period (on 2 ranks the
# replicas are twice that apart). The strategy logs it as `sync/divergence`; the timeline reads it from the
# strategy after every batch, so each point below is one sync of rank 0. `gradient` mode keeps one model (0 by
# construction) and measures none. For DiLoCo it is the drift of the inner AdamW steps since the global copy. The
# lines are the mean over the seeds (over the steps every seed reached), the bands and bars their range.

# %%
LOCAL = ("local_sgd", "diloco")
fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
shades = plt.get_cmap("viridis")
for ax, mode in zip(axes, LOCAL):
    for i, period in enumerate(PERIODS):
        color = shades(i / len(PERIODS))
        grid, mean, low, high = seed_band([r.series("divergence") for r in sweep[f"{mode}/{period}"]])
        ax.plot(grid, mean, linewidth=0.8, color=color, label=f"sync_every={period}")
        ax.fill_between(grid, low, high, color=color, alpha=0.2)
    ax.set(xlabel="optimizer step", ylabel="||rank 0 - average|| at sync", yscale="log", title=f"{mode}: drift")
    ax.legend(fontsize=8)
for mode in LOCAL:
    bands = [(p, error_bar([r.mean_divergence for r in sweep[f"{mode}/{p}"]])) for p in PERIODS]
    bands = [(p, band) for p, band in bands if band is not None]
    axes[2].plot([p for p, _ in bands], [band[0] for _, band in bands], marker="o", color=COLORS[mode], label=mode)
    for p, (mean, yerr) in bands:
        axes[2].errorbar(p, mean, yerr=yerr, color=COLORS[mode], capsize=3)
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
# sets it from its measurements); the line is the mean over the seeds, the band their range. Three targets,
# `local_sgd`:

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
adaptive = by_case(
    run_cases(seed_cases(adaptive_cases, SEEDS), Path(OUT, "adaptive"), common=[f"trainer.max_epochs={EPOCHS}", *SMALL])
)
print(format_seed_runs(adaptive, columns=("test acc", "syncs", "bytes sent/batch", "comm share", "training s")))

# %%
fig, ax = plt.subplots(figsize=(9, 4))
for i, (name, group) in enumerate(adaptive.items()):
    color = plt.get_cmap("tab10")(i)
    grid, mean, low, high = seed_band([r.series("period") for r in group], points=200)
    ax.plot(grid, mean, color=color, label=name)
    ax.fill_between(grid, low, high, color=color, alpha=0.2)
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
# what it came to over the whole run (rank 0's collectives over its training time). On
# this loopback machine a sync of the 104 kB model costs about as much as a compute step, so short periods meet a
# loose target; on a slower link the same rule picks longer ones. The machine is shared and its timings are noisy,
# which is why the period moves during a run: the averager smooths its measurements, but a burst of load on one
# rank still shifts them.
