"""The language model's learning rate: DDP on char_lm at several AdamW learning rates, at two lengths, over seeds.

Every (``model.lr``, length, seed) trains the main job's ``ddp`` case (:func:`lightning_sync.apps.compare.main`,
``--workloads char_lm --steps N``) once; its test loss is the point's value for that seed. A run whose folder under
``--runs`` already holds a result is not run again. ``<out>/lr_sweep.json`` keeps every point with each seed's test
loss, the mean and range and the main job's command; ``<out>/lr_sweep.md`` is its table (the lowest mean at each
length marked ``best``) and ``<out>/lr_sweep.provenance.json`` its provenance, which ``make docs-gen``
(``tools/gen_docs.py``) puts on the results page. The model's ``lr`` default (``conf/model/char_gpt.yaml``) is chosen
from it: every comparison on char_lm runs at that learning rate.

    python benchmarks/lr_sweep.py                                   # lr 1e-3,1.5e-3,2e-3,3e-3 x 300,1000 steps x seeds 0,1,2
    python benchmarks/lr_sweep.py --lr 7.5e-4 --steps 300           # one more point, merged into the same table
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from outer_sweep import run_case, seed_point

from lightning_sync.apps.markdown import markdown_table
from lightning_sync.apps.provenance import provenance


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", default="1e-3,1.5e-3,2e-3,3e-3", help="comma-separated learning rates (model.lr)")
    parser.add_argument("--steps", default="300,1000", help="comma-separated run lengths, in optimizer steps")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--out", default="benchmarks/results/char_lm_lr_sweep", help="the sweep's results folder")
    parser.add_argument("--runs", default="outputs/lr_sweep", help="folder of the main job's run folders")
    return parser


def format_sweep(results: dict[str, Any]) -> str:
    """One row per learning rate, one column per length: test loss mean [min, max] over the seeds (seeds run)."""
    lengths = sorted({p["steps"] for p in results["points"].values()})
    rates = sorted({p["lr"] for p in results["points"].values()})
    best = {}
    for steps in lengths:
        finished = [p for p in results["points"].values() if p["steps"] == steps and p["mean"] is not None]
        best[steps] = min(finished, key=lambda p: p["mean"])["lr"] if finished else None
    rows = []
    for lr in rates:
        cells = []
        for steps in lengths:
            p = results["points"].get(_key(lr, steps))
            if p is None:
                cells.append("-")
                continue
            seeds = sum(v is not None for v in p["values"].values())
            text = "diverged" if p["mean"] is None else f"{p['mean']:.3f} [{p['min']:.3f}, {p['max']:.3f}] ({seeds})"
            cells.append(text + (" best" if best[steps] == lr else ""))
        rows.append((f"{lr:g}", *cells))
    header = ("model.lr", *(f"test loss after {s} steps, mean [min, max] (seeds)" for s in lengths))
    return markdown_table(header, rows, align="l" + "r" * len(lengths))


def _key(lr: float, steps: int) -> str:
    return f"lr{lr:g} steps{steps}"


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    out, runs = Path(args.out), Path(args.runs)
    record_file = out / "lr_sweep.json"
    results: dict[str, Any] = json.loads(record_file.read_text()) if record_file.exists() else {"points": {}}
    rates = [float(v) for v in args.lr.split(",") if v.strip()]
    lengths = [int(v) for v in args.steps.split(",") if v.strip()]
    out.mkdir(parents=True, exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",") if s.strip()):  # seed by seed: every point's first seeds first
        for steps in lengths:
            for lr in rates:
                key = _key(lr, steps)
                argv_ = ["--workloads", "char_lm", "--steps", str(steps), "--cases", "ddp", f"model.lr={lr:g}"]
                value = run_case([*argv_, "--seeds", str(seed)], runs / key.replace(" ", "_") / f"seed{seed}")
                values = {**results["points"].get(key, {}).get("values", {}), str(seed): value}
                command = shlex.join(["python", "-m", "lightning_sync.compare", *argv_, "--seeds", "SEED"])
                results["points"][key] = seed_point(dict(sorted(values.items())), lr=lr, steps=steps,
                                                    compare_command=command)  # fmt: skip
                results["provenance"] = provenance()
                record_file.write_text(json.dumps(results, indent=2))
    commands = results.setdefault("commands", [])
    if provenance()["command"] not in commands:
        commands.append(provenance()["command"])
    record_file.write_text(json.dumps(results, indent=2))
    text = format_sweep(results)
    (out / "lr_sweep.md").write_text(text + "\n")
    note = (
        "DDP, 2 ranks, AdamW at a constant learning rate (no warm-up, no decay); test loss in nats per character, "
        "mean [min, max] over the seeds, `best`: the lowest mean at that length. Each point's main-job command is "
        "in `lr_sweep.json`; the provenance above is the last command's."
    )
    title = "Learning rate of the language model: DDP on char_lm"
    record = {**results["provenance"], "command": " && ".join(commands), "title": title, "note": note}
    (out / "lr_sweep.provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
