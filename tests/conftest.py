"""Test-wide setup: one OpenMP thread per process, set before torch is imported; and the tiers kept honest.

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
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")

TIERS = ("unit", "dist", "e2e", "netns")
HEAVIER_THAN_UNIT = ("dist", "e2e", "netns")


# The files whose tests time a failure: a frozen or killed rank, server or replica group must be noticed, named and
# ended within a timeout, and a survivor must go on at its pace. Each of their tests is marked ``timed``. With several
# pytest-xdist workers (``make test``) these files run one after another on one worker (:func:`_scope`) at the
# normal CPU priority, while the other workers' tests run at a lower one (:func:`_timed_tests_first`): the time a
# failure takes is then the code's, not that of another test's processes sharing the 2 cores.
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
# Files that time nothing but need the normal CPU priority too, each file a unit of its own (not queued behind the
# timed files): the accuracy of async ps depends on how evenly its workers get the CPU, and at the lower priority
# beside the timed tests one async worker starved (async median 0.936 against sync 0.958, over the 2 points it may
# lose).
NORMAL_PRIORITY_FILES = frozenset({"test_ps_async.py"})
# Files of a few long tests that do not depend on one another (a notebook each, the 9-run accuracy test). Under
# pytest-xdist each of their tests is a unit of its own, handed out right after the timed files, so that they spread
# over the other workers instead of one worker taking a whole file of them.
SPLIT_FILES = frozenset({"test_notebooks.py", "test_ps_async.py"})
OTHER_TESTS_NICE = 10
# A test's rough cost in seconds by its markers (the highest counts), for the order the files are handed out in: a
# ``slow`` one tens of seconds, a Trainer or a subprocess (``e2e``, ``netns``) seconds to tens of seconds, a process
# group about a second, a unit test next to nothing.
MARKER_COST = {"slow": 30.0, "e2e": 10.0, "netns": 10.0, "dist": 1.0, "unit": 0.05}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--timed-files-apart",
        action="store_true",
        help="hand each timed file to the xdist workers as a unit of its own instead of all of them as one (`make "
        "test-fast`: the fast tier starts no Trainer and no app, so the timed files' waits may overlap)",
    )


def _file(nodeid: str) -> str:
    return os.path.basename(nodeid.split("::", 1)[0])


def _is_timed(nodeid: str) -> bool:
    return _file(nodeid) in TIMED_FILES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {untiered}")
    for item in items:
        if _is_timed(item.nodeid):
            item.add_marker(pytest.mark.timed)
    # The order pytest-xdist hands the units out in (:func:`pytest_xdist_make_scheduler` keeps it): the timed files,
    # the tests of SPLIT_FILES, then the other files, the costliest first by their markers (:data:`MARKER_COST`), so that
    # the last units handed out are short ones.
    cost: Counter[str] = Counter()
    for item in items:
        cost[_file(item.nodeid)] += max(c for m, c in MARKER_COST.items() if item.get_closest_marker(m))
    items.sort(
        key=lambda item: (
            0 if _is_timed(item.nodeid) else 1 if _file(item.nodeid) in SPLIT_FILES else 2,
            -cost[_file(item.nodeid)],
            _file(item.nodeid),
        )
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist the tests run in this one process
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole files to a worker at a time (as ``--dist loadfile``), the timed files all as one unit (see
    :data:`TIMED_FILES`; each file a unit of its own with ``--timed-files-apart``) and each test of
    :data:`SPLIT_FILES` as one; the units in the collection's order (:func:`pytest_collection_modifyitems`)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    together = not config.getoption("timed_files_apart")

    class _TimedFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if together and _is_timed(nodeid):
                return "timed-files"
            return nodeid if _file(nodeid) in SPLIT_FILES else nodeid.split("::", 1)[0]

    return _TimedFilesTogether(config, log)


@pytest.fixture(scope="session", autouse=True)
def _exit_without_final_collection() -> None:
    """The processes that run tests (each xdist worker, or pytest alone) exit as the apps' processes do
    (:mod:`lightning_sync._exit`). A fixture, not a module-level call: importing the package imports Lightning,
    which pytest-xdist's controller, running no test, would otherwise pay for at start-up."""
    from lightning_sync._exit import skip_final_collection

    skip_final_collection()


@pytest.fixture(autouse=True)
def _timed_tests_first(request: pytest.FixtureRequest) -> None:
    """Under pytest-xdist, a ``timed`` test or one of :data:`NORMAL_PRIORITY_FILES` (and the processes it starts) runs
    at the normal CPU priority and any other test at nice :data:`OTHER_TESTS_NICE`. Raising the priority again needs root (``make test`` as a user leaves
    the priority as it is)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    normal = request.node.get_closest_marker("timed") or _file(request.node.nodeid) in NORMAL_PRIORITY_FILES
    nice = 0 if normal else OTHER_TESTS_NICE
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass


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
