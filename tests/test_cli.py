"""The Hydra app as a user runs it: ``python -m lightning_sync.train ...`` in a subprocess, and the built wheel.

These start real processes (the default ``popen`` launcher re-runs the job for rank 1), so each run costs a few
imports of torch and Lightning, which are single-threaded. All runs of this module are therefore started together
when the module starts (see :func:`cli_runs`), so that both cores work; each test then waits for its own runs. The
runs that start no rank (bad input, ``--help``) run the app's ``main`` in a fork of this process instead
(``tests/app_utils.py``), which skips those imports.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from app_utils import ForkedApp

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
# Left behind by a launching parent they would make a child join the wrong group.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED")
_STRAY = ("outputs", "multirun", "lightning_logs")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("PL_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore", HYDRA_FULL_ERROR="0", **extra)
    return env


def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightning_sync.train", *args]


@dataclass
class _Run:
    """One ``python -m lightning_sync.train`` started in ``root/cwd``; stdout and stderr go to files (no pipe fills)."""

    root: Path
    proc: subprocess.Popen | ForkedApp

    @classmethod
    def start(cls, root: Path, *args: str, forked: bool = False) -> _Run:
        """``forked``: the app's ``main`` in a fork of this process (for runs that start no rank; no interpreter
        start-up, see ``tests/app_utils.py``)."""
        (root / "cwd").mkdir(parents=True)
        if forked:
            from lightning_sync.apps.train import main

            return cls(
                root, ForkedApp(main, [str(REPO / "lightning_sync" / "train.py"), *args], root / "cwd", _env(), root)
            )
        with open(root / "stdout.txt", "w") as out, open(root / "stderr.txt", "w") as err:
            # its own session: the rank it launches is in the same process group, killed together on timeout
            proc = subprocess.Popen(
                _train_cmd(*args),
                cwd=root / "cwd",
                env=_env(),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return cls(root, proc)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """Exit code, stdout and stderr; kills the run (rank children included, one process group) on timeout."""
        try:
            code = self.proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, TimeoutError):
            self.kill()
            raise
        return code, (self.root / "stdout.txt").read_text(), (self.root / "stderr.txt").read_text()

    def kill(self) -> None:
        """Kills the run's process group (the run and the ranks it launched) if anything in it is still alive."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)


