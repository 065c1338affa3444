"""The checks of :class:`~lightning_sync.comm.periodic.PeriodicAverager`'s knobs, run at construction so that a bad
value fails before any process starts (as torch's ``PeriodicModelAverager`` checks its period)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.module_policy import POLICY_FIELD
from lightning_sync.comm.streaming import StreamingOptions, check_streaming_options
from lightning_sync.errors import ConfigError, check_range


def check_periodic_ranges(sync_every: int | str, warmup_steps: int, bucket_cap_mb: float) -> None:
    """Checks each knob's own range: ``sync_every`` an integer ``>= 1`` or ``"auto"``, ``warmup_steps >= 0``,
    ``bucket_cap_mb > 0``.

    Raises:
        ConfigError: the first knob out of range, named.
    """
    if sync_every != "auto":
        if isinstance(sync_every, bool) or not isinstance(sync_every, int):
            raise ConfigError(f"sync_every={sync_every!r} is not allowed; it must be an integer >= 1 or 'auto'")
        check_range("sync_every", sync_every, low=1, integer=True)
    check_range("warmup_steps", warmup_steps, low=0, integer=True)
    check_range("bucket_cap_mb", bucket_cap_mb, low=0, low_open=True)


def check_streaming_periods(
    streaming: StreamingOptions,
    new_compressor: Callable[[], Compressor],
    sync_every: int | str,
    min_sync_every: int | None,
    policy: Mapping[str, int],
) -> None:
    """Checks the streaming knobs against each other and against every period a sync group may have.

    Args:
        streaming: the streaming knobs (fragments, delay, mixing, codec, explicit fragments).
        new_compressor: makes the compressor of the pseudo-gradients when ``outer_compression`` is ``none``.
        sync_every: the default group's fixed period, or ``"auto"`` (checked by :func:`check_periodic_ranges`).
        min_sync_every: the smallest adaptive period with ``sync_every="auto"``, else ``None``.
        policy: the normalized ``module_sync_every``, ``{pattern: period}``.

    Raises:
        ConfigError: a streaming knob out of range or one that does not fit a period, named as the knob;
            ``fragment_modules`` together with ``module_sync_every``.
    """
    periods = [("sync_every", sync_every)] if isinstance(sync_every, int) else []
    if min_sync_every is not None:
        periods.append(("min_sync_every", min_sync_every))
    periods += [(f"{POLICY_FIELD}[{pattern!r}]", every) for pattern, every in policy.items()]
    check_streaming_options(streaming, new_compressor, periods)
    if streaming.fragment_modules is not None and policy:
        raise ConfigError(
            f"fragment_modules={[list(f) for f in streaming.fragment_modules]!r} is not allowed with "
            f"{POLICY_FIELD}; explicit fragments split one group: leave one of them unset"
        )
