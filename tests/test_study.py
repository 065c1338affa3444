"""lightning_sync.apps.study: the notebooks' experiment helpers, on written run folders and on real 2-rank runs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lightning_sync.apps.cases import periodic_cases
from lightning_sync.apps.markdown import band_cell
from lightning_sync.apps.stats import error_bar
from lightning_sync.apps.study import (
    TIMELINE_DIR,
    StudyRun,
    Timeline,
    by_case,
    format_link_model,
    format_runs,
    format_seed_link_model,
    format_seed_runs,
    load_time_to_accuracy,
    modelled_accuracy_curve,
    modelled_step_seconds,
    modelled_time_to_accuracy,
    run_cases,
    seed_cases,
)

DIGITS_GRADIENT_BYTES = 104_488  # 26,122 fp32 parameters: a ring all-reduce on 2 ranks sends that many per rank


def _squeezed(text: str) -> str:
    """``text`` with runs of spaces as one: a padded Markdown table's rows as their cells read."""
    return re.sub(r" +", " ", text)


def _write_run(run_dir: Path) -> StudyRun:
    """A run folder of 6 batches, 3 optimizer steps (accumulation 2), a sync at batches 2, 4 and 6."""
    (run_dir / TIMELINE_DIR).mkdir(parents=True)
    rows = []
    for batch in range(1, 7):
        synced = batch % 2 == 0
        rows.append(
            {
                "t": 100.0 + batch,
                "batch": batch,
                "seconds": 0.5,
                "comm_s": 0.2 if synced else 0.0,
                "step": batch // 2,
                "loss": float(7 - batch),
                "divergence": 0.1 * batch if synced else None,
                "period": 2,
            }
        )
    probes = [
        {"t": 101.0, "batch": 1, "step": 0, "acc": 0.2, "loss": 2.0, "cost_s": 0.25},
        {"t": 105.0, "batch": 5, "step": 2, "acc": 0.8, "loss": 0.5, "cost_s": 0.25},
    ]
    record = {
        "rank": 0,
        "workers": 2,
        "mode": "local_sgd",
        "model_bytes": 400,
        "batch_size": 8,
        "first_batch": 100.5,
        "rows": rows,
        "probes": probes,
    }
    (run_dir / TIMELINE_DIR / "rank0.json").write_text(json.dumps(record))
    summary = {
        "optimizer_steps": 3,
        "batches": 6,
        "step_time_ms": 500.0,
        "bytes_sent_per_step": 1000.0,
        "comm_seconds_per_step": 0.4,
        "calls_per_step": 2.0,
        "test": {"test/acc": 0.75},
        "diverged": False,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.csv").write_text("comm/bytes_sent,step,sync/period\n1000.0,0,2\n,1,\n1000.0,2,2\n")
    return StudyRun.load("case", run_dir)


@pytest.mark.unit
def test_a_run_folder_reads_back_per_batch(tmp_path):
    run = _write_run(tmp_path / "run")
    assert run.batches == 6 and run.test_accuracy == 0.75 and not run.diverged
    assert run.bytes_sent_per_batch == pytest.approx(500.0)  # 3 steps x 1000 bytes over 6 batches
    assert run.compute_seconds_per_batch(warmup=0) == pytest.approx(0.4)  # median of 0.5 and 0.3 over six batches
    # the clock starts at the first batch and leaves the probes out: the last row (106.0) is 5.5 s in, minus 2 x 0.25
    assert run.training_s == pytest.approx(5.0)
    assert run.comm_share == pytest.approx(0.4 * 3 / 5.0)
    assert run.accuracy_curve(x="time") == ([pytest.approx(0.5), pytest.approx(4.25)], [0.2, 0.8])
    assert run.accuracy_curve() == ([1.0, 5.0], [0.2, 0.8])
    x, loss = run.loss_curve(smooth=2)
    assert x == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and loss[:3] == [6.0, 5.5, 4.5]
    assert run.series("divergence") == ([1.0, 2.0, 3.0], [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.6)])
    assert run.syncs == 3 and run.mean_divergence == pytest.approx(0.4)
    assert run.batches_to_accuracy(0.5) == 5 and run.batches_to_accuracy(0.9) is None
    assert run.metric("comm/bytes_sent") == ([0, 2], [1000.0, 1000.0])
    with pytest.raises(ValueError, match="x='epoch' is not allowed"):
        run.loss_curve(x="epoch")


