"""The notebooks are jupytext py:percent sources: they convert to .ipynb and run end to end with SMOKE=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted(Path(__file__).resolve().parent.parent.joinpath("notebooks").glob("*.py"))


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_is_a_valid_percent_notebook(source):
    import jupytext

    notebook = jupytext.read(source, fmt="py:percent")
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert len(code) >= 3 and any(c.cell_type == "markdown" for c in notebook.cells)
    assert "SMOKE" in source.read_text()
    assert all("sys.path" not in c.source for c in code), "notebooks import everything from the installed package"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_runs_in_smoke_mode(source, tmp_path):
    env = dict(os.environ, SMOKE="1", OMP_NUM_THREADS="1", NOTEBOOK_OUT=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, str(source)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test acc" in proc.stdout and "ms/step" in proc.stdout, proc.stdout[-2000:]


PAIRED = [p for p in NOTEBOOKS if p.with_suffix(".ipynb").is_file()]


@pytest.mark.parametrize("source", PAIRED, ids=[p.stem for p in PAIRED])
def test_paired_ipynb_is_in_sync_and_has_the_outputs_of_a_run(source):
    """The committed .ipynb holds the same cells as its py:percent source, executed (figures included)."""
    import jupytext

    script = jupytext.read(source, fmt="py:percent")
    executed = jupytext.read(source.with_suffix(".ipynb"))
    assert [(c.cell_type, c.source) for c in executed.cells] == [(c.cell_type, c.source) for c in script.cells]
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure in the committed notebook"
