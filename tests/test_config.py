"""Every file in conf/ composes and instantiates; strategy YAMLs start from their dataclass schema; bad values are
ConfigErrors; Lightning internals are used in one module only (the import graph is checked by ``make imports``).

The files are found on disk, so a new group option or experiment is covered without touching this test.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import warnings
from dataclasses import MISSING, fields
from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lightning_sync
from lightning_sync.apps.train import CONFIG_DIR, build
from lightning_sync.config import StrategyConfig, knob_docs
from lightning_sync.errors import ConfigError

CONF = Path(CONFIG_DIR)
GROUPS = ("strategy", "model", "data", "trainer", "logger", "callbacks", "experiment", "ft")
OPTIONS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml"))
STRATEGY_FILES = sorted(CONF.glob("strategy/*.yaml"))

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_conf_layout_is_what_the_tests_iterate():
    assert (CONF / "config.yaml").is_file()
    assert {group for group, _ in OPTIONS} == set(GROUPS), OPTIONS
    # every group has at least one option, and the defaults list names existing files
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    for entry in defaults:
        if isinstance(entry, str):
            continue
        ((group, option),) = OmegaConf.to_container(entry).items()
        if option is not None:
            assert (CONF / group / f"{option}.yaml").is_file(), (group, option)


def test_default_config_composes_and_instantiates():
    cfg = _compose()
    _instantiate_all(cfg)


def _instantiate_all(cfg) -> None:
    OmegaConf.resolve(cfg)  # every interpolation resolves
    strategy = hydra.utils.instantiate(cfg.strategy)
    data = hydra.utils.instantiate(cfg.data)
    # as the app does: model fields left null (a text's vocab_size) take the data module's values
    filled = {k: v for k, v in getattr(data, "model_kwargs", {}).items() if cfg.model.get(k, 0) is None}
    model = hydra.utils.instantiate(cfg.model, **filled)
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.strategies import Strategy

    assert isinstance(strategy, Strategy)
    assert isinstance(model, LightningModule)
    assert isinstance(data, LightningDataModule)
    for key in ("devices", "num_nodes", "max_epochs", "accelerator"):
        assert key in cfg.trainer


# Options that only make sense with another group's option (a text model needs a text's vocabulary).
COMPANIONS = {"model=char_gpt": ["data=text"]}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_each_option_composes_and_instantiates(group, option):
    cfg = _compose(f"{group}={option}", *COMPANIONS.get(f"{group}={option}", []))
    if group == "experiment":
        assert cfg.trainer.max_epochs >= 1 or cfg.trainer.max_steps >= 1  # a bounded run, by epochs or steps
    else:
        chosen = OmegaConf.load(CONF / group / f"{option}.yaml")
        if "_target_" in chosen:
            assert cfg[group]._target_ == chosen._target_
    _instantiate_all(cfg)


@pytest.mark.parametrize("path", STRATEGY_FILES, ids=[p.stem for p in STRATEGY_FILES])
def test_strategy_yaml_starts_from_its_schema(path):
    """A knob's default lives in its dataclass only: the YAML names the schema and sets nothing the schema has."""
    yaml = OmegaConf.to_container(OmegaConf.load(path))
    assert yaml.pop("defaults") == [f"/schema/strategy/{path.stem}@_here_", "_self_"]
    composed = OmegaConf.to_container(_compose(f"strategy={path.stem}").strategy)
    target = hydra.utils.get_class(composed.pop("_target_"))
    config_class = target.config_class
    assert issubclass(config_class, StrategyConfig)
    assert target.strategy_name == f"sync_{path.stem}"
    from lightning_sync.apps.conf_store import SCHEMA_DEFAULTS

    # an object's knob (outer_optimizer) defaults to the node that builds what its None stands for
    defaults = {f.name: SCHEMA_DEFAULTS.get(f.name, f.default) for f in fields(config_class)}
    assert MISSING not in defaults.values()  # every knob has a default
    assert not set(yaml) - set(defaults), f"YAML keys that are not knobs: {set(yaml) - set(defaults)}"
    assert composed == {**defaults, **yaml}


def test_every_registered_strategy_has_a_yaml():
    for name, cls in lightning_sync.STRATEGIES.items():
        assert name == cls.strategy_name and cls.__doc__.strip()
        mode = name.removeprefix("sync_")
        assert (CONF / "strategy" / f"{mode}.yaml").is_file(), f"{name}: no conf/strategy/{mode}.yaml"
        assert hydra.utils.get_class(_compose(f"strategy={mode}").strategy._target_) is cls


