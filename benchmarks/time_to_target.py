"""Time to a real loss on char_lm at 1 Mbit to 1 Gbit and loopback: trajectories x measured step times.

Runs three kinds of benchmark (``python -m lightning_sync.bench``; the emulated links need root) into
``<out>/parts/<phase>/`` and composes them (:mod:`lightning_sync.apps.bench.time_to_target`):

1. ``trajectories``: every case to the target on loopback, seeds 0, 1, 2. The target of a seed is the validation
   loss Lightning DDP ends ``budget_steps`` with (about 1.5 nats/char, against 3.25 for a unigram model);
2. ``windows_<rate>``: every deterministic case's ms per step over whole sync periods at each rate (``window=N``);
3. ``validation``: every case end to end at ``--validate-rate``, seed 0, beside its composed time.

A phase whose ``results.json`` exists is not run again (``--redo PHASE`` runs it again), so an interrupted run goes
on where it stopped. ``--redo PHASE --case CASE`` runs only that case of the phase again (into
``parts/<phase>/cases/<case>/``, Lightning DDP's records and targets taken from the phase with ``ddp_from``) and puts
its records in place of the case's old ones, the command and provenance listed under the phase's ``merged``.

The composed report goes to ``<out>/time_to_target.json`` and ``.md``, with a ``.provenance.json`` for the results
page (``make docs-gen``), which also writes the "which mode when" table of the README and the docs' front page from
it.

    python benchmarks/time_to_target.py                     # everything, about an hour and a half
    python benchmarks/time_to_target.py --compose-only      # the report from the parts there are
    python benchmarks/time_to_target.py --redo validation --case ps_async   # one case of one phase again
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_sync.apps.bench import time_to_target as ttt
from lightning_sync.apps.markdown import markdown_table
from lightning_sync.apps.provenance import provenance

CASES = ("lightning_ddp", "allreduce", "powersgd", "periodic", "diloco", "diloco_8", "streaming_diloco",
         "streaming_diloco_8", "sparseloco", "sparseloco_k256", "sparseloco_k256_8", "ps_async")  # fmt: skip
"""The cases: Lightning DDP (the reference), each of our modes at its defaults or the benchmark's settings."""
TO_TARGET = ("workloads=char_lm", "budget_steps=1000", "eval_every=16", "max_steps_factor=1.6", "give_up_factor=3")
"""The trajectories' and the validation's knobs: DDP's loss after 1000 steps (scored every 16, at 992) is the
target; a case stops unreached after 1.6x the steps or 3x DDP's time."""
WINDOWS = {"1mbit": (2, 2, 12), "10mbit": (4, 4, 20), "100mbit": (16, 8, 20), "1gbit": (16, 8, 20),
           "loopback": (16, 8, 20)}  # fmt: skip
"""Per rate, the windows' ``(eval_every, window, warmup_steps)``: scoring intervals short and few where a step of
DDP takes seconds (at 1 Mbit 16 s, and just past PowerSGD's 10 uncompressed steps), long where it takes
milliseconds: DDP's window is 4 steps (62 s) at 1 Mbit, 16 steps at 10 Mbit, 128 steps (5 to 23 s) from 100 Mbit."""


