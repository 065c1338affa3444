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
# (gloo), with the same data and epochs: Lightning-style DDP (with its comm hooks), our bucketed all-reduce
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
# Every case runs over 3 seeds (a seed sets the initial weights and the data order), seed by seed, so a drift of
# the shared machine's load spreads over all cases alike. Tables give each figure as the mean and the range
# [min, max] over the seeds, and `vs ddp` says `tie` when a case's range of test accuracy overlaps DDP's; curves are
# the mean with the seeds' range as a band, bars the mean with the range as an error bar. To keep the 39 digits runs
# (13 cases x 3 seeds) and the 12 bucketing runs within a few minutes on this 2-core machine, the digits train for 8
# epochs instead of 15 (the accuracy curves show how far each case has levelled off by then). For a careful,
# alternating measurement of step time run `python benchmarks/step_time.py`.
#
# Set the environment variable `SMOKE=1` for a few batches of one case per mode, with one seed; `NOTEBOOK_OUT`
# names the output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 8
SEEDS = (0,) if SMOKE else (0, 1, 2)
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_overview")
SMALL = ["++trainer.limit_train_batches=4", "++trainer.limit_val_batches=1"] if SMOKE else []

# %%
from itertools import accumulate
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.compare import available_cases
from lightning_sync.apps.stats import error_bar, seed_band
from lightning_sync.apps.study import by_case, format_seed_runs, run_cases, seed_cases

NO_BAR = (0.0, [[0.0], [0.0]])  # a case without the figure: an empty bar


# %% [markdown]
# ## 1. All modes on the digits classifier

# %%
CASES = available_cases()
if SMOKE:  # one case of each mode (every case's config is built in tests/test_compare.py)
    CASES = {name: CASES[name] for name in ("ddp", "allreduce+powersgd4", "periodic:diloco/8", "ps:async")}
runs = run_cases(seed_cases(CASES, SEEDS), Path(OUT, "digits"), common=[f"trainer.max_epochs={EPOCHS}", *SMALL])
groups = by_case(runs)
print(
    f"Digits classifier, 2 CPU ranks, {EPOCHS} epoch(s){' (SMOKE: 4 batches)' if SMOKE else ''}, "
    f"seeds {', '.join(map(str, SEEDS))}"
)
print(format_seed_runs(groups, reference="ddp"))
COLORS = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(groups)}
STYLES = {name: "--" if name.startswith("ps") else ":" if name.startswith("periodic") else "-" for name in groups}


def band(ax, curves, name, **style):
    """The seeds' mean curve of a case, with their range as a band."""
    grid, mean, low, high = seed_band(curves)
    ax.plot(grid, mean, color=COLORS[name], linestyle=STYLES[name], linewidth=1, label=name, **style)
    ax.fill_between(grid, low, high, color=COLORS[name], alpha=0.15)


# %% [markdown]
# ### Loss and accuracy against batches and against wall time
# The loss is rank 0's training loss, a running mean over 10 batches. All modes see the same samples per batch, so
# against batches they differ only by what their sync does to the optimization; against wall time, cheaper syncs
# (or none, between periodic syncs) also move the curves left. Lines are the mean over the seeds, bands their
# range, over the part of the run every seed covers.

# %%
fig, axes = plt.subplots(2, 2, figsize=(15, 9))
for name, group in groups.items():
    for col, x in enumerate(("batch", "time")):
        band(axes[0, col], [r.loss_curve(x=x) for r in group], name)
        band(axes[1, col], [r.accuracy_curve(x=x) for r in group], name)
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
# bytes against optimizer steps (PowerSGD sends uncompressed for its first `start_iter` = 10 steps,
# periodic modes send only at syncs) and seconds in collectives against batches. Bars are the mean over the seeds,
# black lines their range.

# %%
names = list(groups)
fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
for ax, value in zip(
    axes,
    (
        lambda r: None if r.bytes_sent_per_step is None else r.bytes_sent_per_step / 1e3,
        lambda r: None if r.comm_seconds_per_step is None else 1e3 * r.comm_seconds_per_step,
    ),
):
    for name in names:
        mean, xerr = error_bar([value(r) for r in groups[name]]) or NO_BAR
        ax.barh(name, mean, xerr=xerr, color=COLORS[name], error_kw=dict(capsize=2))
