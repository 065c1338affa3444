"""The benchmark command: its config errors, its report arithmetic, a tiny real run on loopback, and (root only) a
tiny run between two emulated hosts behind 1 Gbit links."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import time

import pytest

from lightning_sync.apps.bench.cli import _parser, main
from lightning_sync.apps.bench.config import BenchConfig, parse_overrides
from lightning_sync.apps.bench.launch import free_port
from lightning_sync.apps.bench.report import markdown, summarize, time_to_accuracy
from lightning_sync.errors import ConfigError


def _squeezed(text: str) -> str:
    """``text`` with runs of spaces as one: a padded Markdown table's rows as their cells read."""
    return re.sub(r" +", " ", text)


@pytest.mark.unit
@pytest.mark.parametrize(
    "override,named,allowed",
    [
        ("network.rate=2mbit", "network.rate='2mbit'", "loopback, 1mbit, 10mbit, 100mbit, 1gbit"),
        ("network.rate=loopback,fast", "network.rate='fast'", "1gbit"),
        ("cases=allreduce,nope", "cases='nope'", "torch_local_sgd"),
        (
            "workloads=resnet",
            "workloads='resnet'",
            "latency_bound, compute_bound, bandwidth_bound, digits, char_lm, payload",
        ),
        ("repeats=0", "repeats=0", ">= 1"),
        ("repeats=two", "repeats='two'", "an integer"),
        ("target_accuracy=1.5", "target_accuracy=1.5", "(0, 1]"),
        ("warmup_steps=60", "warmup_steps=60", "[0, 59]"),
        ("bogus=1", "bogus", "network.rate"),
        ("network.speed=1gbit", "network.speed", "network.rate"),
        ("plots=maybe", "plots='maybe'", "true or false"),
    ],
)
def test_bad_values_name_field_value_and_allowed(override, named, allowed):
    with pytest.raises(ConfigError) as info:
        parse_overrides([override])
    message = str(info.value)
    assert named in message and allowed in message and "\n" not in message, message


@pytest.mark.unit
def test_cases_must_fit_the_workloads():
    with pytest.raises(ConfigError, match=r"cases='gloo_allreduce' is not allowed with workloads=digits"):
        parse_overrides(["workloads=digits", "cases=periodic,gloo_allreduce"])
    with pytest.raises(ConfigError, match=r"workloads='payload' has none of cases=periodic"):
        parse_overrides(["workloads=digits,payload", "cases=periodic"])
    cfg = parse_overrides(["workloads=latency_bound,payload", "network.rate=loopback,1gbit"])
    assert cfg.cases_for("payload") == ["gloo_allreduce", "allreduce"]
    assert "gloo_allreduce" not in cfg.cases_for("latency_bound") and "floor" in cfg.cases_for("latency_bound")
    assert cfg.network.rate == ["loopback", "1gbit"]