@pytest.mark.unit
def test_slow_link_model_is_compute_plus_bytes_over_rate(tmp_path):
    run = _write_run(tmp_path / "run")
    compute = run.compute_seconds_per_batch()  # batches 4 to 6: 0.3, 0.5, 0.3
    assert compute == pytest.approx(0.3)
    assert modelled_step_seconds(run, 1e4) == pytest.approx(0.3 + 8 * 500 / 1e4)
    assert modelled_time_to_accuracy(run, 0.5, 1e4) == pytest.approx(5 * (0.3 + 0.4))
    assert modelled_time_to_accuracy(run, 0.9, 1e4) is None
    assert modelled_accuracy_curve(run, 1e4) == ([pytest.approx(0.7), pytest.approx(3.5)], [0.2, 0.8])
    table = _squeezed(format_link_model([run], 0.5, {"10kbit": 1e4}))
    assert "| case | 300.00 | 5 | 700.0 | 3.5 |" in table


@pytest.mark.unit
def test_tables_name_their_columns(tmp_path):
    run = _write_run(tmp_path / "run")
    table = _squeezed(
        format_runs([run], columns=("test acc", "bytes sent/batch", "syncs", "mean divergence", "comm share"))
    )
    assert table.splitlines()[0] == "| case | test acc | bytes sent/batch | syncs | mean divergence | comm share |"
    assert table.splitlines()[2] == "| case | 75.00% | 500 | 3 | 0.4000 | 24.0% |"
    with pytest.raises(ValueError, match="columns \\['speed'\\] are not allowed"):
        format_runs([run], columns=("speed",))


@pytest.mark.unit
def test_band_cell_is_mean_and_range_and_counts_missing_values():
    assert band_cell([1.0, 2.0, 6.0], ".1f") == "3.0 [1.0, 6.0]"
    assert band_cell([90.0, None], ".2f", "%") == "90.00% [90.00, 90.00] (1 of 2)"
    assert band_cell([None, None]) == "-"


@pytest.mark.unit
def test_error_bar_is_the_mean_and_its_distances_to_the_ends_never_negative():
    assert error_bar([1.0, 2.0, 6.0]) == (3.0, [[2.0], [3.0]])
    assert error_bar([5.0, None]) == (5.0, [[0.0], [0.0]])
    mean, (low, high) = error_bar([0.1] * 3)  # the mean of equal values may round past them
    assert low[0] >= 0.0 and high[0] >= 0.0
    assert error_bar([None]) is None and error_bar([]) is None


@pytest.mark.unit
def test_seed_tables_give_mean_and_range_and_call_overlaps_a_tie(tmp_path):
    accuracies = {"ref": (0.90, 0.92), "close": (0.91, 0.95), "low": (0.50, 0.60), "high": (0.96, 0.97)}
    runs = {}
    for name in seed_cases({case: [] for case in accuracies}, (0, 1)):
        case, seed = name.rsplit(" s", 1)
        run = _write_run(tmp_path / name.replace(" ", "_"))
        run.summary["test"]["test/acc"] = accuracies[case][int(seed)]
        runs[name] = run
    groups = by_case(runs)
    assert list(groups) == list(accuracies) and all(len(g) == 2 for g in groups.values())
    table = _squeezed(format_seed_runs(groups, columns=("test acc", "bytes sent/step"), reference="ref")).splitlines()
    assert table[0] == "| case | test acc mean [min, max] | vs ref | bytes sent/step mean [min, max] |"
    assert table[2] == "| ref | 91.00% [90.00, 92.00] | tie | 1,000 [1,000, 1,000] |"
    assert [line.split(" | ")[2] for line in table[3:]] == ["tie", "worse", "better"]
    runs["low s1"].summary["diverged"] = True
    assert "| low | 50.00% [50.00, 50.00] (1 of 2) | worse |" in _squeezed(
        format_seed_runs(groups, ("test acc",), "ref")
    )
    with pytest.raises(ValueError, match="columns \\['speed'\\] are not allowed"):
        format_seed_runs(groups, columns=("speed",))
    with pytest.raises(ValueError, match="reference 'none' is not a case"):
        format_seed_runs(groups, reference="none")
    model = _squeezed(format_seed_link_model(groups, 0.5, {"10kbit": 1e4}, reference="ref")).splitlines()
    assert model[0].endswith(
        "| modelled ms/batch 10kbit mean [min, max] | modelled s to 50% 10kbit mean [min, max] | vs ref 10kbit |"
    )
    assert (
        model[2]
        == "| ref | 300.00 [300.00, 300.00] | 5.0 [5.0, 5.0] | 700.0 [700.0, 700.0] | 3.50 [3.50, 3.50] | tie |"
    )


