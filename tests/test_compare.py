"""The main job's seeds: mean and min-max spread over seeds, ties when ranges overlap, and the table and
results file both workloads give."""

from __future__ import annotations

import json
import os
import sys

import pytest
from app_utils import run_forked

from lightning_sync.apps.compare import (
    CASES,
    LM_CASES,
    LM_OPT_IN_CASES,
    aggregate,
    format_results,
    format_table,
    workloads,
)
from lightning_sync.apps.stats import Spread, spread, verdict, versus_reference


@pytest.mark.unit
def test_spread_is_mean_and_range_of_the_values_that_exist():
    s = spread([0.9, None, 0.8, float("nan"), 1.0])
    assert s == Spread(mean=pytest.approx(0.9), low=0.8, high=1.0, n=3)
    assert spread([None, None]) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("case", "reference", "higher", "expected"),
    [
        ((0.95, 0.96), (0.90, 0.94), True, "better"),
        ((0.95, 0.96), (0.90, 0.95), True, "tie"),  # touching ranges are a tie
        ((0.80, 0.85), (0.90, 0.94), True, "worse"),
        ((1.40, 1.45), (1.50, 1.60), False, "better"),  # a loss: lower is better
        ((1.70, 1.80), (1.50, 1.60), False, "worse"),
        ((1.55, 1.58), (1.50, 1.60), False, "tie"),  # inside
    ],
)
def test_verdict_against_the_reference(case, reference, higher, expected):
    a = Spread(sum(case) / 2, *case, n=3)
    b = Spread(sum(reference) / 2, *reference, n=3)
    assert verdict(a, b, higher) == expected
    assert verdict(None, b, higher) == "-"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("case", "reference", "expected"),
    [
        ((1.01, 1.00, 1.02), (1.0, 0.98, 1.025), "tie"),  # +1%, ranges overlap
        ((1.03, 1.02, 1.04), (1.0, 0.98, 1.025), "worse"),  # ranges overlap, but +3% is over the 2% bar
        ((1.015, 1.012, 1.02), (1.0, 0.99, 1.01), "worse"),  # +1.5%, but apart from the reference's range
        ((0.90, 0.88, 0.92), (1.0, 0.98, 1.025), "better"),
    ],
)
def test_versus_reference_needs_both_the_percent_bar_and_overlapping_ranges(case, reference, expected):
    percent, found = versus_reference(Spread(*case, n=3), Spread(*reference, n=3))
    assert percent == pytest.approx(100.0 * (case[0] - 1.0))
    assert found == expected
    row = {"mean": 1.0, "min": 0.99, "max": 1.01, "values": {"0": 1.0, "1": 0.99, "2": 1.01}}
    assert Spread.of_row(row) == Spread(1.0, 0.99, 1.01, n=3)


def _summary(seed, value, metric="test/acc", diverged=False, ms=10.0, sent=1000.0):
    s = {"seed": seed, "diverged": diverged, "step_time_ms": ms, "bytes_sent_per_step": sent}
    if not diverged:
        s["test"] = {metric: value}
    return s


@pytest.mark.unit
def test_aggregate_and_table_of_the_digits():
    work = workloads()["digits"]
    runs = {
        "ddp": [_summary(0, 0.96), _summary(1, 0.97, ms=12.0), _summary(2, 0.965, ms=11.0)],
        "allreduce+fp16": [_summary(s, v, sent=500.0) for s, v in enumerate((0.95, 0.962, 0.958))],
        "periodic:diloco/8": [_summary(0, None, diverged=True), _summary(1, 0.90), _summary(2, 0.91)],
    }
    rows = {r["case"]: r for r in aggregate(work, runs)}
    assert rows["ddp"]["vs_ddp"] == "reference" and rows["ddp"]["mean"] == pytest.approx(0.965)
    assert rows["ddp"]["step_time_ms_median"] == 11.0 and rows["ddp"]["seeds"] == [0, 1, 2]
    assert rows["allreduce+fp16"]["vs_ddp"] == "tie"  # 0.962 >= ddp's min 0.96
    assert rows["periodic:diloco/8"]["vs_ddp"] == "worse" and rows["periodic:diloco/8"]["diverged_seeds"] == [0]
    assert rows["periodic:diloco/8"]["values"] == [None, 0.90, 0.91]
    table = format_table(work, list(rows.values()))
    assert "96.50 [96.00, 97.00]" in table
    assert "90.50 [90.00, 91.00] (diverged: seed 0)" in table
    assert "| tie " in table and "| worse " in table
    assert "0.500" in table  # fp16's meter bytes against ddp's


