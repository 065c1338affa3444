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
# # Gradient compression: bytes against accuracy
#
# The `allreduce` mode all-reduces each step's gradients; its `compression` knob decides what travels:
#
# - `none`: fp32, the reference;
# - `fp16`, `bf16`: each value cast to 16 bits for the transfer (half the bytes);
# - `topk` (`TopKCompression(density=0.01)`): each rank sends the largest 1% of its gradient entries, values and indices (an
#   all-gather), and keeps the rest in an error-feedback residual added to its next gradient;
# - `powersgd` (`PowerSGDCompression(rank=4)`): each gradient matrix is sent as two rank-4 factors (r(n + m) values instead of
#   n x m; vectors such as biases go uncompressed), with error feedback, after `start_iter` (10)
#   uncompressed steps.
#
# The digits classifier on 2 CPU ranks, the same epochs for every case, each case over 3 seeds (a seed sets the
# initial weights and the data order); tables give every figure as the mean and the range [min, max] over the
# seeds, and a case whose range overlaps the reference's (`none`) is a tie with it. We compare (a) bytes per step
# against test accuracy, and (b) what that would mean in time on a slow link: a **model** built from the measured
# compute time and bytes of these runs, and, where the benchmark has measured it on emulated links (which needs
# root), its measured time to accuracy.
#
# Set the environment variable `SMOKE=1` to run three of the cases for a few batches only, with one seed;
# `NOTEBOOK_OUT` names the output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 15
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_compression")
SEEDS = (0,) if SMOKE else (0, 1, 2)
SMALL = ["++trainer.limit_train_batches=4", "++trainer.limit_val_batches=1"] if SMOKE else []
TARGET = 0.3 if SMOKE else 0.9  # validation accuracy for the time-to-accuracy model

# %%
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.cases import CATALOGUE
from lightning_sync.apps.markdown import format_cell, markdown_table
from lightning_sync.apps.stats import error_bar, seed_band
from lightning_sync.apps.study import (
    LINK_RATES,
    by_case,
    format_seed_link_model,
    format_seed_runs,
    load_time_to_accuracy,
    modelled_accuracy_curve,
    modelled_time_to_accuracy,
    run_cases,
    seed_cases,
)

# the checkout's benchmark results (a notebook runs in notebooks/; a script knows its own path)
RESULTS = Path(globals().get("__file__", "notebook")).resolve().parent.parent / "benchmarks" / "results"

# the main job's allreduce cases (lightning_sync.apps.cases), by this notebook's names
COMPRESSION = {
    "none": "allreduce",
    "fp16": "allreduce+fp16",
    "bf16": "allreduce+bf16",
    "topk 1%": "allreduce+topk1%",
    "powersgd r4": "allreduce+powersgd4",
}
cases = {label: CATALOGUE[name].overrides() for label, name in COMPRESSION.items()}
if SMOKE:  # the reference and the two sparse codecs (the casts' code paths are the same as none's here)
    cases = {label: cases[label] for label in ("none", "topk 1%", "powersgd r4")}
COLORS = dict(zip(cases, ("black", "tab:blue", "tab:cyan", "tab:orange", "tab:green")))

# %% [markdown]
# ## (a) Bytes per step against accuracy
# Bytes each rank sends per optimizer step in training, as the communication meter counts them (compressed
# payloads at their real size; `powersgd`'s uncompressed first steps included). The 5 cases x 3 seeds are 15 runs
# of a few seconds each. Left: each case's mean test accuracy, the bar its range over the seeds; right: the mean
# validation accuracy of rank 0's probes against batches, the band the seeds' range.

# %%
runs = run_cases(seed_cases(cases, SEEDS), Path(OUT, "digits"), common=[f"trainer.max_epochs={EPOCHS}", *SMALL])
groups = by_case(runs)
print(
    f"Digits classifier, allreduce, 2 CPU ranks, {EPOCHS} epoch(s){' (SMOKE: 4 batches)' if SMOKE else ''}, "
    f"seeds {', '.join(map(str, SEEDS))}"
)
print(
    format_seed_runs(
        groups,
        columns=("test acc", "bytes sent/step", "calls/step", "ms/step", "comm ms/step", "training s"),
        reference="none",
    )
)

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
for name, group in groups.items():
    sent = group[0].bytes_sent_per_step / 1e3
    bar = error_bar([r.test_accuracy and 100 * r.test_accuracy for r in group])
    if bar is not None:
        mean, yerr = bar
        axes[0].errorbar(sent, mean, yerr=yerr, fmt="o", color=COLORS[name], capsize=3)
        axes[0].annotate(name, (sent, mean), textcoords="offset points", xytext=(6, 4), fontsize=9)
    grid, mean, low, high = seed_band([r.accuracy_curve(x="batch") for r in group])
    axes[1].plot(grid, mean, color=COLORS[name], label=name)
    axes[1].fill_between(grid, low, high, color=COLORS[name], alpha=0.2)