@pytest.mark.unit
def test_measured_time_to_accuracy_is_optional_and_checked(tmp_path):
    assert load_time_to_accuracy(tmp_path / "absent.json") == []
    file = tmp_path / "tta.json"
    good = [
        {"case": "allreduce", "rate": "10mbit", "seconds_to_target": 12.5, "target": 0.9},
        {"case": "topk", "rate": "10mbit", "seconds_to_target": None, "target": 0.9},
    ]
    file.write_text(json.dumps(good))
    assert load_time_to_accuracy(file) == good
    file.write_text(json.dumps([{"case": "x", "rate": 10, "seconds_to_target": 1.0, "target": 0.9}]))
    with pytest.raises(ValueError, match="record 0 has rate=10"):
        load_time_to_accuracy(file)
    file.write_text(json.dumps([{"case": "x", "rate": "10mbit", "target": 0.9}]))
    with pytest.raises(ValueError, match="seconds_to_target=None"):
        load_time_to_accuracy(file)


@pytest.mark.unit
def test_periodic_cases_pair_diloco_with_its_inner_adamw():
    cases = periodic_cases(("gradient", "diloco"), (1, 8))
    assert list(cases) == ["gradient/1", "gradient/8", "diloco/1", "diloco/8"]
    assert cases["diloco/8"][-1] == "experiment=diloco" and "strategy.sync_every=8" in cases["diloco/8"]
    assert "experiment=diloco" not in cases["gradient/8"]
    with pytest.raises(ValueError, match="probe_every_batches=0"):
        Timeline("x", probe_every_batches=0)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_real_runs_record_syncs_bytes_and_probes(tmp_path):
    common = ["trainer.max_epochs=1", "++trainer.limit_train_batches=6", "++trainer.limit_val_batches=1", "test=false"]
    cases = {
        **periodic_cases(("gradient", "local_sgd"), (2,)),
        "auto, 5%": [
            "strategy=periodic",
            "strategy.mode=local_sgd",
            "strategy.sync_every=auto",
            "strategy.max_sync_every=4",
            "strategy.target_comm_fraction=0.05",
        ],
    }
    runs = run_cases(cases, tmp_path, common=common, probe_every_batches=5)
    assert (tmp_path / "auto_5pct" / TIMELINE_DIR / "rank1.json").is_file()
    gradient, local = runs["gradient/2"], runs["local_sgd/2"]
    for run in (gradient, local):
        assert run.batches == 6 and run.accuracy_curve()[0] == [1.0, 5.0]
        assert all(0.0 <= a <= 1.0 for a in run.accuracy_curve()[1])
        assert run.compute_seconds_per_batch() > 0 and run.training_s > 0
    # gradient mode: 3 optimizer steps of one dense all-reduce each, over 6 batches
    assert gradient.summary["optimizer_steps"] == 3
    assert gradient.bytes_sent_per_batch == pytest.approx(DIGITS_GRADIENT_BYTES / 2)
    assert gradient.syncs == 0 and gradient.series("period")[1] == [2.0] * 6
    # local SGD: parameters averaged after steps 2, 4 and 6; only those batches spent time in collectives
    steps, drift = local.series("divergence")
    assert steps == [2.0, 4.0, 6.0] and all(d > 0 for d in drift) and local.syncs == 3
    comm = [row["comm_s"] for row in local.timeline["rows"]]
    assert all(c > 0 for c in comm[1::2]) and all(c == 0 for c in comm[0::2]), comm
    assert local.bytes_sent_per_batch >= DIGITS_GRADIENT_BYTES / 2  # parameters and buffers, every 2nd batch
    adaptive = runs["auto, 5%"].series("period")[1]
    assert len(adaptive) == 6 and all(1 <= p <= 4 for p in adaptive) and math.isfinite(runs["auto, 5%"].training_s)
