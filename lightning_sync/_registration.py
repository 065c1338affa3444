"""Registering the ``sync_*`` strategy names with Lightning without importing Lightning early.

``import lightning_sync`` must make ``Trainer(strategy="sync_allreduce")`` work whatever the import path, and must
stay cheap, so that the command-line tools can reject a bad argument before torch and Lightning load (several
seconds). Both hold with a post-import hook: if ``lightning.pytorch`` is already imported, the strategies register
at once; otherwise a finder on ``sys.meta_path`` waits for ``lightning.pytorch`` to finish executing and registers
them right then. A ``Trainer`` cannot exist before ``lightning.pytorch`` has finished importing, so the registry is
always filled before anyone reads it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

_TRIGGER = "lightning.pytorch"


def _register() -> None:
    """Imports :mod:`lightning_sync.strategies`, whose import registers every ``sync_*`` name (once)."""
    importlib.import_module("lightning_sync.strategies")


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` through the other finders and registers our strategies after it executes."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TRIGGER:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            execute(module)
            _remove_hook()
            _register()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterAfterLightning)]


def register_when_lightning_loads() -> None:
    """Registers the strategies now if Lightning is loaded, else as soon as ``lightning.pytorch`` finishes loading."""
    if _TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())
