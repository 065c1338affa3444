"""Streaming DiLoCo's fragments: which parameters sync together, and in which order the fragments sync.

Everything works on parameter names (and shapes), as ``named_parameters()`` gives them.

**By block** (the default, as the streaming DiLoCo paper and torchft form them). The *repeated blocks* are the
children of one container with integer-named children (``blocks.0``, ``blocks.1``, ...) holding the same parameter
names and shapes (of several such containers, the one holding the most parameters). Block ``i`` joins fragment
``i % k``, ``k = min(fragments, blocks)``; a block is never split. A parameter outside every block joins the
fragment of the nearest block before it (the first block's before any), as in torchtitan: embeddings sync with the
block that reads them, the final norm and head with the block that feeds them.

**By layer** (without two repeated blocks): layer ``i`` (each parameter's own module) joins fragment ``i % k``.

**Explicit** (``fragment_modules``): one entry per fragment, in sync order, each a module-name pattern or a list of
them, as torchft's ``DiLoCo`` takes a list of modules. Patterns are case-sensitive :mod:`fnmatch` globs (``*`` also
crosses dots) on module names; every parameter must be in exactly one fragment, and every pattern must match one.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_sync.errors import ConfigError

NamedShapes = Sequence[tuple[str, Sequence[int]]]
"""``(parameter name, shape)`` in model order."""


def normalize_fragment_modules(value: Any, field: str = "fragment_modules") -> tuple[tuple[str, ...], ...] | None:
    """``fragment_modules``, a list of patterns or lists of patterns, as a tuple of tuples (``None`` when unset).

    Raises:
        ConfigError: not a list, an empty list or fragment, a pattern that is not a non-empty string, or a pattern
            given twice; named as the field, with the value and what is allowed.
    """
    if value is None:
        return None
    allowed = "a list with one entry per fragment, in sync order, each a module-name pattern or a list of them"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        raise ConfigError(f"{field}={value!r} is not allowed; it must be {allowed} (or null: fragments by block)")
    fragments: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for index, item in enumerate(value):
        patterns = [item] if isinstance(item, str) else item
        if isinstance(patterns, Mapping) or not isinstance(patterns, Sequence) or not patterns:
            raise ConfigError(f"{field}[{index}]={item!r} is not allowed; it must be a pattern or a list of patterns")
        for pattern in patterns:
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"{field}[{index}] pattern {pattern!r} is not allowed; it must be a non-empty string")
            if pattern in seen:
                raise ConfigError(f"{field}[{index}] pattern {pattern!r} is not allowed; it appears twice")
            seen.add(pattern)
        fragments.append(tuple(patterns))
    return tuple(fragments)


def layer_of(name: str) -> str:
    """The module holding parameter (or buffer) ``name``: ``net.4.weight`` -> ``net.4``."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def modules_of(name: str) -> list[str]:
    """The modules holding parameter ``name``, innermost first, the root left out: ``a.b.w`` -> ``[a.b, a]``."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:depth]) for depth in range(len(parts), 0, -1)]


def find_blocks(named: NamedShapes) -> list[str]:
    """The model's repeated blocks (see the module docstring), by module name in model order (``[]`` when there are
    fewer than two); the candidate holding the most parameter entries wins, the first in model order on a tie."""
    # (container, signature) -> its children in order, and their entries
    children: dict[str, dict[str, list[tuple[str, tuple[int, ...]]]]] = {}
    numel: dict[str, int] = {}
    for name, shape in named:
        parts = name.split(".")
        for depth in range(len(parts) - 1):  # parts[depth] is a child module, not the parameter itself
            if parts[depth].isdigit():
                container, child = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
                children.setdefault(container, {}).setdefault(child, []).append(
                    (".".join(parts[depth + 1 :]), tuple(shape))
                )
                numel[child] = numel.get(child, 0) + math.prod(shape)
    best: list[str] = []
    best_size = 0
    for members in children.values():
        by_signature: dict[tuple[tuple[str, tuple[int, ...]], ...], list[str]] = {}
        for child, signature in members.items():
            by_signature.setdefault(tuple(signature), []).append(child)
        for blocks in by_signature.values():
            size = sum(numel[child] for child in blocks)
            if len(blocks) >= 2 and size > best_size:
                best, best_size = blocks, size
    return best


def _strided(units: Sequence[int], fragments: int) -> list[list[int]]:
    """Unit ``u`` joins fragment ``u % k``, ``k = min(fragments, units)``: each fragment's indices into ``units``."""
    k = max(1, min(fragments, max(units, default=-1) + 1))
    out: list[list[int]] = [[] for _ in range(k)]
    for index, unit in enumerate(units):
        out[unit % k].append(index)
    return out