axes[0].set(xlabel="kB sent per rank per optimizer step", xscale="log", title="bytes per step")
axes[1].set(xlabel="ms of collectives per optimizer step (rank 0)", title="comm time per step")
for ax in axes:
    ax.invert_yaxis()
fig.tight_layout()
plt.show()

fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
for name, group in groups.items():
    totals = []
    for run in group:
        steps, sent = run.metric("comm/bytes_sent")
        totals.append((steps, [b / 1e6 for b in accumulate(sent)]))
    band(axes[0], totals, name)
    totals = []
    for run in group:
        batches, comm = run.series("comm_s", x="batch")
        totals.append((batches, list(accumulate(comm))))
    band(axes[1], totals, name)
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
# steps are synced once more, so every rank ends with the same model. The bar is the mean over the seeds, the
# black line their range; the table says `tie` where a case's range overlaps DDP's.

# %%
accuracies = {n: [100 * r.test_accuracy for r in groups[n] if r.test_accuracy is not None] for n in names}
tested = [n for n in names if accuracies[n]]
fig, ax = plt.subplots(figsize=(10, 4.5))
for name in tested:
    mean, xerr = error_bar(accuracies[name]) or NO_BAR
    bars = ax.barh(name, mean, xerr=xerr, color=COLORS[name], error_kw=dict(capsize=2))
    ax.bar_label(bars, fmt="%.2f%%", fontsize=8, padding=8)
lowest = min(min(a) for a in accuracies.values() if a)
ax.set(
    xlabel="test accuracy (%), mean [min, max]", xlim=(max(0, lowest - 5), 100), title="final test accuracy (axis cut)"
)
ax.invert_yaxis()
fig.tight_layout()
plt.show()
print(format_seed_runs(groups, columns=("test acc", "bytes sent/step", "comm ms/step"), reference="ddp"))

# %% [markdown]
# ## 2. Bucketing on a latency-bound model
# 40 layers of 256 (82 small tensors), one epoch of 40 batches. `naive` is the textbook loop (one blocking
# all-reduce per parameter), `flat` packs all gradients into one buffer after backward, `overlap` launches buckets
# during backward, and `auto` (the default) times launching during and after backward on the first steps, then
# keeps the faster. Each over the same 3 seeds, seed by seed: the figures are the mean and range of the runs. For a
# careful, alternating measurement against torch DDP and the compute-only floor, run
# `python benchmarks/step_time.py`.

# %%
# SMOKE: the textbook loop and the default (tests/test_bucketing.py checks every bucketing)
BUCKETINGS = ("naive", "auto") if SMOKE else ("naive", "flat", "overlap", "auto")
bucket_cases = {b: ["experiment=latency_bound", "strategy=allreduce", f"strategy.bucketing={b}"] for b in BUCKETINGS}
bucketing = by_case(
    run_cases(
        seed_cases(bucket_cases, SEEDS),
        Path(OUT, "bucketing"),
        probe_every_batches=None,
        common=["trainer.max_epochs=1", "++trainer.limit_train_batches=" + ("4" if SMOKE else "40"), "test=false"],
    )
)
print(format_seed_runs(bucketing, columns=("ms/step", "comm ms/step", "calls/step", "bytes sent/step")))
for name, group in bucketing.items():
    print(f"{name:<8} buckets launched (seed by seed): {', '.join(str(r.summary.get('launch_point')) for r in group)}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for i, name in enumerate(BUCKETINGS):
    step, step_err = error_bar([r.step_time_ms for r in bucketing[name]]) or NO_BAR
    comm, comm_err = (
        error_bar([None if r.comm_seconds_per_step is None else 1e3 * r.comm_seconds_per_step for r in bucketing[name]])
        or NO_BAR
    )
    ax.bar(i, step, yerr=step_err, color="tab:blue", capsize=3, label="median batch" if i == 0 else None)
    ax.bar(
        i,
        comm,
        yerr=comm_err,
        width=0.5,
        color="tab:orange",
        capsize=3,
        label="collectives in flight" if i == 0 else None,
    )
ax.set(
    xticks=range(len(BUCKETINGS)),
    xticklabels=BUCKETINGS,
    ylabel="ms per step (mean, bar: range)",
    title="allreduce bucketing, latency-bound MLP, 2 ranks",
)
ax.legend()
fig.tight_layout()
plt.show()
