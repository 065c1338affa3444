"""The outer optimizer's sweep on the language model: DiLoCo's outer lr x momentum at several periods H, against DDP.

Every point of the grid ``--every`` x ``--lr`` x ``--momentum`` trains ``--case`` (default ``periodic:diloco/8``,
its period set by ``strategy.sync_every=H``) with an outer SGD of that lr and momentum (``strategy.outer_optimizer.lr``,
and Nesterov momentum whenever it is not 0) through the main job,
:func:`lightning_sync.apps.compare.main`, once per seed; ``--ddp`` adds the reference, the ``ddp`` case, on the same
seeds. Outer lr 1 with momentum 0 is plain parameter averaging (local SGD).

Each (point, seed) is one main-job run folder under ``--runs`` (its own ``results.json``, with the main job's
command); a run whose folder already holds a result is not run again, so the grid can be pruned and extended by
later commands. The sweep's file, ``<out>/sweep.json``, keeps every point ever run into it with each seed's test
loss, the mean and range, the loss relative to DDP's mean and the verdict (``tie``: mean within 2% of DDP's and the
ranges overlap), the main job's command of each run, and every sweep command in ``commands`` (run them in order to
reproduce it); ``<out>/outer_sweep.md`` is its table and ``<out>/outer_sweep.provenance.json`` its provenance, which
``make docs-gen`` (``tools/gen_docs.py``) puts on the results page.

    python benchmarks/outer_sweep.py --ddp                                  # the whole grid, 300 steps, seeds 0,1,2
    python benchmarks/outer_sweep.py --every 16 --lr 1.0 --momentum 0 --steps 1000 --out benchmarks/results/outer_sweep_1000
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from lightning_sync.apps import compare
from lightning_sync.apps.markdown import markdown_table
from lightning_sync.apps.provenance import provenance
from lightning_sync.apps.stats import TIE_PERCENT, Spread, spread, versus_reference


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", default="8,16", help="comma-separated periods H (strategy.sync_every)")
    parser.add_argument("--lr", default="0.3,0.5,0.7,1.0", help="comma-separated outer learning rates")
    parser.add_argument("--momentum", default="0,0.5,0.9", help="comma-separated outer momenta (Nesterov if > 0)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--case", default="periodic:diloco/8", help="the main job's case the grid sets knobs of")
    parser.add_argument("--ddp", action="store_true", help="also run the ddp reference on the same seeds")
    parser.add_argument("--no-grid", action="store_true", help="run no grid point (only --ddp, or just re-render)")
    parser.add_argument("--out", default="benchmarks/results/outer_sweep_300", help="the sweep's results folder")
    parser.add_argument("--runs", default="outputs/outer_sweep", help="folder of the main job's run folders")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. model.n_layer=4)")
    return parser


def _key(every: int, lr: float, momentum: float) -> str:
    return f"H{every} lr{lr:g} m{momentum:g}"


def run_case(argv: list[str], folder: Path) -> float | None:
    """One main-job run (one case, one seed) into ``folder``, unless it holds a result already: its test loss."""
    found = folder / "results.json"
    if not found.exists():
        compare.main([*argv, "--out", str(folder)])
    block = json.loads(found.read_text())["workloads"]["char_lm"]
    (row,) = block["rows"]
    return row["values"][0]


def seed_point(values: dict[str, float | None], **about: Any) -> dict[str, Any]:
    """A point of a sweep: ``about``, each seed's value, and their mean, min and max (``None`` if none finished)."""
    found = spread(list(values.values()))
    return {
        **about,
        "values": values,
        "mean": None if found is None else found.mean,
        "min": None if found is None else found.low,
        "max": None if found is None else found.high,
    }


def _judge(points: dict[str, dict[str, Any]], ddp: dict[str, Any] | None) -> None:
    """Adds ``vs_ddp_percent`` and ``vs_ddp`` (``tie``/``better``/``worse``/``-``) to every point."""
    for point in points.values():
        if ddp is None or ddp["mean"] is None or point["mean"] is None:
            point["vs_ddp_percent"], point["vs_ddp"] = None, "-"
            continue
        point["vs_ddp_percent"], point["vs_ddp"] = versus_reference(Spread.of_row(point), Spread.of_row(ddp))


