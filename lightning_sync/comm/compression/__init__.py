"""Gradient compression shared by every sync mode.

A :class:`Compressor` averages one :class:`FlatBucket` over a process group. It owns the encoding, the collectives
(issued through a :class:`~lightning_sync.comm.meter.CommMeter`, so the meter sees the compressed payload) and the
decoding, and writes the mean back into the bucket's buffer in place. The same objects serve the DDP comm hook,
the bucketed all-reduce and periodic averaging.

Compressors with memory (error-feedback residuals, PowerSGD's warm-start factors) keep it per bucket index; it is
part of :meth:`Compressor.state_dict`, so it goes into checkpoints.

One module per concern: :mod:`~lightning_sync.comm.compression.base` (the contract),
:mod:`~lightning_sync.comm.compression.cast` (none, fp16, bf16), :mod:`~lightning_sync.comm.compression.topk` and
:mod:`~lightning_sync.comm.compression.powersgd`; this package adds the factory by name.

Nothing here knows of Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning_sync.comm.compression.base import Compressor, FlatBucket, _completed
from lightning_sync.comm.compression.cast import BF16Compression, CastCompression, FP16Compression, NoCompression
from lightning_sync.comm.compression.powersgd import PowerSGDCompression, _PowerSGDMemory
from lightning_sync.comm.compression.topk import TopKCompression
from lightning_sync.errors import check_choice

__all__ = [
    "BF16Compression",
    "COMPRESSORS",
    "CastCompression",
    "Compressor",
    "FP16Compression",
    "FlatBucket",
    "NoCompression",
    "PowerSGDCompression",
    "TopKCompression",
    "_PowerSGDMemory",
    "_completed",
    "build_compressor",
    "compressor_factory",
]


COMPRESSORS = ("none", "fp16", "bf16", "topk", "powersgd")


def build_compressor(
    name: str,
    *,
    topk_density: float = 0.01,
    error_feedback: bool = True,
    powersgd_rank: int = 4,
    powersgd_start_iter: int = 0,
    powersgd_warm_start: bool = True,
    field: str = "compression",
) -> Compressor:
    """A fresh compressor by name (one of :data:`COMPRESSORS`); options not used by that compressor are ignored.

    Args:
        field: the knob that chose ``name``, for the error message.

    Raises:
        ConfigError: ``name`` is not one of :data:`COMPRESSORS`, or an option of the chosen compressor is out of
            range.
    """
    check_choice(field, name, COMPRESSORS)
    if name == "topk":
        return TopKCompression(topk_density, error_feedback=error_feedback)
    if name == "powersgd":
        return PowerSGDCompression(
            powersgd_rank,
            start_iter=powersgd_start_iter,
            error_feedback=error_feedback,
            warm_start=powersgd_warm_start,
        )
    return {"none": NoCompression, "fp16": FP16Compression, "bf16": BF16Compression}[name]()


def compressor_factory(name: str, **options: Any) -> Callable[[], Compressor]:
    """A function that builds fresh, identically configured compressors; checks ``name`` and ``options`` now.

    Use it where a component needs one compressor per bucket group but the knobs should fail early (for example in
    a strategy's constructor, before any process starts).
    """
    build_compressor(name, **options)
    return functools.partial(build_compressor, name, **options)
