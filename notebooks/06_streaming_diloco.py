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
# # Streaming DiLoCo: fragments, overlapped outer syncs, 4-bit outer gradients
#
# DiLoCo (`strategy=periodic strategy.mode=diloco`) lets each rank take `sync_every` steps with its own AdamW, then
# all-reduces the pseudo-gradients (how far each replica moved) and applies an outer Nesterov SGD. Streaming DiLoCo
# (Douillard et al. 2025) adds three knobs, all in the same strategy:
#
# * `fragments=k`: the layers are dealt round-robin into k fragments, and one fragment syncs every `sync_every/k`
#   steps, so one transfer carries about 1/k of the model;
# * `sync_delay=τ`: a fragment's all-reduce runs in a background thread during the next τ inner steps, and
#   `fragment_alpha=α` mixes the result with what the rank learned meanwhile (`α·local + (1-α)·global`);
# * `outer_compression=int8|int4`: the pseudo-gradients travel as block-scaled integers (reduce-scatter, sum in
#   fp32, all-gather).
#
# This notebook trains the language model (`experiment=char_lm`, CharGPT, 418k parameters) on 2 CPU ranks with DDP,
# plain DiLoCo and streaming variants over 3 seeds, and plots validation loss against characters for each knob:
# fp32/int8/int4, k=1/4 and τ=0/1/2. Then (c) reads the compute utilization measured by the benchmark on emulated
# 10 Mbit, 100 Mbit and 1 Gbit links (the paper's Table 4), and (d) the main job's bytes against loss for DiLoCo in
# fp32 and int8, streaming DiLoCo in int4 and the SparseLoCo outer codec.
#
# Set the environment variable `SMOKE=1` to run every case for a few steps with one seed; `NOTEBOOK_OUT` names the
# output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
STEPS = 12 if SMOKE else 300
SYNC_EVERY = 12 if SMOKE else 16  # each fragment's period; with k=4 a fragment syncs every SYNC_EVERY/4 steps
SEEDS = (0,) if SMOKE else (0, 1, 2)
PROBE_EVERY = 3 if SMOKE else 20  # rank 0's validation probes, in batches
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_streaming_diloco")

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

from lightning_sync.apps.bench.report import utilization_rows
from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.provenance import provenance, summary_line
from lightning_sync.apps.stats import seed_band
from lightning_sync.apps.study import by_case, load_bench_rows, run_cases, seed_cases
from lightning_sync.examples.data import TextDataModule

# the checkout's benchmark results (a notebook runs in notebooks/; a script knows its own path)
RESULTS = Path(globals().get("__file__", "notebook")).resolve().parent.parent / "benchmarks" / "results"

data = TextDataModule()
print(f"unigram baseline: {data.unigram_entropy:.3f} nats/char")

# %% [markdown]
# ## The runs
# Every case trains the same steps from the same seeds. The streaming cases use `fragment_alpha=0.5` whenever
# `sync_delay > 0` (the paper's choice), and 0 otherwise. The outer optimizer is the strategy's default, SGD with
# lr 0.7 and no momentum: over runs of tens of outer steps, the DiLoCo paper's Nesterov momentum 0.9 costs DiLoCo
# more loss than any of the three knobs do (the results page's "Outer optimizer sweep").


# %%
def diloco(fragments=1, delay=0, compression="none"):
    """Overrides of one DiLoCo case on the language model."""
    return [
        "strategy=periodic",
        "strategy.mode=diloco",
        f"strategy.sync_every={SYNC_EVERY}",
        f"strategy.fragments={fragments}",
        f"strategy.sync_delay={delay}",
        f"strategy.fragment_alpha={0.5 if delay else 0.0}",
        f"strategy.outer_compression={compression}",
    ]


