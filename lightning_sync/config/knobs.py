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
    """Each field of dataclass ``cls`` (inherited ones included) with its help, on one line; in field order. A field
    without help gets ``""``.

    The help is the field's ``metadata["help"]`` (see :func:`knob`). The strategies' ``Args:`` documentation and the
    ``--help`` of the Hydra app print these, so a knob is documented once, where it is defined.
    """
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
