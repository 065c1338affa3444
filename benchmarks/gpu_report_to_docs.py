"""Writes the guide's page on what was verified on a GPU, ``docs/guide/gpu.md``, from the GPU check's report.

    python benchmarks/gpu_report_to_docs.py            # from benchmarks/results/gpu/report.json, if there is one
    python benchmarks/gpu_report_to_docs.py --check    # exit 1 when the page is not what the report gives

Without a report the page says that no GPU run has been recorded yet, and how to run the check. A report made on
the CPU (``gpu_check.py --device cpu``) is refused: the page describes a GPU run or none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import DEFAULT_OUT, REPO, render_markdown  # noqa: E402

DEFAULT_REPORT = DEFAULT_OUT / "report.json"
DEFAULT_PAGE = REPO / "docs" / "guide" / "gpu.md"

INTRO = """\
# Verified on GPU

Every mode is written for GPUs with NCCL as well as for CPUs with gloo. The GPU check,
`benchmarks/gpu_check.py`, runs the GPU path on one CUDA device in at most 8 minutes and records what passed:

- **every strategy** on the char_lm example (`accelerator="gpu", devices=1`, in 32-bit and in bf16-mixed):
  `ddp` with each comm hook, `allreduce` with each compression, `periodic` local SGD, DiLoCo and streaming
  DiLoCo with int8/int4 outer compression, `ps` sync and async. At one rank the collectives return at once, so
  these fits check the strategies' device handling and the precision plugins;
- **the core collectives on CUDA tensors**, two processes on the one GPU: bucketed gradient sync, PowerSGD,
  top-k, int8/int4 averaging, the streaming outer sync on its worker thread, the replica check, and the
  parameter-server client's copies between the device and the wire. NCCL refuses two ranks on one device, so these
  run on gloo, which takes CUDA tensors; each result is compared with a reference computed on the CPU;
- **one-rank NCCL** calls of the collectives the package issues on tensors it makes itself;
- **the int8/int4 codec's throughput** on the GPU and on the CPU, in GB/s;
- **a step-time table** of the modes at one rank, with Lightning's own single-device strategy as the baseline.

Each case is recorded as ok or failed with its error, so one failure does not hide the others.

## Running it

On a machine with a CUDA GPU, from the repository root:

```bash
make gpu-check                                 # or: python3 benchmarks/gpu_check.py
```

It writes `benchmarks/results/gpu/report.json` and `report.md`, then this page from them
(`python benchmarks/gpu_report_to_docs.py`). `--cases` picks cases by name or glob (`--list` names them all);
`--allow-cpu` (or `--device cpu`) runs the same cases on a CPU to try the check itself, with its report in
`outputs/gpu_check_cpu/`.
"""

NO_RUN = """
## Results

No GPU run has been recorded yet: `benchmarks/results/gpu/report.json` does not exist. The check passes on CPU
(its tests run it there, `tests/test_gpu.py`), and its CUDA-marked tests are skipped without a GPU. Run
`make gpu-check` on a GPU machine and commit `benchmarks/results/gpu/` with this page.
"""


def render_page(report: dict[str, Any] | None) -> str:
    """The page: what the check covers and how to run it, then the report's results (or that there are none).

    Raises:
        SystemExit: ``report`` was made on another device than CUDA.
    """
    if report is None:
        return INTRO + NO_RUN
    device = report.get("device", {}).get("type")
    if device != "cuda":
        raise SystemExit(
            f"error: the report was made on device {device!r}, not on a CUDA GPU; the guide's GPU page describes a "
            "GPU run only (a CPU trial belongs in outputs/gpu_check_cpu/)"
        )
    results = render_markdown(report, heading="##").replace("## GPU check:", "## Results:", 1)
    return INTRO + "\n" + results


def load_report(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT, help="the GPU check's report.json")
    parser.add_argument("--out", type=Path, default=DEFAULT_PAGE, help="the page to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs")
    args = parser.parse_args(argv)
    page = render_page(load_report(args.report))
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != page:
            print(f"{args.out} is not what {args.report} gives; run python benchmarks/gpu_report_to_docs.py")
            return 1
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
