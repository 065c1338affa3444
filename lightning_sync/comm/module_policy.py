"""``module_sync_every``: per-module sync periods, from config patterns to the parameters they name.

``module_sync_every`` is ``{glob pattern: period}``, case-sensitive :mod:`fnmatch` globs (``*`` also crosses dots) on
full parameter and buffer names such as ``net.4.weight``. Each pattern makes one sync group with its own period; the
names no pattern matches form the default group :data:`DEFAULT_GROUP`, which follows ``sync_every``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_sync.errors import ConfigError, check_range

DEFAULT_GROUP = "*"
POLICY_FIELD = "module_sync_every"


def normalize_module_policy(value: Any, field: str = POLICY_FIELD) -> dict[str, int] | None:
    """``module_sync_every`` as a plain ``{pattern: period}`` dict (``None`` when unset).

    Accepts a mapping ``{pattern: period}``, or a list whose items are ``{pattern: period}`` one-entry mappings,
    ``{"pattern": p, "every": n}`` mappings or ``[pattern, period]`` pairs (OmegaConf containers work as well).
    Patterns are non-empty strings, periods integers ``>= 1``, and a pattern may appear only once.
    """
    if value is None:
        return None
    pairs: list[tuple[Any, Any]] = []
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        for item in value:
            if isinstance(item, Mapping) and set(item.keys()) == {"pattern", "every"}:
                pairs.append((item["pattern"], item["every"]))
            elif isinstance(item, Mapping) and len(item) == 1:
                pairs.extend(item.items())
            elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 2:
                pairs.append((item[0], item[1]))
            else:
                raise ConfigError(
                    f"{field} item {item!r} is not allowed; each item must be {{pattern: period}}, "
                    "{pattern: ..., every: ...} or [pattern, period]"
                )
    else:
        raise ConfigError(
            f"{field}={value!r} is not allowed; it must be null, a mapping {{pattern: period}} or a list of "
            "[pattern, period] pairs"
        )
    if not pairs:
        raise ConfigError(f"{field}={value!r} is not allowed; give at least one pattern (or null for none)")
    policy: dict[str, int] = {}
    for pattern, period in pairs:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{field} pattern {pattern!r} is not allowed; it must be a non-empty string")
        if pattern in policy:
            raise ConfigError(f"{field} pattern {pattern!r} is not allowed; it appears twice")
        check_range(f"{field}[{pattern!r}]", period, low=1, integer=True)
        policy[pattern] = int(period)
    return policy


def match_module_policy(
    names: Iterable[str], policy: Mapping[str, int], field: str = POLICY_FIELD, what: str = "parameter"
) -> dict[str, str]:
    """``{name: pattern}`` for each name that a pattern of ``policy`` matches (fnmatch, case-sensitive).

    Raises:
        ConfigError: a name matched by two patterns.
    """
    assigned: dict[str, str] = {}
    for name in names:
        hits = [pattern for pattern in policy if fnmatch.fnmatchcase(name, pattern)]
        if len(hits) > 1:
            raise ConfigError(
                f"{field}: {what} {name!r} is matched by {len(hits)} patterns ({', '.join(repr(h) for h in hits)}); "
                "each parameter may match at most one pattern"
            )
        if hits:
            assigned[name] = hits[0]
    return assigned


def assign_patterns(
    param_names: Sequence[str], buffer_names: Iterable[str], policy: Mapping[str, int], field: str = POLICY_FIELD
) -> tuple[dict[str, str], dict[str, str]]:
    """Each parameter's and each buffer's pattern of ``policy`` (names matched by none are left out).

    Raises:
        ConfigError: a pattern matches no parameter, or a name matches two.
    """
    param_pattern = match_module_policy(param_names, policy, field)
    for pattern in set(policy) - set(param_pattern.values()):
        shown = ", ".join(param_names[:6]) + (", ..." if len(param_names) > 6 else "")
        raise ConfigError(
            f"{field}: pattern {pattern!r} matches no parameter; patterns are fnmatch globs on full parameter "
            f"names such as {shown}"
        )
    return param_pattern, match_module_policy(buffer_names, policy, field, what="buffer")


def validate_module_policy(model: nn.Module, policy: Any, field: str = POLICY_FIELD) -> dict[str, int]:
    """Checks a ``module_sync_every`` policy against a model before any rank starts.

    Returns:
        ``{parameter name: period}`` for every parameter a pattern matches (the others use ``sync_every``).

    Raises:
        ConfigError: a bad policy, a pattern that matches no parameter, or a parameter matched by two patterns.
    """
    normalized = normalize_module_policy(policy, field) or {}
    assigned, _ = assign_patterns([name for name, _ in model.named_parameters()], (), normalized, field)
    return {name: normalized[pattern] for name, pattern in assigned.items()}
