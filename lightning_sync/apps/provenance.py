"""Where a result comes from: the code, the command, the software and the CPU, recorded beside every results file.

:func:`provenance` is what the compare job, the benchmark and the notebooks store with their numbers, so that two
tables from two machines (or two commits) can be told apart and explained. It reads only local facts (``git`` in
the checkout of an editable install, package metadata, ``/proc/cpuinfo``, ``/proc/loadavg``) and records no host
name or user name.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import urllib.parse
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "lightning", "numpy", "lightning-sync")
"""The distributions whose versions a record holds, besides Python's."""


def git_output(*args: str, cwd: str | Path | None = None) -> str | None:
    """``git <args>``'s output in ``cwd`` (default: the working directory); ``None`` outside a git checkout or
    without git."""
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def source_checkout(distribution: str = "lightning-sync") -> str | None:
    """The folder of the code that runs: the git checkout that holds the imported package (also when an editable
    install points at another checkout, as when a clone runs with a venv made for the original, or when a stale
    ``*.egg-info`` in the working directory hides the install's metadata); else the source folder of an editable
    install of ``distribution`` (its PEP 610 ``direct_url.json``); ``None`` for an installed wheel, whose version
    alone says which code ran."""
    root = Path(__file__).resolve().parents[2]  # lightning_sync/apps/provenance.py -> the folder above the package
    if (root / ".git").exists():
        return str(root)
    try:
        info = json.loads(metadata.distribution(distribution).read_text("direct_url.json") or "{}")
    except metadata.PackageNotFoundError:
        info = {}
    url = str(info.get("url", ""))
    if info.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlparse(url).path)
    return None


def git_state() -> dict[str, Any]:
    """``{"commit": full hash or None, "dirty": True if tracked files differ from it (None: unknown),
    "dirty_files": the first 20 of them}`` of the code that runs: the checkout of an editable install
    (:func:`source_checkout`); all ``None`` for an installed wheel."""
    checkout = source_checkout()
    if checkout is None:
        return {"commit": None, "dirty": None, "dirty_files": []}
    commit = (git_output("rev-parse", "HEAD", cwd=checkout) or "").strip() or None
    status = git_output("status", "--porcelain", "--untracked-files=no", cwd=checkout) if commit else None
    files = [line[3:] for line in (status or "").splitlines()]
    return {"commit": commit, "dirty": None if status is None else bool(status), "dirty_files": files[:20]}


def cpu_info(path: str | Path = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name, logical CPUs and feature flags (sorted), from ``/proc/cpuinfo`` (Linux); on other
    systems the model is :func:`platform.processor` and the flags are empty."""
    file = Path(path)
    model: str | None = platform.processor() or None
    flags: list[str] = []
    count = 0
    if file.is_file():
        for line in file.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "processor":
                count += 1
            elif key == "model name" and count <= 1:
                model = value
            elif key in ("flags", "Features") and not flags:
                flags = sorted(value.split())
    return {"model": model, "logical_cpus": count or os.cpu_count(), "flags": flags}


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """A record of where a result comes from, to store beside it (JSON-ready).

    Args:
        argv: the arguments after the interpreter (``None``: this process's own command line).

    Returns:
        ``{"command", "commit", "dirty", "dirty_files", "date", "python", "versions": {name: version}, "machine"
        (one line), "platform", "cpu": {"model", "logical_cpus", "flags"}, "load_average"}``; ``command`` is the command line as a shell would take it,
        with ``python -m <module>`` for a module run.
    """
    if argv is None:  # the interpreter's own command line: ``python -m pkg.mod args`` as typed
        orig = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
        command = shlex.join([Path(orig[0]).name, *orig[1:]])
    else:
        command = shlex.join([Path(sys.executable).name, *argv])
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    cpu = cpu_info()
    return {
        "command": command,
        **git_state(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in PACKAGES},
        "machine": f"{platform.system()} {platform.machine()}, {cpu['logical_cpus']} CPUs, {cpu['model']}",
        "platform": platform.platform(),
        "cpu": cpu,
        "load_average": load,
    }


def summary_line(record: dict[str, Any]) -> str:
    """One line of a record for a report's footer: commit (``+dirty``), Python, the packages and the CPU."""
    commit = (record.get("commit") or "unknown")[:10] + ("+dirty" if record.get("dirty") else "")
    packages = " ".join(f"{k} {v}" for k, v in record.get("versions", {}).items() if v)
    return f"commit {commit}; Python {record.get('python')}; {packages}; CPU {record.get('cpu', {}).get('model')}"