def test_hydra_modes_match_the_registered_strategies():
    from lightning_sync.apps.conf_store import MODES

    assert {f"sync_{mode}" for mode in MODES} == set(lightning_sync.STRATEGIES)
    for mode, (target, config_class) in MODES.items():
        cls = lightning_sync.STRATEGIES[f"sync_{mode}"]
        assert hydra.utils.get_class(target) is cls and cls.config_class is config_class


@pytest.mark.parametrize(
    "knobs, message",
    [
        (
            {"_target_": "lightning_sync.AllReduceStrategy", "timeout_s": -1},
            "strategy.timeout_s=-1 is not allowed; it must be > 0",
        ),
        (
            {"_target_": "lightning_sync.AllReduceStrategy", "compression": "topk2"},
            "strategy.compression='topk2' is not allowed; choose one of: none, fp16",
        ),
        (
            {"_target_": "lightning_sync.PeriodicSyncStrategy", "mode": "local_sgd", "sync_every": 0},
            "strategy.sync_every=0 is not allowed",
        ),
        (
            {"_target_": "lightning_sync.ParameterServerStrategy", "mode": "async", "max_staleness": 3},
            "strategy.max_staleness=3 is not allowed with mode='async'; it is for ssp",
        ),
        (
            {"_target_": "lightning_sync.ParameterServerStrategy", "mode": "hogwild"},
            "strategy.mode='hogwild' is not allowed; choose one of: sync, async, ssp",
        ),
        (
            {"_target_": "lightning_sync.ParameterServerStrategy", "mode": "sync", "spare_workers": 1},
            "strategy.spare_workers=1 is not allowed with mode='sync'",
        ),
        (
            {"_target_": "lightning_sync.ParameterServerStrategy", "mode": "async", "join": True},
            "strategy.join=True is not allowed with spare_workers=0; a worker joins a job started with spare_workers",
        ),
    ],
    ids=["strategy-knob", "compressor-knob", "averager-knob", "ps-knob", "ps-mode", "ps-spare", "ps-join"],
)
def test_the_apps_knob_check_names_strategy_knob_value_and_what_is_allowed(knobs, message):
    """The Hydra app checks a composed ``strategy`` node before it starts any process: the config's own knobs, how
    they combine (``ps``), and the knobs its algorithms own (a compressor's, the averager's)."""
    from lightning_sync.apps.conf_store import check_strategy_knobs

    with pytest.raises(ConfigError) as info:
        check_strategy_knobs(knobs)
    assert message in str(info.value)


def _internals_checker():
    """``.ci/check_lightning_internals.py`` (the lint step's rule that Lightning internals live in one module)."""
    from repo_utils import load_script

    return load_script(".ci/check_lightning_internals.py")


def test_lightning_internals_check_flags_each_kind_of_use(tmp_path):
    checker = _internals_checker()
    source = tmp_path / "user.py"
    source.write_text(
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "from lightning.fabric.utilities.distributed import _set_num_threads_if_needed\n"
        "class S(DDPStrategy):\n"
        "    def _configure_launcher(self):\n"
        "        super()._configure_launcher()\n"
        "def f(strategy, trainer, launcher):\n"
        "    strategy._launcher = None\n"
        "    trainer.fit_loop.max_epochs = -1\n"
        "    trainer.accumulate_grad_batches = 2\n"
        "    trainer.callbacks.insert(0, None)\n"
        "    launcher.launch = print\n"
        "    return launcher.procs\n"
    )
    assert checker.main([str(source)]) == 1
    tree = {source: ast.parse(source.read_text())}
    derived = checker.lightning_derived_classes(tree)
    found = checker.check_file(source, tree[source], checker.private_lightning_names(), set(), derived)
    lines = sorted({int(msg.split(":")[1]) for msg in found})
    assert lines == [2, 3, 5, 7, 8, 9, 10, 11, 12], found


