"""Runs a command-line app's ``main`` in a process forked from the test process, as its own process would run it.

A fresh interpreter spends about 7 s of CPU importing torch, Lightning and torchmetrics before the app reads its
first argument; a fork of the test process, which has imported them already, starts in milliseconds. A fork that
stands for ``python -m <module>`` (its ``command``) has that module's spec as ``__main__.__spec__``, so that a rank
launcher (Lightning's ``popen`` one, which re-runs ``__main__``) starts its other ranks as that command, fresh
interpreters as a user's run starts them.

The child is a session of its own (killed with its process group), writes stdout and stderr to files, and gets the
argument list, environment, working directory, warnings and logging a fresh interpreter would have.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def _fresh_logging() -> None:
    """Logging as a fresh interpreter that imported Lightning has it: no root handlers (pytest adds its own), and
    Lightning's loggers each printing to stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.addHandler(logging.StreamHandler(sys.stderr))
        logger.propagate = False


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
    """Writes a warning to stderr, as the interpreter does."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno))


def _child(
    main: Callable[[], object],
    argv: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    out: Path,
    command: Sequence[str],
) -> int:
    os.setsid()
    os.chdir(cwd)
    for fd, path in ((1, out / "stdout.txt"), (2, out / "stderr.txt")):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    sys.orig_argv = list(command)  # what provenance records as the command line
    if len(command) > 2 and command[1] == "-m":
        import __main__  # the test runner's: this fork is the app now

        __main__.__spec__ = importlib.util.find_spec(command[2])
    warnings.resetwarnings()
    warnings.showwarning = _show_warning  # pytest's catch_warnings(record=True) would keep collecting them
    # PYTHONWARNINGS's filters, set as the interpreter sets them at start (conftest's deprecations-as-errors)
    warnings._processoptions([o for o in env.get("PYTHONWARNINGS", "").split(",") if o])  # type: ignore[attr-defined]
    _fresh_logging()
    try:
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()  # a test of this process may have composed a config
    except ImportError:
        pass
    try:
        main()
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on stderr, exit code 1
        traceback.print_exc()
        return 1


class ForkedApp:
    """``main()`` running in a forked child; a ``subprocess.Popen``-like handle on it (``pid``, ``poll``,
    ``wait``).

    Args:
        main: the app's entry point (e.g. ``lightning_sync.apps.train.main``), which reads ``sys.argv``.
        argv: its ``sys.argv``, program name first.
        cwd: the child's working directory.
        env: its whole environment.
        out: the folder its ``stdout.txt`` and ``stderr.txt`` go to.
        command: the command line it stands for (``sys.orig_argv``), e.g. ``[python, "-m", module, *args]``;
            default: the interpreter and ``argv``.
    """

    def __init__(
        self,
        main: Callable[[], object],
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        out: Path,
        command: Sequence[str] = (),
    ) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns into the test runner
            code = 1
            try:
                code = _child(main, argv, cwd, env, out, command or [sys.executable, *argv])
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # noqa: BLE001
                        pass
                os._exit(code)
        self.pid, self.out = pid, out
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit code; raises ``TimeoutError`` (and leaves the child running) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"forked app {self.pid} still running after {timeout} s")
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """Kills the child's process group, if anything in it is alive, and reaps the child."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.wait(10)
        except ChildProcessError:
            pass


def run_forked(
    main: Callable[[], object],
    argv: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    command: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Runs ``main`` in a :class:`ForkedApp` to its end (killed after ``timeout`` seconds): its exit code, stdout and
    stderr, as ``subprocess.run(..., capture_output=True, text=True)`` returns them."""
    out = Path(tempfile.mkdtemp(dir=cwd, prefix="forked-out-"))
    app = ForkedApp(main, argv, cwd, env, out, command)
    try:
        code = app.wait(timeout)
    finally:
        app.kill()
    stdout, stderr = ((out / name).read_text() for name in ("stdout.txt", "stderr.txt"))
    return subprocess.CompletedProcess(list(argv), code, stdout, stderr)