def format_sweep(results: dict[str, Any]) -> str:
    """The sweep's table: one row per point (by H, momentum, lr), DDP first, test loss mean [min, max] over seeds."""
    ddp = results.get("ddp")
    rows = []
    if ddp is not None and ddp["mean"] is not None:
        seeds = len([v for v in ddp["values"].values() if v is not None])
        rows.append(
            ("ddp", "-", "-", "-", f"{ddp['mean']:.3f} [{ddp['min']:.3f}, {ddp['max']:.3f}]", "-", "reference", seeds)
        )
    order = sorted(results["points"].values(), key=lambda p: (p["every"], p["outer_momentum"], p["outer_lr"]))
    for p in order:
        done = [v for v in p["values"].values() if v is not None]
        loss = "diverged" if p["mean"] is None else f"{p['mean']:.3f} [{p['min']:.3f}, {p['max']:.3f}]"
        percent = "-" if p.get("vs_ddp_percent") is None else f"{p['vs_ddp_percent']:+.1f}%"
        momentum = f"{p['outer_momentum']:g}" + (" (Nesterov)" if p["outer_momentum"] > 0 else "")
        rows.append(
            (
                p["case"].rsplit("/", 1)[0],
                p["every"],
                f"{p['outer_lr']:g}",
                momentum,
                loss,
                percent,
                p["vs_ddp"],
                len(done),
            )
        )
    header = (
        "case",
        "H",
        "outer lr",
        "outer momentum",
        "test loss nats/char mean [min, max]",
        "vs ddp",
        "verdict",
        "seeds",
    )
    return markdown_table(header, rows, align="lrrrrrlr")


def _title(results: dict[str, Any]) -> str:
    extra = f" ({' '.join(results['overrides'])})" if results["overrides"] else ""
    return f"Outer optimizer sweep: DiLoCo on char_lm, {results['steps']} steps{extra}"


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    out, runs = Path(args.out), Path(args.runs) / f"{args.steps}_steps"
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    previous = out / "sweep.json"
    results: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    if results and (results["steps"], results["overrides"]) != (args.steps, args.overrides):
        sys.exit(f"error: {previous} has steps={results['steps']} overrides={results['overrides']}; use another --out")
    results.setdefault("points", {})
    base = ["--workloads", "char_lm", "--steps", str(args.steps)]
    tag = "_".join(o.replace("=", "").replace(".", "") for o in args.overrides) or "default"
    jobs: list[tuple[str, list[str], dict[str, Any]]] = []
    if args.ddp:
        jobs.append(("ddp", ["--cases", "ddp", *args.overrides], {"case": "ddp"}))
    grid = [] if args.no_grid else [(h, lr, m) for h in map(int, _floats(args.every)) for m in _floats(args.momentum)
                                    for lr in _floats(args.lr)]  # fmt: skip
    for every, lr, momentum in grid:
        knobs = [f"strategy.sync_every={every}", f"strategy.outer_optimizer.lr={lr:g}"]
        if momentum:  # the schema's outer SGD has no momentum argument: add it, with Nesterov
            knobs += [f"+strategy.outer_optimizer.momentum={momentum:g}", "+strategy.outer_optimizer.nesterov=true"]
        about = {"case": args.case, "every": every, "outer_lr": lr, "outer_momentum": momentum}
        jobs.append((_key(every, lr, momentum), ["--cases", args.case, *args.overrides, *knobs], about))
    for seed in seeds:  # seed by seed, so that a pruned sweep has every point's first seeds first
        for key, case_argv, about in jobs:
            folder = runs / tag / key.replace(" ", "_") / f"seed{seed}"
            value = run_case([*base, "--seeds", str(seed), *case_argv], folder)
            target = results.setdefault("ddp", None) if key == "ddp" else results["points"].get(key)
            values = {**(target or {}).get("values", {}), str(seed): value}
            command = shlex.join(["python", "-m", "lightning_sync.compare", *base, "--seeds", "SEED", *case_argv])
            point = seed_point(dict(sorted(values.items())), **about, compare_command=command)
            if key == "ddp":
                results["ddp"] = point
            else:
                results["points"][key] = point
            _judge(results["points"], results.get("ddp"))
            results.update(steps=args.steps, overrides=args.overrides, tie_percent=TIE_PERCENT)
            results["provenance"] = provenance()
            out.mkdir(parents=True, exist_ok=True)
            previous.write_text(json.dumps(results, indent=2))
    commands = results.setdefault("commands", [])
    command = provenance()["command"]
    if jobs and command not in commands:  # --no-grid alone re-renders the table
        commands.append(command)
    previous.write_text(json.dumps(results, indent=2))
    text = format_sweep(results)
    (out / "outer_sweep.md").write_text(text + "\n")
    note = (
        f"Test loss after {results['steps']} steps, mean [min, max] over the seeds run; `vs ddp`: the mean's "
        f"difference from DDP's; `tie`: within {TIE_PERCENT:g}% of it and the ranges overlap. The case's period is "
        "set by `strategy.sync_every=H`; a momentum above 0 is Nesterov's. Each point's main-job command is in "
        "`sweep.json`; the provenance above is the last command's (the runs are deterministic: a point rerun at a "
        "later commit gives the same loss to the last digit)."
    )
    record = {**results["provenance"], "command": " && ".join(commands), "title": _title(results), "note": note}
    (out / "outer_sweep.provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
