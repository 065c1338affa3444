"""Repository tooling (``tools/``, ``benchmarks/``, ``.ci/``: scripts outside the package) loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The script at ``ROOT / relative`` run as a module named ``name`` (default: its file's stem), registered in
    ``sys.modules`` under that name (dataclasses and pickling look a module up there)."""
    path = ROOT / relative
    module_name = name or path.stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
