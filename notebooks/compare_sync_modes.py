# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Comparing the sync modes
#
# Every mode trains the same digits classifier on 2 CPU ranks (gloo), with the same seed and epochs. We compare
# test accuracy, step time and the bytes each rank sends per optimizer step, as counted by lightning_sync's
# communication meter. A second section compares the three ways the `allreduce` mode can bucket gradients on a
# latency-bound model (40 layers, 82 small tensors).
#
# Set `SMOKE = True` (or the environment variable `SMOKE=1`) to run every case for a few steps only.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SMOKE = os.environ.get("SMOKE", "0") == "1"
EPOCHS = 1 if SMOKE else 30
OUT = os.environ.get("NOTEBOOK_OUT", "outputs/notebook")

# %%
import csv
import warnings
from pathlib import Path

from lightning_sync.compare import available_cases, case_dir_name, format_table, run_case

warnings.filterwarnings("ignore")
smoke_overrides = ["+trainer.limit_train_batches=4", "+trainer.limit_val_batches=1"] if SMOKE else []
common = ["strategy.start_method=fork", f"trainer.max_epochs={EPOCHS}", *smoke_overrides]

# %% [markdown]
# ## 1. All modes on the digits classifier

# %%
rows = []
for name, overrides in available_cases().items():
    run_dir = Path(OUT, "digits", case_dir_name(name))
    rows.append({"mode": name, "run_dir": str(run_dir), **run_case(overrides + common, run_dir)})
print(format_table(rows))

# %% [markdown]
# ### Training loss per mode
# Each run folder has `metrics.csv`, with `train/loss_step` and the `comm/*` metrics for every optimizer step.


# %%
def loss_curve(run_dir: str) -> list[float]:
    with open(Path(run_dir, "metrics.csv")) as f:
        return [float(r["train/loss_step"]) for r in csv.DictReader(f) if r.get("train/loss_step")]


curves = {r["mode"]: loss_curve(r["run_dir"]) for r in rows}
for mode, curve in curves.items():
    tail = curve[-10:] or [float("nan")]
    print(f"{mode:<24} steps={len(curve):>4}  first loss={curve[0]:.3f}  mean of last 10={sum(tail) / len(tail):.3f}")

# %%
try:
    import matplotlib.pyplot as plt
except ImportError:  # matplotlib is optional
    plt = None
if plt is not None:
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, curve in curves.items():
        ax.plot(curve, label=mode, linewidth=0.8)
    ax.set(xlabel="optimizer step", ylabel="train loss", yscale="log")
    ax.legend(fontsize=7)

# %% [markdown]
# ## 2. Bucketing on a latency-bound model
# `naive` is the textbook loop (one blocking all-reduce per parameter), `flat` packs all gradients into one buffer
# after backward, `overlap` launches buckets during backward, and `auto` (the default) times launching overlap's
# buckets during and after backward on the first steps, then keeps the faster. For a careful, alternating
# measurement against torch DDP and the compute-only floor, run `python benchmarks/step_time.py`.

# %%
bucket_rows = []
for bucketing in ("naive", "flat", "overlap", "auto"):
    overrides = ["experiment=latency_bound", "strategy=allreduce", f"strategy.bucketing={bucketing}",
                 "strategy.start_method=fork", "+trainer.limit_train_batches=" + ("4" if SMOKE else "40"),
                 "trainer.max_epochs=1", "test=false"]
    summary = run_case(overrides, Path(OUT, "bucketing", bucketing))
    bucket_rows.append((bucketing, summary["step_time_ms"], summary["calls_per_step"], summary.get("launch_point")))
for bucketing, ms, calls, launch in bucket_rows:
    print(f"{bucketing:<8} {ms:8.2f} ms/step  {calls:6.1f} collectives/step  buckets launched {launch}")
