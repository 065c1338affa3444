"""The notebooks' smoke run, shared by tests/test_notebooks.py and tests/test_notebooks_lm.py.

The smoke runs are split over two test files so that ``--dist loadfile`` can give them to two workers: together
they take minutes.
"""

from __future__ import annotations

import functools
import os
import runpy
import warnings
from pathlib import Path

from app_utils import run_forked

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
# The notebooks whose smoke runs tests/test_notebooks_lm.py takes (the char_lm ones but 07, and 03); every other
# notebook's, new ones included, runs in tests/test_notebooks.py.
SECOND_FILE = ("03_parameter_server", "04_compression", "05_language_model", "06_streaming_diloco")


def _run_and_count(source: Path) -> None:
    """Runs a notebook source as ``__main__`` on matplotlib's Agg backend, with no figure of this process open
    before it, then prints how many figures it left open. The warning filters are those ``PYTHONWARNINGS`` gives a
    fresh interpreter (tests/conftest.py's ``CHILD_WARNINGS``: a deprecation is an error)."""
    options = [option for option in os.environ.get("PYTHONWARNINGS", "").split(",") if option]
    warnings._processoptions(options)  # type: ignore[attr-defined]  # what the interpreter does with them at start
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.close("all")
    runpy.run_path(str(source), run_name="__main__")
    print(f"FIGURES DRAWN: {len(plt.get_fignums())}")


def check_smoke_run(source: Path, tmp_path: Path) -> None:
    """Runs ``source`` with SMOKE=1 in a fork of this process (tests/app_utils.py: the environment, warnings and
    logging of a fresh interpreter, without its seconds of importing torch and Lightning; the notebook's runs fork
    their ranks, or start processes of their own, from it): it must exit 0, print what :data:`EXPECTED` says and
    leave at least as many figures drawn. Its exit skips the collector's passes over the heap (``os._exit``), as the
    apps' processes do (lightning_sync._exit)."""
    env = dict(os.environ, SMOKE="1", OMP_NUM_THREADS="1", NOTEBOOK_OUT=str(tmp_path / "out"), MPLBACKEND="Agg")
    proc = run_forked(functools.partial(_run_and_count, source), [str(source)], tmp_path, env, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert source.stem in EXPECTED, f"add {source.stem} to EXPECTED: what its SMOKE run prints and draws"
    printed, figures = EXPECTED[source.stem]
    missing = [text for text in printed if text not in proc.stdout]
    assert not missing, f"{missing} not printed:\n{proc.stdout[-2000:]}"
    drawn = int(proc.stdout.rsplit("FIGURES DRAWN: ", 1)[1].split()[0])
    assert drawn >= figures, f"{source.name} drew {drawn} figures, expected at least {figures}"