CASES = {
    "ddp": ["strategy=ddp"],
    "diloco (k=1, τ=0, fp32)": diloco(),
    "k=4, τ=1, fp32": diloco(4, 1),
    "k=4, τ=1, int8": diloco(4, 1, "int8"),
    "k=4, τ=1, int4": diloco(4, 1, "int4"),
    "k=1, τ=0, int4": diloco(1, 0, "int4"),
    "k=4, τ=0, int4": diloco(4, 0, "int4"),
    "k=4, τ=2, int4": diloco(4, 2, "int4"),
}
FAMILIES = {
    "outer compression (k=4, τ=1)": ["k=4, τ=1, fp32", "k=4, τ=1, int8", "k=4, τ=1, int4"],
    "fragments (τ=0, int4)": ["k=1, τ=0, int4", "k=4, τ=0, int4"],
    "sync delay (k=4, int4)": ["k=4, τ=0, int4", "k=4, τ=1, int4", "k=4, τ=2, int4"],
}
COLORS = dict(zip(CASES, plt.get_cmap("tab10").colors))
common = [
    "experiment=char_lm",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    *(["data.val_windows=8"] if SMOKE else []),
]
runs = run_cases(seed_cases(CASES, SEEDS), Path(OUT, "runs"), common=common, probe_every_batches=PROBE_EVERY)
groups = by_case(runs)
record = provenance()
print(f"CharGPT, 2 CPU ranks, {STEPS} steps, seeds {', '.join(map(str, SEEDS))}{' (SMOKE)' if SMOKE else ''}")
print(summary_line(record) + f"; load average {record['load_average']}")

ddp_loss = sum(r.test_loss for r in groups["ddp"]) / len(groups["ddp"])
print(
    markdown_table(
        ("case", "test loss nats/char mean [min, max]", "vs ddp (mean)", "meter bytes/step", "bytes vs ddp"),
        [
            (
                name,
                band_cell([r.test_loss for r in group]),
                format_cell(sum(r.test_loss for r in group) / len(group) / ddp_loss, ".3f", "x"),
                format_cell(group[0].bytes_sent_per_step, ",.0f"),
                format_cell(groups["ddp"][0].bytes_sent_per_step / group[0].bytes_sent_per_step, ".1f", "x fewer")
                if group[0].bytes_sent_per_step
                else "-",
            )
            for name, group in groups.items()
        ],
    )
)

# %% [markdown]
# ## (a) Validation loss against characters, one knob at a time
# Rank 0's probes: the validation loss of the parameters rank 0 holds (between syncs, its own replica), every few
# batches; characters are those both ranks trained on together. The line is the mean of the seeds, the band their
# range. DDP and plain DiLoCo are drawn in every panel as references.

# %%
fig, axes = plt.subplots(1, len(FAMILIES), figsize=(18, 5), sharey=True)
for ax, (title, members) in zip(axes, FAMILIES.items()):
    for name in ["ddp", "diloco (k=1, τ=0, fp32)", *members]:
        grid, mean, low, high = seed_band([r.probe_loss_curve(x="tokens") for r in groups[name]])
        ax.plot(grid, mean, color=COLORS[name], label=name, linestyle="--" if name in ("ddp",) else "-")
        ax.fill_between(grid, low, high, color=COLORS[name], alpha=0.15)
    ax.axhline(data.unigram_entropy, color="gray", linestyle=":", label="unigram baseline")
    ax.set(xlabel="characters trained on (both ranks)", title=title)
    ax.legend(fontsize=8)
