"""The strategies compose instead of inheriting: no sync strategy subclasses another, and each class chain holds
few classes of ours (docs/architecture: "Strategies compose")."""

from __future__ import annotations

import pytest

from lightning_sync.strategies import STRATEGIES, SyncStrategyBase
from lightning_sync.strategies._gradients import GradientAllReduce

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# the most lightning_sync classes each strategy's MRO may hold (the strategy, SyncStrategyBase, LightningDDPHooks)
MAX_OWN_CLASSES = {"sync_ddp": 3, "sync_allreduce": 3, "sync_periodic": 3, "sync_ps": 3}


def _own(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.startswith("lightning_sync.")]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_mro_holds_few_classes_of_ours(name):
    cls = STRATEGIES[name]
    print(name, " -> ".join(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__))
    assert len(_own(cls)) <= MAX_OWN_CLASSES[name], [c.__qualname__ for c in _own(cls)]
    assert SyncStrategyBase in _own(cls)


def test_no_sync_strategy_subclasses_another():
    assert set(MAX_OWN_CLASSES) == set(STRATEGIES)
    for name, cls in STRATEGIES.items():
        others = [o.__name__ for o in STRATEGIES.values() if o is not cls and issubclass(cls, o)]
        assert not others, f"{cls.__name__} ({name}) subclasses {others}"


def test_allreduce_and_periodic_hold_the_same_gradient_path():
    allreduce = STRATEGIES["sync_allreduce"]()
    periodic = STRATEGIES["sync_periodic"](mode="gradient", sync_every=2)
    local_sgd = STRATEGIES["sync_periodic"](mode="local_sgd", sync_every=2)
    assert isinstance(allreduce.gradients, GradientAllReduce)
    assert isinstance(periodic.gradients, GradientAllReduce)
    assert local_sgd.gradients is None  # no warmup: local steps only
    assert STRATEGIES["sync_ddp"]().gradients is None  # torch DDP's own buckets


def test_ps_holds_its_membership_and_says_which_workers_are_worlds_of_their_own():
    """ps keeps its elastic membership in an object of its own; the modes that tolerate a lost rank (and a worker
    added with join) make each worker a world of its own, which Lightning sees as world_size 1."""
    a, b = STRATEGIES["sync_ps"](mode="async"), STRATEGIES["sync_ps"](mode="async")
    assert a.membership is not b.membership
    assert a.tolerates_lost_ranks and not STRATEGIES["sync_ps"]().tolerates_lost_ranks
    assert a.own_world and STRATEGIES["sync_ps"](elastic=True).own_world and not STRATEGIES["sync_ps"]().own_world
    assert a.lost_workers == {} and a.added_workers == []


def test_state_lives_on_instances():
    """Two strategies share no mutable state: none is a class attribute of ours."""
    a, b = STRATEGIES["sync_allreduce"](), STRATEGIES["sync_allreduce"]()
    assert a._comm_resumed is not b._comm_resumed and a.gradients is not b.gradients
    for name, cls in STRATEGIES.items():
        for own in _own(cls):
            for attr, value in vars(own).items():
                assert not isinstance(value, (list, dict, set)) or attr.startswith("__"), (name, own, attr)