@pytest.mark.unit
def test_cli_rejects_a_bad_value_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "out"), "network.rate=1tbit"])
    assert "network.rate='1tbit' is not allowed; choose one of: loopback, 1mbit, 10mbit, 100mbit, 1gbit" in str(
        info.value
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_help_lists_every_knob_case_and_workload():
    text = _parser().format_help()
    for name in (
        "network.rate=loopback",
        "repeats=3",
        "target_accuracy=0.95",
        "torch_local_sgd",
        "gloo_allreduce",
        "bandwidth_bound",
        "--out",
    ):
        assert name in text


@pytest.mark.unit
def test_summary_medians_and_ratios():
    cfg = BenchConfig()
    records = [
        {"workload": "latency_bound", "rate": "loopback", "case": case, "repeat": r, "ok": True, "step_time_ms": ms}
        for r, (a, b, f) in enumerate([(40.0, 30.0, 20.0), (50.0, 45.0, 10.0), (60.0, 20.0, 30.0)])
        for case, ms in (("lightning_ddp", a), ("allreduce", b), ("floor", f))
    ]
    records += [
        {"workload": "digits", "rate": "10mbit", "case": c, "repeat": 0, "ok": ok, "seconds_to_target": s}
        for c, ok, s in (
            ("lightning_ddp", True, 8.0),
            ("periodic", True, 2.0),
            ("topk", True, None),
            ("floor", False, None),
        )
    ]
    rows = {(r["workload"], r["case"]): r for r in summarize(records, cfg)}
    assert rows["latency_bound", "allreduce"]["median"] == 30.0
    assert rows["latency_bound", "allreduce"]["vs_lightning_ddp"] == pytest.approx(0.6)
    assert rows["latency_bound", "allreduce"]["vs_floor"] == pytest.approx(1.5)
    assert rows["digits", "periodic"]["vs_lightning_ddp"] == pytest.approx(0.25)
    assert rows["digits", "topk"]["median"] is None and rows["digits", "floor"]["failed"] == 1
    assert time_to_accuracy(list(rows.values()), cfg) == [
        {"case": c, "rate": "10mbit", "seconds_to_target": s, "target": 0.95}
        for c, s in (("lightning_ddp", 8.0), ("periodic", 2.0), ("topk", None), ("floor", None))
    ]
    table = _squeezed(markdown(list(rows.values()), cfg))
    assert "| allreduce | 30.00 | 0.60x | 1.50x |" in table
    assert "| topk | - | - | - | - | - | never |" in table


def _report(out):
    results = json.loads((out / "results.json").read_text())
    return results, _squeezed((out / "results.md").read_text())


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_tiny_run_on_loopback_writes_json_markdown_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    main(
        [
            "--out",
            str(out),
            "workloads=digits",
            "cases=torch_ddp,allreduce",
            "repeats=1",
            "warmup_steps=2",
            "target_accuracy=0.5",
            "max_epochs=3",
            "eval_every=4",
            "timeout_s=150",
        ]
    )
    printed = capsys.readouterr().out
    assert printed.count("] loopback ") == 2, printed  # one line per finished run
    results, table = _report(out)
    records = results["records"]
    assert [(r["workload"], r["case"]) for r in records] == [
        ("digits", "torch_ddp"),
        ("digits", "allreduce"),
    ]
    assert all(r["ok"] for r in records), records
    for r in records:
        assert r["step_time_ms"] > 0 and r["seconds_to_target"] > 0 and r["steps_to_target"] % 4 == 0
        assert r["final_accuracy"] >= 0.5 and r["trajectory"][-1][2] == r["final_accuracy"]
    assert records[1]["bytes_sent_per_step"] == pytest.approx(104_488)  # the digits MLP, ring formula, 2 ranks
    assert "| torch_ddp |" in table and "| allreduce" in table and "vs torch_ddp" in table
    assert "network loopback" in table
    tta = json.loads((out / "time_to_accuracy.json").read_text())
    assert {(r["case"], r["rate"], r["target"]) for r in tta} == {
        ("torch_ddp", "loopback", 0.5),
        ("allreduce", "loopback", 0.5),
    }
    assert all(r["seconds_to_target"] > 0 for r in tta)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "digits.png").stat().st_size > 0


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_run_past_its_timeout_fails_cleanly(tmp_path, capsys):
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), "cases=torch_ddp", "repeats=1", "timeout_s=2", "plots=false"])
    assert info.value.code == 1
    results, _ = _report(out)
    (record,) = results["records"]
    # Past its 2 s the run is killed; on a loaded machine its ranks may give up first (their rendezvous honours the
    # same timeout_s), which must fail just as cleanly.
    error = record["error"]
    assert not record["ok"] and ("timed out after 2 s" in error or "node exit codes" in error), record
    assert "FAILED: " in capsys.readouterr().out
    deadline = time.monotonic() + 10  # SIGKILLed processes leave the table once the kernel has reaped them
    while True:
        leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    states = {
        pid: pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
        for pid in leftover
        if pathlib.Path(f"/proc/{pid}/stat").exists()
    }
    assert not leftover, f"processes of the run are still alive after 10 s: {states}"


@pytest.mark.unit
def test_char_lm_cases_put_the_target_setter_first_and_need_it():
    cfg = parse_overrides(["workloads=char_lm", "cases=allreduce,diloco,lightning_ddp,floor"])
    assert cfg.cases_for("char_lm") == ["lightning_ddp", "allreduce", "diloco", "floor"]
    default = parse_overrides(["workloads=char_lm"]).cases_for("char_lm")
    assert default[0] == "lightning_ddp" and {"diloco", "ps_async", "torch_local_sgd", "single"} <= set(default)
    with pytest.raises(ConfigError, match=r"cases=allreduce,topk is not allowed with workloads=char_lm.*lightning_ddp"):
        parse_overrides(["workloads=char_lm", "cases=allreduce,topk"])
    with pytest.raises(ConfigError, match=r"give_up_factor=0.5"):
        parse_overrides(["workloads=char_lm", "give_up_factor=0.5"])


