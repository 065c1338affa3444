"""Accuracy of an elastic parameter server that loses a worker: async ps on the digits, with and without a kill.

Each seed runs the Hydra app twice, as a user would (``python -m lightning_sync.train strategy=ps
strategy.mode=async trainer.devices=3 ...``: 3 workers, one dedicated server): once untouched, and once with worker 2
SIGKILLed a third of the way through training (a third of the untouched run's training time after rank 0's first
logged metrics). The job must end with exit code 0 on the two survivors,
naming the lost worker; the table compares the test accuracy (rank 0's parameters after the last push, on the fixed
test split) of the two runs per seed, and their means over the seeds. The issue's bar: the mean with the loss within
2 points of the mean without it. Also reported: each worker's pushes applied (the servers' clocks, from the
checkpoint), which show how early worker 2 was lost. Writes ``<out>/records.json`` (every run), and ``<out>.md`` with a
``.provenance.json`` beside it for the results page (``make docs-gen``).

    python benchmarks/ps_elastic_accuracy.py                     # seeds 0, 1, 2, about 3 minutes
    python benchmarks/ps_elastic_accuracy.py --seeds 0 --out /tmp/elastic_accuracy
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from lightning_sync.apps.markdown import markdown_table  # noqa: E402
from lightning_sync.apps.provenance import provenance  # noqa: E402

EPOCHS = 60
OVERRIDES = ["strategy=ps", "strategy.mode=async", "strategy.timeout_s=15", "trainer.devices=3",
             f"trainer.max_epochs={EPOCHS}", "trainer.log_every_n_steps=5", "+logger.csv.flush_logs_every_n_steps=5",
             "test=true"]  # fmt: skip
"""Every run's overrides (the seed and the run folder are added): 3 workers, async, the digits classifier."""
BAR_POINTS = 2.0
TITLE = "Elastic parameter server: accuracy after losing one async worker of 3"


def _epochs_logged(run_dir: Path) -> int:
    """The highest epoch in rank 0's ``metrics.csv`` so far (-1: none yet)."""
    file = run_dir / "metrics.csv"
    if not file.is_file():
        return -1
    with file.open() as handle:
        epochs = [int(float(row["epoch"])) for row in csv.DictReader(handle) if row.get("epoch")]
    return max(epochs, default=-1)


def _training_seconds(summary: dict[str, Any]) -> float:
    """A run's training time: its optimizer steps times its median step time (from ``summary.json``)."""
    return float(summary["optimizer_steps"]) * float(summary["step_time_ms"]) / 1e3


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the job's rank ``rank`` (a child of the ``popen`` launcher runs its rank's job name)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found = re.search(r"hydra\.job\.name=\S*_rank(\d+)", cmd)
        if f"hydra.run.dir={run_dir}" in cmd and found and int(found.group(1)) == rank:
            return int(entry.name)
    return None


