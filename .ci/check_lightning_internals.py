"""Fails when lightning_sync uses a private Lightning name outside ``lightning_sync/strategies/_lightning.py``.

Checked in every Python file under ``lightning_sync/`` (run from the repository root, ``make lint``):

- an import of a private name from a Lightning package (``from lightning... import _X``, ``lightning._x``);
- a private attribute or method of the Lightning classes a strategy subclasses or holds (Strategy, Trainer, the
  launchers, the loops, LightningModule), whether read, written, called or overridden; the names are read from the
  installed Lightning, so a name Lightning adds is covered too;
- the unstable public uses listed in ``_lightning.UNSTABLE_USES``: writes to ``limit_val_batches``,
  ``accumulate_grad_batches``, ``max_epochs`` or ``launch``, ``fit_loop``, ``.procs`` and ``callbacks.insert``;
- a private name reached through a string: ``getattr(x, "_name")``, ``hasattr``, ``setattr``, ``delattr``;
- in ``_lightning.py`` itself, a private Lightning name it uses but does not list in ``PRIVATE_NAMES``;
- an attribute written or deleted on a Lightning object, i.e. one held as ``trainer``, ``precision_plugin``,
  ``fit_loop``, ``launcher``, ... (:data:`LIGHTNING_OBJECTS`; ``x.trainer.y = ...`` and ``setattr(trainer, ...)``
  included), other than the writes Lightning documents (:data:`DOCUMENTED_WRITES`): an instance patch.

Usage: ``python .ci/check_lightning_internals.py [FILE_OR_DIR ...]`` (default ``lightning_sync``). Exit code 1 and
one line per use when any is found.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

HOME = "lightning_sync/strategies/_lightning.py"
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
WRITES = {"limit_val_batches", "accumulate_grad_batches", "max_epochs", "launch"}
READS = {"fit_loop", "procs"}
LIGHTNING_OBJECTS = {
    "trainer",
    "strategy",
    "precision_plugin",
    "plugin",
    "accelerator",
    "cluster_environment",
    "checkpoint_io",
    "launcher",
    "fit_loop",
    "epoch_loop",
    "lightning_module",
    "pl_module",
}
"""Names under which lightning_sync holds Lightning objects; writing an attribute on one of them is an instance patch."""
DOCUMENTED_WRITES = {"should_stop"}
"""Attributes Lightning documents as set by user code (``trainer.should_stop = True`` stops training); the public
properties with a setter (``trainer.loggers``, ``strategy.precision_plugin``, ...) are allowed as well."""
STRING_ACCESS = {"getattr", "hasattr", "setattr", "delattr"}


def _lightning_classes() -> list[type]:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops import _FitLoop, _TrainingEpochLoop
    from lightning.pytorch.plugins import Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    classes = [
        DDPStrategy,
        Trainer,
        LightningModule,
        Callback,
        _FitLoop,
        _TrainingEpochLoop,
        LightningOptimizer,
        Precision,
    ]
    classes += [_SubprocessScriptLauncher, _MultiProcessingLauncher]
    return [base for cls in classes for base in cls.__mro__ if base.__module__.startswith("lightning.")]


def private_lightning_names() -> set[str]:
    """Private attribute and method names of the Lightning classes lightning_sync touches (dunders excluded)."""
    names: set[str] = set()
    for cls in _lightning_classes():
        names.update(n for n in vars(cls) if n.startswith("_") and not n.startswith("__"))
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=", source))
    return names


def public_setters() -> set[str]:
    """Public properties with a setter on those classes: writing them is Lightning's own API."""
    return {
        name
        for cls in _lightning_classes()
        for name, value in vars(cls).items()
        if isinstance(value, property) and value.fset is not None and not name.startswith("_")
    }


def _is_lightning(module: str) -> bool:
    return module.split(".")[0] in LIGHTNING_PACKAGES


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(base).split(".")[-1] for base in cls.bases]


def lightning_derived_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of our classes that subclass a Lightning class, directly or through another class of ours."""
    lightning_bases: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and _is_lightning(node.module):
                lightning_bases.update(alias.asname or alias.name for alias in node.names)
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    derived: set[str] = set()
    while True:
        more = {c.name for c in classes if set(_base_names(c)) & (lightning_bases | derived)} - derived
        if not more:
            return derived
        derived |= more


def _defined_names(node: ast.ClassDef) -> set[str]:
    """Private names a class body defines: methods, class attributes and ``self._x = ...`` in its methods."""
    names = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in (t for top in targets for t in ast.walk(top)):  # ``self._a, self._b = ...`` too
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    names.add(target.attr)
    return {n for n in names if n.startswith("_")}


def own_names(trees: dict[Path, ast.Module], derived: set[str], all_classes: bool = False) -> set[str]:
    """Private names that lightning_sync defines on its own objects (classes not derived from Lightning's; with
    ``all_classes``, on every class of its own)."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (all_classes or node.name not in derived):
                names |= _defined_names(node)
    return names


