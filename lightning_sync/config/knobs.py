"""A config field with its help (:func:`knob`), and the help of every field of a config (:func:`knob_docs`)."""

from __future__ import annotations

import ast
import inspect
from dataclasses import field, fields, is_dataclass
from typing import TypeVar

_T = TypeVar("_T")


def knob(default: _T, help: str) -> _T:
    """A dataclass field with ``default`` and its ``help`` (whitespace folded to single spaces) in its metadata.

    Typed as the default's type, as :func:`dataclasses.field` is, so ``x: int = knob(1, "...")`` type-checks.
    """
    folded = " ".join(help.split())
    return field(default=default, metadata={"help": folded})


def knob_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` (inherited ones included) with its help, on one line; in field order. A field
    without help gets ``""``.

    The help is the field's ``metadata["help"]`` (see :func:`knob`). The strategies' ``Args:`` documentation and the
    ``--help`` of the Hydra app print these, so a knob is documented once, where it is defined. A dataclass whose
    fields have no help metadata at all is read the older way, from the string under each field in its class body
    (the benchmark's :class:`~lightning_sync.apps.bench.config.BenchConfig`).
    """
    if not any("help" in f.metadata for f in fields(cls)):
        return _attribute_docstrings(cls)
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` with the string under it in the class body (read from the source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass) or klass is object or "__dataclass_fields__" not in vars(klass):
            continue
        try:
            node = ast.parse(inspect.getsource(klass)).body[0]
            assert isinstance(node, ast.ClassDef)
            body = node.body
        except (OSError, TypeError):  # no source (e.g. a class made at run time): no docstrings
            continue
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return {f.name: docs.get(f.name, "") for f in fields(cls)}