def phases(validate_rate: str) -> dict[str, list[str]]:
    """``{phase: bench overrides}`` in the order they run."""
    deterministic = ",".join([c for c in CASES if not c.startswith("ps")] + ["floor"])
    out = {"trajectories": [*TO_TARGET, "network.rate=loopback", f"cases={','.join(CASES)}", "repeats=3"]}
    for rate, (every, window, warmup) in WINDOWS.items():
        out[f"windows_{rate}"] = ["workloads=char_lm", f"window={window}", f"eval_every={every}",
                                  f"network.rate={rate}", f"warmup_steps={warmup}", f"cases={deterministic}",
                                  "repeats=1"]  # fmt: skip
    out["validation"] = [*TO_TARGET, f"network.rate={validate_rate}", f"cases={','.join(CASES)}", "repeats=1"]
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/time_to_target", help="the report's folder")
    parser.add_argument("--validate-rate", default="100mbit", help="the rate of the end-to-end runs")
    parser.add_argument("--redo", action="append", default=[], help="run this phase again (repeatable)")
    parser.add_argument("--only", action="append", default=[], help="run only this phase (repeatable)")
    parser.add_argument("--compose-only", action="store_true", help="run nothing; compose the parts there are")
    parser.add_argument(
        "--case", action="append", default=[], help="with --redo: run only this case of the phase (repeatable)"
    )
    return parser


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _redo_cases(folder: Path, overrides: list[str], cases: list[str]) -> None:
    """Runs ``cases`` of the phase in ``folder`` again and puts their records and summary rows in place of the
    phase's, listing the command and its provenance under ``merged``."""
    again = folder / "cases" / "_".join(cases)
    phase_results = folder / "results.json"
    chosen = [o for o in overrides if not o.startswith("cases=")] + [f"cases={','.join(cases)}"]
    chosen.append(f"ddp_from={phase_results}")
    command = [sys.executable, "-m", "lightning_sync.bench", "--out", str(again), *chosen]
    print(f"== {folder.name} ({', '.join(cases)}): {shlex.join(['python', *command[1:]])}", flush=True)
    subprocess.run(command, check=False)
    new, old = _load(again / "results.json"), _load(phase_results)
    if new is None or old is None:
        sys.exit(f"error: the run in {again} wrote no results.json")
    for key in ("records", "summary"):
        old[key] = [r for r in old.get(key, []) if r.get("case") not in cases]
        old[key] += [r for r in new.get(key, []) if r.get("case") in cases]
    merged = {"cases": cases, "command": shlex.join(["python", *command[1:]]), "provenance": new.get("provenance")}
    old["merged"] = [m for m in old.get("merged", []) if m["cases"] != cases] + [merged]
    phase_results.write_text(json.dumps(old, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    plan = phases(args.validate_rate)
    commands = {}
    for phase, overrides in plan.items():
        folder = out / "parts" / phase
        command = [sys.executable, "-m", "lightning_sync.bench", "--out", str(folder), *overrides]
        commands[phase] = shlex.join(["python", *command[1:]])
        chosen = not args.only or phase in args.only
        if args.compose_only or not chosen or ((folder / "results.json").exists() and phase not in args.redo):
            continue
        if args.case and (folder / "results.json").exists():
            _redo_cases(folder, overrides, args.case)
            continue
        print(f"== {phase}: {commands[phase]}", flush=True)
        subprocess.run(command, check=False)  # a failed run is recorded in its results.json and reported below
    results = {p: data for p in plan if (data := _load(out / "parts" / p / "results.json")) is not None}
    if "trajectories" not in results:
        sys.exit(f"error: no trajectories in {out / 'parts' / 'trajectories'}; run without --compose-only first")
    windows = [data for p, data in results.items() if p.startswith("windows_")]
    composed = ttt.compose(results["trajectories"], windows, results.get("validation"))
    merged = {f"{p} ({', '.join(m['cases'])})": m for p, data in results.items() for m in data.get("merged", [])}
    report = {
        **composed,
        "decisions": ttt.decide(composed),
        "commands": {p: commands[p] for p in results} | {key: m["command"] for key, m in merged.items()},
        "parts_provenance": {p: data.get("provenance") for p, data in results.items()}
        | {key: m["provenance"] for key, m in merged.items()},
        "provenance": provenance(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_target.json").write_text(json.dumps(report, indent=1) + "\n")
    text = format_report(report)
    (out / "time_to_target.md").write_text(text + "\n")
    record = {
        **report["parts_provenance"].get("trajectories", {}),
        "command": " && ".join(report["commands"].values()),
        "title": TITLE,
        "note": NOTE,
    }
    (out / "time_to_target.provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)


TITLE = "Time to a real loss, 1 Mbit to loopback"
NOTE = (
    "Method: each case's steps to the target come from its loopback run (per seed; the runs are deterministic, so "
    "the link does not change them); its ms per step at each rate from a window of whole scoring intervals after a "
    "warm-up (" + ", ".join(f"{warmup} steps at {rate}" for rate, (_, _, warmup) in WINDOWS.items()) + "; sync steps "
    "included, one seed); the composed time is their product, at every rate, loopback included. The asynchronous "
    "parameter server (whose steps depend on timing) is measured end to end. The validation table puts one "
    "end-to-end run per case beside its composed time."
)


def format_report(report: dict[str, Any]) -> str:
    """The report's Markdown: the decision table, the times per case and rate, and the validation."""
    targets = ", ".join(f"{loss:.4f}" for loss in report["targets"].values() if loss is not None)
    parts = [
        "### Which mode when\n",
        markdown_table(*ttt.decision_table(report["decisions"]), align="llrrrl"),
        f"\n### Training time to the target, per case and link rate\n\nTarget: the validation loss Lightning DDP "
        f"reaches in {ttt.reference_steps(report)} steps, per seed ({targets} nats/char for seeds "
        f"{', '.join(map(str, report['seeds']))}); mean [min, max] over the seeds.\n",
        markdown_table(*ttt.time_table(report)),
    ]
    if report["validation"]:
        parts += [
            "\n### The composed time against one end-to-end run\n",
            markdown_table(*ttt.validation_table(report["validation"])),
        ]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
