"""What a parameter-server run recorded: the :class:`PSTimeline` callback in every worker, and :class:`PSRun`, the
finished run read back (see :mod:`lightning_sync.apps.ps_study` for the numbers its methods give)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sync.apps.timeline import Timeline, batch_loss, read_timelines

if TYPE_CHECKING:
    from lightning_sync.strategies.ps import ParameterServerStrategy

TIMELINE_DIR = "ps_timeline"
"""The folder, inside a run folder, of the workers' timelines (``rank<r>.json``)."""


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
