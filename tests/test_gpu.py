"""The GPU check (``benchmarks/gpu_check.py``) and the guide page made from its report.

On a machine without CUDA the ``cuda``-marked tests are skipped, and the check itself runs on the CPU: its case
selection and device rules, its two-rank cases, and a reduced run of the whole script whose JSON and markdown
reports must be written with every case ok. With a GPU the ``cuda`` tests run the check's pieces on it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch
from app_utils import run_forked
from dist_utils import run_ranks
from repo_utils import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _load(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return load_script(f"benchmarks/{name}.py")


gpu_check = _load("gpu_check")
gpu_docs = _load("gpu_report_to_docs")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------------------- units
@pytest.mark.unit
def test_the_cases_cover_every_mode_compressor_and_precision():
    COMPRESSORS = ("none", "fp16", "bf16", "topk", "powersgd")  # the gradient codecs the GPU check runs

    names = {c.name for c in gpu_check.STRATEGY_CASES}
    for precision in ("fp32", "bf16"):
        for compressor in COMPRESSORS:
            assert f"ddp_{compressor}_{precision}" in names
            assert f"allreduce_{compressor}_{precision}" in names
        for other in ("lightning_single_device", "periodic_local_sgd", "periodic_diloco", "periodic_streaming_int8", "periodic_streaming_int4",
                      "ps_sync", "ps_async"):  # fmt: skip
            assert f"{other}_{precision}" in names
    assert {c.precision for c in gpu_check.STRATEGY_CASES} == {"32-true", "bf16-mixed"}
    streaming = [c for c in gpu_check.STRATEGY_CASES if "streaming" in c.name]
    assert {c.knobs["outer_compression"] for c in streaming} == {"int8", "int4"}
    assert all(c.knobs["fragments"] > 1 and c.knobs["sync_delay"] > 0 for c in streaming)
    assert set(gpu_check.CASE_FUNCTIONS) == set(gpu_check.COLLECTIVE_CASES)
    for needed in ("bucketing", "powersgd", "topk", "int8", "int4", "ps_client"):
        assert needed in gpu_check.COLLECTIVE_CASES
    # every case is described in the report
    assert all(f"{s}/{n}" in gpu_check.CASE_HELP for s, n in [c.split("/") for c in gpu_check.all_case_names()
                                                            if not c.startswith("strategy/")])  # fmt: skip


@pytest.mark.unit
def test_case_selection_by_section_name_and_glob():
    every = gpu_check.all_case_names()
    assert gpu_check.select_cases(None) == every
    assert gpu_check.select_cases(["collective"]) == [f"collective/{n}" for n in gpu_check.COLLECTIVE_CASES]
    picked = gpu_check.select_cases(["quantizer/int4", "strategy/ps_*_bf16"])
    assert picked == ["strategy/ps_sync_bf16", "strategy/ps_async_bf16", "quantizer/int4"]  # in the check's order
    with pytest.raises(SystemExit, match="'nope' matches no case"):
        gpu_check.select_cases(["nope"])


@pytest.mark.unit
def test_without_cuda_it_stops_with_a_clear_message_unless_cpu_is_allowed(tmp_path):
    args = gpu_check.parse_args([])
    with pytest.raises(SystemExit, match=r"no CUDA device here .*--allow-cpu or --device cpu"):
        gpu_check.options_from(args, cuda_available=False)
    opts = gpu_check.options_from(gpu_check.parse_args(["--allow-cpu"]), cuda_available=False)
    assert opts.device == "cpu" and opts.out == gpu_check.CPU_OUT
    assert gpu_check.options_from(gpu_check.parse_args([]), cuda_available=True).out == gpu_check.DEFAULT_OUT
    # a CPU run never writes where the GPU report lives
    with pytest.raises(SystemExit, match="holds the GPU report"):
        gpu_check.options_from(
            gpu_check.parse_args(["--device", "cpu", "--out", str(gpu_check.DEFAULT_OUT)]), cuda_available=False
        )
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_check.options_from(gpu_check.parse_args(["--device", "cuda", "--allow-cpu"]), cuda_available=False)


@pytest.mark.unit
def test_the_guide_page_is_what_the_recorded_report_gives():
    report = gpu_docs.load_report(gpu_docs.DEFAULT_REPORT)
    page = gpu_docs.render_page(report)
    assert (ROOT / "docs" / "guide" / "gpu.md").read_text() == page, (
        "docs/guide/gpu.md is stale: run python benchmarks/gpu_report_to_docs.py"
    )
    if report is None:
        assert "No GPU run has been recorded yet" in page and "make gpu-check" in page
    else:
        assert report["device"]["type"] == "cuda", "benchmarks/results/gpu/report.json must come from a GPU run"


# ---------------------------------------------------------------------------------------------------------- CPU
# The case functions run in forked ranks here (about a second each); the check's own fresh-process runner, which
# CUDA needs, is exercised by test_the_check_runs_on_cpu_and_writes_both_reports.
def _case_on_cpu(rank: int, world: int, name: str, port: int) -> None:
    details = gpu_check.CASE_FUNCTIONS[name](rank, world, "cpu", port)
    assert isinstance(details, dict) and details, details


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", gpu_check.COLLECTIVE_CASES)
def test_two_rank_case_passes_on_cpu(name):
    run_ranks(_case_on_cpu, name, gpu_check._free_port(), timeout=100)


def _one_rank_checks(result: str) -> None:
    gpu_check.nccl_main("cpu", result)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_one_rank_package_collectives_on_cpu(tmp_path):
    result = tmp_path / "result.json"
    child = multiprocessing.get_context("fork").Process(target=_one_rank_checks, args=(str(result),))
    child.start()
    child.join(100)
    if child.is_alive():
        child.kill()
        pytest.fail("the one-rank checks hung for 100 s")
    outcome = json.loads(result.read_text())
    assert outcome["status"] == "ok", outcome
    details = outcome["details"]
    assert details["backend"] == "gloo" and set(details["checks"].values()) == {"ok"}, details


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_the_check_runs_on_cpu_and_writes_both_reports(tmp_path):
    cases = [
        "strategy/allreduce_powersgd_bf16",
        "strategy/periodic_streaming_int4_fp32",
        "strategy/ps_async_fp32",
        "collective/int4",
        "quantizer/int8",
    ]
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    argv = [str(BENCHMARKS / "gpu_check.py"), "--allow-cpu", "--out", str(out), "--steps", "4", "--warmup", "1",
            "--quant-entries", "65536", "--cases", *cases]  # fmt: skip
    # the script's main in a fork of this process, which imported it (no interpreter start-up); its two-rank cases
    # still run in the fresh processes its own runner starts
    proc = run_forked(lambda: sys.exit(gpu_check.main()), argv, tmp_path, env, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [c["case"] for c in report["cases"]] == cases
    assert {c["case"]: c["status"] for c in report["cases"]} == dict.fromkeys(cases, "ok"), report["cases"]
    assert report["device"]["type"] == "cpu" and report["counts"] == {"ok": len(cases), "failed": 0, "skipped": 0}
    fits = {c["name"]: c["details"] for c in report["cases"] if c["section"] == "strategy"}
    assert all(d["steps"] == 4 and d["timed_steps"] == 3 and d["median_step_ms"] > 0 for d in fits.values())
    assert fits["allreduce_powersgd_bf16"]["precision"] == "bf16-mixed"
    assert [row["case"] for row in report["step_times"]] == [
        "allreduce_powersgd", "periodic_streaming_int4", "ps_async"
    ]  # fmt: skip
    assert {(r["codec"], r["op"], r["device"]) for r in report["quantizer"]} == {
        ("int8", "encode", "cpu"), ("int8", "decode", "cpu")
    }  # fmt: skip
    markdown = (out / "report.md").read_text()
    assert markdown.startswith(f"# GPU check: {len(cases)} ok, 0 failed, 0 skipped")
    for needed in ("| `collective/int4` | ok |", "## Step time at one rank", "| ps_async |", "## int8/int4 codec",
                   "NCCL refuses two ranks on one device"):  # fmt: skip
        assert needed in markdown, needed
    # the guide page refuses a CPU run, and shows a GPU one
    with pytest.raises(SystemExit, match="not on a CUDA GPU"):
        gpu_docs.render_page(report)
    as_gpu = {**report, "device": {**report["device"], "type": "cuda", "name": "a GPU", "cuda": "x", "nccl": "y"}}
    page = gpu_docs.render_page(as_gpu)
    assert page.startswith("# Verified on GPU") and "## Results: 5 ok, 0 failed, 0 skipped" in page
    assert "### Step time at one rank" in page and "| `strategy/ps_async_fp32` | ok |" in page


@pytest.mark.unit
def test_a_failing_case_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise ValueError("planted failure")

    monkeypatch.setattr(gpu_check, "quantizer_throughput", boom)
    monkeypatch.setattr(gpu_check, "run_nccl", lambda device: {"backend": "gloo", "checks": {"x": "ok"}})
    opts = gpu_check.options_from(
        gpu_check.parse_args(["--allow-cpu", "--out", str(tmp_path), "--cases", "quantizer", "nccl"]),
        cuda_available=False,
    )
    report = gpu_check.run_check(opts, log=lambda line: None)
    status = {c["case"]: c["status"] for c in report["cases"]}
    assert status == {"nccl/package_tensors": "ok", "quantizer/int8": "failed", "quantizer/int4": "failed"}
    assert "ValueError: planted failure" in report["cases"][1]["error"]
    markdown = (tmp_path / "report.md").read_text()
    assert "## Errors" in markdown and "planted failure" in markdown
    assert json.loads((tmp_path / "report.json").read_text())["counts"] == {"ok": 1, "failed": 2, "skipped": 0}


# ---------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.dist
@CUDA
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", gpu_check.COLLECTIVE_CASES)
def test_two_rank_case_on_cuda(name):
    details = gpu_check.run_pair(name, "cuda", timeout_s=180)
    assert details


@pytest.mark.cuda
@pytest.mark.dist
@CUDA
@pytest.mark.timeout(120)
def test_package_collectives_on_a_one_rank_nccl_group():
    details = gpu_check.run_nccl("cuda")
    assert details["backend"] == "nccl" and set(details["checks"].values()) == {"ok"}


@pytest.mark.cuda
@pytest.mark.e2e
@CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", gpu_check.STRATEGY_CASES, ids=lambda c: c.name)
def test_strategy_fits_on_cuda(case):
    details = gpu_check.run_strategy_case(case, "cuda", steps=4, warmup=1)
    assert details["precision"] == case.precision and details["median_step_ms"] > 0


@pytest.mark.cuda
@pytest.mark.unit
@CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantizer_throughput_on_cuda_and_cpu(bits):
    details = gpu_check.quantizer_throughput(bits, "cuda", 2**20, 3)
    assert {r["device"] for r in details["rows"]} == {"cuda", "cpu"}
    assert set(details["gpu_over_cpu"]) == {"encode", "decode"}
