"""The notebooks are jupytext py:percent sources: they convert to .ipynb and run end to end with SMOKE=1.

Their conventions (a SMOKE mode, everything taken from the installed package) are checked by ``make lint``
(``.ci/check_conventions.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

NOTEBOOKS = sorted(Path(__file__).resolve().parent.parent.joinpath("notebooks").glob("*.py"))
# What each notebook must print in SMOKE mode (headers of the tables it prints) and the figures it must draw.
EXPECTED = {
    "01_overview": (("test acc", "ms/step", "comm ms/step", "bytes sent/step", "calls/step"), 5),
    "02_periodic": (("test acc", "bytes sent/batch", "mean divergence", "comm share"), 3),
    "03_parameter_server": (("test acc", "ms/step", "samples/s"), 3),
    "04_compression": (("test acc", "bytes sent/step", "modelled ms/batch 10mbit"), 2),
    "05_language_model": (("test loss nats/char", "meter bytes/step", "modelled s to target 10mbit"), 3),
    "06_streaming_diloco": (("test loss nats/char", "meter bytes/step", "utilization 10mbit"), 3),
    "07_fault_tolerance": (("exit code", "commits", "heal", "final parameters of the 3 groups equal: True"), 1),
}
# Runs a notebook source as __main__, then reports how many matplotlib figures it left open (Agg backend); its exit
# skips the collector's passes over the heap, as the apps' processes do (lightning_sync._exit).
_RUN_AND_COUNT = (
    "from lightning_sync._exit import skip_final_collection; skip_final_collection(); "
    "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__'); "
    "import matplotlib.pyplot as plt; print(f'FIGURES DRAWN: {len(plt.get_fignums())}')"
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_runs_in_smoke_mode(source, tmp_path):
    env = dict(os.environ, SMOKE="1", OMP_NUM_THREADS="1", NOTEBOOK_OUT=str(tmp_path / "out"), MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_AND_COUNT, str(source)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert source.stem in EXPECTED, f"add {source.stem} to EXPECTED: what its SMOKE run prints and draws"
    printed, figures = EXPECTED[source.stem]
    missing = [text for text in printed if text not in proc.stdout]
    assert not missing, f"{missing} not printed:\n{proc.stdout[-2000:]}"
    drawn = int(proc.stdout.rsplit("FIGURES DRAWN: ", 1)[1].split()[0])
    assert drawn >= figures, f"{source.name} drew {drawn} figures, expected at least {figures}"


PAIRED = [p for p in NOTEBOOKS if p.with_suffix(".ipynb").is_file()]


@pytest.mark.parametrize("source", PAIRED, ids=[p.stem for p in PAIRED])
def test_paired_ipynb_is_in_sync_and_has_the_outputs_of_a_run(source):
    """The committed .ipynb holds the same cells as its py:percent source, executed (figures included)."""
    import jupytext

    script = jupytext.read(source, fmt="py:percent")
    executed = jupytext.read(source.with_suffix(".ipynb"))
    assert [(c.cell_type, c.source) for c in executed.cells] == [(c.cell_type, c.source) for c in script.cells]
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], "the committed run raised"
    figures = sum("image/png" in o.get("data", {}) for o in outputs)
    assert figures >= EXPECTED[source.stem][1], f"{figures} figures in the committed notebook"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "SMOKE" not in text, "the committed notebook holds the outputs of a SMOKE run"
