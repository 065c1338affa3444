"""Reading the process table from ``/proc`` (Linux): one process's ``stat`` fields, its parent, its descendants;
for the frozen-rank handling (:mod:`lightning_sync.strategies._launcher`) and the benchmark's node launcher. Where
there is no ``/proc``, nothing is found.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent pid); ``None`` if
    the process is gone or there is no ``/proc``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent pid of ``pid``; ``None`` if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def descendants(pids: Iterable[int]) -> list[int]:
    """Every live descendant of ``pids`` (children, their children, ...), from one read of the process table."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        parent = parent_pid(int(entry.name))
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = list(pids)
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