@pytest.mark.unit
def test_a_loss_ranks_lower_as_better_and_the_results_render():
    work = workloads()["char_lm"]
    runs = {
        "ddp": [_summary(s, v, "test/loss") for s, v in enumerate((1.50, 1.52, 1.55))],
        "periodic:local_sgd/8": [_summary(s, v, "test/loss") for s, v in enumerate((1.40, 1.45, 1.48))],
    }
    rows = aggregate(work, runs)
    assert [r["vs_ddp"] for r in rows] == ["reference", "better"]
    results = {"seeds": [0, 1, 2], "sizes": {}, "workloads": {"char_lm": {"title": work.title, "rows": rows}}}
    text = format_results(results)
    assert text.startswith("### Character language model") and "seeds 0, 1, 2" in text
    assert "1.523 [1.500, 1.550]" in text and "| better " in text


@pytest.mark.unit
def test_both_workloads_run_over_three_seeds_by_default():
    from lightning_sync.apps.compare import DEFAULT_SEEDS, _parser

    assert len(DEFAULT_SEEDS) >= 3
    assert _parser().parse_args([]).workloads == "digits,char_lm"
    assert "ddp" in LM_CASES and len(LM_CASES) >= 3


@pytest.mark.unit
def test_opt_in_cases_run_only_when_named_and_ps_trains_on_the_same_samples():
    from lightning_sync.apps.compare import LM_OPT_IN_CASES, _parser, _plan

    default = _plan(_parser().parse_args(["--workloads", "char_lm"]))["char_lm"]
    assert set(default.cases) == set(LM_CASES) and not set(default.cases) & set(LM_OPT_IN_CASES)
    named = _plan(_parser().parse_args(["--workloads", "char_lm", "--cases", "ddp,ps:async_local/8", "--steps", "50"]))
    work = named["char_lm"]
    assert list(work.cases) == ["ddp", "ps:async_local/8"]
    assert work.per_case["ps:async_local/8"] == ["trainer.max_steps=100"]  # 2 workers x 50 steps each
    assert "ddp" not in work.per_case and "periodic:streaming_diloco/16" not in work.per_case
    with pytest.raises(SystemExit):
        _plan(_parser().parse_args(["--workloads", "digits", "--cases", "ps:async_local/8"]))


