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
# # The parameter server under a straggler
#
# `strategy=ps` trains with parameter servers: the Lightning ranks are workers that push gradients, and servers
# hold the parameters and the optimizer. Its `mode` decides who waits for whom:
#
# - `sync`: each step every server averages one gradient per worker, steps once, and every worker pulls (= DDP);
# - `async`: each push is applied as it arrives, and its worker gets the fresh parameters back at once;
# - `ssp` (stale synchronous parallel, here `max_staleness=2`): as async, but no worker gets more than 2 steps ahead
#   of the slowest.
#
# Three workers train the digits classifier; worker 2 is made 3x slower (`strategy.slow_worker=2
# strategy.slowdown=3`: after each push it sleeps twice what its whole step took). Every mode gets the same sample
# budget. Each worker records every push (time, server version, staleness, server ingress) and worker 0 probes the
# validation accuracy every quarter second (`lightning_sync.apps.ps_study`). Every case runs over 3 seeds (a seed
# sets the initial weights and the data order), seed by seed: tables give each figure as the mean and the range
# [min, max] over the seeds, and a mode whose range overlaps sync's is a tie with it; curves are the mean with the
# seeds' range as a band. We look at (a) throughput and accuracy against wall time, (b) the staleness of the
# updates, and (c) how many bytes each server receives per update with one and with two servers. For a careful,
# alternating and repeated measurement run `python benchmarks/ps_straggler.py`.
#
# Set the environment variable `SMOKE=1` to run the cases for a few steps only (one server in (c)), with one
# seed; `NOTEBOOK_OUT` names the output folder.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 20
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook_ps")
SEEDS = (0,) if SMOKE else (0, 1, 2)
SMALL = ["++trainer.limit_train_batches=4"] if SMOKE else []

# %%
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from lightning_sync.apps.markdown import band_cell
from lightning_sync.apps.ps_study import format_seed_table, ps_overrides, run_ps, staleness_histogram, summarize
from lightning_sync.apps.stats import seed_band
from lightning_sync.apps.study import by_case, seed_cases

MODES = ("sync", "async", "ssp:2")
COLORS = {"sync": "tab:blue", "async": "tab:orange", "ssp:2": "tab:green"}

# %% [markdown]
# ## (a) sync, async and ssp with one straggler
# Throughput counts the samples behind the servers' updates (sync: 3 batches per update, async/ssp: one), per
# second of training: start-up (forking the ranks, starting the server, the first pull), the first 10% of the
# updates and the final test are left out. `vs sync` compares the samples/s, `acc vs sync` the test accuracy.

# %%
cases = {spec: ps_overrides(spec, workers=3, slow_worker=2, slowdown=3.0, epochs=EPOCHS, extra=SMALL) for spec in MODES}
seeded = {
    name: run_ps(name, overrides, Path(OUT, "straggler", name.replace(":", "_").replace(" ", "_")), probe_every_s=0.25)
    for name, overrides in seed_cases(cases, SEEDS).items()
}
runs = by_case(seeded)
print(f"3 workers (worker 2 3x slower), {EPOCHS} epoch(s){' (SMOKE: 4 batches)' if SMOKE else ''}, seeds {SEEDS}")
print(format_seed_table(summarize(runs)))
for spec, group in runs.items():
    rates = [r.worker_push_rates() for r in group]
    cells = ", ".join(band_cell([rate[w] for rate in rates], ".1f") for w in range(3))
    print(
        f"{spec:<6} pushes/s of workers 0, 1, 2: {cells}   updates {band_cell([r.updates for r in group], '.0f')}"
        f"   whole run {band_cell([r.wall_s for r in group], '.1f')} s"
    )

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
for spec, group in runs.items():
    for ax, curve in zip(axes, ("samples_curve", "accuracy_curve")):
        grid, mean, low, high = seed_band([getattr(r, curve)() for r in group])
        ax.plot(grid, mean, label=spec, color=COLORS[spec])
        ax.fill_between(grid, low, high, color=COLORS[spec], alpha=0.2)
axes[0].set(
    xlabel="wall time since the first batch (s)",
    ylabel="samples applied by the servers",
    title="training progress (slope = throughput)",
)
axes[1].set(
    xlabel="wall time since the first batch (s)",
    ylabel="validation accuracy (worker 0)",
    title="accuracy against wall time",
    ylim=(0, 1),
)
width = 0.25
for i, (spec, group) in enumerate(runs.items()):
    per_worker = list(zip(*(r.worker_push_rates() for r in group)))
    means = [sum(w) / len(w) for w in per_worker]
    errors = [[m - min(w) for m, w in zip(means, per_worker)], [max(w) - m for m, w in zip(means, per_worker)]]
    positions = [w + (i - 1) * width for w in range(len(means))]
    axes[2].bar(positions, means, width, label=spec, color=COLORS[spec])
    axes[2].errorbar(positions, means, yerr=errors, fmt="none", color="black", capsize=2)
