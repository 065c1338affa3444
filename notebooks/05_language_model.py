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
# # A language model: where the sync modes differ
#
# The digits classifier has 26k parameters: one fp32 all-reduce is 104 kB, and at 100 Mbit/s communication hardly
# matters. This notebook trains the character-level language model (`experiment=char_lm`: `CharGPT`, a small
# decoder-only transformer, 418k parameters, on CPython's own reference text) with every sync mode, over 3 seeds.
# One fp32 all-reduce of its gradients is 1.67 MB: about 134 ms at 100 Mbit/s, several times a step's compute on
# one core. That is the regime local SGD, DiLoCo and compression are for.
#
# We show (a) validation loss against characters trained on and against wall time, with the seeds' band (min to
# max) around their mean; (b) bytes per step, the meter's against those measured on an emulated wire by the
# benchmark; (c) time to a target loss at each emulated link rate, measured by the benchmark where it has run, and
# modelled from these runs.
#
# Set the environment variable `SMOKE=1` to run every case for a few steps with one seed; `NOTEBOOK_OUT` names the
# output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
STEPS = 6 if SMOKE else 150
SEEDS = (0,) if SMOKE else (0, 1, 2)
PROBE_EVERY = 2 if SMOKE else 15  # rank 0's validation probes, in batches
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_language_model")

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.cases import hydra_cases
from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.provenance import provenance, summary_line
from lightning_sync.apps.stats import error_bar, seed_band
from lightning_sync.apps.study import LINK_RATES, by_case, load_bench_rows, modelled_time_to_loss, run_cases, seed_cases
from lightning_sync.examples.data import TextDataModule

# the checkout's benchmark results (a notebook runs in notebooks/; a script knows its own path)
RESULTS = Path(globals().get("__file__", "notebook")).resolve().parent.parent / "benchmarks" / "results"

data = TextDataModule()
print(f"corpus: {data.num_chars:,} characters, {data.vocab_size} distinct")
print(f"unigram baseline: {data.unigram_entropy:.3f} nats/char ({data.unigram_bits:.3f} bits/char)")

# %% [markdown]
# ## The runs
# Every mode on 2 CPU ranks (gloo), the same steps and seeds. A seed sets the initial weights and the data order.
# `allreduce` appears with compression only: uncompressed, it averages the same fp32 gradients as `ddp` and sends
# the same bytes. 150 steps per run keep the 18 runs within the time a notebook should take on this machine.
# `ps:async` has one dedicated server process; DiLoCo's outer optimizer is the strategy's default (SGD, lr 0.7, no
# momentum) over the model's AdamW.

# %%
MODES = hydra_cases(
    ["ddp", "allreduce+powersgd4", "allreduce+topk1%", "periodic:local_sgd/8", "periodic:diloco/8", "ps:async"]
)
COLORS = dict(zip(MODES, plt.get_cmap("tab10").colors))
common = [
    "experiment=char_lm",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    *(["data.val_windows=8"] if SMOKE else []),
]
runs = run_cases(seed_cases(MODES, SEEDS), Path(OUT, "runs"), common=common, probe_every_batches=PROBE_EVERY)
groups = by_case(runs)
record = provenance()
print(f"CharGPT, 2 CPU ranks, {STEPS} steps, seeds {', '.join(map(str, SEEDS))}{' (SMOKE)' if SMOKE else ''}")
print(summary_line(record) + f"; load average {record['load_average']}")

