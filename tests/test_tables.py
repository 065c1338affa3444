"""The table writer (lightning_sync/apps/markdown.py) and the results-page generator (tools/gen_docs.py).

- ``markdown_table``: header, rule with alignment, padded rows; a wrong column count is refused.
- ``results_page``: a table per results file (compare, bench, a committed .md with its provenance), each with its
  command and provenance, embedded in results.json or beside it; ``--check`` fails when the page differs from what
  the files give.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from repo_utils import load_script

from lightning_sync.apps.bench.report import utilization_rows
from lightning_sync.apps.markdown import markdown_table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
gen_docs = load_script("tools/gen_docs.py")
main, results_page = gen_docs.main, gen_docs.results_page


def _squeezed(text: str) -> str:
    """``text`` with runs of spaces as one: a padded table's rows as their cells read."""
    return re.sub(r" +", " ", text)


COMPARE_TABLE = "### digits, seeds 0\n\n| mode | acc |\n|:---|---:|\n| ddp | 96.67 |"


def test_markdown_table_header_rule_and_rows():
    text = markdown_table(["case", "ms"], [["a", 1.5], ["b", None]])
    assert text.splitlines() == ["| case   | ms   |", "|:-------|:-----|", "| a      | 1.5  |", "| b      | -    |"]


def test_markdown_table_alignment_and_padding():
    text = markdown_table(["mode", "bytes"], [["ddp", "104,488"], ["allreduce", "2"]], align="lr")
    lines = text.splitlines()
    assert lines[0] == "| mode      |   bytes |"
    assert lines[1] == "|:----------|--------:|"
    assert lines[3] == "| allreduce |       2 |"
    assert len({len(line) for line in lines}) == 1  # every line as wide: reads as plain text too
    assert markdown_table(["a", "b", "c"], [[1, 2, 3]], align="lcr").splitlines()[1] == "|:----|:---:|----:|"
    assert markdown_table(["a", "b"], [], align="lr").splitlines()[0] == "| a   | b   |"  # no rows: headers only


@pytest.mark.parametrize(
    ("rows", "align", "message"),
    [([["only one"]], None, "row 0 has 1 columns, the headers 2"), ([], "l", "align has 1 columns"), ([], "lx", "x")],
)
def test_markdown_table_refuses_a_wrong_shape(rows, align, message):
    with pytest.raises(ValueError, match=message):
        markdown_table(["a", "b"], rows, align=align)


def _results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    (root / "compare").mkdir(parents=True)
    record = {"command": "python -m lightning_sync.compare --out benchmarks/results/compare", "commit": "0123456789ab"}
    record["versions"] = {"torch": "2.13.0", "lightning": "2.6.6"}
    (root / "compare" / "results.json").write_text(json.dumps({"provenance": record, "workloads": {}}))
    (root / "payload_1gbit.md").write_text("### payload\n\n| case | busbw |\n|---|---|\n| allreduce | 946.9 |\n")
    (root / "payload_1gbit.provenance.json").write_text(
        json.dumps({"title": "Bus bandwidth", "command": "python -m lightning_sync.bench workloads=payload"})
    )
    (root / "ignored.md").write_text("| no | provenance |\n|---|---|\n")
    return root


@pytest.fixture(autouse=True)
def _compare_tables(monkeypatch):
    """compare's own formatter is compare's to test; here it returns a fixed table for any results."""
    from lightning_sync.apps import compare

    monkeypatch.setattr(compare, "format_results", lambda results: COMPARE_TABLE, raising=False)


def test_results_page_has_every_table_with_its_command(tmp_path):
    page = results_page([_results(tmp_path)])
    assert "do not edit by hand" in page
    assert "## Main job" in page and "| ddp | 96.67 |" in page and "#### digits, seeds 0" in page
    assert "Command: `python -m lightning_sync.compare --out benchmarks/results/compare`" in page
    assert "commit `0123456789`" in page and "torch 2.13.0" in page
    assert "## Bus bandwidth" in page and "#### payload" in page and "946.9" in page
    assert "lightning" in page.split("## Main job")[1].split("|")[0]  # versions in the provenance line
    assert "ignored" not in page  # a table without provenance is not published


def test_results_page_without_results_says_how_to_make_them(tmp_path):
    page = results_page([tmp_path])
    assert "No results of the main job found" in page and "make compare" in page