def run(seed: int, run_dir: Path, kill_after_s: float | None, timeout_s: float = 600.0) -> dict[str, Any]:
    """One run of the app; with ``kill_after_s``, worker 2 is SIGKILLed that many seconds after rank 0's first logged
    metrics."""
    kill = kill_after_s is not None
    run_dir = run_dir.resolve()  # the launcher gives the other ranks the absolute path
    command = [sys.executable, "-m", "lightning_sync.train", *OVERRIDES, f"seed={seed}", f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed_at, first_metrics = None, None
    try:
        while kill_after_s is not None and killed_at is None and job.poll() is None:
            if first_metrics is None and (run_dir / "metrics.csv").is_file():
                first_metrics = time.monotonic()
            due = first_metrics is not None and time.monotonic() >= first_metrics + kill_after_s
            if due and (pid := _rank_pid(run_dir, 2)) is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = _epochs_logged(run_dir)
            time.sleep(0.05)
        _, stderr = job.communicate(timeout=timeout_s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    state_file = run_dir / "checkpoints" / "last.ckpt.rank0.pt"
    clocks = None
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False, map_location="cpu")
        clocks = state["servers"][0]["clocks"]
    return {
        "seed": seed,
        "kill": kill,
        "command": shlex.join(["python", *command[1:]]),
        "returncode": job.returncode,
        "seconds": time.monotonic() - started,
        "killed_at_epoch": killed_at,
        "test_acc": summary.get("test", {}).get("test/acc"),
        "training_s": _training_seconds(summary)
        if "optimizer_steps" in summary and "step_time_ms" in summary
        else None,
        "lost_workers": summary.get("lost_workers", {}),
        "clocks": clocks,
        "stderr_tail": stderr[-2000:] if job.returncode else "",
    }


def _mean(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.fmean(done) if done and len(done) == len(values) else None


def report(records: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The Markdown table (one row per seed, then the means) and the verdict."""
    seeds = sorted({r["seed"] for r in records})
    by = {(r["seed"], r["kill"]): r for r in records}
    rows = []
    for seed in seeds:
        kept, lost = by.get((seed, False), {}), by.get((seed, True), {})
        rows.append([
            str(seed),
            _pct(kept.get("test_acc")),
            _pct(lost.get("test_acc")),
            f"{lost.get('returncode')} / {', '.join(lost.get('lost_workers') or {}) or 'none'}",
            str(lost.get("killed_at_epoch")),
            " / ".join(map(str, lost.get("clocks") or [])) or "-",
        ])  # fmt: skip
    kept_mean = _mean([by.get((s, False), {}).get("test_acc") for s in seeds])
    lost_mean = _mean([by.get((s, True), {}).get("test_acc") for s in seeds])
    rows.append(["mean", _pct(kept_mean), _pct(lost_mean), "", "", ""])
    gap = None if kept_mean is None or lost_mean is None else 100 * (kept_mean - lost_mean)
    verdict = {
        "kept_mean": kept_mean,
        "lost_mean": lost_mean,
        "gap_points": gap,
        "within_bar": gap is not None and abs(gap) <= BAR_POINTS,
        "every_lost_run_exited_0": all(by.get((s, True), {}).get("returncode") == 0 for s in seeds),
    }
    header = ["seed", "test acc, no loss", "test acc, worker 2 killed", "exit code / lost", "killed at epoch",
              "pushes applied per worker (killed run)"]  # fmt: skip
    text = markdown_table(header, rows, align="lrrlrl")
    gap_text = "-" if gap is None else f"{gap:+.2f}"
    text += (
        f"\n\nMean test accuracy without the loss minus with it: {gap_text} points (the bar: within "
        f"{BAR_POINTS:g}); every killed run exited 0 on the survivors: {verdict['every_lost_run_exited_0']}."
    )
    return text, verdict


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--out", default="benchmarks/results/ps_elastic_accuracy", help="its runs and records.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    records = []
    for seed in (int(s) for s in args.seeds.split(",")):
        untouched = run(seed, out / "runs" / f"seed{seed}_none", None)  # then the same seed with the loss
        after = (untouched["training_s"] or 10.0) / 3
        for record in (untouched, run(seed, out / "runs" / f"seed{seed}_kill", after)):
            records.append(record)
            kill = record["kill"]
            print(f"seed {seed} {'kill' if kill else 'none'}: exit {record['returncode']}, test acc "
                  f"{record['test_acc']}, lost {list(record['lost_workers'])}, clocks {record['clocks']}, "
                  f"{record['seconds']:.0f} s", flush=True)  # fmt: skip
    text, verdict = report(records)
    prov = provenance()
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.json").write_text(
        json.dumps({"records": records, "verdict": verdict, "provenance": prov}, indent=1)
    )
    command = shlex.join(["python", "benchmarks/ps_elastic_accuracy.py", *(argv or sys.argv[1:])])
    page = out.parent / f"{out.name}.md"
    page.write_text(text + "\n")
    note = (
        f"3 workers and one dedicated server (`{' '.join(OVERRIDES)}`), the digits classifier; each seed once "
        "untouched and once with worker 2 SIGKILLed a third of the way through training. Test accuracy is "
        "rank 0's, on the fixed test split."
    )
    record = {**prov, "command": command, "title": TITLE, "note": note}
    page.with_suffix(".provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
