"""What ``python -m lightning_sync.train --help`` prints, filled in from ``conf/`` and the config dataclasses.

Hydra's own help lists every config group it knows, the ``schema/strategy`` group that only backs
``conf/strategy/*.yaml`` included, and no knob's meaning. The app's help template (``hydra.help`` in
``conf/config.yaml``) calls two resolvers registered here instead: the groups a user chooses from (the folders of
``conf/``) and every knob of the chosen strategy with its default and its docstring (:func:`~lightning_sync.config.
knob_docs`), so ``strategy=ps --help`` documents the ``ps`` knobs. Neither imports torch or Lightning.
"""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, fields
from pathlib import Path

from omegaconf import OmegaConf

from lightning_sync.apps.conf_store import MODES, SCHEMA_DEFAULTS
from lightning_sync.config import knob_docs

_WIDTH = 110


def group_options(config_dir: str) -> dict[str, list[str]]:
    """``{group: [option, ...]}`` of the config folder: each sub-folder and its ``.yaml`` files' names."""
    conf = Path(config_dir)
    return {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in sorted(conf.iterdir()) if d.is_dir()}


def _groups_text(config_dir: str) -> str:
    groups = group_options(config_dir)
    width = max(len(group) for group in groups)
    return "\n".join(f"  {group:<{width}}  {', '.join(options)}" for group, options in groups.items() if options)


def _knobs_text(mode: str) -> str:
    if mode not in MODES:
        return f"  (strategy={mode} is not one of lightning_sync's: {', '.join(MODES)})"
    config_class = MODES[mode][1]
    defaults = {
        f.name: SCHEMA_DEFAULTS.get(f.name, f.default) for f in fields(config_class) if f.default is not MISSING
    }
    lines = []
    for name, doc in knob_docs(config_class).items():
        lines.append(f"  strategy.{name}={_as_override(defaults.get(name, '???'))}")
        lines += textwrap.wrap(
            doc.replace("``", "`"),
            _WIDTH,
            initial_indent="      ",
            subsequent_indent="      ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def _as_override(value: object) -> str:
    """A default as one writes it on the command line (``true``, ``null``), not as Python prints it."""
    if value is None:
        return "null"
    if isinstance(value, dict):  # a node: {_target_:torch.optim.SGD,_partial_:true,lr:0.7}
        return "{" + ",".join(f"{key}:{_as_override(item)}" for key, item in value.items()) + "}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _for_template(text: str) -> str:
    """Hydra fills the help template with :class:`string.Template`: a ``$`` of ours must not start a placeholder."""
    return text.replace("$", "$$")


def register_help_resolvers(config_dir: str) -> None:
    """Registers ``ls_help_groups`` and ``ls_help_knobs`` (for the template in ``conf/config.yaml``)."""
    OmegaConf.register_new_resolver("ls_help_groups", lambda: _for_template(_groups_text(config_dir)), replace=True)
    OmegaConf.register_new_resolver("ls_help_knobs", lambda mode: _for_template(_knobs_text(str(mode))), replace=True)
