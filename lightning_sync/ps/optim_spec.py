"""The worker's optimizer as plain values (:class:`OptimizerSpec`), so that a server can rebuild it for its shard.

Every push carries the worker's current ``lr`` of each group (:func:`current_lrs`), so learning-rate schedulers keep
working; the other hyperparameters are fixed at the values the spec was taken with.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class OptimizerSpec:
    """A picklable recipe of a worker's optimizers (usually one; manual optimization, e.g. a GAN's generator and
    discriminator, has several).

    Attributes:
        classes: per optimizer, ``"module:qualname"`` of its class (importable on the server).
        groups: per param group of every optimizer, in order, its hyperparameters (every key but ``params``).
        group_of: per parameter of the ordered parameter list, the index of its param group.
        owner: per param group, the index of its optimizer.
    """

    classes: tuple[str, ...]
    groups: tuple[dict[str, Any], ...]
    group_of: tuple[int, ...]
    owner: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_optimizers(self) -> int:
        return len(self.classes)

    def as_dict(self) -> dict[str, Any]:
        """Plain-value form (``torch.load(weights_only=True)`` can read it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerSpec:
        """Inverse of :meth:`as_dict`."""
        return cls(*(tuple(data[f.name]) for f in fields(cls)))


def _import_class(path: str) -> type[torch.optim.Optimizer]:
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"optimizer_class={path!r} must look like 'package.module:ClassName'")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise ValueError(f"optimizer_class={path!r} is not a torch.optim.Optimizer subclass")
    return obj


def optimizer_spec(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> OptimizerSpec:
    """Describes ``optimizer`` (or several) for the servers: their groups' current hyperparameters (tensors cloned),
    and ``group_of[i]``, the group holding ``params[i]``.

    Args:
        optimizer: the worker's optimizer, or its optimizers (each parameter in one only), their classes importable.
        params: the ordered parameter list the parameter server trains; exactly the optimizers' parameters.

    Raises:
        ValueError: a parameter appears twice (in ``params``, or in two optimizers), is not in any optimizer, or an
            optimizer holds parameters that ``params`` does not list.
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    if not optimizers:
        raise ValueError("no optimizer; the parameter server needs at least one")
    params = list(params)
    position: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in position:
            raise ValueError(f"params[{i}] is the same tensor as params[{position[id(p)]}]; list each parameter once")
        position[id(p)] = i
    group_of = [-1] * len(params)
    groups: list[dict[str, Any]] = []
    owner: list[int] = []
    extra = 0
    names = "/".join(type(o).__name__ for o in optimizers)
    for index, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in position:
                    extra += 1
                elif group_of[position[id(p)]] >= 0:
                    raise ValueError(
                        f"params[{position[id(p)]}] is in two param groups of the {names} optimizers; a parameter "
                        "the servers train belongs to one optimizer"
                    )
                else:
                    group_of[position[id(p)]] = len(groups)
            groups.append(
                {
                    k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in group.items()
                    if k != "params"
                }
            )
            owner.append(index)
    missing = [i for i, g in enumerate(group_of) if g < 0]
    if missing:
        raise ValueError(f"params{missing} are not in any param group of the {names} optimizer(s)")
    if extra:
        raise ValueError(
            f"the {names} optimizer(s) hold {extra} parameter(s) that params does not list; "
            "pass every parameter the optimizers train"
        )
    classes = tuple(f"{type(o).__module__}:{type(o).__qualname__}" for o in optimizers)
    return OptimizerSpec(classes, tuple(groups), tuple(group_of), tuple(owner))


def build_shard_optimizer(
    spec: OptimizerSpec, params: Sequence[torch.Tensor], indices: Sequence[int], optimizer: int = 0
) -> tuple[torch.optim.Optimizer | None, list[int]]:
    """Builds the shard optimizer that mirrors the worker's optimizer number ``optimizer``: one group per worker group
    holding shard parameters, with its hyperparameters, in the worker's order.

    Args:
        spec: from :func:`optimizer_spec`.
        params: the shard's parameters (leaf tensors with ``requires_grad``).
        indices: for each, its index in the worker's ordered parameter list.

    Returns:
        The optimizer, and for each of its groups the index of the worker group it mirrors; ``None`` and ``[]`` if it
        holds none of the shard's parameters.

    Raises:
        ValueError: ``params`` and ``indices`` differ in length, or an index is outside the spec.
    """
    if len(params) != len(indices):
        raise ValueError(f"got {len(params)} params but {len(indices)} indices; they must match one to one")
    members: dict[int, list[torch.Tensor]] = {}
    for p, i in zip(params, indices):
        if not 0 <= i < len(spec.group_of):
            raise ValueError(f"parameter index {i} is outside the spec's {len(spec.group_of)} parameters")
        if spec.owner[spec.group_of[i]] == optimizer:
            members.setdefault(spec.group_of[i], []).append(p)
    mirrored = sorted(members)
    if not mirrored:
        return None, []
    groups = [{"params": members[g], **spec.groups[g]} for g in mirrored]
    optimizer_class = _import_class(spec.classes[optimizer])
    # the first group's hyperparameters are the defaults too, for optimizers with required ones
    accepted = inspect.signature(optimizer_class.__init__).parameters
    defaults = {k: v for k, v in spec.groups[mirrored[0]].items() if k in accepted}  # the groups hold no "params"
    return optimizer_class(groups, **defaults), mirrored


#: Optimizers whose step a constant factor on every gradient leaves as it is (up to ``eps``): the Adam family, ...
SCALE_INVARIANT = frozenset(
    {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "Adafactor"}
)


def scales_learning_rate(spec: OptimizerSpec, optimizer: int = 0) -> bool:
    """Whether an async or ssp push's ``push_scale`` multiplies the learning rate of the worker's optimizer number
    ``optimizer`` (:data:`SCALE_INVARIANT` ones and their subclasses, on whose step a factor on the gradient would
    cancel) rather than the pushed gradient (SGD and any other optimizer whose step is linear in it: ``W`` pushes of
    ``g/W`` move as far as one sync step of the average)."""
    path = spec.classes[optimizer]
    name = path.rpartition(":")[2].rpartition(".")[2]
    try:
        mro = [cls.__name__ for cls in _import_class(path).__mro__]
    except (ImportError, AttributeError, ValueError):
        mro = [name]
    return bool(SCALE_INVARIANT.intersection(mro))


def current_lrs(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> list[float]:
    """The current learning rate of each param group, of every optimizer in order (what a push carries)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    return [float(group["lr"]) for opt in optimizers for group in opt.param_groups]
