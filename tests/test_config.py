"""Every file in conf/ composes and instantiates; strategy YAMLs match their dataclasses; bad values are ConfigErrors.

The files are found on disk, so a new group option or experiment is covered without touching this test.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lightning_sync
from lightning_sync.config import ConfigError, _StrategyConfig, field_defaults
from lightning_sync.train import CONFIG_DIR, build

CONF = Path(CONFIG_DIR)
GROUPS = ("strategy", "model", "data", "trainer", "experiment")
OPTIONS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml"))
STRATEGY_FILES = sorted(CONF.glob("strategy/*.yaml"))

pytestmark = pytest.mark.timeout(60)


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
    model = hydra.utils.instantiate(cfg.model)
    data = hydra.utils.instantiate(cfg.data)
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.strategies import Strategy

    assert isinstance(strategy, Strategy)
    assert isinstance(model, LightningModule)
    assert isinstance(data, LightningDataModule)
    for key in ("devices", "num_nodes", "max_epochs", "accelerator"):
        assert key in cfg.trainer


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_each_option_composes_and_instantiates(group, option):
    cfg = _compose(f"{group}={option}")
    if group == "experiment":
        assert cfg.trainer.max_epochs >= 1
    else:
        chosen = OmegaConf.load(CONF / group / f"{option}.yaml")
        if "_target_" in chosen:
            assert cfg[group]._target_ == chosen._target_
    _instantiate_all(cfg)


@pytest.mark.parametrize("path", STRATEGY_FILES, ids=[p.stem for p in STRATEGY_FILES])
def test_strategy_yaml_matches_its_dataclass(path):
    yaml = OmegaConf.to_container(OmegaConf.load(path))
    target = hydra.utils.get_class(yaml.pop("_target_"))
    config_class = target.config_class
    assert issubclass(config_class, _StrategyConfig)
    names = {f.name for f in fields(config_class)}
    only_yaml, only_class = set(yaml) - names, names - set(yaml)
    assert set(yaml) == names, f"only in YAML: {only_yaml}; only in {config_class.__name__}: {only_class}"
    defaults = field_defaults(config_class)
    assert set(defaults) == names  # every knob has a default
    differ = {k: (yaml[k], defaults[k]) for k in names if yaml[k] != defaults[k]}
    assert not differ, f"YAML value, dataclass default: {differ}"


def test_every_registered_strategy_has_a_yaml():
    targets = {OmegaConf.load(p)._target_ for p in STRATEGY_FILES}
    classes = {hydra.utils.get_class(t) for t in targets}
    for name, (cls, _) in lightning_sync.STRATEGIES.items():
        assert cls in classes, f"{name}: {cls.__name__} has no conf/strategy/*.yaml"


@pytest.mark.parametrize(
    "override,field,value",
    [
        ("strategy.comm_hook=zzz", "strategy.comm_hook", "'zzz'"),
        ("strategy.bucket_cap_mb=-1", "strategy.bucket_cap_mb", "-1"),
        ("trainer.devices=0", "trainer.devices", "0"),
        ("strategy.start_method=thread", "strategy.start_method", "'thread'"),
        ("strategy.powersgd_rank=0", "strategy.powersgd_rank", "0"),
        ("trainer.devices=two", "trainer.devices", "'two'"),
    ],
)
def test_bad_values_raise_config_error(override, field, value, tmp_path):
    cfg = _compose(override, f"+run_dir={tmp_path}")
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
    with pytest.raises(ConfigError, match=r"strategy\.not_a_knob"):
        DDPSyncStrategy(not_a_knob=1)


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
    from lightning_sync.train import _check_group_choices

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
    from lightning_sync.train import _check_group_choices

    _check_group_choices(argv)  # raises nothing