@pytest.mark.unit
def test_our_cases_read_bench_knobs_and_give_periodic_eval_points():
    from lightning_sync.apps.bench.config import OUR_CASES, sync_period

    cfg = parse_overrides(["workloads=char_lm", "sync_every=4", "diloco_sync_every=24"])
    assert OUR_CASES["diloco"].arguments(cfg) == {"mode": "diloco", "sync_every": 24}
    assert [sync_period(c, cfg) for c in ("periodic", "diloco", "torch_local_sgd", "topk", "ps_async")] == [
        4,
        24,
        4,
        1,
        1,
    ]


def _lm_record(case, repeat, trajectory, rate="10mbit", **extra):
    return {
        "workload": "char_lm",
        "rate": rate,
        "case": case,
        "repeat": repeat,
        "seed": repeat,
        "ok": True,
        "trajectory": trajectory,
        "seconds_to_target": None,
        "steps_to_target": None,
        **extra,
    }


@pytest.mark.unit
def test_targets_come_from_ddp_per_seed_and_time_is_read_off_trajectories():
    from lightning_sync.apps.bench.cli import Targets

    cfg = parse_overrides(["workloads=char_lm", "budget_steps=16", "give_up_factor=2"])
    assert [cfg.seed_of(r) for r in range(3)] == [0, 1, 2]
    assert parse_overrides(["seed=5", "seed_per_repeat=false"]).seed_of(2) == 5
    targets = Targets(cfg)
    assert targets.spec("char_lm", "10mbit", 0) == {}
    ddp = _lm_record("lightning_ddp", 0, [(4.0, 8, 2.9), (8.0, 16, 2.5)])
    targets.observe(ddp)
    assert ddp["seconds_to_target"] == 8.0 and ddp["steps_to_target"] == 16 and ddp["target_loss"] == 2.5
    assert targets.spec("char_lm", "10mbit", 0) == {"target": 2.5, "give_up_s": 16.0}
    assert targets.spec("char_lm", "1gbit", 0) == {"target": 2.5, "give_up_s": None}
    assert targets.spec("char_lm", "10mbit", 1) == {}  # seed 1 waits for its own DDP run
    targets.observe(_lm_record("lightning_ddp", 1, [(5.0, 16, 2.6)]))
    assert targets.spec("char_lm", "10mbit", 1) == {"target": 2.6, "give_up_s": 10.0}
    floor = _lm_record("floor", 0, [(1.0, 8, 3.0), (2.0, 16, 2.7)])
    targets.observe(floor)
    assert floor["seconds_at_budget"] == 2.0 and floor["seconds_to_target"] is None


@pytest.mark.unit
def test_a_window_measures_whole_sync_periods_after_the_warm_up(tmp_path):
    from lightning_sync.apps.bench.cli import Targets
    from lightning_sync.apps.bench.plots import write_plots
    from lightning_sync.apps.bench.report import markdown, summarize
    from lightning_sync.apps.bench.worker import _clock_for
    from lightning_sync.apps.bench.workloads import WORKLOADS

    cfg = parse_overrides(
        ["workloads=char_lm", "cases=diloco,floor", "window=2", "eval_every=4", "warmup_steps=10"]
    )  # no DDP needed: no target
    # scored every lcm(eval_every, period); the window starts at the first scoring at or past warmup_steps
    assert cfg.window_span("diloco") == (16, 48) and cfg.window_span("floor") == (12, 20)
    assert _clock_for("diloco", WORKLOADS["char_lm"], cfg, {"target": 2.0}) == (None, 16, True, None, 48)
    assert _clock_for("floor", WORKLOADS["char_lm"], cfg, {})[4] == 20
    targets = Targets(cfg)
    # diloco: 16 steps of warm-up, then 2 x 16 steps in 2 + 10 s (a slow sync at step 48)
    diloco = _lm_record("diloco", 0, [(4.0, 16, 3.0), (6.0, 32, 2.9), (16.0, 48, 2.8)], rate="1mbit")
    # the floor: its first 3 points are before step 12 (PowerSGD's uncompressed start, say): left out
    floor = _lm_record(
        "floor", 0, [(9.0, 4, 3.0), (9.5, 8, 2.9), (10.0, 12, 2.8), (10.5, 16, 2.7), (11.0, 20, 2.6)], "1mbit"
    )
    for record in (diloco, floor):
        targets.observe(record)
    assert diloco["window_step_ms"] == pytest.approx(1e3 * 12.0 / 32) and "target_loss" not in diloco
    assert floor["window_step_ms"] == pytest.approx(125.0) and floor["window_from"] == 12
    rows = summarize([diloco, floor], cfg)
    assert [r["median"] for r in rows] == pytest.approx([375.0, 125.0])
    assert rows[0]["utilization"] == pytest.approx(1 / 3)
    text = markdown(rows, cfg)
    assert "ms per step over 2 scoring intervals" in text and "past step 10" in text and "375.00" in text
    assert write_plots(rows, [diloco, floor], tmp_path, 2.0)  # the windows' axis has its label
    with pytest.raises(ConfigError, match=r"window=-1"):
        parse_overrides(["workloads=char_lm", "window=-1"])


