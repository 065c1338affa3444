"""The smoke runs of notebooks 03 to 06 (tests/notebook_utils.py's ``SECOND_FILE``), in a file of their own so that
``--dist loadfile`` can run them beside tests/test_notebooks.py's."""

from __future__ import annotations

import pytest
from notebook_utils import NOTEBOOKS, SECOND_FILE, check_smoke_run

pytestmark = pytest.mark.e2e

SECOND = [p for p in NOTEBOOKS if p.stem in SECOND_FILE]


def test_every_notebook_of_this_file_exists():
    assert [p.stem for p in SECOND] == list(SECOND_FILE)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", SECOND, ids=[p.stem for p in SECOND])
def test_runs_in_smoke_mode(source, tmp_path):
    check_smoke_run(source, tmp_path)
