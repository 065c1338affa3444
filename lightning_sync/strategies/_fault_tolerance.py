"""The strategies' side of fault tolerance across replica groups (:mod:`lightning_sync.ft`): ``periodic`` and
``allreduce``.

The strategy's Lightning world is one replica group. These helpers resolve the ``fault_tolerance`` knob before any
rank starts (torchft present), build the link to the other groups once the group's process group exists (its torchft
``Manager`` heals the LightningModule and the optimizers, as well as the
:class:`~lightning_sync.ft.averager.FaultTolerantAverager` connected to it), and shard the data by group.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ParallelStrategy

from lightning_sync.ft.config import FaultTolerance, as_fault_tolerance, require_torchft
from lightning_sync.ft.replica import ReplicaGroupLink


def fault_tolerance_of(value: Any) -> FaultTolerance | None:
    """The ``fault_tolerance`` knob, checked in the launching process: its fields and torchft's presence (a one-line
    error naming the ``lightning-sync[ft]`` extra).

    Raises:
        ConfigError: a bad field.
        FaultToleranceUnavailable: torchft is not installed.
    """
    config = as_fault_tolerance(value)
    if config is not None:
        require_torchft()
    return config


def replica_group_link(strategy: ParallelStrategy, config: FaultTolerance) -> ReplicaGroupLink:
    """This rank's link to the other replica groups (joins the lighthouse; rank 0 of the group first checks that one
    answers within ``timeout_s``); a healing group pulls the LightningModule's and the optimizers' state."""
    link = ReplicaGroupLink(config, group_rank=strategy.global_rank, group_world_size=strategy.world_size)

    def save() -> dict[str, Any]:
        module = strategy.lightning_module
        assert module is not None
        return {"model": module.state_dict(), "optimizers": [o.state_dict() for o in strategy.optimizers]}

    def load(state: dict[str, Any]) -> None:
        module = strategy.lightning_module
        assert module is not None
        module.load_state_dict(state["model"])
        for optimizer, saved in zip(strategy.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)

    link.register_state("training", save, load)
    return link


def replica_group_shard(kwargs: dict[str, Any], config: FaultTolerance | None) -> dict[str, Any]:
    """Lightning's ``DistributedSampler`` arguments with the group's shard: ``num_replica_groups`` times as many
    replicas, this rank's index offset by ``replica_group`` times the group's size."""
    if config is None:
        return kwargs
    size = int(kwargs["num_replicas"])
    return dict(
        kwargs, num_replicas=size * config.num_replica_groups, rank=config.replica_group * size + kwargs["rank"]
    )


def stop_at_healed_max_steps(trainer: Any, steps: int) -> None:
    """Stops the Trainer (``should_stop``) once the averager's step count reaches ``max_steps``: a group that healed
    took a live group's step count, which runs ahead of its own loop, so every group ends at the same sync."""
    max_steps = getattr(trainer, "max_steps", -1)
    if max_steps is not None and max_steps >= 0 and steps >= max_steps:
        trainer.should_stop = True