def _ddp_results(tmp_path, rates=("10mbit",), seeds=(0, 1), **config):
    records = [
        _lm_record("lightning_ddp", seed, [(20.0 + seed, 16, 2.5 + seed / 10)], rate=rate, target_loss=2.5 + seed / 10)
        for rate in rates
        for seed in seeds
    ] + [_lm_record("floor", 0, [(1.0, 16, 3.0)])]
    base = {"budget_steps": 16, "eval_every": 8, "warmup_steps": 20, "flush_denormal": True, **config}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": base, "records": records, "summary": []}))
    return str(path)


@pytest.mark.unit
def test_ddp_from_reuses_ddp_runs_for_targets_and_leaves_them_out_of_the_plan(tmp_path):
    from lightning_sync.apps.bench.cli import Targets, _reuse_ddp

    path = _ddp_results(tmp_path)
    common = ["workloads=char_lm", "budget_steps=16", "repeats=2", "network.rate=10mbit", f"ddp_from={path}"]
    cfg = parse_overrides([*common, "cases=floor,streaming_diloco_8"])  # no lightning_ddp needed
    plan = [("10mbit", "char_lm", r, c) for r in range(2) for c in ("lightning_ddp", "floor")]
    records: list[dict] = []
    targets = Targets(cfg)
    left = _reuse_ddp(cfg, plan, targets, records)
    assert left == [("10mbit", "char_lm", 0, "floor"), ("10mbit", "char_lm", 1, "floor")]
    assert [(r["case"], r["seed"], r["reused_from"]) for r in records] == [
        ("lightning_ddp", 0, path),
        ("lightning_ddp", 1, path),
    ]
    assert targets.spec("char_lm", "10mbit", 1) == {"target": 2.6, "give_up_s": 42.0}
    # a rate the file lacks: DDP must run there
    with pytest.raises(ConfigError, match=r"ddp_from=.* has no lightning_ddp run of char_lm at 100mbit seed 0"):
        parse_overrides([*common[:-2], "network.rate=10mbit,100mbit", f"ddp_from={path}", "cases=floor"])
    both = parse_overrides([*common[:-2], "network.rate=10mbit,100mbit", f"ddp_from={path}", "cases=lightning_ddp"])
    plan = [(rate, "char_lm", 0, "lightning_ddp") for rate in ("10mbit", "100mbit")]
    assert _reuse_ddp(both, plan, Targets(both), []) == [("100mbit", "char_lm", 0, "lightning_ddp")]


@pytest.mark.unit
def test_ddp_from_refuses_a_file_run_with_other_knobs(tmp_path):
    common = ["workloads=char_lm", "budget_steps=16", "repeats=1", "cases=floor"]
    with pytest.raises(ConfigError, match=r"ddp_from=.* with budget_steps=16: its runs used budget_steps=160"):
        parse_overrides([*common, f"ddp_from={_ddp_results(tmp_path, budget_steps=160)}"])
    old = _ddp_results(tmp_path, flush_denormal=None)
    data = json.loads(pathlib.Path(old).read_text())
    del data["config"]["flush_denormal"]  # written before the knob: ran without flushing
    pathlib.Path(old).write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"flush_denormal=True: its runs used flush_denormal=False"):
        parse_overrides([*common, f"ddp_from={old}"])
    with pytest.raises(ConfigError, match=r"ddp_from='/nonexistent.json' is not allowed; it must be a benchmark"):
        parse_overrides([*common, "ddp_from=/nonexistent.json"])


