"""Test-wide setup: one OpenMP thread per process, set before torch is imported; deprecations stay errors in the
Python interpreters a test starts; the tiers kept honest.

With the ``fork`` start method, a child deadlocks in libgomp if the parent ran a multi-threaded torch op first.

Every test carries a tier marker (``pyproject.toml`` defines them); collection fails on one that has none. A test
whose tier is ``unit`` (marked ``unit`` and no heavier tier) runs in this process only: starting a process, a
process group, a Lightning ``Trainer`` or a Python interpreter fails it, naming what it started, so the fast tier
stays fast. A heavier marker wins over a module-wide ``unit``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

TIERS = ("unit", "dist", "e2e", "netns")
HEAVIER_THAN_UNIT = ("dist", "e2e", "netns")
LONG_MARKERS = ("e2e", "netns", "slow", "timed")

# The warning filters of the Python interpreters that tests start (a popen rank, a ps server, an app), as
# PYTHONWARNINGS entries ``action:message:category:module`` (message: a literal prefix; module: exact; the last
# matching entry wins). As pyproject.toml's filterwarnings in this process: a DeprecationWarning or FutureWarning is
# an error, except these, raised by third-party code on a path we use (the first pair is pyproject's too).
CHILD_WARNINGS = ",".join(
    [
        "error::DeprecationWarning",
        "error::FutureWarning",
        # Lightning's batch-size inference builds a LeafSpec, which torch 2.13 deprecates
        "ignore:`isinstance(treespec:FutureWarning:lightning.pytorch.utilities._pytree",
        "ignore:`isinstance(treespec:DeprecationWarning:lightning.pytorch.utilities._pytree",
        # Lightning's all_gather with sync_grads (self.all_gather, torchmetrics' sync under the ps strategy)
        "ignore:torch.distributed.nn.functional.all_gather is deprecated:FutureWarning:lightning.fabric.utilities.distributed",
        # torchft's Manager logs through Logger.warn
        "ignore:The 'warn' method is deprecated:DeprecationWarning:torchft.manager",
    ]
)

# The files whose tests time a failure: a frozen or killed rank, server or replica group must be noticed, named and
# ended within a timeout (a fixed margin after it, tests/fault_utils.py), and a survivor must go on. Each of their
# tests is marked ``timed`` (``-m timed`` selects them). They are scheduled as any other file: ``make test`` runs
# ``--dist loadfile``, a whole file to a worker at a time.
TIMED_FILES = frozenset(
    {
        "test_faults.py",
        "test_ft.py",
        "test_ps_core.py",
        "test_ps_elastic.py",
        "test_ps_faults.py",
        "test_ps_stall.py",
        "test_restart.py",
        "test_streaming_diloco.py",
    }
)


def _file(nodeid: str) -> str:
    return os.path.basename(nodeid.split("::", 1)[0])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {untiered}")
    for item in items:
        if _file(item.nodeid) in TIMED_FILES:
            item.add_marker(pytest.mark.timed)
    # The long files first (those with a test that runs a whole job, waits out a timeout or trains for long: fresh
    # interpreters, tens of seconds each), in the order collected, then the rest: with `--dist loadfile
    # --no-loadscope-reorder` (Makefile) many short files, not one long one, end the run.
    long = {_file(item.nodeid) for item in items if any(item.get_closest_marker(m) for m in LONG_MARKERS)}
    items.sort(key=lambda item: _file(item.nodeid) not in long)


@pytest.fixture(scope="session", autouse=True)
def _children_keep_deprecations_as_errors() -> None:
    """The interpreters that tests start warn as :data:`CHILD_WARNINGS` says. Set here, in the process that runs
    tests, and not at import: pytest-xdist's workers would start with it, and pytest leaves a process's own
    deprecation filters to PYTHONWARNINGS when it is set."""
    os.environ.setdefault("PYTHONWARNINGS", CHILD_WARNINGS)


@pytest.fixture(scope="session", autouse=True)
def _exit_without_final_collection() -> None:
    """The processes that run tests (each xdist worker, or pytest alone) exit as the apps' processes do
    (:mod:`lightning_sync._exit`). A fixture, not a module-level call: importing the package imports Lightning,
    which pytest-xdist's controller, running no test, would otherwise pay for at start-up."""
    from lightning_sync._exit import skip_final_collection

    skip_final_collection()


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a `unit` test {what}; mark it `dist` or `e2e` (see the markers in pyproject.toml)")

    return refuse


def _is_python(args: Any) -> bool:
    argv0 = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    program = os.fsdecode(argv0).split()[0] if os.fsdecode(argv0).strip() else ""
    return program == sys.executable or os.path.basename(program).startswith("python")


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    node = request.node
    if node.get_closest_marker("unit") is None or any(node.get_closest_marker(t) for t in HEAVIER_THAN_UNIT):
        yield
        return
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starts a process"))
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None:
        monkeypatch.setattr(distributed, "init_process_group", _refuse("starts a process group"))
    lightning = sys.modules.get("lightning.pytorch")
    if lightning is not None:
        monkeypatch.setattr(lightning.Trainer, "__init__", _refuse("builds a Trainer"))
    popen_init = subprocess.Popen.__init__

    def popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _is_python(args):
            _refuse(f"starts a Python interpreter ({args!r})")()
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    yield


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test starts from the session's environment: what a test (or Lightning in this process) set is undone.

    Lightning's launchers write ``MASTER_PORT`` into ``os.environ`` of the process that fits; left there, every
    later fit in the session would bind that one port, and fail with EADDRINUSE as soon as anything else holds it.
    """
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
