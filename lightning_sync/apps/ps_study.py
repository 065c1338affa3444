"""Parameter-server experiments through Lightning: run ``strategy=ps`` cases and read what every worker saw.

Shared by ``benchmarks/ps_straggler.py`` and ``notebooks/03_parameter_server.py``. One case is one Hydra config run
in this process with forked ranks (:func:`lightning_sync.apps.runner.run_case`), with a :class:`PSTimeline` callback
in every worker. After each push a worker notes the time, the servers' version, the push's staleness and every
server's ingress so far (all from the strategy's ``last_reply``, a :class:`~lightning_sync.ps.PSReply`); worker 0
can also probe the validation accuracy every few seconds. Each worker writes its notes to
``<run folder>/ps_timeline/rank<r>.json``; :func:`run_ps` reads them back into a :class:`PSRun`, whose methods give
the numbers the benchmark and the notebook report (the callback and the record live in
:mod:`lightning_sync.apps.ps_run`):

* :meth:`PSRun.throughput`: samples per second over all workers, in the training phase only. The servers' version
  counts updates (sync: one per step of all ``W`` workers, so ``W x batch`` samples; async/ssp: one per push, one
  batch), and worker 0 observes it after each of its pushes. The rate is the version's slope on worker 0's clock
  from the first observation past ``skip`` of the run's updates to the last one, so start-up (forking the ranks,
  starting the servers, the first pull) and the final test are left out.
* :meth:`PSRun.staleness`: every applied push's staleness, per worker.
* :meth:`PSRun.ingress_per_update`: bytes each server received per update over the same training window.

Times come from ``time.monotonic``, one clock for all processes of a host: the timelines are for single-host
experiments.

    from lightning_sync.apps.ps_study import ps_overrides, run_ps
    run = run_ps("async", ps_overrides("async", epochs=10), "outputs/ps/async")
    print(run.throughput(), run.test_accuracy, run.staleness())
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.ps_run import TIMELINE_DIR, PSRun, PSTimeline
from lightning_sync.apps.stats import spread, verdict
from lightning_sync.apps.timeline import run_with_timeline

__all__ = [
    "TIMELINE_DIR",
    "PSRun",
    "PSTimeline",
    "format_seed_table",
    "format_table",
    "parse_mode",
    "ps_overrides",
    "run_ps",
    "staleness_histogram",
    "summarize",
]


# ---------------------------------------------------------------------------------------------------- configs
def parse_mode(spec: str) -> tuple[str, int | None]:
    """``"ssp:2"`` -> ``("ssp", 2)``; ``"async"`` -> ``("async", None)``.

    Raises:
        ValueError: a bound on a mode other than ``ssp``, or one that is not an integer.
    """
    mode, _, bound = spec.partition(":")
    if not bound:
        return mode, None
    if mode != "ssp" or not bound.isdigit():
        raise ValueError(f"mode {spec!r} is not allowed; a staleness bound goes with ssp only, e.g. ssp:2")
    return mode, int(bound)


def ps_overrides(
    spec: str,
    *,
    workers: int = 3,
    slow_worker: int = 2,
    slowdown: float = 3.0,
    num_servers: int = 1,
    placement: str = "dedicated",
    epochs: int | None = None,
    max_steps: int | None = None,
    batch_size: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Hydra overrides for one parameter-server case on the digits classifier.

    The run keeps what the comparison needs and drops what would blur it: no checkpoints (``callbacks=none``: in
    async a worker-0 checkpoint fetches every server's state mid-run), no validation during fit (sync would
    validate each epoch, async/ssp never do), no progress bar; ranks are forked.

    Args:
        spec: ``sync``, ``async`` or ``ssp[:s]`` (``s``: ``max_staleness``, default the config's, 2).
        workers: worker ranks (``trainer.devices``).
        slow_worker: the straggler's rank (-1: none).
        slowdown: how many times slower the straggler's steps are (``strategy.slowdown``).
        num_servers: parameter servers the model is sharded over.
        placement: ``dedicated`` (server processes) or ``colocated`` (threads in the first workers).
        epochs: ``trainer.max_epochs`` (async/ssp: that many epochs' worth of samples over all workers, the same
            sample budget as sync); ``None``: the config's.
        max_steps: ``trainer.max_steps`` (in async/ssp: server updates); ``None``: the config's.
        batch_size: samples per batch per worker; ``None``: the config's (32).
        extra: more overrides, applied last.
    """
    mode, bound = parse_mode(spec)
    out = [
        "strategy=ps",
        f"strategy.mode={mode}",
        f"trainer.devices={workers}",
        f"strategy.num_servers={num_servers}",
        f"strategy.placement={placement}",
        "strategy.start_method=fork",
        "callbacks=none",
        "++trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
    ]
    if bound is not None:
        out.append(f"strategy.max_staleness={bound}")
    if slow_worker >= 0:
        out += [f"strategy.slow_worker={slow_worker}", f"strategy.slowdown={slowdown}"]
    if epochs is not None:
        out.append(f"trainer.max_epochs={epochs}")
    if max_steps is not None:
        out.append(f"trainer.max_steps={max_steps}")
    if batch_size is not None:
        out.append(f"data.batch_size={batch_size}")
    return out + list(extra)


