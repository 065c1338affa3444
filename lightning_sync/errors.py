"""The error a user's configuration mistake raises, and the two checks that raise it.

A leaf module. A message starts with the field it blames, so a caller that knows where the field lives can name it
in full (:meth:`ConfigError.under` turns ``sync_every=0 ...`` into ``strategy.sync_every=0 ...``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A user's configuration mistake: one line naming the field, the value and what is allowed.

    Example::

        >>> from lightning_sync import AllReduceStrategy
        >>> AllReduceStrategy(bucket_cap_mb=-1)
        Traceback (most recent call last):
            ...
        lightning_sync.errors.ConfigError: strategy.bucket_cap_mb=-1 is not allowed; it must be > 0
    """

    def under(self, group: str) -> ConfigError:
        """The same error with the field named inside ``group`` (``group.field=...``)."""
        return ConfigError(f"{group}.{self}")


def check_choice(field: str, value: Any, allowed: Iterable[str]) -> None:
    """Raises ConfigError unless ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def check_range(
    field: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raises ConfigError unless ``value`` is a number (an integer if ``integer``) within the bounds.

    The bounds are inclusive unless ``low_open``/``high_open``; ``None`` means unbounded.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    infinite = isinstance(value, float) and not math.isfinite(value)
    if not number or (integer and not isinstance(value, int)) or infinite:
        raise ConfigError(f"{field}={value!r} is not allowed; it must be {'an integer' if integer else 'a number'}")
    lower_ok = low is None or (value > low if low_open else value >= low)
    upper_ok = high is None or (value < high if high_open else value <= high)
    if lower_ok and upper_ok:
        return
    if high is None:
        allowed = f"{'>' if low_open else '>='} {low}"
    elif low is None:
        allowed = f"{'<' if high_open else '<='} {high}"
    else:
        allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    raise ConfigError(f"{field}={value!r} is not allowed; it must be {allowed}")


class CheckpointError(ValueError):
    """A checkpoint that this run cannot resume from: unreadable, or saved by another strategy or world size.

    The message names the file and both sides (what the checkpoint holds, what this run is).

    Example::

        >>> from lightning_sync import AllReduceStrategy
        >>> AllReduceStrategy().load_checkpoint("missing.ckpt")
        Traceback (most recent call last):
            ...
        lightning_sync.errors.CheckpointError: checkpoint 'missing.ckpt' does not exist (or is not a file)
    """