def test_lightning_internals_check_flags_string_access_and_instance_patches(tmp_path):
    checker = _internals_checker()
    source = tmp_path / "user.py"
    source.write_text(
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._mine, self._other = 1, 2\n"
        "def f(optimizer, trainer, strategy, plugin, mine):\n"
        "    getattr(optimizer, '_optimizer', optimizer)\n"
        "    plugin.clip_gradients = print\n"
        "    strategy.precision_plugin.__dict__.pop('clip_gradients')\n"
        "    setattr(trainer, 'max_steps', 3)\n"
        "    trainer.fit_loop.epoch_loop.anything = 1\n"
        "    hasattr(mine, '_other')\n"  # a private name of our own: allowed
        "    trainer.should_stop = True\n"  # documented
        "    trainer.loggers = []\n"  # a public property with a setter
        "    strategy.precision_plugin = plugin\n"
    )
    assert checker.main([str(source)]) == 1
    tree = {source: ast.parse(source.read_text())}
    derived = checker.lightning_derived_classes(tree)
    found = checker.check_file(
        source,
        tree[source],
        checker.private_lightning_names(),
        checker.own_names(tree, derived),
        derived,
        checker.own_names(tree, derived, all_classes=True) - checker.private_lightning_names(),
        checker.public_setters(),
    )
    lines = sorted({int(msg.split(":")[1]) for msg in found})
    assert lines == [5, 6, 7, 8, 9], found


def test_the_home_module_lists_every_private_name_it_uses(tmp_path):
    """``_lightning.py`` itself may use Lightning's private names, each listed in its ``PRIVATE_NAMES``."""
    checker = _internals_checker()
    home = tmp_path / checker.HOME
    source = "PRIVATE_NAMES = ({listed})\n\ndef set_steps(loop):\n    loop._batches_that_stepped = 3\n"
    private = checker.private_lightning_names()
    for listed, expected in (('"_launcher",', ["_batches_that_stepped"]), ('"_batches_that_stepped",', [])):
        tree = ast.parse(source.format(listed=listed))
        found = checker.unlisted_in_home({home: tree}, private)
        assert [msg.split("private ")[1].split()[0] for msg in found] == expected, found


def test_lightning_internals_only_in_their_module():
    package = Path(lightning_sync.__file__).parent
    assert _internals_checker().main([str(package)]) == 0


def test_deprecations_of_lightning_internals_we_use_are_errors():
    """pytest turns a DeprecationWarning naming any private name of ``_lightning.py`` into an error."""
    from lightning_sync.strategies._lightning import PRIVATE_NAMES

    for name in PRIVATE_NAMES:
        with pytest.raises(DeprecationWarning):
            warnings.warn(f"`DDPStrategy.{name}` is deprecated", DeprecationWarning)
    with pytest.raises(DeprecationWarning):
        warnings.warn("`Trainer.fit_loop.max_epochs` is deprecated", DeprecationWarning)
    warnings.warn("an unrelated library's deprecation", DeprecationWarning)  # only reported


@pytest.mark.parametrize(
    "override,field,value",
    [
        ("strategy.comm_hook=zzz", "strategy.comm_hook", "'zzz'"),
        ("strategy.bucket_cap_mb=-1", "strategy.bucket_cap_mb", "-1"),
        ("trainer.devices=0", "trainer.devices", "0"),
        ("strategy.start_method=thread", "strategy.start_method", "'thread'"),
        (
            "strategy.comm_hook={_target_:lightning_sync.PowerSGDCompression,rank:0}",
            "strategy.comm_hook.rank",
            "0",
        ),
        (
            "strategy=allreduce strategy.compression={_target_:lightning_sync.TopKCompression,density:0}",
            "strategy.compression.density",
            "0",
        ),
        ("strategy=allreduce strategy.bucketing=zz", "strategy.bucketing", "'zz'"),
        (
            "strategy=periodic strategy.sync_every=auto strategy.target_comm_fraction=2",
            "strategy.target_comm_fraction",
            "2",
        ),
        ("trainer.devices=two", "trainer.devices", "'two'"),
    ],
)
def test_bad_values_raise_config_error(override, field, value, tmp_path):
    cfg = _compose(*override.split(), f"+run_dir={tmp_path}")
    with pytest.raises(ConfigError) as info:
        build(cfg)
    message = str(info.value)
    assert f"{field}={value}" in message, message
    assert "\n" not in message


def test_bad_values_direct_dataclass():
    from lightning_sync import DDPSyncStrategy

    with pytest.raises(ConfigError, match=r"strategy\.comm_hook='zzz'"):
        DDPSyncStrategy(comm_hook="zzz")
    with pytest.raises(ConfigError, match=r"strategy\.bucket_cap_mb=-1"):
        DDPSyncStrategy(bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="not_a_knob"):  # as any Python call (and mypy) rejects an unknown argument
        DDPSyncStrategy(not_a_knob=1)  # type: ignore[call-arg]


def _strategy_classes() -> list[type]:
    return list(lightning_sync.STRATEGIES.values())


