"""The main job: train the digits classifier with each sync mode and print one comparison table.

``python -m lightning_sync.compare`` (or ``lightning-sync-compare``) runs every case of :data:`CASES` through the
same Hydra config as ``lightning_sync.apps.train`` (2 CPU ranks, same seed and epochs), one after the other, and prints
mode, test accuracy, median step time and bytes sent per rank per optimizer step. Results also go to
``<out>/results.json`` and ``<out>/results.md``; each case's run folder holds its metrics.csv and config.

While it runs it shows one progress display (case i of n, epoch, step, time left: a bar on a terminal, a line per
epoch in a log) and one result line per finished case; Lightning's banners are silenced. A case whose training loss
diverges is stopped and shown as ``diverged at step N`` instead of a test accuracy.

    python -m lightning_sync.compare                     # all cases, 30 epochs
    python -m lightning_sync.compare --epochs 3 --cases ddp,allreduce
    python -m lightning_sync.compare --smoke             # a few steps each (CI)
    python -m lightning_sync.compare --cases ddp model.lr=0.5   # Hydra overrides for every case
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sync.apps.tables import markdown_table, write_provenance

# Each case: Hydra overrides on top of conf/config.yaml.
CASES: dict[str, list[str]] = {
    "ddp": ["strategy=ddp"],
    "ddp+fp16_hook": ["strategy=ddp", "strategy.comm_hook=fp16"],
    "ddp+powersgd_hook": ["strategy=ddp", "strategy.comm_hook=powersgd"],
    "allreduce": ["strategy=allreduce"],
    "allreduce+fp16": ["strategy=allreduce", "strategy.compression=fp16"],
    "allreduce+bf16": ["strategy=allreduce", "strategy.compression=bf16"],
    "allreduce+topk1%": ["strategy=allreduce", "strategy.compression=topk", "strategy.topk_density=0.01"],
    "allreduce+powersgd4": ["strategy=allreduce", "strategy.compression=powersgd", "strategy.powersgd_rank=4"],
    "periodic:local_sgd/8": ["strategy=periodic", "strategy.mode=local_sgd", "strategy.sync_every=8"],
    # The paper's setting (conf/experiment/diloco.yaml): AdamW inside, outer Nesterov SGD at lr 0.7, momentum 0.9.
    # On top of this model's default inner SGD (lr 0.1, momentum 0.9) that outer momentum diverges.
    "periodic:diloco/8": ["strategy=periodic", "strategy.mode=diloco", "strategy.sync_every=8", "experiment=diloco"],
    # One dedicated server process; in async and ssp the same samples as the other rows, one update per push.
    "ps:sync": ["strategy=ps", "strategy.mode=sync"],
    "ps:async": ["strategy=ps", "strategy.mode=async"],
    "ps:ssp/2": ["strategy=ps", "strategy.mode=ssp", "strategy.max_staleness=2"],
}


def available_cases() -> dict[str, list[str]]:
    """The cases whose strategy config exists in this installation."""
    from lightning_sync.apps.train import CONFIG_DIR

    names = {p.stem for p in Path(CONFIG_DIR, "strategy").glob("*.yaml")}
    return {k: v for k, v in CASES.items() if v[0].split("=", 1)[1] in names}


def case_dir_name(case: str) -> str:
    """A folder name for a case name (``periodic:diloco/8`` -> ``periodic_diloco_8``)."""
    return case.replace("/", "_").replace(":", "_").replace("%", "pct")


def run_case(overrides: list[str], run_dir: Path, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Composes the config with ``overrides`` and trains it in this process (ranks are forked).

    Args:
        overrides: Hydra overrides on top of ``conf/config.yaml``.
        run_dir: the run folder.
        callbacks: more Trainer callbacks (e.g. the job's progress display).
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lightning_sync.apps.train import CONFIG_DIR, run

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(cfg, callbacks)


def _accuracy_cell(row: dict[str, Any]) -> str:
    """``96.67%``, ``diverged at step N`` or ``-`` (no test)."""
    if row.get("diverged"):
        return f"diverged at step {row.get('diverged_at_step')}"
    acc = row.get("test", {}).get("test/acc")
    return f"{acc * 100:.2f}%" if acc is not None else "-"


def _number(value: Any, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (a diverged case shows ``diverged at step N`` as its accuracy)."""
    ref = next((r.get("bytes_sent_per_step") for r in rows if r["mode"] == "ddp"), None)
    header = ("mode", "test acc", "ms/step", "bytes sent/step", "vs ddp bytes")
    cells = []
    for r in rows:
        b = r.get("bytes_sent_per_step")
        cells.append(
            (
                r["mode"],
                _accuracy_cell(r),
                _number(r.get("step_time_ms"), ".2f"),
                _number(b, ",.0f"),
                f"{b / ref:.3f}" if (b is not None and ref) else "-",
            )
        )
    return markdown_table(header, cells, align="lrrrr", pad=True)