def layer_fragments(names: Sequence[str], fragments: int) -> list[list[int]]:
    """By layer: layer ``i`` (each parameter's own module, in order of first appearance) joins fragment ``i % k``,
    with ``k = min(fragments, layers)``; for each fragment, the indices into ``names`` of its parameters."""
    layers: dict[str, int] = {}
    return _strided([layers.setdefault(layer_of(name), len(layers)) for name in names], fragments)


def block_fragments(named: NamedShapes, fragments: int) -> list[list[int]]:
    """By block: block ``i`` joins fragment ``i % k`` (``k = min(fragments, blocks)``), each other parameter the
    fragment of the nearest block before it (the first block's before any); by layer without repeated blocks.

    Returns:
        For each fragment, the indices into ``named`` of its parameters, in model order.
    """
    names = [name for name, _ in named]
    blocks = {block: i for i, block in enumerate(find_blocks(named))}
    if len(blocks) < 2:
        return layer_fragments(names, fragments)
    units, current = [], 0
    for name in names:
        current = next((blocks[m] for m in modules_of(name) if m in blocks), current)
        units.append(current)
    return _strided(units, fragments)


def explicit_fragments(
    names: Sequence[str], patterns: Sequence[Sequence[str]], field: str = "fragment_modules"
) -> list[list[int]]:
    """The fragments ``patterns`` name (see the module docstring), in their order.

    Raises:
        ConfigError: a pattern matching no parameter, a parameter in two fragments or in none.
    """
    out: list[list[int]] = [[] for _ in patterns]
    used: set[str] = set()
    for index, name in enumerate(names):
        modules = modules_of(name)
        hits = []
        for f, fragment in enumerate(patterns):
            matched = [p for p in fragment if any(fnmatch.fnmatchcase(m, p) for m in modules)]
            used.update(matched)
            if matched:
                hits.append((f, matched[0]))
        if not hits:
            raise ConfigError(
                f"{field}: parameter {name!r} is in no fragment; every parameter must be in exactly one: add a "
                f"pattern for one of its modules ({', '.join(modules) or 'none: give it a module'})"
            )
        if len(hits) > 1:
            shown = " and ".join(f"{f} ({p!r})" for f, p in hits)
            raise ConfigError(
                f"{field}: parameter {name!r} is in fragments {shown}; every parameter must be in exactly one"
            )
        out[hits[0][0]].append(index)
    for f, fragment in enumerate(patterns):
        for pattern in fragment:
            if pattern not in used:
                examples = sorted({m for name in names for m in modules_of(name)}, key=len)[:6]
                raise ConfigError(
                    f"{field}[{f}] pattern {pattern!r} matches no module holding a parameter; patterns are fnmatch "
                    f"globs on module names such as {', '.join(examples)}"
                )
    return out


def split_fragments(
    named: NamedShapes, fragments: int, patterns: Sequence[Sequence[str]] | None = None
) -> list[list[int]]:
    """A sync group's fragments, in sync order, as indices into ``named``: ``patterns`` (``fragment_modules``) when
    given, else by block (by layer without repeated blocks)."""
    if patterns is not None:
        return explicit_fragments([name for name, _ in named], patterns)
    return block_fragments(named, fragments)


def buffer_fragments(names: Sequence[str], split: Sequence[Sequence[int]], buffers: Sequence[str]) -> list[int]:
    """Each buffer's fragment: that of the innermost module above it whose parameters are all in one fragment (a
    BatchNorm's statistics go with its weight); the last fragment where there is none."""
    owners: dict[str, set[int]] = {}
    for f, indices in enumerate(split):
        for i in indices:
            for module in modules_of(names[i]):
                owners.setdefault(module, set()).add(f)
    return [
        next((min(owners[m]) for m in modules_of(buffer) if len(owners.get(m, ())) == 1), len(split) - 1)
        for buffer in buffers
    ]


def describe_fragments(named: NamedShapes, fragments: int, patterns: Sequence[Sequence[str]] | None = None) -> str:
    """A Markdown table of the fragments: each fragment's modules (blocks whole, other parameters by module) and
    its share of the parameter entries."""
    split = split_fragments(named, fragments, patterns)
    blocks = set(find_blocks(named)) if patterns is None else set()
    sizes = [math.prod(shape) for _, shape in named]
    total = max(1, sum(sizes))
    rows = ["| fragment | modules | parameters | share |", "|---|---|---|---|"]
    for f, indices in enumerate(split):
        modules: list[str] = []
        for i in indices:
            name = named[i][0]
            module = next((m for m in modules_of(name) if m in blocks), None) or layer_of(name) or name
            if module not in modules:
                modules.append(module)
        count = sum(sizes[i] for i in indices)
        shown = ", ".join(f"`{m}`" for m in modules)
        rows.append(f"| {f} | {shown} | {count:,} | {count / total:.1%} |")
    return "\n".join(rows)