axes[0].set_ylabel("validation loss (nats/char)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (b) Bytes per step
# What the meter books per rank per optimizer step: DDP's ring all-reduce of the fp32 gradients, and for DiLoCo
# the outer syncs spread over the steps (quantized payload and its scales included).

# %%
fig, ax = plt.subplots(figsize=(11, 4))
names = list(groups)
ax.bar(range(len(names)), [(groups[n][0].bytes_sent_per_step or 0) / 1e3 for n in names],
       color=[COLORS[n] for n in names])  # fmt: skip
ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
ax.set(ylabel="kB per rank per step", yscale="log", title="bytes per step (meter)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## (c) Compute utilization on emulated links (the paper's Table 4)
# From the benchmark (`python -m lightning_sync.bench workloads=char_lm network.rate=...`, root only): two network
# namespaces joined by a rate-limited veth pair, one rank in each. Compute utilization is the `floor` case's
# milliseconds per step (2 ranks that never communicate) over the case's: 100% means communication costs nothing.
# `diloco` syncs the whole model every 16 steps; `streaming_diloco` runs with 4 fragments, τ=2, α=0.5 and int4.

# %%
bench = load_bench_rows("char_lm", RESULTS)
table = utilization_rows(bench, cases=("lightning_ddp", "diloco", "streaming_diloco"))
if table:
    rates = list(table[0]["by_rate"])
    print(
        markdown_table(
            ("case", *(f"utilization {rate}" for rate in rates)),
            [(row["case"], *(format_cell(row["by_rate"][rate], ".0%") for rate in rates)) for row in table],
        )
    )
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(table)
    for i, row in enumerate(table):
        xs = [j + (i - (len(table) - 1) / 2) * width for j in range(len(rates))]
        ax.bar(xs, [100 * (row["by_rate"][r] or 0) for r in rates], width, label=row["case"])
    ax.set_xticks(range(len(rates)), rates)
    ax.set(ylabel="compute utilization (%)", ylim=(0, 105), title="floor ms/step over the case's ms/step")
    ax.legend()
    fig.tight_layout()
    plt.show()
else:
    print("no char_lm results of the benchmark under benchmarks/results (emulated links need root)")

# %% [markdown]
# ## (d) Bytes against loss: fp32, int8, int4 and SparseLoCo
# From the main job's SparseLoCo runs (`python -m lightning_sync.compare --workloads char_lm --steps 1000 --cases
# ...`, the cases `periodic:sparseloco*/<H>` of `lightning_sync.apps.cases`, 3 seeds): each case's test loss after
# 1000 steps (mean, bar: min to max over the seeds) against the bytes the meter books per rank per step, one panel per
# sync period H. DiLoCo sends fp32 pseudo-gradients (or int8 ones: `periodic:diloco_int8/<H>`, one run for every H in
# `diloco_int8_1000_steps`), streaming DiLoCo int4 ones in 4 fragments; SparseLoCo keeps the top 64 (or 256) of every
# 4,096 entries of its error-feedback buffer, in 2 bits (or fp32 values), with an outer SGD at lr 1. `ddp` is drawn as
# a reference where the run has it.

# %%
sparse_runs = {h: RESULTS / f"sparseloco_h{h}_1000_steps" / "results.json" for h in (8, 16, 30)}
sparse_runs = {h: json.loads(path.read_text()) for h, path in sparse_runs.items() if path.exists()}
int8_run = RESULTS / "diloco_int8_1000_steps" / "results.json"  # DiLoCo with int8 payloads, every H in one run
int8_rows = json.loads(int8_run.read_text())["workloads"]["char_lm"]["rows"] if int8_run.exists() else []
if sparse_runs:
    fig, axes = plt.subplots(1, len(sparse_runs), figsize=(6 * len(sparse_runs), 4.5), squeeze=False)
    for ax, (h, run) in zip(axes[0], sparse_runs.items()):
        same_h = [row for row in int8_rows if row["case"].endswith(f"/{h}")]
        for row in run["workloads"]["char_lm"]["rows"] + same_h:
            x = row["meter_bytes_sent_per_step"]
            ax.errorbar(x, row["mean"], yerr=[[row["mean"] - row["min"]], [row["max"] - row["mean"]]], fmt="o",
                        capsize=3, label=f"{row['case']} ({x:,.0f} B)")  # fmt: skip
        ax.set(xscale="log", xlabel="bytes per rank per step (meter)", ylabel="test loss (nats/char)",
               title=f"H = {h}, {run['sizes']['steps']} steps, seeds {run['seeds']}")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
else:
    print("no SparseLoCo compare results under benchmarks/results")

# %% [markdown]
# ## Saved data
# Every run's summary and probe curve, with the provenance (commit, command, versions, CPU), in `<OUT>/results.json`.

# %%
saved = {
    "provenance": record,
    "steps": STEPS,
    "sync_every": SYNC_EVERY,
    "seeds": list(SEEDS),
    "runs": {
        name: {"summary": run.summary, "probe_loss_by_tokens": run.probe_loss_curve(x="tokens")}
        for name, run in runs.items()
    },
    "utilization": table,
    "sparseloco_runs": {h: run["workloads"]["char_lm"]["rows"] for h, run in sparse_runs.items()},
    "int8_runs": int8_rows,
}
Path(OUT).mkdir(parents=True, exist_ok=True)
Path(OUT, "results.json").write_text(json.dumps(saved, indent=1))
print(f"saved: {Path(OUT, 'results.json')}")