@pytest.mark.parametrize("cls", _strategy_classes(), ids=lambda cls: cls.__name__)
def test_constructor_takes_each_knob_with_its_default_and_help(cls):
    """A strategy's keyword arguments are its config's fields (same defaults; same types where the field is not
    ``Any``) and Lightning's own strategy arguments, each documented in the ``Args:`` of its docstring."""
    import inspect
    import typing

    from lightning_sync.strategies._base import LIGHTNING_ARGUMENTS

    config_class = cls.config_class
    params = dict(inspect.signature(cls.__init__).parameters)
    assert params.pop("self").kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    knobs = {f.name: f for f in fields(config_class)}
    assert set(params) == set(knobs) | set(LIGHTNING_ARGUMENTS)
    hints = typing.get_type_hints(cls.__init__)
    field_hints = typing.get_type_hints(config_class)
    for name, field in knobs.items():
        assert params[name].default == field.default, name
        if field_hints[name] is not typing.Any:
            assert hints[name] == field_hints[name], name
        assert field.metadata.get("help"), f"{config_class.__name__}.{name} has no help"
    for name in LIGHTNING_ARGUMENTS:
        assert params[name].default is None, name
    args = cls.__doc__.split("\nArgs:\n", 1)[1]
    documented = re.findall(r"^    (\w+): (\S.*)$", args, flags=re.MULTILINE)
    assert [name for name, _ in documented] == list(params)  # in signature order, each with text
    for name, first_line in documented:
        expected = knob_docs(config_class).get(name) or LIGHTNING_ARGUMENTS[name]
        assert expected.startswith(first_line), name


@pytest.mark.parametrize("cls", _strategy_classes(), ids=lambda cls: cls.__name__)
def test_strategy_from_a_config_object_keeps_every_knob(cls):
    defaults = cls().config
    changed = dataclasses.replace(defaults, timeout_s=12.5, check_consistency_every=3)
    strategy = cls.from_config(changed, process_group_backend="gloo")
    assert strategy.config == changed and strategy.config is not changed
    assert strategy.process_group_backend == "gloo"


def test_config_from_arguments_needs_every_field():
    from lightning_sync.config import AllReduceConfig

    arguments = {**AllReduceConfig().knobs(), "self": object(), "accelerator": None}
    assert AllReduceConfig.from_arguments(arguments) == AllReduceConfig()
    del arguments["bucketing"]
    with pytest.raises(TypeError, match="bucketing"):
        AllReduceConfig.from_arguments(arguments)


def test_knob_docs_come_from_field_metadata():
    from lightning_sync.config import PeriodicConfig, knob, knob_docs

    docs = knob_docs(PeriodicConfig)
    assert list(docs) == [f.name for f in fields(PeriodicConfig)]
    assert all(docs.values()) and not any("\n" in doc or "  " in doc for doc in docs.values())

    @dataclasses.dataclass
    class Mixed:
        a: int = knob(
            1,
            """First
            knob.""",
        )
        b: int = 2

    assert knob_docs(Mixed) == {"a": "First knob.", "b": ""}
    assert Mixed.a == 1 and Mixed().a == 1


@pytest.mark.parametrize(
    "argv,named",
    [
        (["strategy=nope"], "strategy='nope'"),
        (["+experiment=nope"], "experiment='nope'"),
        (["-m", "strategy=ddp,nope", "seed=1"], "strategy='nope'"),
        (["model=digits", "data=nope"], "data='nope'"),
    ],
)
def test_unknown_group_option_is_one_line_config_error(argv, named):
    from lightning_sync.apps.train import _check_group_choices

    with pytest.raises(ConfigError) as info:
        _check_group_choices(argv)
    message = str(info.value)
    assert named in message and "\n" not in message, message
    group = named.split("=")[0]
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        assert option in message  # names what is allowed


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [f"{group}={option}" for group, option in OPTIONS if group != "experiment"],
        ["-m", "strategy=" + ",".join(p.stem for p in STRATEGY_FILES)],
        ["experiment=null", "~experiment", "strategy.comm_hook=zzz", "strategy=glob(*)", "model=${oc.env:M,digits}"],
        ["--config-dir", "/elsewhere", "strategy=mine"],
        ["hydra.searchpath=[file:///elsewhere]", "strategy=mine"],
        ["-cn", "config", "--cfg", "job"],
    ],
)
def test_group_option_check_leaves_the_rest_to_hydra(argv):
    from lightning_sync.apps.train import _check_group_choices

    _check_group_choices(argv)  # raises nothing
