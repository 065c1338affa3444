"""The package as a user installs and imports it: the core stands alone, and the registry names always work.

- ``import lightning_sync`` registers all four ``sync_*`` names with Lightning, also in a user's own package run as
  ``python -m pkg.train`` whose ``__init__`` imports it before Lightning is imported.
- The core (strategies, comm, ps) imports neither Hydra nor matplotlib: those are the ``apps`` extra.
- A dedicated parameter server process runs on torch alone: it never imports Lightning.
- An unknown strategy knob added with ``+strategy.<knob>=`` is a one-line config error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=110)


def test_registry_names_work_from_a_user_package_run_with_dash_m(tmp_path):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("import lightning_sync  # noqa: F401\n")
    (package / "train.py").write_text(
        textwrap.dedent(
            """
            import sys
            import lightning as L

            assert "lightning_sync.strategies" in sys.modules, "import lightning_sync did not import the strategies"
            for name in ("sync_ddp", "sync_allreduce", "sync_periodic", "sync_ps"):
                trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False,
                                    enable_progress_bar=False, enable_model_summary=False)
                print(name, type(trainer.strategy).__name__)
            """
        )
    )
    result = _run(["-m", "userpkg.train"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("sync_")]
    assert lines == [
        "sync_ddp DDPSyncStrategy",
        "sync_allreduce AllReduceStrategy",
        "sync_periodic PeriodicSyncStrategy",
        "sync_ps ParameterServerStrategy",
    ]


def test_plain_import_registers_the_names_and_exports_the_strategies(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        assert "lightning" not in sys.modules
        import lightning_sync
        from lightning.pytorch.strategies import StrategyRegistry
        print(sorted(name for name in StrategyRegistry if name.startswith("sync_")))
        print(lightning_sync.AllReduceStrategy is StrategyRegistry["sync_allreduce"]["strategy"])
        """
    )
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["['sync_allreduce', 'sync_ddp', 'sync_periodic', 'sync_ps']", "True"]


def test_a_server_process_imports_the_server_and_not_lightning(tmp_path, monkeypatch):
    """The strategy starts each dedicated server with ``LIGHTNING_SYNC_SERVER_PROCESS=1``; with it, the server's
    module loads without Lightning (seconds of CPU per server), and the strategy names still resolve on first use."""
    import lightning_sync.ps.placement as placement
    from lightning_sync._server_process import SERVER_PROCESS_ENV

    started: list[dict[str, str]] = []

    class _Popen:
        def __init__(self, command: list[str], env: dict[str, str], **kwargs: object) -> None:
            started.append(env)

        def poll(self) -> int:
            return 0

    with monkeypatch.context() as patch:  # (subprocess.Popen itself: undone before the real run below)
        patch.setattr(placement.subprocess, "Popen", _Popen)
        placement.start_servers("dedicated", 0, "127.0.0.1", 1, num_workers=2, num_servers=2, timeout_s=5)
    assert [env.get(SERVER_PROCESS_ENV) for env in started] == ["1", "1"], started
    code = textwrap.dedent(
        """
        import sys
        import lightning_sync.ps.__main__
        print("lightning" in sys.modules, "lightning.pytorch" in sys.modules)
        import lightning_sync
        print(lightning_sync.ParameterServerStrategy.__name__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**ENV, SERVER_PROCESS_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["False False", "ParameterServerStrategy"], result.stdout


def test_core_works_without_the_apps_extra(tmp_path):
    """As after ``pip install .`` with no extras: Hydra and matplotlib cannot be imported at all, and
    the core still imports, registers and trains under a plain ``lightning.Trainer``."""
    code = textwrap.dedent(
        """
        import importlib.abc, importlib.machinery, sys

        BLOCKED = {"hydra", "omegaconf", "matplotlib"}

        class Hide(importlib.abc.MetaPathFinder):
            # PathFinder, blind to the apps extra's packages: as if they were not installed

            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    return None
                return importlib.machinery.PathFinder.find_spec(name, path, target)

        sys.meta_path[:] = [Hide() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
        import torch
        import lightning as L
        from lightning.pytorch.demos.boring_classes import BoringModel
        import lightning_sync
        import lightning_sync.comm.bucketing, lightning_sync.comm.periodic, lightning_sync.ps
        import lightning_sync.callbacks, lightning_sync.algorithms, lightning_sync.config
        for name in ("sync_ddp", "sync_allreduce", "sync_periodic", "sync_ps"):
            trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, max_steps=2,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
            if name == "sync_allreduce":
                trainer.fit(BoringModel())
        apps = sorted(m for m in sys.modules if m.startswith(("lightning_sync.apps", "lightning_sync.examples")))
        print("apps", apps)
        """
    )
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "apps []"


def test_unknown_knob_added_with_plus_is_a_one_line_error(tmp_path):
    result = _run(["-m", "lightning_sync.train", "strategy=ddp", "+strategy.no_such_knob=1"], tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "strategy.no_such_knob" in lines[0] and "DDPConfig" in lines[0] and "bucket_cap_mb" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.unit
def test_the_wheel_lists_every_package_of_the_source_tree():
    """pyproject.toml names the packages one by one (conf/ ships as lightning_sync.conf): a new subpackage left out
    of that list would be missing from an installed wheel, while an editable install hides it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "lightning_sync").rglob("__init__.py")}
    assert found <= listed, f"packages missing from [tool.setuptools] packages: {sorted(found - listed)}"


_EXIT_CHILD = """
import gc, importlib.util, sys
spec = importlib.util.spec_from_file_location("_exit", sys.argv[2])  # the module alone: no torch to import
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
if sys.argv[1] == "skip":
    module.skip_final_collection()
    module.skip_final_collection()  # a second call registers nothing more
class Cycle:
    def __del__(self):
        print("cycle finalized", flush=True)
cycle = Cycle()
cycle.me = cycle
del cycle
gc.disable()  # the cycle stays alive until the exit
import atexit
atexit.register(print, "a later exit handler ran")
"""


def test_an_app_process_exits_without_collecting_the_heap(tmp_path):
    """``skip_final_collection``: the exit's collections skip the heap (a reference cycle alive at exit is not
    finalized, where a plain interpreter finalizes it), and the exit handlers registered after it still run."""
    script = tmp_path / "child.py"
    script.write_text(_EXIT_CHILD)
    runs = {}
    for mode in ("skip", "plain"):
        proc = _run([str(script), mode, str(REPO / "lightning_sync" / "_exit.py")], tmp_path)
        assert proc.returncode == 0, proc.stderr
        runs[mode] = proc.stdout
    assert "cycle finalized" in runs["plain"], runs
    assert "cycle finalized" not in runs["skip"], runs
    assert all("a later exit handler ran" in out for out in runs.values()), runs
