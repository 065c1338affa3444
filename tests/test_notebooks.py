"""The notebooks are jupytext py:percent sources: they convert to .ipynb and run end to end with SMOKE=1 (here 01, 02,
07 and any new one; 03 to 06 in tests/test_notebooks_lm.py, so that two workers can share the smoke runs).

Their conventions (a SMOKE mode, everything taken from the installed package) are checked by ``make lint``
(``.ci/check_conventions.py``).
"""

from __future__ import annotations

import pytest
from notebook_utils import EXPECTED, NOTEBOOKS, SECOND_FILE, check_smoke_run

pytestmark = pytest.mark.e2e

FIRST = [p for p in NOTEBOOKS if p.stem not in SECOND_FILE]  # the others: tests/test_notebooks_lm.py


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", FIRST, ids=[p.stem for p in FIRST])
def test_runs_in_smoke_mode(source, tmp_path):
    check_smoke_run(source, tmp_path)


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
