"""Experiments through Lightning: run cases of the Hydra config and read back what each run saw, batch by batch.

Shared by the notebooks (``notebooks/01_overview``, ``02_periodic``, ``04_compression``, ...). One case is one Hydra
config (overrides on ``conf/config.yaml``) trained in this process with forked ranks
(:func:`lightning_sync.apps.runner.run_case`), with a :class:`~lightning_sync.apps.timeline.Timeline` callback in
every rank. :func:`run_cases` runs several cases and reads each back into a
:class:`~lightning_sync.apps.study_run.StudyRun`: its ``summary.json`` (test accuracy, step time, bytes and comm
seconds per step), rank 0's timeline and its ``metrics.csv`` (``comm/*`` per optimizer step); :func:`seed_cases` and
:func:`by_case` run every case over several seeds and group the runs back by case.

This module is the notebooks' one import: it also gives the names of the modules it builds on, the recording
(:mod:`lightning_sync.apps.timeline`), the run record (:mod:`lightning_sync.apps.study_run`), its tables
(:mod:`lightning_sync.apps.run_tables`), the slow-link model (:mod:`lightning_sync.apps.link_model`) and the
readers of the benchmark's results files (:mod:`lightning_sync.apps.results`).

    from lightning_sync.apps.study import run_cases, format_runs
    runs = run_cases({"ddp": ["strategy=ddp"], "allreduce": ["strategy=allreduce"]}, "outputs/study",
                     common=["trainer.max_epochs=5"])
    print(format_runs(runs.values()))
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from lightning_sync.apps.link_model import (
    LINK_RATES,
    format_link_model,
    format_seed_link_model,
    modelled_accuracy_curve,
    modelled_step_seconds,
    modelled_time_to_accuracy,
    modelled_time_to_loss,
)
from lightning_sync.apps.provenance import provenance
from lightning_sync.apps.results import load_bench_rows, load_time_to_accuracy
from lightning_sync.apps.run_tables import COLUMNS, SEED_METRICS, format_runs, format_seed_runs
from lightning_sync.apps.runner import STUDY_OVERRIDES, case_dir_name
from lightning_sync.apps.study_run import StudyRun
from lightning_sync.apps.timeline import TIMELINE_DIR, Timeline, batch_loss, read_timelines, run_with_timeline

__all__ = [
    "COLUMNS",
    "LINK_RATES",
    "SEED_METRICS",
    "STUDY_OVERRIDES",
    "TIMELINE_DIR",
    "StudyRun",
    "Timeline",
    "batch_loss",
    "by_case",
    "format_link_model",
    "format_runs",
    "format_seed_link_model",
    "format_seed_runs",
    "load_bench_rows",
    "load_time_to_accuracy",
    "modelled_accuracy_curve",
    "modelled_step_seconds",
    "modelled_time_to_accuracy",
    "modelled_time_to_loss",
    "read_timelines",
    "run_cases",
    "run_study",
    "run_with_timeline",
    "seed_cases",
]


def run_study(
    name: str, overrides: Sequence[str], run_dir: str | Path, probe_every_batches: int | None = 5, quiet: bool = True
) -> StudyRun:
    """Runs one case with a :class:`Timeline` (rank 0 probing every ``probe_every_batches`` batches) and reads it
    back. A diverged run is returned as well (:attr:`StudyRun.diverged`; no test accuracy)."""
    run_dir = Path(run_dir)
    timeline = Timeline(run_dir / TIMELINE_DIR, probe_every_batches=probe_every_batches)
    summary, wall = run_with_timeline(name, overrides, run_dir, timeline, quiet=quiet)
    return StudyRun.load(name, run_dir, summary, wall)


def run_cases(
    cases: Mapping[str, Sequence[str]],
    out: str | Path,
    common: Sequence[str] = (),
    probe_every_batches: int | None = 5,
    quiet: bool = True,
) -> dict[str, StudyRun]:
    """Runs every case one after the other, each in ``<out>/<case folder>``; returns them by name.

    Each case's overrides are :data:`STUDY_OVERRIDES`, then the case's own, then ``common``. ``<out>/provenance.json``
    records the commit, command, versions and CPU (:func:`lightning_sync.apps.provenance.provenance`). A case's folder is its
    name with ``/``, ``:``, ``%``, spaces and other punctuation replaced (``auto, target 2%`` -> ``auto_target_2pct``).

    Args:
        cases: ``{name: Hydra overrides}`` (e.g. :func:`lightning_sync.apps.cases.hydra_cases`).
        out: the parent folder of the run folders.
        common: overrides for every case, applied last (epochs, batch limits, seed).
        probe_every_batches: rank 0's validation probes (see :class:`Timeline`).
        quiet: no per-epoch progress lines.
    """
    Path(out).mkdir(parents=True, exist_ok=True)  # where these runs came from, beside them
    Path(out, "provenance.json").write_text(json.dumps(provenance(), indent=1) + "\n")
    return {
        name: run_study(
            name,
            [*STUDY_OVERRIDES, *overrides, *common],
            Path(out, re.sub(r"[^\w.+-]+", "_", case_dir_name(name))),
            probe_every_batches,
            quiet,
        )
        for name, overrides in cases.items()
    }


# ---------------------------------------------------------------------------------------------------- seeds
def seed_cases(cases: Mapping[str, Sequence[str]], seeds: Iterable[int]) -> dict[str, list[str]]:
    """``{"<case> s<seed>": overrides + seed=<seed>}``: every case once per seed, seed by seed (so a drift of the
    machine's load spreads over all cases alike). Read them back by case with :func:`by_case`."""
    return {f"{name} s{seed}": [*overrides, f"seed={seed}"] for seed in seeds for name, overrides in cases.items()}


def by_case(runs: Mapping[str, StudyRun]) -> dict[str, list[StudyRun]]:
    """The runs of :func:`seed_cases` grouped by case (the name before `` s<seed>``), in first-seen order."""
    grouped: dict[str, list[StudyRun]] = {}
    for name, run in runs.items():
        grouped.setdefault(name.rsplit(" s", 1)[0], []).append(run)
    return grouped
