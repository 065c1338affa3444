"""The composed time to a target: a trajectory's steps times a measured step time, checked against end-to-end runs."""

from __future__ import annotations

import pytest
from repo_utils import load_script

from lightning_sync.apps.bench import time_to_target as ttt

pytestmark = pytest.mark.unit


def _run(case, seed, steps, seconds, rate="loopback"):
    return {"case": case, "seed": seed, "rate": rate, "ok": True, "steps_to_target": steps,
            "seconds_to_target": seconds, "target_loss": 1.5 + seed / 100}  # fmt: skip


def _window(case, rate, ms):
    return {"case": case, "rate": rate, "metric": "window_step_ms", "median": ms}


TRAJECTORIES = {
    "records": [
        *(_run("lightning_ddp", s, 992, 40.0 + s) for s in range(3)),
        *(_run("diloco", s, 1008 + 16 * s, 38.0) for s in range(3)),
        _run("periodic", 0, 1200, 50.0),
        _run("periodic", 1, None, None),  # never reached the target
        _run("periodic", 2, 1300, 55.0),
        *(_run("ps_async", s, 900 + s, 30.0 + s) for s in range(3)),
    ]
}
WINDOWS = [
    {
        "summary": [
            _window("lightning_ddp", "1mbit", 13_000.0),
            _window("diloco", "1mbit", 900.0),
            _window("periodic", "1mbit", 1700.0),
            _window("floor", "1mbit", 30.0),
        ]
    },  # fmt: skip
    {"summary": [_window("lightning_ddp", "1gbit", 60.0), _window("diloco", "1gbit", 40.0)]},
]
VALIDATION = {
    "records": [
        _run("lightning_ddp", 0, 992, 64.0, rate="1gbit"),
        _run("diloco", 0, 1008, 50.0, rate="1gbit"),
        _run("ps_async", 0, 950, 44.0, rate="1gbit"),
    ]
}


def test_steps_times_step_time_per_seed_and_measured_where_steps_depend_on_timing():
    out = ttt.compose(TRAJECTORIES, WINDOWS, VALIDATION)
    assert out["seeds"] == [0, 1, 2] and out["targets"] == {0: 1.5, 1: 1.51, 2: 1.52}
    diloco = out["cases"]["diloco"]
    assert diloco["seconds"]["1mbit"]["per_seed"] == pytest.approx([1008 * 0.9, 1024 * 0.9, 1040 * 0.9])
    assert diloco["how"] == {"1mbit": "composed", "10mbit": "not run", "100mbit": "not run", "1gbit": "composed",
                             "loopback": "not run"}  # fmt: skip
    # loopback: composed like any rate, from a window there (none here); the trajectories' own times are not used
    # a seed that never reached the target: no mean (the case is "not reached"), steps kept per seed
    assert out["cases"]["periodic"]["seconds"]["1mbit"]["mean"] is None
    # ps: never composed, only its end-to-end runs count
    ps = out["cases"]["ps_async"]
    assert ps["how"]["1mbit"] == "not run" and ps["how"]["1gbit"] == "measured"
    assert ps["seconds"]["1gbit"]["per_seed"] == [44.0]
    # the floor runs DDP's steps at its own step time
    assert out["cases"]["floor"]["seconds"]["1mbit"]["per_seed"] == pytest.approx([992 * 0.03] * 3)


def test_validation_puts_each_end_to_end_run_beside_its_composed_time():
    rows = {r["case"]: r for r in ttt.compose(TRAJECTORIES, WINDOWS, VALIDATION)["validation"]}
    assert set(rows) == {"lightning_ddp", "diloco"}  # ps is measured, not composed
    assert rows["lightning_ddp"]["composed_s"] == pytest.approx(992 * 0.06)
    assert rows["lightning_ddp"]["composed_over_measured"] == pytest.approx(59.52 / 64.0)
    assert rows["lightning_ddp"]["agrees"] is True  # 7% apart
    assert rows["diloco"]["composed_s"] == pytest.approx(1008 * 0.04) and rows["diloco"]["agrees"] is False  # 19%