@pytest.mark.unit
def test_one_catalogue_gives_the_main_job_s_overrides_and_the_bench_s_arguments():
    from lightning_sync.apps.bench.config import OUR_CASES, BenchConfig
    from lightning_sync.apps.cases import CATALOGUE, select
    from lightning_sync.apps.compare import CASES

    # a case both harnesses run is one definition under two names
    assert OUR_CASES["powersgd"] is CATALOGUE["allreduce+powersgd4"] and OUR_CASES["ps_async"] is CATALOGUE["ps:async"]
    assert (
        CASES["allreduce+powersgd4"]
        == LM_CASES["allreduce+powersgd4"]
        == [
            "strategy=allreduce",
            "strategy.compression=powersgd",
        ]
    )
    assert OUR_CASES["powersgd"].arguments(BenchConfig()) == {"compression": "powersgd"}
    # diloco on the digits takes AdamW inside; the language model has it already
    assert (
        CASES["periodic:diloco/8"][-1] == "experiment=diloco"
        and "experiment=diloco" not in LM_CASES["periodic:diloco/8"]
    )
    # the bench's period knob replaces sync_every; at its default both harnesses run the same period
    periodic = OUR_CASES["periodic"]
    assert periodic is CATALOGUE["periodic:local_sgd/8"] and periodic.arguments(BenchConfig())["sync_every"] == 8
    assert periodic.arguments(BenchConfig(sync_every=3)) == {"mode": "local_sgd", "sync_every": 3}
    # the same settings under each harness's name are two cases
    assert CATALOGUE["streaming_diloco_8"].knobs == CATALOGUE["periodic:streaming_diloco/8"].knobs
    with pytest.raises(KeyError, match="nope"):
        select("ddp", "nope")


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_smoke_run_gives_both_tables_and_a_results_file_with_provenance(tmp_path):
    from lightning_sync.apps.compare import main

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = ["--smoke", "--seeds", "0,1", "--cases", "ddp,periodic:local_sgd/8", "--out", str(tmp_path / "out")]
    # the job forks its ranks: it runs as a fork of this process (no interpreter start-up), as a command would
    command = [sys.executable, "-m", "lightning_sync.compare", *args]
    proc = run_forked(main, ["lightning_sync.compare", *args], tmp_path, env, timeout=380, command=command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### Digits classifier" in proc.stdout and "### Character language model" in proc.stdout, proc.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["seeds"] == [0, 1]
    prov = results["provenance"]
    assert prov["commit"] and "lightning_sync.compare" in prov["command"] and prov["cpu"]["flags"]
    assert {"torch", "lightning", "numpy"} <= prov["versions"].keys()
    for name in ("digits", "char_lm"):
        block = results["workloads"][name]
        assert [len(v) for v in block["runs"].values()] == [2, 2], block["runs"]
        assert [r["case"] for r in block["rows"]] == ["ddp", "periodic:local_sgd/8"]
        assert all(len(r["values"]) == 2 for r in block["rows"])
    lm = results["workloads"]["char_lm"]["runs"]["ddp"]
    assert all(r["unigram"]["loss"] > 3 and "test/loss" in r["test"] for r in lm), lm


@pytest.mark.unit
def test_provenance_names_the_checkout_even_when_a_stale_egg_info_hides_the_editable_install(monkeypatch):
    """Run from a checkout whose working directory holds an old ``*.egg-info``, ``importlib.metadata`` finds that
    one (no ``direct_url.json``): the record still names the checkout's commit."""
    from importlib import metadata
    from pathlib import Path

    from lightning_sync.apps import provenance

    class _StaleEggInfo:
        def read_text(self, name: str) -> None:
            return None

    monkeypatch.setattr(metadata, "distribution", lambda name: _StaleEggInfo())
    repo = Path(__file__).resolve().parents[1]
    assert provenance.source_checkout() == str(repo)
    head = (provenance.git_output("rev-parse", "HEAD", cwd=repo) or "").strip()
    assert head and provenance.git_state()["commit"] == head


@pytest.mark.unit
def test_provenance_names_the_checkout_that_runs_not_the_one_an_editable_install_points_at(monkeypatch, tmp_path):
    """A clone run with the original checkout's venv imports the clone's package: the record names the clone."""
    import json
    from importlib import metadata
    from pathlib import Path

    from lightning_sync.apps import provenance

    class _EditableElsewhere:
        def read_text(self, name: str) -> str:
            return json.dumps({"url": f"file://{tmp_path}", "dir_info": {"editable": True}})

    monkeypatch.setattr(metadata, "distribution", lambda name: _EditableElsewhere())
    assert provenance.source_checkout() == str(Path(__file__).resolve().parents[1])


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_every_case_of_every_workload_builds_its_strategy_model_and_trainer(tmp_path):
    """Each case the compare job can run (the opt-in ones too) composes with its workload's overrides and builds its
    strategy, data, model and Trainer, without training: the notebooks' smoke runs train only some of them."""
    from hydra import compose, initialize_config_dir

    from lightning_sync.apps.train import CONFIG_DIR, build

    built = []
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for work in workloads().values():
            for case, overrides in {**work.cases, **work.opt_in}.items():
                cfg = compose(
                    "config",
                    overrides=[*overrides, *work.common, *work.per_case.get(case, []), f"+run_dir={tmp_path / 'run'}"],
                )
                _, model, trainer = build(cfg)
                family = overrides[0].split("=", 1)[1]
                assert trainer.strategy.strategy_name == f"sync_{family}", (work.name, case, trainer.strategy)
                assert model is not None
                built.append(f"{work.name}/{case}")
    assert len(built) == len(CASES) + len(LM_CASES) + len(LM_OPT_IN_CASES), built
