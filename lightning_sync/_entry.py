"""The ``python -m lightning_sync.<tool>`` entry points: each runs its app module as ``__main__``.

The apps live in :mod:`lightning_sync.apps`, whose dependencies (Hydra, matplotlib) are the ``apps``
extra; the core never imports them. Without the extra, the entry point says which install gives it.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys

_APP_DEPENDENCIES = ("hydra", "omegaconf")


def run_app(module: str) -> None:
    """Runs ``module`` (or its package's ``__main__``) as the main module, after checking the extra is installed."""
    missing = [name for name in _APP_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"error: {module} needs the 'apps' extra ({', '.join(missing)} not installed): "
            "pip install 'lightning-sync[apps]'"
        )
    runpy.run_module(module, run_name="__main__", alter_sys=False)
