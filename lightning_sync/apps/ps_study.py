"""Parameter-server experiments through Lightning: run ``strategy=ps`` cases and read what every worker saw.

Shared by ``benchmarks/ps_straggler.py`` and ``notebooks/03_parameter_server.py``. One case is one Hydra config run
in this process with forked ranks (:func:`lightning_sync.apps.runner.run_case`), with a :class:`PSTimeline` callback
in every worker. After each push a worker notes the time, the servers' version, the push's staleness and every
server's ingress so far (all from the strategy's ``last_reply``, a :class:`~lightning_sync.ps.PSReply`); worker 0
can also probe the validation accuracy every few seconds. Each worker writes its notes to
``<run folder>/ps_timeline/rank<r>.json``; :func:`run_ps` reads them back into a :class:`PSRun`, whose methods give
the numbers the benchmark and the notebook report:

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

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.stats import spread, verdict
from lightning_sync.apps.timeline import Timeline, batch_loss, read_timelines, run_with_timeline

if TYPE_CHECKING:
    from lightning_sync.strategies.ps import ParameterServerStrategy

TIMELINE_DIR = "ps_timeline"
"""The folder, inside a run folder, of the workers' timelines (``rank<r>.json``)."""


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


# ---------------------------------------------------------------------------------------------------- recording
class PSTimeline(Timeline):
    """In every worker of a ``strategy=ps`` fit: notes each push's reply; writes them when training ends.

    A row per training batch whose push got a reply: ``t`` (``time.monotonic`` after the batch), ``version`` (the
    servers' oldest version in the reply), ``staleness`` (the push's largest staleness over the servers; ``-1`` if
    the reply was not to an applied push, e.g. the pull after the stop), ``applied``, ``ingress`` (each server's
    bytes received so far) and ``loss`` (the batch's training loss). Worker 0 with ``probe_every_s`` also evaluates
    the model on the datamodule's validation split every ``probe_every_s`` seconds, as
    :class:`~lightning_sync.apps.timeline.Timeline` does, noting the servers' version with each probe.

    Args:
        out_dir: where to write ``rank<r>.json`` (created if missing).
        probe_every_s: seconds between worker 0's accuracy probes; ``None``: no probes.
    """

    def __init__(self, out_dir: str | Path, probe_every_s: float | None = None) -> None:
        super().__init__(out_dir, probe_every_s=probe_every_s)

    @override
    def _meta_fields(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Adds the number of servers."""
        config = getattr(trainer.strategy, "config", None)
        return {**super()._meta_fields(trainer, pl_module), "num_servers": getattr(config, "num_servers", None)}

    @override
    def _row(self, trainer: pl.Trainer, outputs: Any) -> dict[str, Any] | None:
        """The push's reply (``None`` before the first reply)."""
        reply = getattr(trainer.strategy, "last_reply", None)
        if reply is None:
            return None
        return {
            "version": reply.version,
            "staleness": reply.stalest if reply.applied else -1,
            "applied": bool(reply.applied),
            "ingress": list(reply.server_bytes_recv),
            "loss": batch_loss(outputs),
        }

    @override
    def _probe_fields(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The servers' version the probed parameters come from."""
        strategy = cast("ParameterServerStrategy", trainer.strategy)  # _row found its last_reply
        return {"version": strategy.last_reply.version}


# ---------------------------------------------------------------------------------------------------- one run
@dataclass
class PSRun:
    """One finished case: the run's summary and every worker's timeline.

    Attributes:
        name: the case's name (e.g. ``ssp:2``).
        mode: the strategy's mode (``sync``, ``async``, ``ssp``).
        run_dir: the run folder.
        summary: ``summary.json`` (step time, bytes per step, test metrics).
        workers: each worker's timeline (``rank<r>.json``), by rank.
        wall_s: the whole case's wall time in this process (start-up and test included).
    """

    name: str
    mode: str
    run_dir: Path
    summary: dict[str, Any]
    workers: list[dict[str, Any]]
    wall_s: float = math.nan
    _origin: float = field(init=False, repr=False, default=0.0)

    def __post_init__(self) -> None:
        if not self.workers or not self.workers[0]["rows"]:
            raise ValueError(f"{self.run_dir}: worker 0 recorded no push; did the fit run?")
        self._origin = self.workers[0]["first_batch"]

    @classmethod
    def load(
        cls, name: str, run_dir: str | Path, summary: dict[str, Any] | None = None, wall_s: float = math.nan
    ) -> PSRun:
        """Reads a run folder written by :func:`run_ps` (``summary``: ``summary.json`` if not given)."""
        run_dir = Path(run_dir)
        workers = read_timelines(run_dir / TIMELINE_DIR)
        if summary is None:
            file = run_dir / "summary.json"
            summary = json.loads(file.read_text()) if file.is_file() else {}
        mode = workers[0]["mode"] if workers else "?"
        return cls(name, mode, run_dir, summary, workers, wall_s)

    # -------------------------------------------------------------------------------------------- basics
    @property
    def num_workers(self) -> int:
        """Worker ranks."""
        return int(self.workers[0]["workers"])

    @property
    def samples_per_update(self) -> int:
        """Samples behind one server update: ``W x batch`` in sync, one batch in async/ssp."""
        batch = int(self.workers[0]["batch_size"])
        return batch * self.num_workers if self.mode == "sync" else batch

    @property
    def updates(self) -> int:
        """The servers' final version (updates applied), as worker 0 last saw it."""
        return int(self.workers[0]["rows"][-1]["version"])

    @property
    def test_accuracy(self) -> float | None:
        """``test/acc`` of the final model (``None`` if the run was not tested)."""
        return self.summary.get("test", {}).get("test/acc")

    @property
    def training_s(self) -> float:
        """Worker 0's training time: its first batch's start to its last batch's end."""
        return self.workers[0]["rows"][-1]["t"] - self._origin

    def _window(self, skip: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """Worker 0's first row past ``skip`` of the updates and its last row (the training window)."""
        rows = self.workers[0]["rows"]
        last = rows[-1]
        threshold = max(1, math.ceil(skip * last["version"]))
        first = next((r for r in rows if r["version"] >= threshold and r is not last), rows[0])
        if last["version"] <= first["version"] or last["t"] <= first["t"]:
            raise ValueError(f"{self.run_dir}: too few updates to measure past the first {skip:.0%}")
        return first, last

    # -------------------------------------------------------------------------------------------- numbers
    def throughput(self, skip: float = 0.1) -> float:
        """Training samples per second over all workers, from the ``skip`` share of updates to the end.

        Args:
            skip: share of the run's updates left out at the start (start-up, ssp's initial lead, first pulls).
        """
        first, last = self._window(skip)
        return (last["version"] - first["version"]) * self.samples_per_update / (last["t"] - first["t"])

    def worker_push_rates(self, skip: float = 0.1) -> list[float]:
        """Each worker's applied pushes per second over worker 0's training window (the straggler's is lowest)."""
        first, last = self._window(skip)
        return [
            sum(1 for r in w["rows"] if r["applied"] and first["t"] < r["t"] <= last["t"]) / (last["t"] - first["t"])
            for w in self.workers
        ]

    def staleness(self) -> list[list[int]]:
        """Every applied push's staleness (server version when applied minus the version it was computed on), per
        worker; all zeros in sync."""
        return [[r["staleness"] for r in w["rows"] if r["applied"] and r["staleness"] >= 0] for w in self.workers]

    def ingress_per_update(self, skip: float = 0.1) -> list[float]:
        """Bytes each server received per update over the training window (sync: ``W`` pushes of its shard)."""
        first, last = self._window(skip)
        updates = last["version"] - first["version"]
        return [(b - a) / updates for a, b in zip(first["ingress"], last["ingress"])]

    @property
    def model_bytes(self) -> int:
        """Bytes of the trained parameters (what one uncompressed push carries, before headers)."""
        return int(self.workers[0]["model_bytes"])

    def cpu_cores_used(self) -> float:
        """CPU time of all worker processes (colocated server threads included, dedicated server processes not)
        from each one's first batch to its end of training, over worker 0's training time: how many of the
        machine's cores the workers kept busy."""
        cpu = sum(w["cpu_at_end"] - w["cpu_at_first_batch"] for w in self.workers)
        return cpu / self.training_s

    # -------------------------------------------------------------------------------------------- curves
    def samples_curve(self) -> tuple[list[float], list[float]]:
        """``(seconds since worker 0's first batch, samples the servers have applied)``, one point per push of
        worker 0; the slope is the throughput."""
        rows = self.workers[0]["rows"]
        return [r["t"] - self._origin for r in rows], [r["version"] * self.samples_per_update for r in rows]

    def accuracy_curve(self) -> tuple[list[float], list[float]]:
        """``(seconds, validation accuracy)`` of worker 0's probes (empty without ``probe_every_s``)."""
        probes = self.workers[0]["probes"]
        return [p["t"] - self._origin for p in probes], [p["acc"] for p in probes]

    def loss_curve(self, smooth: int = 10) -> tuple[list[float], list[float]]:
        """``(seconds, training loss)`` of worker 0's batches, a running mean over ``smooth`` batches."""
        rows = [r for r in self.workers[0]["rows"] if r["loss"] is not None]
        losses = [r["loss"] for r in rows]
        means = [statistics.fmean(losses[max(0, i + 1 - smooth) : i + 1]) for i in range(len(losses))]
        return [r["t"] - self._origin for r in rows], means


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