def run_ps(
    name: str,
    overrides: Sequence[str],
    run_dir: str | Path,
    probe_every_s: float | None = None,
    quiet: bool = True,
    callbacks: Sequence[pl.Callback] = (),
) -> PSRun:
    """Runs one parameter-server case (see :func:`ps_overrides`) and reads back what its workers recorded.

    Lightning's banners and known-harmless warnings are silenced (:func:`lightning_sync.apps._console.quiet_lightning`).

    Args:
        name: the case's name in tables and plots.
        overrides: Hydra overrides with ``strategy=ps`` (e.g. from :func:`ps_overrides`).
        run_dir: the run folder (a timeline left there by an earlier run is replaced).
        probe_every_s: worker 0 probes the validation accuracy this often (``None``: never).
        quiet: no per-epoch progress lines (otherwise: the run's progress on stderr).
        callbacks: more Trainer callbacks, after the timeline .

    Raises:
        RuntimeError: the fit diverged, or a worker wrote no timeline.
    """
    run_dir = Path(run_dir)
    timeline = PSTimeline(run_dir / TIMELINE_DIR, probe_every_s)
    summary, wall = run_with_timeline(name, overrides, run_dir, timeline, callbacks, quiet)
    if summary.get("diverged"):
        raise RuntimeError(f"{name}: training diverged at step {summary.get('diverged_at_step')} ({run_dir})")
    run = PSRun.load(name, run_dir, summary, wall)
    if len(run.workers) != run.num_workers:
        raise RuntimeError(f"{name}: {len(run.workers)} of {run.num_workers} workers wrote a timeline ({run_dir})")
    return run


# ---------------------------------------------------------------------------------------------------- many runs
def summarize(
    runs: Sequence[PSRun] | Mapping[str, Sequence[PSRun]], reference: str = "sync", skip: float = 0.1
) -> list[dict[str, Any]]:
    """One row per case name (in first-seen order), pooling its repeats.

    Each row: ``name``, ``mode``, ``rounds``, ``throughput`` (median samples/s), ``throughputs`` (each round's),
    ``ratio`` (median throughput over ``reference``'s median; ``None`` without that case), ``staleness_mean`` and
    ``staleness_max`` (over every push of every round; 0 in sync), ``test_acc`` (median) and ``test_accs``,
    ``step_ms`` (median of worker 0's median step time) and ``step_mss`` (each round's), ``updates`` and
    ``training_s`` (medians) and ``training_ss`` (each round's).

    Args:
        runs: finished runs, in any order; runs of one case share its ``name``. Or runs already grouped by case,
            ``{case: runs}`` (e.g. :func:`lightning_sync.apps.study.by_case` of seeded runs named ``<case> s<seed>``).
        reference: the case the ratios divide by.
        skip: see :meth:`PSRun.throughput`.
    """
    groups: dict[str, list[PSRun]] = {}
    if isinstance(runs, Mapping):
        groups = {name: list(group) for name, group in runs.items()}
    else:
        for run in runs:
            groups.setdefault(run.name, []).append(run)
    rows: list[dict[str, Any]] = []
    for name, group in groups.items():
        pushes = [s for run in group for worker in run.staleness() for s in worker]
        accs = [run.test_accuracy for run in group if run.test_accuracy is not None]
        steps = [run.summary["step_time_ms"] for run in group if run.summary.get("step_time_ms") is not None]
        throughputs = [run.throughput(skip) for run in group]
        rows.append({
            "name": name,
            "mode": group[0].mode,
            "rounds": len(group),
            "throughput": statistics.median(throughputs),
            "throughputs": throughputs,
            "staleness_mean": statistics.fmean(pushes) if pushes else None,
            "staleness_max": max(pushes) if pushes else None,
            "test_acc": statistics.median(accs) if accs else None,
            "test_accs": accs,
            "step_ms": statistics.median(steps) if steps else None,
            "step_mss": steps,
            "updates": statistics.median(run.updates for run in group),
            "training_s": statistics.median(run.training_s for run in group),
            "training_ss": [run.training_s for run in group],
        })  # fmt: skip
    ref = next((r["throughput"] for r in rows if r["name"] == reference), None)
    for row in rows:
        row["ratio"] = row["throughput"] / ref if ref else None
    return rows