def _holds_lightning_object(owner: ast.expr) -> bool:
    """Whether ``owner`` reads as a Lightning object: ``trainer``, ``self.trainer``, ``x.trainer.fit_loop``, ..."""
    if isinstance(owner, ast.Name):
        return owner.id in LIGHTNING_OBJECTS
    return isinstance(owner, ast.Attribute) and owner.attr in LIGHTNING_OBJECTS


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def check_file(
    path: Path,
    tree: ast.Module,
    private: set[str],
    own: set[str],
    derived: set[str],
    ours: set[str] = frozenset(),  # type: ignore[assignment]
    allowed_writes: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[str]:
    """The uses of Lightning internals in ``path``, one message each.

    ``ours``: private names our own classes define (reachable through a string); ``allowed_writes``: attributes
    that may be written on a Lightning object besides :data:`DOCUMENTED_WRITES`.
    """
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{path}:{getattr(node, 'lineno', 0)}: {what} (only {HOME} may use Lightning internals)")

    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in derived):
        for name in sorted(_defined_names(cls) & private):
            report(cls, f"class {cls.name} overrides or sets Lightning's private {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _is_lightning(node.module):
            if any(part.startswith("_") for part in node.module.split(".")):
                report(node, f"imports the private module {node.module}")
            for alias in node.names:
                if alias.name.startswith("_"):
                    report(node, f"imports the private name {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_lightning(alias.name) and any(p.startswith("_") for p in alias.name.split(".")):
                    report(node, f"imports the private module {alias.name}")
        elif isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if node.attr in private and (owner == "super()" or node.attr not in own):
                report(node, f"uses Lightning's private {node.attr}")
            elif node.attr in READS:
                report(node, f"uses Lightning's {node.attr}")
            elif node.attr in WRITES and isinstance(node.ctx, ast.Store) and owner != "self":
                report(node, f"writes Lightning's {node.attr}")
            elif node.attr == "insert" and isinstance(node.value, ast.Attribute) and node.value.attr == "callbacks":
                report(node, "inserts into the Trainer's callbacks")
            elif node.attr == "__dict__" and _holds_lightning_object(node.value):
                report(node, f"reaches into the __dict__ of the Lightning object {owner} (an instance patch)")
            elif (
                isinstance(node.ctx, (ast.Store, ast.Del))
                and _holds_lightning_object(node.value)
                and node.attr not in DOCUMENTED_WRITES | allowed_writes
            ):
                report(node, f"writes {node.attr} on the Lightning object {owner} (an instance patch)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in STRING_ACCESS:
            name = node.args[1] if len(node.args) > 1 else None
            private_name = isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value)
            if private_name and (name.value in private or name.value not in ours):  # type: ignore[union-attr]
                report(node, f"{node.func.id}() of the private name {name.value!r} through a string")
            elif node.func.id in {"setattr", "delattr"} and node.args and _holds_lightning_object(node.args[0]):
                report(
                    node, f"{node.func.id}() on the Lightning object {ast.unparse(node.args[0])} (an instance patch)"
                )
    return found


def unlisted_in_home(trees: dict[Path, ast.Module], private: set[str]) -> list[str]:
    """The private Lightning names that the home module uses (reads, writes, overrides or imports) but does not
    list in its ``PRIVATE_NAMES``, whose docstring inventory a reader of a new Lightning release checks first."""
    home = next((f for f in trees if f.resolve().as_posix().endswith(HOME)), None)
    if home is None:
        return []
    tree, used, listed = trees[home], set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            used.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in private:
            used.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module and _is_lightning(node.module):
            used.update(alias.name for alias in node.names if _is_private(alias.name))
        elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "PRIVATE_NAMES" for t in node.targets):
            listed.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return [
        f"{home}: uses Lightning's private {name} without listing it in PRIVATE_NAMES" for name in sorted(used - listed)
    ]


def main(argv: list[str]) -> int:
    private = private_lightning_names()
    paths = [Path(p) for p in (argv or ["lightning_sync"])]
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))
    trees = {f: ast.parse(f.read_text(), filename=str(f)) for f in files}
    derived = lightning_derived_classes(trees)
    own = own_names(trees, derived)
    ours = own_names(trees, derived, all_classes=True) - private
    allowed_writes = public_setters()
    problems = [
        msg
        for f, tree in trees.items()
        if not f.resolve().as_posix().endswith(HOME)
        for msg in check_file(f, tree, private, own, derived, ours, allowed_writes)
    ]
    problems += unlisted_in_home(trees, private)
    for msg in problems:
        print(msg)
    if problems:
        print(f"{len(problems)} use(s) of Lightning internals outside {HOME} or unlisted in it", file=sys.stderr)
        return 1
    print(f"Lightning internals: only in {HOME} ({len(files)} files checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
