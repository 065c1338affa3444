"""The one table writer and the results-page generator (lightning_sync/apps/tables.py).

- ``markdown_table``: header, rule with alignment, rows; padding for plain text; a wrong column count is refused.
- ``provenance``: command, commit, date and versions; ``write_provenance`` puts it beside a results file.
- ``results_page``: a table per results file (compare, bench, a committed .md with its provenance), each with its
  command and provenance; ``--check`` fails when the page differs from what the files give.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sync.apps.compare import format_table
from lightning_sync.apps.tables import main, markdown_table, provenance, results_page, write_provenance

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

COMPARE_ROWS = [
    {"mode": "ddp", "test": {"test/acc": 0.9667}, "step_time_ms": 4.11, "bytes_sent_per_step": 104488},
    {"mode": "allreduce+topk1%", "test": {"test/acc": 0.9639}, "step_time_ms": 4.34, "bytes_sent_per_step": 2096},
    {"mode": "periodic", "diverged": True, "diverged_at_step": 17, "step_time_ms": None, "bytes_sent_per_step": None},
]


def test_markdown_table_header_rule_and_rows():
    text = markdown_table(["case", "ms"], [["a", 1.5], ["b", None]])
    assert text.splitlines() == ["| case | ms |", "|---|---|", "| a | 1.5 |", "| b | - |"]


def test_markdown_table_alignment_and_padding():
    text = markdown_table(["mode", "bytes"], [["ddp", "104,488"], ["allreduce", "2"]], align="lr", pad=True)
    lines = text.splitlines()
    assert lines[0] == "| mode      |   bytes |"
    assert lines[1] == "|:----------|--------:|"
    assert lines[3] == "| allreduce |       2 |"
    assert len({len(line) for line in lines}) == 1  # every line as wide: reads as plain text too
    assert markdown_table(["a", "b", "c"], [], align="lcr").splitlines()[1] == "|:---|:---:|---:|"


@pytest.mark.parametrize(
    ("rows", "align", "message"),
    [([["only one"]], None, "row 0 has 1 columns, the headers 2"), ([], "l", "align has 1 columns"), ([], "lx", "x")],
)
def test_markdown_table_refuses_a_wrong_shape(rows, align, message):
    with pytest.raises(ValueError, match=message):
        markdown_table(["a", "b"], rows, align=align)


def test_compare_table_uses_the_writer():
    lines = format_table(COMPARE_ROWS).splitlines()
    assert lines[0].split("|")[1].strip() == "mode" and lines[1].endswith(":|")
    assert "96.67%" in lines[2] and "104,488" in lines[2] and "1.000" in lines[2]
    assert "0.020" in lines[3] and "diverged at step 17" in lines[4]


def test_provenance_names_command_commit_and_versions(tmp_path):
    record = provenance(["python", "-m", "lightning_sync.compare", "--epochs", "3"], cwd=ROOT)
    assert record["command"] == "python -m lightning_sync.compare --epochs 3"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record["commit"] == head and isinstance(record["dirty"], bool)
    assert record["versions"]["torch"] and record["versions"]["lightning"] and record["date"].endswith("UTC")
    assert provenance("x", cwd=tmp_path)["commit"] is None  # not a checkout
    path = write_provenance(tmp_path / "out", "python -m lightning_sync.compare")
    assert json.loads(path.read_text())["command"] == "python -m lightning_sync.compare"


def _results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    (root / "compare").mkdir(parents=True)
    (root / "compare" / "results.json").write_text(json.dumps(COMPARE_ROWS))
    write_provenance(root / "compare", "python -m lightning_sync.compare --out benchmarks/results/compare")
    (root / "payload_1gbit.md").write_text("### payload\n\n| case | busbw |\n|---|---|\n| allreduce | 946.9 |\n")
    (root / "payload_1gbit.provenance.json").write_text(
        json.dumps({"title": "Bus bandwidth", "command": "python -m lightning_sync.bench workloads=payload"})
    )
    (root / "ignored.md").write_text("| no | provenance |\n|---|---|\n")
    return root


def test_results_page_has_every_table_with_its_command(tmp_path):
    page = results_page([_results(tmp_path)])
    assert "do not edit by hand" in page
    assert "## Main job: every sync mode on the digits" in page and "104,488" in page
    assert "Command: `python -m lightning_sync.compare --out benchmarks/results/compare`" in page
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
    (folder / "results.json").write_text(json.dumps({"config": asdict(cfg), "summary": summary, "records": []}))
    page = results_page([folder])
    assert "## Benchmark:" in page and "| allreduce | 10.00 |" in page
    assert "Command and versions not recorded" in page  # no provenance.json: said, not hidden


def test_check_fails_on_a_stale_page_and_passes_after_writing(tmp_path, capsys):
    root, out = _results(tmp_path), tmp_path / "docs" / "results.md"
    assert main([str(root), "--out", str(out), "--check"]) == 1
    assert main([str(root), "--out", str(out)]) == 0
    assert main([str(root), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("104,488", "104,000"))  # a hand edit
    assert main([str(root), "--out", str(out), "--check"]) == 1


def test_committed_results_page_is_up_to_date():
    done = subprocess.run(
        [sys.executable, "-m", "lightning_sync.apps.tables", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