print(
    markdown_table(
        ("mode", "test loss nats/char mean [min, max]", "test bpc mean", "ms/step (median)", "meter bytes/step"),
        [
            (
                name,
                band_cell([r.test_loss for r in group]),
                format_cell(
                    None
                    if any(r.test_loss is None for r in group)
                    else sum(r.test_loss for r in group) / len(group) / 0.6931471805599453,
                    ".3f",
                ),
                format_cell(sorted(r.step_time_ms for r in group)[len(group) // 2], ".1f"),
                format_cell(group[0].bytes_sent_per_step, ",.0f"),
            )
            for name, group in groups.items()
        ],
    )
)

# %% [markdown]
# ## (a) Validation loss against characters and against wall time
# Rank 0's probes: the validation loss of the parameters rank 0 holds (in `local_sgd` and `diloco` its own replica
# between syncs), every few batches. Characters are those both ranks trained on together. The wall time is rank 0's
# training clock (the probes' own cost taken out) on this shared 2-core machine: with other work on the machine
# its scale moves from run to run; the order of the modes is what to read. The line is the mean of the seeds, the
# band their range, over the part of the run every seed covers. In `ps:async` the run's steps are the server's
# updates, shared by the two workers as fast as each pushes, so rank 0 runs fewer batches and its curve is
# shorter.

# %%
fig, axes = plt.subplots(1, 2, figsize=(15, 5))
for ax, x in zip(axes, ("tokens", "time")):
    for name, group in groups.items():
        grid, mean, low, high = seed_band([r.probe_loss_curve(x=x) for r in group])
        ax.plot(grid, mean, color=COLORS[name], label=name)
        ax.fill_between(grid, low, high, color=COLORS[name], alpha=0.2)
    ax.axhline(data.unigram_entropy, color="gray", linestyle=":", label="unigram baseline")
    ax.set(
        xlabel="characters trained on (both ranks)" if x == "tokens" else "rank 0's training seconds",
        ylabel="validation loss (nats/char)",
        title=f"validation loss against {'characters' if x == 'tokens' else 'wall time'}",
    )
axes[0].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (b) Bytes per step: the meter and the wire
# The meter's figure is what the strategy counts each rank sending per optimizer step: for a dense all-reduce the
# payload the ring formula assigns a rank (2 (n - 1) / n x the gradient bytes, so 1 x for 2 ranks), for a
# compressed mode the compressed payload, for `ps` the pushes, and for `periodic` the syncs spread over the steps.
# The wire's is what the benchmark (`python -m lightning_sync.bench workloads=char_lm network.rate=...`, root only)
# reads from each emulated host's interface counters over the training phase: TCP/IP framing and the store's
# traffic included.

# %%
bench = load_bench_rows("char_lm", RESULTS)
meter = {name: group[0].bytes_sent_per_step for name, group in groups.items()}
if bench:
    print("wire bytes from: " + ", ".join(sorted({Path(r["file"]).parent.name for r in bench})))
    print(
        markdown_table(
            ("case", "rate", "meter bytes/step", "wire bytes/step", "wire/meter"),
            [
                (
                    r["case"],
                    r["rate"],
                    format_cell(r.get("median_bytes_sent_per_step"), ",.0f"),
                    format_cell(r.get("median_wire_bytes_per_step"), ",.0f"),
                    format_cell(r.get("median_wire_over_meter"), ".3f"),
                )
                for r in bench
            ],
        )
    )
else:
    print(
        "no char_lm results of the benchmark under benchmarks/results (it writes them; emulated links need root): "
        "the meter's bytes of these runs only"
    )
fig, ax = plt.subplots(figsize=(11, 4.5))
names = list(meter)
ax.bar([i - 0.2 for i in range(len(names))], [(meter[n] or 0) / 1e3 for n in names], 0.4, label="meter (these runs)")
wire = {r["case"]: r.get("median_wire_bytes_per_step") for r in bench if r.get("median_wire_bytes_per_step")}
if wire:
    cases = list(wire)
    ax.bar([len(names) + i for i in range(len(cases))], [wire[c] / 1e3 for c in cases], 0.4, label="wire (benchmark)")
    names += cases
ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
ax.set(ylabel="kB per rank per optimizer step", title="bytes per step")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (c) Time to the target loss at each link rate
# **Measured**: where the benchmark has run `char_lm` on emulated links, its median seconds to the loss Lightning
# DDP ends its budget with, with its bounds (`floor`: 2 ranks that never communicate; `single`: one process with
# the global batch); it runs the other cases past DDP's budget until they reach that loss.
#
# **Modelled** from these runs, for every mode: these runs stop after the same number of steps, so the target
# here is the validation loss DDP reaches two thirds of the way (the mean over its seeds), which leaves a mode that
# learns a little more slowly per step room to reach it. A run's time to the target is the batches it needed
# times (compute seconds per batch + 8 x meter bytes per batch / rate): no latency, no overlap of transfer and
# compute, and the compute time measured on this shared machine (with other jobs running, a batch's compute here
# is several times its CPU time, which shortens every ratio between the rates). A mode that never reaches the
# target within the run shows none.


# %%
def loss_at(run, batch):
    """Rank 0's last probed validation loss at or before ``batch``."""
    return [loss for x, loss in zip(*run.probe_loss_curve(x="batch")) if x <= batch][-1]


TARGET = sum(loss_at(r, 2 * STEPS // 3) for r in groups["ddp"]) / len(groups["ddp"])
print(
    f"target: validation loss {TARGET:.3f} nats/char (DDP's at step {2 * STEPS // 3} of {STEPS}, "
    f"mean of {len(groups['ddp'])} seed(s))"
)
measured = [r for r in bench if r.get("metric") in ("seconds_to_target", "seconds_at_budget")]
if measured:
    print(
        markdown_table(
            ("case", "rate", "median s to target", "spread (min-max)", "target loss"),
            [
                (
                    r["case"],
                    r["rate"],
                    format_cell(r.get("median"), ".2f") if r.get("median") is not None else "not reached",
                    "-" if not r.get("spread") else f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}",
                    format_cell(r.get("target_loss"), ".4f"),
                )
                for r in measured
            ],
        )
    )
else:
    print("no measured time to target (the benchmark's char_lm results are absent): the model below only")
modelled = {
    name: {rate: [modelled_time_to_loss(r, TARGET, bps) for r in group] for rate, bps in LINK_RATES.items()}
    for name, group in groups.items()
}
print(
    markdown_table(
        ("mode", *(f"modelled s to target {rate} mean [min, max]" for rate in LINK_RATES)),
        [(name, *(band_cell(modelled[name][rate]) for rate in LINK_RATES)) for name in groups],
    )
)
fig, ax = plt.subplots(figsize=(12, 4.5))
width = 0.8 / len(groups)
for i, name in enumerate(groups):
    for j, rate in enumerate(LINK_RATES):
        bar = error_bar(modelled[name][rate])
        if bar is not None:
            (mean, yerr), x = bar, j + (i - (len(groups) - 1) / 2) * width
            ax.bar(x, mean, width, color=COLORS[name], label=name if j == 0 else None)
            ax.errorbar(x, mean, yerr=yerr, color="black", capsize=2)
ax.set(
    xticks=range(len(LINK_RATES)),
    xticklabels=list(LINK_RATES),
    ylabel="modelled seconds to the target",
    title="model: time to DDP's loss at two thirds of its run (none: not reached)",
)
if ax.patches:
    ax.set_yscale("log")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Saved data
# Every run's summary and curves, with the provenance (commit, command, versions, CPU), in `<OUT>/results.json`.

# %%
saved = {
    "provenance": record,
    "steps": STEPS,
    "seeds": list(SEEDS),
    "unigram": {"loss": data.unigram_entropy, "bpc": data.unigram_bits},
    "target_loss": TARGET,
    "runs": {
        name: {
            "summary": run.summary,
            "probe_loss_by_tokens": run.probe_loss_curve(x="tokens"),
            "probe_loss_by_time": run.probe_loss_curve(x="time"),
        }
        for name, run in runs.items()
    },
}
Path(OUT).mkdir(parents=True, exist_ok=True)
Path(OUT, "results.json").write_text(json.dumps(saved, indent=1))
print(f"saved: {Path(OUT, 'results.json')}")
