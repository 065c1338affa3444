"""A config field with its help (:func:`knob`), and the help of every field of a config (:func:`knob_docs`)."""

from __future__ import annotations

import copy
from dataclasses import field, fields
from typing import TypeVar

_T = TypeVar("_T")


def knob(default: _T, help: str) -> _T:
    """A dataclass field with ``default`` and its ``help`` (whitespace folded to single spaces) in its metadata.

    Typed as the default's type, as :func:`dataclasses.field` is, so ``x: int = knob(1, "...")`` type-checks. A
    list, dict or set default is copied for each instance (a ``default_factory``).
    """
    metadata = {"help": " ".join(help.split())}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def knob_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` (inherited ones included), in order, with its :func:`knob` help (``""``:
    none), as the strategies' ``Args:`` and the Hydra app's ``--help`` print it."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