def test_a_bench_results_file_is_rendered_by_the_bench_report(tmp_path):
    from lightning_sync.apps.bench.config import BenchConfig

    cfg = BenchConfig()
    summary = [
        {
            "workload": "latency_bound",
            "rate": "loopback",
            "case": "allreduce",
            "metric": "step_time_ms",
            "median": 10.0,
            "repeats": [10.0],
            "shown": ["10.00"],
        }
    ]
    from dataclasses import asdict

    folder = tmp_path / "bench"
    folder.mkdir()
    saved = {**asdict(cfg), "a_field_of_an_older_version": 1}  # asdict nests network as a dict
    (folder / "results.json").write_text(json.dumps({"config": saved, "summary": summary, "records": []}))
    page = results_page([folder])
    assert "## Benchmark:" in page and "| allreduce | 10.00 |" in _squeezed(page)
    assert "Command and versions not recorded" in page  # no provenance.json: said, not hidden


def test_utilization_is_floor_step_time_over_the_case_s_per_rate_slowest_first():
    def row(rate, case, ms):
        return {"workload": "char_lm", "rate": rate, "case": case, "median_step_time_ms": ms}

    rows = [
        row("1gbit", "floor", 50.0), row("1gbit", "lightning_ddp", 100.0), row("10mbit", "floor", 40.0),
        row("10mbit", "lightning_ddp", 800.0), row("10mbit", "diloco", 50.0), row("100mbit", "diloco", 80.0),
        {**row("10mbit", "diloco", 999.0), "workload": "digits"},
    ]  # fmt: skip
    table = utilization_rows(rows, cases=("lightning_ddp", "diloco"))
    assert [r["case"] for r in table] == ["lightning_ddp", "diloco"]
    assert list(table[0]["by_rate"]) == ["10mbit", "1gbit"]  # 100mbit has no floor
    assert table[0]["by_rate"] == {"10mbit": 0.05, "1gbit": 0.5}
    assert table[1]["by_rate"] == {"10mbit": 0.8, "1gbit": None}
    assert utilization_rows([row("1gbit", "diloco", 1.0)]) == []
    # a row's own utilization (against its run's floor) wins, and the first run of a rate and case counts
    later = [{**row("10mbit", "diloco", 10.0), "utilization": 0.9}, {**row("10mbit", "floor", 1.0)}]
    again = utilization_rows([*rows, *later], cases=("lightning_ddp", "diloco"))
    assert again[0]["by_rate"]["10mbit"] == 0.05 and again[1]["by_rate"]["10mbit"] == 0.8