@pytest.mark.unit
def test_char_lm_table_gives_median_spread_bounds_and_bytes():
    cfg = parse_overrides(["workloads=char_lm", "budget_steps=16", "repeats=2"])
    records = []
    for repeat, (ddp_s, diloco_s) in enumerate([(10.0, 1.0), (12.0, 3.0)]):
        common = {"target_loss": 2.5}
        records += [
            _lm_record("lightning_ddp", repeat, [(ddp_s, 16, 2.5)], seconds_to_target=ddp_s, steps_to_target=16,
                       final_loss=2.5, wire_bytes_per_step=1.7e6, wire_over_meter=1.03, **common),
            _lm_record("diloco", repeat, [(diloco_s, 32, 2.45)], seconds_to_target=diloco_s, steps_to_target=32,
                       final_loss=2.45, bytes_sent_per_step=1.0e5, wire_bytes_per_step=1.04e5, **common),
            _lm_record("topk", repeat, [(20.0, 48, 2.8)], final_loss=2.8, gave_up=True, **common),
            _lm_record("floor", repeat, [(0.5, 16, 2.9)], seconds_at_budget=0.5, final_loss=2.9, **common),
        ]  # fmt: skip
    rows = {r["case"]: r for r in summarize(records, cfg)}
    assert rows["diloco"]["median"] == 2.0 and rows["diloco"]["spread"] == [1.0, 3.0]
    assert rows["diloco"]["vs_lightning_ddp"] == pytest.approx(2.0 / 11.0)
    assert rows["diloco"]["vs_floor"] == pytest.approx(4.0) and rows["floor"]["median"] == 0.5
    assert rows["topk"]["median"] is None
    # mean ms/step from the trajectories (training s over steps): diloco 31.25 and 93.75, floor 31.25
    assert rows["diloco"]["median_mean_step_ms"] == pytest.approx(62.5)
    assert rows["diloco"]["utilization"] == pytest.approx(0.5) and rows["floor"]["utilization"] == 1.0
    assert rows["lightning_ddp"]["utilization"] == pytest.approx(31.25 / 687.5)
    table = _squeezed(markdown(list(rows.values()), cfg))
    assert "<= 2.5000 nats/char" in table and "wire/meter" in table
    assert "| diloco | 2.00 | 1.00-3.00 | 0.18x | 4.00x | 32 | 2.4500 | 62.5 | 50% |" in table
    from lightning_sync.apps.bench.report import _payload_kind

    assert [_payload_kind(c) for c in ("streaming_diloco", "topk", "diloco", "ps_async", "floor")] == [
        "compressed", "compressed", "ring", "push", ""
    ]  # fmt: skip
    assert "100,000 (ring)" in table and "| topk | not reached |" in table and "never never" in table
    assert "| floor (bound: s for budget_steps) | 0.50 |" in table


@pytest.mark.unit
def test_resummarize_recomputes_the_summary_and_table_from_the_records(tmp_path):
    from dataclasses import asdict

    from lightning_sync.apps.bench.report import resummarize

    cfg = parse_overrides(["workloads=char_lm", "budget_steps=16", "repeats=1"])
    records = [
        _lm_record("lightning_ddp", 0, [(8.0, 16, 2.5)], target_loss=2.5),
        _lm_record("floor", 0, [(2.0, 16, 2.9)], seconds_at_budget=2.0, target_loss=2.5),
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": asdict(cfg), "summary": [], "records": records}))
    resummarize(path)
    data = json.loads(path.read_text())
    rows = {r["case"]: r for r in data["summary"]}
    assert rows["lightning_ddp"]["utilization"] == pytest.approx(0.25) and data["records"] == json.loads(
        json.dumps(records)
    )
    assert "resummarized" in data and "| lightning_ddp |" in _squeezed((tmp_path / "results.md").read_text())


@pytest.mark.unit
def test_the_clock_gives_up_on_rank_0s_time_on_every_rank(monkeypatch):
    """A rank whose own clock is past ``give_up_s`` goes on while rank 0's is not: were the decision its own, it would
    stop a step before rank 0, which then waits in a collective for a rank that is gone."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_sync.apps.bench import clock as clock_module

    now = iter([0.0, 100.0, 100.0])  # start; then this rank sees 100 s of training, past give_up_s
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=lambda: next(now)))
    received = iter([0.0, 5.0, 1.0])  # rank 0's broadcasts: the meeting, its score, its 1 s of training

    def broadcast(value: float) -> float:  # this is rank 1
        return next(received)

    target = clock_module.TargetClock(lambda m: 5.0, 1.0, 1, broadcast, lower_is_better=True, give_up_s=2.0)
    target.start()
    assert target.check(nn.Linear(1, 1), step=1) is False
    assert target.trajectory == [(1.0, 1, 5.0)] and not target.gave_up


@pytest.mark.unit
def test_free_port_does_not_follow_the_seeded_random_module():
    """Processes seeded alike (``seed_everything(0)`` in two test workers) must not draw the same ports."""
    import random

    draws = []
    for _ in range(2):
        random.seed(0)
        draws.append([free_port() for _ in range(3)])
    assert draws[0] != draws[1]