def test_the_fastest_per_rate_its_ties_speedup_and_steps_over_ddp():
    decisions = {d["rate"]: d for d in ttt.decide(ttt.compose(TRAJECTORIES, WINDOWS, VALIDATION))}
    slow = decisions["1mbit"]
    assert slow["fastest"] == "diloco" and slow["ties"] == []
    assert slow["speedup_vs_ddp"] == pytest.approx((992 * 13.0) / (1024 * 0.9))
    assert slow["steps_vs_ddp"] == pytest.approx(1024 / 992)
    # loopback: only ps async ran there (measured end to end)
    assert decisions["loopback"]["fastest"] == "ps_async" and decisions["loopback"]["how"] == "measured"
    assert decisions["loopback"]["speedup_vs_ddp"] is None
    # 1 Gbit: diloco's [40.3, 41.6] s against ps async's one run, 44 s: no overlap, no tie
    assert decisions["1gbit"]["fastest"] == "diloco" and decisions["1gbit"]["ties"] == []
    assert decisions["1gbit"]["speedup_vs_ddp"] == pytest.approx(59.52 / 41.0, rel=0.01)
    assert "10mbit" not in decisions  # no case was timed there


def test_tables_say_not_reached_measured_and_timing_dependent():
    report = ttt.compose(TRAJECTORIES, WINDOWS, VALIDATION)
    header, body = ttt.time_table(report)
    assert header == ["case", "steps to target", "1mbit", "1gbit", "loopback"]  # a rate nobody ran is left out
    rows = {r[0]: r for r in body}
    assert rows["`periodic`"][2] == "not reached"
    assert rows["`ps_async`"][1] == "timing-dependent" and rows["`ps_async`"][3].endswith("(measured)")
    assert rows["`diloco`"][2] == "15 min [15 min, 16 min]" and rows["`diloco`"][3] == "41 s [40 s, 42 s]"
    header, body = ttt.decision_table(ttt.decide(report))
    assert body[0][:2] == ["1mbit", "`diloco`"]


def test_redoing_one_case_of_a_phase_replaces_its_records_and_lists_its_command(tmp_path, monkeypatch):
    import json

    script = load_script("benchmarks/time_to_target.py", "time_to_target_script")
    out = tmp_path / "ttt"
    for phase, data in {
        "trajectories": {**TRAJECTORIES, "provenance": {"commit": "trajectories"}},
        "validation": {
            "records": [_run("lightning_ddp", 0, 992, 64.0, "1gbit"), _run("ps_async", 0, None, None, "1gbit")],
            "summary": [{"case": "ps_async", "metric": "seconds_to_target"}, {"case": "lightning_ddp"}],
            "provenance": {"commit": "old"},
        },
    }.items():
        (out / "parts" / phase).mkdir(parents=True)
        (out / "parts" / phase / "results.json").write_text(json.dumps(data))
    ran = []

    def bench(command, check):  # what `python -m lightning_sync.bench` would write: the reused DDP, the case again
        ran.append(command)
        folder = out / "parts" / "validation" / "cases" / "ps_async"
        assert command[command.index("--out") + 1] == str(folder)
        folder.mkdir(parents=True)
        records = [_run("lightning_ddp", 0, 992, 64.0, "1gbit"), _run("ps_async", 0, 950, 44.0, "1gbit")]
        (folder / "results.json").write_text(json.dumps({"records": records, "provenance": {"commit": "new"}}))

    monkeypatch.setattr(script.subprocess, "run", bench)
    monkeypatch.setattr(script, "provenance", lambda: {"commit": "now"})
    args = ["--out", str(out), "--only", "validation", "--redo", "validation", "--case", "ps_async"]
    script.main(args)
    (command,) = ran
    assert [a for a in command if a.startswith("cases=")] == ["cases=ps_async"]
    assert f"ddp_from={out / 'parts' / 'validation' / 'results.json'}" in command
    merged = json.loads((out / "parts" / "validation" / "results.json").read_text())
    assert [(r["case"], r["steps_to_target"]) for r in merged["records"]] == [("lightning_ddp", 992), ("ps_async", 950)]
    assert merged["summary"] == [{"case": "lightning_ddp"}]  # the case's old row is gone; the new run had none
    assert merged["provenance"] == {"commit": "old"} and merged["merged"][0]["provenance"] == {"commit": "new"}
    report = json.loads((out / "time_to_target.json").read_text())
    assert "cases=ps_async" in report["commands"]["validation (ps_async)"]
    assert report["parts_provenance"]["validation (ps_async)"] == {"commit": "new"}
    assert report["cases"]["ps_async"]["seconds"]["1gbit"]["per_seed"] == [44.0]
    ran.clear()
    import shutil

    shutil.rmtree(out / "parts" / "validation" / "cases")
    script.main(args)  # again: one entry per case in `merged`, the latest
    assert len(json.loads((out / "parts" / "validation" / "results.json").read_text())["merged"]) == 1
