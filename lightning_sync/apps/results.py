"""Readers of the results files ``python -m lightning_sync.bench`` writes (emulated links need root), if any."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_time_to_accuracy(path: str | Path) -> list[dict[str, Any]]:
    """Measured time-to-accuracy records (``python -m lightning_sync.bench`` writes them to
    ``<out>/time_to_accuracy.json``), or ``[]`` if the file is absent.

    Each record: ``case`` (str), ``rate`` (str, e.g. ``10mbit``), ``seconds_to_target`` (float, or ``None`` when
    the target was not reached) and ``target`` (the accuracy aimed at).

    Args:
        path: the JSON file (a list of records).

    Raises:
        ValueError: the file is not a list of such records (names the record and the field).
    """
    file = Path(path)
    if not file.is_file():
        return []
    records = json.loads(file.read_text())
    if not isinstance(records, list):
        raise ValueError(f"{file}: expected a list of records, got {type(records).__name__}")
    expected = "expected {case: str, rate: str, seconds_to_target: number or null, target: number}"
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{file}: record {i} is {record!r}; {expected}")
        checks = {"case": (str,), "rate": (str,), "seconds_to_target": (int, float, type(None)), "target": (int, float)}
        for name, types in checks.items():
            value = record.get(name)
            if name not in record or not isinstance(value, types) or isinstance(value, bool):
                raise ValueError(f"{file}: record {i} has {name}={value!r}; {expected}")
    return records


def load_bench_rows(workload: str, root: str | Path) -> list[dict[str, Any]]:
    """The summary rows of ``workload`` in every benchmark ``results.json`` under ``root`` (the folders ``python -m
    lightning_sync.bench`` writes), or ``[]`` if there are none.

    Each row is the benchmark's (``case``, ``rate``, ``median``, ``spread``, ``target_loss``,
    ``median_bytes_sent_per_step``, ``median_wire_bytes_per_step``, ``median_wire_over_meter``, ...) plus ``file``:
    the results file it came from.
    """
    folder = Path(root)
    rows = []
    for file in sorted(folder.rglob("results.json")) if folder.is_dir() else []:
        data = json.loads(file.read_text())
        if isinstance(data, dict) and {"config", "summary"} <= data.keys():
            rows += [{**r, "file": str(file)} for r in data["summary"] if r.get("workload") == workload]
    return rows