axes[0].set(
    xlabel="kB sent per rank per optimizer step",
    ylabel="test accuracy (%), mean [min, max]",
    xscale="log",
    title="bytes against accuracy",
)
axes[1].set(
    xlabel="training batches per rank",
    ylabel="validation accuracy (rank 0)",
    ylim=(0, 1),
    title="accuracy against batches",
)
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (b) Time to accuracy on a slow link: a model
# **This is a model, not a measurement.** For each run, one training batch on a link of rate R is modelled as
#
# > compute seconds per batch + 8 x bytes sent per batch / R
#
# where compute is the median over rank 0's batches of the batch's wall time minus its seconds in collectives (so
# compression's own work, e.g. PowerSGD's matrix products or top-k's selection, stays in), and the bytes are the
# meter's. It assumes a full-duplex link per rank (each rank's send and receive overlap), no latency, and no
# overlap of transfer with compute; the time to reach `TARGET` validation accuracy is the batches each run needed
# (rank 0's probes, after the first batch and every 5) times that, for each seed; the table gives the mean and range
# over the seeds, and `vs none` compares each case's modelled seconds with fp32's at that rate (`tie`: the ranges
# overlap). A seed that never reached the target counts in `(k of n)`. It counts bytes only: on a real link each
# message also pays a latency, and PowerSGD makes about three collectives per step (its P and Q factors and the
# uncompressed vectors; the `calls/step` column) where the others make one, so the model flatters it there.
# The compute term is measured on a shared 2-core machine: between runs it moves by tens of percent, which shifts
# the 1 Gbit/s column most (there compute is most of the time).

# %%
print(format_seed_link_model(groups, TARGET, reference="none"))

# %%
fig, axes = plt.subplots(1, len(LINK_RATES) + 1, figsize=(20, 4.5))
for ax, (rate, bps) in zip(axes, LINK_RATES.items()):
    drawn = False
    for name, group in groups.items():
        grid, mean, low, high = seed_band([modelled_accuracy_curve(r, bps) for r in group])
        ax.plot(grid, mean, color=COLORS[name], label=name)
        ax.fill_between(grid, low, high, color=COLORS[name], alpha=0.2)
        drawn = drawn or bool(grid)
    if drawn:
        ax.set_xscale("log")
    ax.axhline(TARGET, color="gray", linestyle=":")
    ax.set(
        xlabel="modelled training seconds",
        ylabel="validation accuracy (rank 0)",
        ylim=(0, 1),
        title=f"model: accuracy against time at {rate}",
    )
axes[0].legend()
width = 0.8 / len(groups)
for i, (name, group) in enumerate(groups.items()):
    for j, bps in enumerate(LINK_RATES.values()):
        bar = error_bar([modelled_time_to_accuracy(r, TARGET, bps) for r in group])
        if bar is not None:
            (mean, yerr), x = bar, j + (i - (len(groups) - 1) / 2) * width
            axes[-1].bar(x, mean, width, color=COLORS[name], label=name if j == 0 else None)
            axes[-1].errorbar(x, mean, yerr=yerr, color="black", capsize=2)
axes[-1].set(
    xticks=range(len(LINK_RATES)),
    xticklabels=list(LINK_RATES),
    ylabel=f"modelled seconds to {TARGET:.0%} (mean, bar: range)",
    title=f"model: time to {TARGET:.0%} validation accuracy (none: not reached)",
)
if axes[-1].patches:
    axes[-1].set_yscale("log")
    axes[-1].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (c) Measured on emulated links
# `python -m lightning_sync.bench` can run the time-to-accuracy workload with each rank in its own network
# namespace behind a rate-limited link (root only) and writes `benchmarks/results/time_to_accuracy.json`. If that
# file exists, its measured seconds to the target are plotted here; a case that never reached the target is marked
# with an x. Its cases are the benchmark's own (named as in its output), not the runs above.

# %%
measured = load_time_to_accuracy(RESULTS / "time_to_accuracy.json")
if not measured:
    print(
        "no measured time to accuracy in benchmarks/results/time_to_accuracy.json (the benchmark writes it; "
        "emulated links need root): only the model above"
    )
else:
    print(
        markdown_table(
            ("case", "rate", "target", "seconds to target"),
            [
                (r["case"], r["rate"], f"{r['target']:.0%}", format_cell(r["seconds_to_target"], ",.1f"))
                for r in measured
            ],
        )
    )
    bench_cases = list(dict.fromkeys(r["case"] for r in measured))
    bench_rates = list(dict.fromkeys(r["rate"] for r in measured))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(bench_cases)
    for i, case in enumerate(bench_cases):
        color, offset = plt.get_cmap("tab10")(i % 10), (i - (len(bench_cases) - 1) / 2) * width
        records = [r for r in measured if r["case"] == case]
        reached = [r for r in records if r["seconds_to_target"] is not None]
        ax.bar(
            [bench_rates.index(r["rate"]) + offset for r in reached],
            [r["seconds_to_target"] for r in reached],
            width,
            color=color,
            label=case,
        )
        missed = [bench_rates.index(r["rate"]) + offset for r in records if r["seconds_to_target"] is None]
        ax.plot(missed, [1.0] * len(missed), "x", color=color, markersize=9)
    ax.set(
        xticks=range(len(bench_rates)),
        xticklabels=bench_rates,
        yscale="log",
        ylabel="measured seconds to target",
        title="measured time to accuracy, emulated links (benchmark)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