def format_table(rows: Sequence[dict[str, Any]], reference: str = "sync") -> str:
    """:func:`summarize`'s rows as a Markdown table: samples/s, ratio, staleness, test acc, ms/step.

    ``ms/step (worker 0)`` is :class:`~lightning_sync.callbacks.SyncReport`'s median, from a batch's start to its
    end on worker 0: a sync worker's wait for a straggler that is still sleeping after its own batch is not in it,
    so compare the modes' pace by samples/s.
    """
    header = (
        "mode",
        "samples/s",
        f"vs {reference}",
        "staleness mean",
        "staleness max",
        "test acc",
        "ms/step (worker 0)",
        "training s",
    )

    cell = format_cell
    cells = []
    for r in rows:
        acc = None if r["test_acc"] is None else 100 * r["test_acc"]
        cells.append(
            (
                r["name"],
                cell(r["throughput"], ",.0f"),
                cell(r["ratio"], ".2f", "x"),
                cell(r["staleness_mean"], ".2f"),
                cell(r["staleness_max"], "d"),
                cell(acc, ".2f", "%"),
                cell(r["step_ms"], ".2f"),
                cell(r["training_s"], ".1f"),
            )
        )
    return markdown_table(header, cells)


def format_seed_table(rows: Sequence[dict[str, Any]], reference: str = "sync") -> str:
    """:func:`summarize`'s rows as a Markdown table over rounds (e.g. seeds): samples/s, test acc, worker 0's
    ms/step and training seconds as ``mean [min, max]`` over the case's rounds; after samples/s and after test acc a
    ``vs <reference>`` column says ``tie`` when the ranges overlap, else ``better`` or ``worse``
    (:func:`lightning_sync.apps.stats.verdict`); staleness mean and max over every push of every round.

    Raises:
        ValueError: ``reference`` is not a row's name.
    """
    by_name = {r["name"]: r for r in rows}
    if reference not in by_name:
        raise ValueError(f"reference {reference!r} is not a case; the cases are: {', '.join(by_name)}")
    ref = by_name[reference]

    def accs(row: dict[str, Any]) -> list[float]:
        return [100 * a for a in row["test_accs"]]

    header = (
        "mode",
        "samples/s mean [min, max]",
        f"vs {reference}",
        "test acc mean [min, max]",
        f"acc vs {reference}",
        "staleness mean",
        "staleness max",
        "ms/step (worker 0) mean [min, max]",
        "training s mean [min, max]",
    )
    cells = []
    for r in rows:
        cells.append(
            (
                r["name"],
                band_cell(r["throughputs"], ",.0f"),
                verdict(spread(r["throughputs"]), spread(ref["throughputs"]), higher_is_better=True),
                band_cell(accs(r), ".2f", "%") if r["test_accs"] else "-",
                verdict(spread(accs(r)), spread(accs(ref)), higher_is_better=True),
                format_cell(r["staleness_mean"], ".2f"),
                format_cell(r["staleness_max"], "d"),
                band_cell(r["step_mss"], ".2f") if r["step_mss"] else "-",
                band_cell(r["training_ss"], ".1f"),
            )
        )
    return markdown_table(header, cells)


def staleness_histogram(runs: Sequence[PSRun]) -> dict[int, list[int]]:
    """Counts of each staleness value over ``runs`` (e.g. the rounds of one case), per worker rank:
    ``{staleness: [pushes of worker 0, of worker 1, ...]}``."""
    counts: dict[int, list[int]] = {}
    for run in runs:
        for rank, values in enumerate(run.staleness()):
            for s in values:
                counts.setdefault(s, [0] * run.num_workers)[rank] += 1
    return dict(sorted(counts.items()))
