"""One default per knob: every torch-level class that takes a knob of a strategy config defaults it as the config does.

The config dataclasses (:mod:`lightning_sync.config`) are the schema of the strategies and the Hydra app. The
torch-level classes (:mod:`lightning_sync.comm`, :mod:`lightning_sync.ps`) are usable alone, and take the same knobs
as constructor arguments; a user of ``PeriodicAverager()`` must get what a user of ``PeriodicSyncStrategy()`` gets.
Arguments are matched by name; where a class spells a knob or its default otherwise, :data:`SPELLED_OTHERWISE` says
so, and :data:`NOT_THE_KNOB` lists the arguments that share a knob's name but are not that knob.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any

import pytest

from lightning_sync.comm.adaptive import AdaptiveOptions
from lightning_sync.comm.averaging import ModelAverager
from lightning_sync.comm.bucketing import GradientSynchronizer
from lightning_sync.comm.compression import CODECS, NoCompression, resolve_codec
from lightning_sync.comm.periodic import PeriodicAverager
from lightning_sync.comm.streaming import StreamingOptions
from lightning_sync.comm.sync_groups import SyncGroup
from lightning_sync.config import AllReduceConfig, DDPConfig, ParameterServerConfig, PeriodicConfig, StrategyConfig
from lightning_sync.ps.server import ParameterServer
from lightning_sync.ps.settings import PSConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

#: Each torch-level class and the schema whose knobs it takes.
SCHEMA: dict[type, type[StrategyConfig]] = {
    PeriodicAverager: PeriodicConfig,
    StreamingOptions: PeriodicConfig,
    AdaptiveOptions: PeriodicConfig,
    ModelAverager: PeriodicConfig,
    SyncGroup: PeriodicConfig,
    GradientSynchronizer: AllReduceConfig,
    PSConfig: ParameterServerConfig,
    ParameterServer: ParameterServerConfig,
}

#: ``(class, argument): (knob, the class's spelling of the knob's default)``: a knob spelled otherwise by the class.
SPELLED_OTHERWISE: dict[tuple[type, str], tuple[str, Any]] = {
    (PeriodicAverager, "outer"): ("mode", {"local_sgd": False, "diloco": True}),  # the mode, as a flag
    (PeriodicAverager, "new_compressor"): ("compression", "codec"),  # the codec, as its class
    (PSConfig, "push_scale"): ("push_scale", {"auto": None}),
    (PSConfig, "codec"): ("compression", "spec"),  # the codec, as its spec (None: uncompressed)
}

#: ``(class, argument)``: an argument that has a knob's name but is another setting (with the reason).
NOT_THE_KNOB: dict[tuple[str, str], str] = {
    ("CommMeter", "timeout_s"): "the process group's timeout as the meter reports it; None: the backend's",
    ("FaultTolerance", "timeout_s"): "torchft's quorum timeout, the knob fault_tolerance.timeout_s of its own schema",
}


def _schema_default(config: type[StrategyConfig], knob: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(config)}[knob]


def _defaults(cls: type) -> dict[str, Any]:
    try:
        parameters = inspect.signature(cls).parameters
    except ValueError:  # no signature (an exception class)
        return {}
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def _as_the_class_spells_it(owner: type, argument: str, value: Any) -> Any:
    spelling = SPELLED_OTHERWISE[(owner, argument)][1]
    if spelling == "codec":
        return CODECS[value]
    if spelling == "spec":
        return None if value == "none" else resolve_codec(value)().spec()
    return spelling.get(value, value)


def _checked(cls: type) -> list[tuple[str, Any, Any]]:
    """``(argument, the class's default, the schema's default)`` for each knob ``cls`` takes (a subclass of a class
    of :data:`SCHEMA` is compared with its base's schema)."""
    owner = next(c for c in cls.__mro__ if c in SCHEMA)
    config = SCHEMA[owner]
    knobs = {f.name for f in dataclasses.fields(config)}
    pairs = []
    for argument, default in _defaults(cls).items():
        if (owner, argument) in SPELLED_OTHERWISE:
            knob = SPELLED_OTHERWISE[(owner, argument)][0]
            pairs.append((argument, default, _as_the_class_spells_it(owner, argument, _schema_default(config, knob))))
        elif argument in knobs:
            pairs.append((argument, default, _schema_default(config, argument)))
    return pairs


def _differ(cls: type) -> dict[str, tuple[Any, Any]]:
    return {argument: (default, expected) for argument, default, expected in _checked(cls) if default != expected}


@pytest.mark.parametrize("cls", list(SCHEMA), ids=lambda cls: cls.__name__)
def test_each_default_of_a_torch_level_class_is_the_schemas(cls):
    assert _checked(cls), f"{cls.__name__} shares no knob with {SCHEMA[cls].__name__}"
    assert not _differ(cls), f"{cls.__name__}: (its default, the schema's) per argument: {_differ(cls)}"


def test_the_check_covers_the_knobs_each_class_takes():
    """The name matching finds what it should (and so the test above can fail)."""
    covered = {cls: {argument for argument, _, _ in _checked(cls)} for cls in SCHEMA}
    assert {"sync_every", "warmup_steps", "bucket_cap_mb", "outer", "new_compressor", "timeout_s"} <= covered[
        PeriodicAverager
    ]
    assert covered[StreamingOptions] == {f.name for f in dataclasses.fields(StreamingOptions)}
    assert covered[AdaptiveOptions] == {f.name for f in dataclasses.fields(AdaptiveOptions)}
    assert {"bucketing", "bucket_cap_mb", "first_bucket_mb", "find_unused_parameters"} <= covered[GradientSynchronizer]
    assert {"mode", "max_staleness", "push_scale", "codec", "local_steps", "elastic"} <= covered[PSConfig]
    assert PeriodicAverager().bucket_cap_mb == PeriodicConfig.bucket_cap_mb  # the default in effect, too
    assert PSConfig().new_codec().spec() == NoCompression().spec()


def test_the_default_options_objects_are_the_schemas():
    defaults = _defaults(PeriodicAverager)
    assert defaults["streaming"] == StreamingOptions(**PeriodicConfig().arguments_for(StreamingOptions))
    assert defaults["adaptive"] == AdaptiveOptions(**PeriodicConfig().arguments_for(AdaptiveOptions))


@pytest.mark.parametrize("config", [AllReduceConfig, PeriodicConfig], ids=lambda c: c.__name__)
def test_every_gradient_sync_schema_has_the_synchronizers_defaults(config):
    for argument, default in _defaults(GradientSynchronizer).items():
        if argument in {f.name for f in dataclasses.fields(config)}:
            assert default == _schema_default(config, argument), argument


def test_every_torch_level_class_that_takes_a_knob_agrees_with_the_schema():
    """Every public class of ``comm``/``ps``/``ft`` that takes an argument named as a knob, with a default: it (or a
    base) is in :data:`SCHEMA` and its defaults agree, or the argument is in :data:`NOT_THE_KNOB`; so a new class or
    argument cannot bring a second default."""
    import lightning_sync.comm
    import lightning_sync.ft
    import lightning_sync.ps

    knobs = {f.name for config in (AllReduceConfig, DDPConfig, ParameterServerConfig, PeriodicConfig) for f in
             dataclasses.fields(config)}  # fmt: skip
    unchecked, differ, compared = set(), {}, set()
    for package in (lightning_sync.comm, lightning_sync.ps, lightning_sync.ft):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.rsplit(".", 1)[1].startswith("_"):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional dependency (torchft) is missing
                continue
            for name, cls in vars(module).items():
                if not inspect.isclass(cls) or cls.__module__ != module.__name__ or name.startswith("_"):
                    continue
                if any(c in SCHEMA for c in cls.__mro__):
                    compared.add(cls)
                    differ.update({f"{name}.{argument}": pair for argument, pair in _differ(cls).items()})
                    continue
                for argument in set(_defaults(cls)) & knobs:
                    if (name, argument) not in NOT_THE_KNOB:
                        unchecked.add(f"{info.name}.{name}({argument}=...)")
    assert not unchecked, f"torch-level classes taking a knob that no test here compares: {sorted(unchecked)}"
    assert not differ, f"(a class's default, the schema's) per argument: {differ}"
    assert set(SCHEMA) <= compared  # the walk found every class of SCHEMA


def test_a_registry_name_gives_its_codec_class_with_the_class_defaults():
    """A codec has its defaults in its class only: a registry name (the schema's spelling) builds the class as is."""
    for name, codec in CODECS.items():
        assert codec.name == name
        assert repr(resolve_codec(name)()) == repr(codec())
    for config, knob in [(AllReduceConfig, "compression"), (PeriodicConfig, "outer_compression"),
                         (DDPConfig, "comm_hook"), (ParameterServerConfig, "compression")]:  # fmt: skip
        assert _schema_default(config, knob) in CODECS, (config.__name__, knob)