def test_check_fails_on_a_stale_page_and_passes_after_writing(tmp_path, capsys):
    root, out = _results(tmp_path), tmp_path / "docs" / "results.md"
    assert main([str(root), "--out", str(out), "--check"]) == 1
    assert main([str(root), "--out", str(out)]) == 0
    assert main([str(root), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("96.67", "97.00"))  # a hand edit
    assert main([str(root), "--out", str(out), "--check"]) == 1


def test_committed_results_page_is_up_to_date(monkeypatch, capsys):
    monkeypatch.undo()  # drops the compare formatter's stand-in: the committed page is rendered by the real one
    monkeypatch.chdir(ROOT)
    assert main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.unit
def test_a_compare_run_gets_a_figure_that_check_keeps_current(tmp_path, capsys):
    rows = [
        {"case": "ddp", "mean": 2.30, "min": 2.28, "max": 2.33, "values": [2.28, 2.30, 2.33]},
        {"case": "periodic:diloco/8", "mean": 2.29, "min": 2.27, "max": 2.32, "values": [2.27, 2.29, 2.32]},
    ]
    run = tmp_path / "results" / "char_lm_300_steps"
    run.mkdir(parents=True)
    workloads = {"char_lm": {"title": "t", "metric": "test/loss", "spread": "min-max", "rows": rows}}
    sizes, overrides = {"steps": 300, "epochs": 30}, ["strategy.outer_lr=0.5"]
    data = {"provenance": {"command": "c"}, "workloads": workloads, "sizes": sizes, "overrides": overrides}
    (run / "results.json").write_text(json.dumps(data))
    out = tmp_path / "docs" / "results.md"
    assert main([str(tmp_path / "results"), "--out", str(out)]) == 0
    figure = out.parent / "figures" / "char_lm_300_steps.svg"
    # titled by what it ran; the figure named by its folder
    title = "Compare `char_lm_300_steps`: char_lm 300 steps: ddp, periodic:diloco/8 (outer_lr=0.5)"
    assert f"## {title}" in out.read_text() and f"![{title}](figures/char_lm_300_steps.svg)" in out.read_text()
    svg = figure.read_text()
    assert svg.startswith("<?xml") and "periodic:diloco/8" in svg and "test/loss" in svg
    assert main([str(tmp_path / "results"), "--out", str(out), "--check"]) == 0  # the same bytes again
    figure.write_text(svg.replace("periodic:diloco/8", "periodic:diloco/16"))
    assert main([str(tmp_path / "results"), "--out", str(out), "--check"]) == 1
    # an about.md beside the results gives the short title, and its method leads the section's note
    (run / "about.md").write_text("# DiLoCo at outer lr 0.5\n\nTwo ranks, seeds 0-2.\n")
    assert main([str(tmp_path / "results"), "--out", str(out)]) == 0
    page = out.read_text()
    section = page.split("## DiLoCo at outer lr 0.5\n", 1)[1]
    assert "![DiLoCo at outer lr 0.5](figures/char_lm_300_steps.svg)" in section and f"## {title}" not in page
    note = section.split('??? note "How it was measured"\n\n', 1)[1].split("\n\n####", 1)[0]
    assert note.startswith("    Two ranks, seeds 0-2.\n\n    What ran: " + title) and "Command: `c`" in note
    assert "- [DiLoCo at outer lr 0.5](#diloco-at-outer-lr-05)" in page


def test_which_mode_block_names_the_fastest_its_call_and_where_ddp_is_right():
    from lightning_sync.apps.bench import time_to_target as ttt

    def run(case, seed, steps, rate="loopback"):
        return {"case": case, "seed": seed, "rate": rate, "ok": True, "steps_to_target": steps,
                "seconds_to_target": 1.0, "target_loss": 1.5, "trajectory": [[1.0, steps, 1.5]]}  # fmt: skip

    def window(case, rate, ms):
        return {"case": case, "rate": rate, "metric": "window_step_ms", "median": ms}

    trajectories = {"records": [run(c, s, n) for s in (0, 1) for c, n in (("lightning_ddp", 992), ("diloco_8", 960))]}
    windows = [{"summary": [window("lightning_ddp", "1mbit", 16000.0), window("diloco_8", "1mbit", 2000.0),
                            window("lightning_ddp", "loopback", 40.0), window("diloco_8", "loopback", 42.0)]}]  # fmt: skip
    composed = ttt.compose(trajectories, windows, None)
    report = {**composed, "decisions": ttt.decide(composed), "provenance": {"commit": "abcdef1234567"}}
    block = gen_docs.which_mode(report)
    rows = [line for line in block.splitlines() if line.startswith("| 1mbit") or line.startswith("| loopback")]
    assert "`diloco_8`" in rows[0] and "8.27x" in rows[0]  # 992 x 16 s over 960 x 2 s
    # loopback: DDP's 39.7 s against diloco_8's 40.3 s: DDP is the one to use there
    assert "`lightning_ddp`" in rows[1] and "1.00x" in rows[1]
    assert "It is the fastest, or tied with the fastest, at: loopback." in block
    assert "- `diloco_8`: `PeriodicSyncStrategy(mode='diloco', sync_every=8)`" in block
    assert "commit `abcdef1234`" in block and "results.md#time-to-a-real-loss" in block
    page = "intro\n" + gen_docs.WHICH_MODE_START + "x -->\nold\n" + gen_docs.WHICH_MODE_END + "\nrest\n"
    done = gen_docs._with_which_mode(page, report, docs_page=True)
    assert "old" not in done and done.endswith(gen_docs.WHICH_MODE_END + "\nrest\n") and "](results.md#" in done


@pytest.mark.unit
def test_defaults_block_judges_each_case_against_ddp_of_its_own_model_by_two_percent_and_the_ranges():
    def row(case, mean, low, high):
        return {"case": case, "mean": mean, "min": low, "max": high}

    def run(steps, *rows, model=""):
        command = f"python -m lightning_sync.compare --steps {steps} {model}".strip()
        return {"workloads": {"char_lm": {"rows": list(rows)}}, "sizes": {"steps": steps}, "seeds": [0, 1, 2],
                "provenance": {"commit": "0123456789abc", "command": command}}  # fmt: skip

    short = run(300, row("ddp", 2.0, 1.9, 2.1), row("periodic:diloco/16", 2.03, 2.0, 2.06))  # +1.5%, overlapping
    long = run(1000, row("ddp", 1.0, 0.99, 1.01), row("periodic:diloco/16", 1.03, 1.005, 1.05))  # +3%: worse
    four = run(300, row("ddp", 3.0, 2.9, 3.1), row("periodic:diloco/16", 2.5, 2.4, 2.6), model="model.n_layer=4")
    block = gen_docs.defaults_block([("2 blocks", short, long), ("4 blocks", four, run(1000, row("ddp", 1, 1, 1)))])
    lines = [line for line in block.splitlines() if line.startswith("| `periodic:diloco/16`")]
    assert "`mode='diloco', sync_every=16`" in lines[0]  # the case's knobs, from the catalogue
    assert "2.030 [2.000, 2.060], +1.5%, tie" in lines[0] and "1.030 [1.005, 1.050], +3.0%, worse" in lines[0]
    assert "2.500 [2.400, 2.600], -16.7%, better" in lines[1] and lines[1].rstrip(" |").endswith("-")  # not run
    assert "`python -m lightning_sync.compare --steps 300 model.n_layer=4` (commit `0123456789`)" in block