axes[2].set(
    xticks=range(3),
    xticklabels=["worker 0", "worker 1", "worker 2 (3x slower)"],
    ylabel="pushes per second (mean, bar: range)",
    title="each worker's pace",
)
axes[0].legend()
axes[1].legend(loc="lower right")
axes[2].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# In sync the three workers push at one pace, the straggler's. In async the fast workers keep their own pace and
# the straggler falls behind; its pushes are the stale ones (b). ssp ties the fast workers to the straggler again,
# up to a lead of 2 steps: under a straggler that is slow all the time its pace is the straggler's, so in theory it
# gains nothing over sync (ssp is for stragglers that come and go). Measured, ssp can still come out ahead of sync
# (the table's `vs sync` says whether it does beyond the seeds' range), as the straggler itself may run faster in
# ssp than in sync: between batches a sync worker also waits in Lightning's collectives (the SIGTERM-flag broadcast
# every batch, the divergence guard's exchange every 10), where async/ssp workers, each a world of
# its own, wait for no one.
#
# How much slower is the straggler? `strategy.slowdown=3` sleeps after each push twice what its whole step took, so
# it pushes about 3x less often than a fast worker in async. The three workers and the server process share 2
# cores, so async's fast workers slow each other down. On a shared machine a run's pace varies by tens of percent
# from run to run: read the `vs sync` verdicts, where a difference inside the seeds' ranges is a tie;
# `benchmarks/ps_straggler.py` alternates the modes and repeats them. Every mode sees the same samples: compare the
# accuracies at the same wall time, and at the end.

# %% [markdown]
# ## (b) Staleness of the updates
# A push's staleness is the server version when it is applied minus the version its gradient was computed on (0 in
# sync). Each bar is split by worker, and counts the pushes of all seeds: the straggler's pushes are the stale
# ones.

# %%
stale_modes = [spec for spec in MODES if spec != "sync"]
fig, axes = plt.subplots(1, len(stale_modes), figsize=(12, 4), sharey=True)
for ax, spec in zip(axes, stale_modes):
    hist = staleness_histogram(runs[spec])
    values = list(hist)
    bottom = [0] * len(values)
    for rank, color in zip(range(3), ("tab:gray", "tab:olive", "tab:red")):
        counts = [hist[v][rank] for v in values]
        ax.bar(values, counts, bottom=bottom, color=color, label=f"worker {rank}" + (" (slow)" if rank == 2 else ""))
        bottom = [b + c for b, c in zip(bottom, counts)]
    pushes = [s for run in runs[spec] for worker in run.staleness() for s in worker]
    ax.set(
        xlabel="staleness (server updates)",
        title=f"{spec}: mean {sum(pushes) / len(pushes):.2f}, max {max(pushes)} over {len(pushes)} pushes "
        f"({len(runs[spec])} seed(s))",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
axes[0].set_ylabel("pushes")
fig.tight_layout()
plt.show()
for spec in stale_modes:
    print(f"{spec:<6} staleness histogram {{value: [pushes of worker 0, 1, 2]}}: {staleness_histogram(runs[spec])}")

# %% [markdown]
# ## (c) Server ingress with one and with two servers
# In sync mode every update is one push of each worker's gradient, so the servers receive about W x (model bytes)
# per update, plus a small header and the learning rates per push. With two servers the parameters are sharded by
# bytes, whole tensors per server, so each receives its shard's share: about half, as evenly as whole tensors allow
# (the 128 x 128 hidden weight alone is 63% of the model's bytes, which sets the split). No straggler here: bytes
# per update do not depend on pace. Each case runs over the same 3 seeds; the figures are the mean and range.

# %%
ingress_cases = {
    f"{servers} server(s)": ps_overrides(
        "sync", workers=3, slow_worker=-1, num_servers=servers, max_steps=8 if SMOKE else 60, extra=["test=false"]
    )
    for servers in ((1,) if SMOKE else (1, 2))  # SMOKE: two servers are tests/test_ps_strategy.py's
}
ingress = by_case(
    {
        name: run_ps(name, overrides, Path(OUT, "ingress", name.replace(" ", "_").replace("(", "").replace(")", "")))
        for name, overrides in seed_cases(ingress_cases, SEEDS).items()
    }
)
first = ingress["1 server(s)"][0]
model_bytes = first.model_bytes
expected = first.num_workers * model_bytes
for name, group in ingress.items():
    per_run = [r.ingress_per_update() for r in group]
    cells = ", ".join(f"server {i}: {band_cell([p[i] for p in per_run], ',.0f')}" for i in range(len(per_run[0])))
    print(
        f"{name}: bytes received per update {cells}; total {band_cell([sum(p) for p in per_run], ',.0f')} "
        f"= {band_cell([sum(p) / expected for p in per_run], '.4f')} x W x model bytes "
        f"({expected:,} = 3 x {model_bytes:,})"
    )

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for x, group in enumerate(ingress.values()):
    per_server = [sum(p) / len(group) for p in zip(*(r.ingress_per_update() for r in group))]
    servers = len(per_server)
    bottom = 0.0
    for i, nbytes in enumerate(per_server):
        ax.bar(
            x,
            nbytes / 1e3,
            bottom=bottom / 1e3,
            color=("tab:blue", "tab:cyan")[i],
            edgecolor="white",
            label=f"server {i}" if servers == 2 else None,
        )
        ax.text(x, (bottom + nbytes / 2) / 1e3, f"server {i}\n{nbytes / 1e3:,.1f} kB", ha="center", va="center")
        bottom += nbytes
ax.axhline(expected / 1e3, color="black", linestyle="--", label="W x model bytes")
ax.axhline(expected / 2e3, color="gray", linestyle=":", label="half of it")
ax.set(
    xticks=range(len(ingress)),
    xticklabels=list(ingress),
    ylabel="kB received per update (mean of the seeds)",
    title="sync: server ingress per update, 3 workers",
)
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()