def _result_line(index: int, total: int, row: dict[str, Any], seconds: float) -> str:
    """One line for a finished case: its test accuracy (or where it diverged), ms/step and bytes sent per step."""
    head = f"[{index}/{total}] {row['mode']:<22}"
    if row.get("diverged"):
        body = (
            f"DIVERGED at step {row.get('diverged_at_step')} ({row.get('diverged_reason', 'loss')}, training "
            f"loss {row.get('diverged_loss', math.nan):.4g})"
        )
    else:
        body = (
            f"test acc {_accuracy_cell(row):>7}  {_number(row.get('step_time_ms'), '.2f'):>6} ms/step  "
            f"{_number(row.get('bytes_sent_per_step'), ',.0f'):>9} bytes/step"
        )
    return f"{head} {body}  ({seconds:.0f} s)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30, help="training epochs per case")
    # argparse %-formats help strings: a case name's % must be doubled
    cases = ", ".join(CASES).replace("%", "%%")
    parser.add_argument("--cases", default="", help="comma-separated subset of: " + cases)
    parser.add_argument("--out", default="outputs/compare", help="folder for the runs and the results table")
    parser.add_argument("--smoke", action="store_true", help="4 training batches per case (for CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every case, e.g. model.lr=0.05")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.epochs < 1:
        sys.exit(f"error: --epochs={args.epochs} is not allowed; it must be >= 1")
    from lightning_sync.apps._console import ProgressReport, quiet_lightning

    quiet_lightning()
    cases = available_cases()
    if args.cases:
        wanted = args.cases.split(",")
        unknown = [c for c in wanted if c not in cases]
        if unknown:
            sys.exit(f"error: --cases {','.join(unknown)} unknown; choose from: {', '.join(cases)}")
        cases = {c: cases[c] for c in wanted}
    # the job's own progress display (rank 0 of each case) replaces Lightning's bar
    common = [
        "strategy.start_method=fork",
        f"trainer.max_epochs={args.epochs}",
        f"seed={args.seed}",
        "trainer.enable_progress_bar=false",
    ]
    if args.smoke:
        common += ["trainer.max_epochs=1", "+trainer.limit_train_batches=4", "+trainer.limit_val_batches=1"]
    common += args.overrides
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    durations: list[float] = []
    for index, (name, overrides) in enumerate(cases.items(), start=1):
        progress = ProgressReport(
            label=f"[{index}/{len(cases)}] {name}",
            later_runs=len(cases) - index,
            run_seconds=statistics.mean(durations) if durations else None,
        )
        started = time.perf_counter()
        summary = run_case(overrides + common, out / case_dir_name(name), callbacks=[progress])
        durations.append(time.perf_counter() - started)
        rows.append({"mode": name, "overrides": overrides, **summary})
        print(_result_line(index, len(cases), rows[-1], durations[-1]), flush=True)
    table = format_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    (out / "results.md").write_text(table + "\n")
    write_provenance(out)
    epochs = "smoke" if args.smoke else args.epochs
    extra = f", overrides: {' '.join(args.overrides)}" if args.overrides else ""
    print(f"\nDigits classifier, 2 CPU ranks (gloo), {epochs} epochs, seed {args.seed}{extra}")
    print(table)


if __name__ == "__main__":
    main()