BAD_INPUTS = [
    ("strategy=nope", "strategy='nope'"),
    ("strategy.comm_hook=zzz", "strategy.comm_hook='zzz'"),
    ("trainer.devices=0", "trainer.devices=0"),
    ("strategy.bucket_cap_mb=-1", "strategy.bucket_cap_mb=-1"),
    # several overrides, separated by spaces
    ("strategy=allreduce strategy.compression=zip", "strategy.compression='zip'"),
    ("strategy=periodic strategy.sync_every=0", "strategy.sync_every=0"),
    ("strategy=periodic strategy.mode=local_sgd strategy.module_sync_every=[['nope.*',8]]", "'nope.*'"),
    # a worker added to a running ps job needs that job's address
    (
        "strategy=ps strategy.mode=async strategy.spare_workers=1 strategy.join=true",
        "needs MASTER_ADDR and MASTER_PORT",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def cli_runs(tmp_path_factory) -> dict[str, _Run]:
    """Starts every CLI run of the module at once (each test waits for its own)."""
    root = tmp_path_factory.mktemp("cli")
    runs = {
        "single": _Run.start(
            root / "single",
            "strategy=ddp",
            "trainer.devices=2",
            "experiment=smoke",
            f"hydra.run.dir={root / 'single' / 'run'}",
        ),
        "sweep": _Run.start(
            root / "sweep",
            "-m",
            "strategy=ddp",
            "strategy.comm_hook=none,fp16",
            "experiment=smoke",
            f"hydra.sweep.dir={root / 'sweep' / 'sweep'}",
        ),
    }
    for i, (override, _) in enumerate(BAD_INPUTS):
        runs[f"bad{i}"] = _Run.start(
            root / f"bad{i}",
            *override.split(" "),
            "experiment=smoke",
            f"hydra.run.dir={root / f'bad{i}' / 'run'}",
            forked=True,
        )
    yield runs
    for run in runs.values():
        run.kill()


def _digits_step_bytes() -> float:
    """Bytes one rank sends per step for the default digits MLP on 2 ranks: a ring all-reduce of its fp32 grads."""
    from lightning_sync.examples.models import DigitsClassifier

    grad_bytes = sum(p.numel() * 4 for p in DigitsClassifier().parameters())
    return 2 * (2 - 1) / 2 * grad_bytes


def _check_run_folder(folder: Path, comm_hook: str) -> dict:
    for name in ("metrics.csv", "config.yaml", "summary.json"):
        assert (folder / name).is_file(), f"{folder} has no {name}: {sorted(p.name for p in folder.iterdir())}"
    with open(folder / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and "comm/bytes_sent" in rows[0], rows[:1]
    sent = [float(r["comm/bytes_sent"]) for r in rows if r.get("comm/bytes_sent")]
    assert len(sent) == 4, sent  # smoke: 4 optimizer steps, one row each
    expected = _digits_step_bytes() * (0.5 if comm_hook == "fp16" else 1.0)
    assert all(s == pytest.approx(expected, rel=0.05) for s in sent), (sent, expected)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["strategy"]["comm_hook"] == comm_hook
    assert config["trainer"]["devices"] == 2
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == 4, summary
    assert summary["strategy"] == "DDPSyncStrategy"
    assert summary["bytes_sent_per_step"] == pytest.approx(expected, rel=0.05), summary
    assert "test/acc" in summary.get("test", {}), summary
    return summary


def _no_stray_output(*dirs: Path) -> None:
    for d in dirs:
        stray = [p for p in d.rglob("*") if p.is_dir() and p.name in _STRAY]
        assert not stray, f"unexpected output folders: {stray}"


def _check_no_leftovers(run: _Run, expected: list[str]) -> None:
    """Nothing but the named folders (and the captured output) in the run's root; nothing at all in its cwd."""
    names = sorted(p.name for p in run.root.iterdir() if p.name not in ("stdout.txt", "stderr.txt"))
    assert names == sorted(["cwd", *expected]), names
    assert not any((run.root / "cwd").iterdir()), list((run.root / "cwd").iterdir())
    _no_stray_output(run.root)


_INSTALLED_CHECK = """
import json, os, sys
site = os.path.realpath(sys.argv[1])
import lightning_sync, lightning_sync.apps.train as train
from hydra import compose, initialize_config_dir
assert os.path.realpath(lightning_sync.__file__).startswith(site + os.sep), lightning_sync.__file__
assert os.path.realpath(train.CONFIG_DIR).startswith(site + os.sep), train.CONFIG_DIR
with initialize_config_dir(config_dir=train.CONFIG_DIR, version_base="1.3"):
    cfg = compose(config_name="config", overrides=["experiment=smoke", "strategy.comm_hook=fp16"])
conf = train.CONFIG_DIR
files = sorted(
    os.path.relpath(os.path.join(d, f), conf) for d, _, fs in os.walk(conf) for f in fs if f.endswith(".yaml")
)
print(json.dumps({"config_dir": train.CONFIG_DIR, "files": files, "target": cfg.strategy._target_,
                  "comm_hook": cfg.strategy.comm_hook, "limit_train_batches": cfg.trainer.limit_train_batches}))
"""


@pytest.mark.timeout(300)
def test_conf_ships_inside_the_wheel(tmp_path):
    """conf/ is inside the wheel as lightning_sync/conf, and the installed app finds and composes it (offline).

    First in the module, so it runs while the CLI runs started by :func:`cli_runs` are still importing.
    """
    # Build from a copy, so nothing (build/, *.egg-info) is written into the checkout and no stale build leaks in.
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            "outputs",
            "multirun",
            "lightning_logs",
            "notebooks",
            "tests",
            "benchmarks",
        ),
    )
    offline = _env(PIP_NO_INDEX="1")
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        cwd=tmp_path,
        env=offline,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lightning_sync-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        cwd=tmp_path,
        env=offline,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert (site / "lightning_sync" / "examples" / "digits.csv.gz").is_file()  # the digits' data ships too
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    check = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CHECK, str(site)],
        cwd=outside,
        env=_env(PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert check.returncode == 0, check.stderr[-4000:]
    result = json.loads(check.stdout.strip().splitlines()[-1])
    assert Path(result["config_dir"]).resolve().is_relative_to(site.resolve())
    repo_files = sorted(str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").rglob("*.yaml"))
    assert result["files"] == repo_files
    assert result["target"] == "lightning_sync.DDPSyncStrategy"
    assert result["comm_hook"] == "fp16" and result["limit_train_batches"] == 4


@pytest.mark.timeout(300)
def test_two_rank_run_writes_outputs(cli_runs):
    run = cli_runs["single"]
    code, out, err = run.wait(timeout=240)
    assert code == 0, err[-4000:]
    _check_run_folder(run.root / "run", "none")
    summaries = [line for line in out.splitlines() if line.startswith("summary:")]
    assert len(summaries) == 1, out  # rank 1 ran the same job but reports nothing
    assert "bytes_sent_per_step=" in summaries[0]
    _check_no_leftovers(run, ["run"])


@pytest.mark.timeout(300)
def test_multirun_gives_one_sweep_folder(cli_runs):
    run = cli_runs["sweep"]
    code, out, err = run.wait(timeout=240)
    assert code == 0, err[-4000:]
    sweep = run.root / "sweep"
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0_ddp", "1_ddp"], [p.name for p in jobs]
    summaries = [_check_run_folder(job, hook) for job, hook in zip(jobs, ("none", "fp16"))]
    assert summaries[1]["bytes_sent_per_step"] == pytest.approx(summaries[0]["bytes_sent_per_step"] / 2, rel=0.05)
    # each job ran once: one summary line each, one launch of the sweep, one .hydra folder per job
    assert sum(line.startswith("summary:") for line in out.splitlines()) == 2, out
    assert (out + err).count("Launching 2 jobs") == 1, (out + err)[-3000:]
    assert sorted(p.parent.name for p in sweep.rglob(".hydra")) == ["0_ddp", "1_ddp"]
    _check_no_leftovers(run, ["sweep"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BAD_INPUTS)), ids=[o for o, _ in BAD_INPUTS])
def test_bad_input_fails_fast_with_one_line(cli_runs, index):
    override, named = BAD_INPUTS[index]
    run = cli_runs[f"bad{index}"]
    code, out, err = run.wait(timeout=240)
    lines = err.strip().splitlines()
    assert code != 0, (override, out, err)
    assert "Traceback" not in err, (override, err)
    assert 0 < len(lines) < 15, (override, err)
    assert named in err, (override, named, err)
    # it stopped before any rank started or anything was trained
    assert "Initializing distributed" not in out + err, (override, "a rank started")
    assert "summary:" not in out
    assert not (run.root / "run").exists()  # not even Hydra's record of a job that never ran
    assert not any((run.root / "cwd").iterdir())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ddp", "allreduce", "periodic", "ps"])
def test_help_lists_the_groups_and_documents_every_knob_of_the_chosen_strategy(tmp_path, mode):
    from lightning_sync.apps.conf_store import MODES
    from lightning_sync.config import knob_docs

    cwd = tmp_path / "cwd"
    run = _Run.start(tmp_path, f"strategy={mode}", "--help", forked=True)
    code, out, err = run.wait(timeout=100)
    assert code == 0, err[-3000:]
    flat = " ".join(out.split())
    assert "schema" not in out, out  # the group behind conf/strategy/*.yaml is not a user's choice
    assert re.search(r"^ +strategy +allreduce, ddp, periodic, ps$", out, re.M), out
    assert f"== Knobs of strategy={mode} " in out
    for name, doc in knob_docs(MODES[mode][1]).items():
        assert doc, f"strategy.{name} of {mode} has no docstring"
        assert f"strategy.{name}=" in out and " ".join(doc.replace("``", "`").split()) in flat, name
    assert "\nstrategy:\n" in out and "\ntrainer:\n" in out  # the composed config follows
    assert not any(cwd.iterdir())  # help writes no run folder


@pytest.fixture(scope="module")
def late_runs(tmp_path_factory) -> dict[str, _Run]:
    """The runs of the tests below, started together when the first of them asks (after the runs above)."""
    from importlib.util import find_spec

    root = tmp_path_factory.mktemp("cli_late")
    runs = {
        "first": _Run.start(  # its ranks forked, and it a fork of this process: resuming is what is tested here
            root / "first",
            "strategy=ddp",
            "strategy.start_method=fork",
            "experiment=smoke",
            "trainer.limit_train_batches=2",
            f"hydra.run.dir={root / 'first' / 'run'}",
            forked=True,
        ),
    }
    if not (find_spec("tensorboard") or find_spec("tensorboardX")):
        runs["tensorboard"] = _Run.start(
            root / "tensorboard",
            "logger=tensorboard",
            "experiment=smoke",
            f"hydra.run.dir={root / 'tensorboard' / 'run'}",
            forked=True,  # it must stop before any rank starts
        )
    yield runs
    for run in runs.values():
        run.kill()


@pytest.mark.timeout(600)
def test_resume_from_last_checkpoint(late_runs):
    """Two steps, then a second run resumed from ``checkpoints/last.ckpt`` (``ckpt_path=``) trains two more."""
    first = late_runs["first"]
    code, _, err = first.wait(timeout=240)
    assert code == 0, err[-4000:]
    ckpt = first.root / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in (first.root / "run").rglob("*"))
    assert json.loads((first.root / "run" / "summary.json").read_text())["optimizer_steps"] == 2
    # stderr is a file, not a terminal: one plain progress line per epoch, no bar
    assert "epoch 1/1 step 2 | train/loss" in err and "\r" not in err, err[-3000:]
    resumed = _Run.start(
        first.root.parent / "resumed",
        "strategy=ddp",
        "strategy.start_method=fork",
        "experiment=smoke",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=2",
        f"ckpt_path={ckpt}",
        "callbacks=early_stopping",
        f"hydra.run.dir={first.root.parent / 'resumed' / 'run'}",
        forked=True,
    )
    try:
        code, _, err = resumed.wait(timeout=240)
    finally:
        resumed.kill()
    assert code == 0, err[-4000:]
    folder = resumed.root / "run"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["optimizer_steps"] == 4 and summary["batches"] == 2, summary  # steps 3 and 4 only
    assert summary["diverged"] is False and "test/acc" in summary["test"], summary
    with open(folder / "metrics.csv", newline="") as f:
        steps = sorted({int(r["step"]) for r in csv.DictReader(f) if r.get("comm/bytes_sent")})
    assert steps == [2, 3], steps
    assert (folder / "checkpoints" / "last.ckpt").is_file() and (folder / "test" / "metrics.csv").is_file()
    assert "epoch 2/2 step 4 |" in err, err[-3000:]


@pytest.mark.timeout(300)
def test_tensorboard_logger_without_tensorboard_fails_fast(late_runs):
    if "tensorboard" not in late_runs:
        pytest.skip("TensorBoard is installed here")
    run = late_runs["tensorboard"]
    code, out, err = run.wait(timeout=240)
    assert code == 2, (out, err)
    assert "pip install tensorboard" in err and "Traceback" not in err, err
    assert 0 < len(err.strip().splitlines()) < 15, err
    assert "Initializing distributed" not in out + err and not (run.root / "run" / "metrics.csv").exists()
