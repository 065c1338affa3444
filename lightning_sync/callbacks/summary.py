"""The JSON run summary that the callbacks write their parts into (rank 0 only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def merge_summary(path: str | None, part: dict[str, Any]) -> None:
    """Merges ``part`` into the JSON file at ``path`` (nothing if ``None``).

    With fork/spawn, fit and test run in different processes, and several callbacks write their own keys: each
    merges its part into what is there.
    """
    if path is not None:
        Path(path).write_text(json.dumps({**read_summary(path), **part}, indent=2, sort_keys=True))


def read_summary(path: str) -> dict[str, Any]:
    """The summary JSON at ``path`` (``{}`` if there is none yet)."""
    file = Path(path)
    return json.loads(file.read_text()) if file.is_file() else {}
