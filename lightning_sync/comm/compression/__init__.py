"""Codecs: how a payload is averaged over a process group, shared by every sync mode. One registry.

A codec (a :class:`Compressor`) averages one :class:`FlatBucket` over a process group in place: it owns the
encoding, the collectives (through a :class:`~lightning_sync.comm.meter.CommMeter`, which so counts the compressed
payload) and the decoding; its memory (error feedback, PowerSGD's factors) is kept per bucket index and
checkpointed. Every consumer takes its codec, an object or a name of :data:`CODECS`, through :func:`resolve_codec`,
which refuses one lacking a capability the consumer needs, before any process starts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from lightning_sync.comm.compression.base import Compressor
from lightning_sync.comm.compression.base import FlatBucket as FlatBucket
from lightning_sync.comm.compression.cast import BF16Compression, FP16Compression, NoCompression
from lightning_sync.comm.compression.powersgd import PowerSGDCompression
from lightning_sync.comm.compression.quantized import Int4Compression, Int8Compression
from lightning_sync.comm.compression.sparseloco import SparseLoCo
from lightning_sync.comm.compression.topk import TopKCompression
from lightning_sync.errors import ConfigError, check_choice

CODECS: dict[str, type[Compressor]] = {
    codec.name: codec
    for codec in (
        NoCompression,
        FP16Compression,
        BF16Compression,
        TopKCompression,
        PowerSGDCompression,
        Int8Compression,
        Int4Compression,
        SparseLoCo,
    )
}
"""Every codec by its registry name; a name builds the class with its defaults."""


def resolve_codec(
    value: str | Compressor, field: str = "compression", needs: Iterable[str] = ()
) -> Callable[[], Compressor]:
    """A function that builds fresh, identical copies of the codec ``value`` (a name of :data:`CODECS` or a
    :class:`Compressor`), checked now.

    Args:
        field: the knob that chose ``value``, for the error message.
        needs: the capabilities the consumer needs (see :attr:`Compressor.capabilities`).

    Raises:
        ConfigError: ``value`` is neither a codec nor a registry name, or lacks one of ``needs``.
    """
    if isinstance(value, str):
        check_choice(field, value, CODECS)
        prototype = CODECS[value]()
    elif isinstance(value, Compressor):
        prototype = value
    else:
        raise ConfigError(
            f"{field}={value!r} is not allowed; it must be a codec object (a Compressor) or one of: {', '.join(CODECS)}"
        )
    for capability in needs:
        if capability not in prototype.capabilities:
            able = [name for name, codec in CODECS.items() if capability in codec.capabilities]
            raise ConfigError(
                f"{field}={prototype!r} is not allowed here: this consumer needs a codec that can ride "
                f"{capability}, which {type(prototype).__name__} cannot; codecs that can: {', '.join(able)}"
            )
    return lambda: copy.deepcopy(prototype)
