"""lightning_sync.apps.ps_study: the parameter-server experiment helpers, on real (tiny) runs of 2 forked workers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_sync.apps.ps_study import (
    TIMELINE_DIR,
    PSRun,
    format_seed_table,
    format_table,
    parse_mode,
    ps_overrides,
    run_ps,
    summarize,
)

WORKERS = 2


def _squeezed(text: str) -> str:
    """``text`` with runs of spaces as one: a padded Markdown table's rows as their cells read."""
    return re.sub(r" +", " ", text)


@pytest.mark.unit
def test_overrides_name_the_case():
    assert parse_mode("ssp:3") == ("ssp", 3) and parse_mode("async") == ("async", None)
    with pytest.raises(ValueError, match="ssp only"):
        parse_mode("async:2")
    out = ps_overrides("ssp:3", workers=2, slow_worker=1, slowdown=2.0, num_servers=2, max_steps=7, extra=["seed=1"])
    for item in (
        "strategy=ps",
        "strategy.mode=ssp",
        "strategy.max_staleness=3",
        "trainer.devices=2",
        "strategy.slow_worker=1",
        "strategy.slowdown=2.0",
        "strategy.num_servers=2",
        "trainer.max_steps=7",
    ):
        assert item in out
    assert out[-1] == "seed=1" and not any("slow_worker" in o for o in ps_overrides("sync", slow_worker=-1))


def _write_timeline(run_dir: Path, mode: str, rows: list[tuple[float, int]]) -> None:
    folder = run_dir / TIMELINE_DIR
    folder.mkdir(parents=True)
    record = {
        "rank": 0,
        "workers": 2,
        "mode": mode,
        "num_servers": 1,
        "model_bytes": 100,
        "batch_size": 8,
        "first_batch": 10.0,
        "probes": [],
        "rows": [
            {"t": t, "version": v, "staleness": 0, "applied": True, "ingress": [200 * v], "loss": 1.0} for t, v in rows
        ],
    }
    (folder / "rank0.json").write_text(json.dumps(record))


@pytest.mark.unit
def test_throughput_is_the_version_slope_past_the_skipped_updates(tmp_path):
    rows = [(11.0, 1), (12.0, 2), (12.5, 4), (13.5, 8), (14.5, 10)]
    _write_timeline(tmp_path / "sync", "sync", rows)
    _write_timeline(tmp_path / "async", "async", rows)
    sync, asyn = PSRun.load("sync", tmp_path / "sync"), PSRun.load("async", tmp_path / "async")
    # skip 30% of 10 updates: the window starts at the first row with version >= 3 (12.5 s, version 4)
    assert sync.throughput(skip=0.3) == pytest.approx((10 - 4) * 2 * 8 / 2.0)  # sync: W batches per update
    assert asyn.throughput(skip=0.3) == pytest.approx((10 - 4) * 8 / 2.0)
    assert sync.ingress_per_update(skip=0.3) == [pytest.approx(200.0)]
    assert sync.training_s == pytest.approx(4.5)
    (row_sync, row_async) = summarize([sync, asyn], skip=0.3)
    assert row_sync["ratio"] == 1.0 and row_async["ratio"] == pytest.approx(0.5)


@pytest.mark.unit
def test_seed_table_gives_mean_and_range_over_rounds_and_ties(tmp_path):
    rows = [(11.0, 1), (12.0, 2), (12.5, 4), (13.5, 8), (14.5, 10)]
    runs = {}
    for name, mode, accuracy in (("sync s0", "sync", 0.90), ("sync s1", "sync", 0.92), ("async s0", "async", 0.91)):
        _write_timeline(tmp_path / name, mode, rows)
        runs[name] = PSRun.load(name, tmp_path / name, {"test": {"test/acc": accuracy}, "step_time_ms": 10.0})
    table_rows = summarize({"sync": [runs["sync s0"], runs["sync s1"]], "async": [runs["async s0"]]}, skip=0.3)
    assert [r["name"] for r in table_rows] == ["sync", "async"] and table_rows[0]["rounds"] == 2
    assert table_rows[0]["step_mss"] == [10.0, 10.0] and table_rows[0]["training_ss"] == [pytest.approx(4.5)] * 2
    table = _squeezed(format_seed_table(table_rows)).splitlines()
    assert table[0].startswith(
        "| mode | samples/s mean [min, max] | vs sync | test acc mean [min, max] | acc vs sync |"
    )
    assert table[2].startswith("| sync | 48 [48, 48] | tie | 91.00% [90.00, 92.00] | tie |")
    assert table[3].startswith("| async | 24 [24, 24] | worse | 91.00% [91.00, 91.00] | tie |")
    with pytest.raises(ValueError, match="reference 'ddp' is not a case"):
        format_seed_table(table_rows, reference="ddp")


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_async_run_records_throughput_staleness_and_accuracy(tmp_path):
    overrides = ps_overrides("async", workers=WORKERS, slow_worker=1, slowdown=3.0, max_steps=30)
    run = run_ps("async", overrides, tmp_path / "async", probe_every_s=0.0)
    assert run.mode == "async" and run.num_workers == WORKERS and len(run.workers) == WORKERS
    assert run.updates == 30 and run.samples_per_update == 32
    assert run.throughput() > 0 and all(rate > 0 for rate in run.worker_push_rates())
    pushes = run.staleness()
    assert all(pushes) and max(s for worker in pushes for s in worker) >= 1, pushes
    # every update is one push; the push that hits the stop is not seen (the final pull's reply replaces it)
    assert sum(len(worker) for worker in pushes) >= 29
    assert len(pushes[1]) < len(pushes[0]), pushes  # async: the straggler does not set the fast worker's pace
    t, acc = run.accuracy_curve()
    assert len(t) >= 5 and all(0.0 <= a <= 1.0 for a in acc)
    assert run.test_accuracy is not None and 0.0 < run.test_accuracy <= 1.0


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_sync_ingress_per_server_sums_to_workers_times_model_bytes(tmp_path):
    runs = []
    for servers in (1, 2):
        overrides = ps_overrides(
            "sync", workers=WORKERS, slow_worker=-1, num_servers=servers, max_steps=8, extra=["test=false"]
        )
        runs.append(run_ps(f"{servers} servers", overrides, tmp_path / f"s{servers}"))
    for servers, run in zip((1, 2), runs):
        per_server = run.ingress_per_update()
        assert len(per_server) == servers and all(b > 0 for b in per_server)
        headers = sum(per_server) - WORKERS * run.model_bytes  # a header and the learning rate per push per server
        assert 0 <= headers < WORKERS * servers * 256, per_server
        assert [set(worker) for worker in run.staleness()] == [{0}] * WORKERS and run.throughput() > 0
    assert 0.35 < runs[1].ingress_per_update()[0] / sum(runs[1].ingress_per_update()) < 0.65
    table = _squeezed(format_table(summarize(runs, reference="1 servers")))
    assert "| 2 servers |" in table and "ms/step" in table and "test acc" in table
