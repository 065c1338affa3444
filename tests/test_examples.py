"""Every public class of ``lightning_sync`` (its ``__all__``) has an ``Example::`` in its docstring, and the
example runs: its ``>>>`` lines are doctests, run here in this process (no process group is needed)."""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import doctest  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

import lightning_sync  # noqa: E402

PUBLIC_CLASSES = sorted(n for n in lightning_sync.__all__ if inspect.isclass(getattr(lightning_sync, n)))
# a strategy's example builds a lightning.Trainer (no fit): the e2e tier; the others' are unit tests
TIERED = [
    pytest.param(n, marks=pytest.mark.e2e if n.endswith("Strategy") else pytest.mark.unit) for n in PUBLIC_CLASSES
]


@pytest.mark.parametrize("name", TIERED)
def test_public_class_has_a_running_example(name, tmp_path, monkeypatch):
    cls = getattr(lightning_sync, name)
    assert re.search(r"^ *Example::$", cls.__doc__ or "", re.M), f"{name}'s docstring has no Example:: section"
    monkeypatch.chdir(tmp_path)  # an example that writes, writes here
    module = sys.modules[cls.__module__]
    test = doctest.DocTestParser().get_doctest(cls.__doc__, dict(vars(module)), name, module.__file__, 0)
    assert test.examples, f"{name}'s Example:: has no >>> lines to run"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
    assert runner.failures == 0
