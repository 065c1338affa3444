"""Griffe extension for the docs site: the documentation lightning_sync builds when its classes are defined.

A strategy's ``Args:`` section is filled in from its config's field help when the class is created
(:class:`lightning_sync.strategies._base.SyncStrategyBase`), and a config field's help lives in the field's metadata
(:func:`lightning_sync.config.knob`). Griffe reads the source, so it sees neither; this extension imports each such
class and hands Griffe its run-time docstring and its fields' help.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import griffe


def _runtime_class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


class RuntimeDocstrings(griffe.Extension):
    """Replaces the static docstrings of lightning_sync's strategies and config fields by their run-time ones."""

    def on_class(self, *, cls: griffe.Class, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if not cls.path.startswith("lightning_sync.") or cls.docstring is None:
            return
        runtime = _runtime_class(cls.path)
        if runtime is None:
            return
        docstring = vars(runtime).get("__doc__")
        if docstring and "\nArgs:\n" in docstring and "\nArgs:\n" not in cls.docstring.value:
            cls.docstring = self._docstring(inspect.cleandoc(docstring), cls, loader)
        if dataclasses.is_dataclass(runtime):
            for field in dataclasses.fields(runtime):
                member = cls.members.get(field.name)
                if field.metadata.get("help") and isinstance(member, griffe.Attribute):
                    member.docstring = self._docstring(field.metadata["help"], member, loader)

    @staticmethod
    def _docstring(text: str, parent: griffe.Object, loader: griffe.GriffeLoader) -> griffe.Docstring:
        return griffe.Docstring(
            text, parent=parent, parser=loader.docstring_parser, parser_options=loader.docstring_options
        )
