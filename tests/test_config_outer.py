"""The outer optimizer as an object (``outer_optimizer``, a callable from parameters to a ``torch.optim.Optimizer``):
one default, taken alike by periodic (DiLoCo, streaming DiLoCo) and ps (async local SGD); Adam trains DiLoCo, and an
optimizer class defined here runs through periodic, streaming and ps with no edit to the package."""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import functools  # noqa: E402
import inspect  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from test_ps_core import _backward, _client, _free_port, _join, _model, procs  # noqa: E402, F401
from test_ps_outer import _diloco_reference  # noqa: E402
from torch import nn  # noqa: E402

import lightning_sync.ps as ps  # noqa: E402
from lightning_sync import OUTER_OPTIMIZER, DelayedNesterov, ParameterServerStrategy, PeriodicSyncStrategy  # noqa: E402
from lightning_sync.algorithms import ps_settings  # noqa: E402
from lightning_sync.apps.conf_store import SCHEMA_DEFAULTS  # noqa: E402
from lightning_sync.comm.meter import CommMeter  # noqa: E402
from lightning_sync.comm.periodic import PeriodicAverager, StreamingOptions  # noqa: E402
from lightning_sync.config import ParameterServerConfig, PeriodicConfig  # noqa: E402
from lightning_sync.errors import ConfigError  # noqa: E402
from lightning_sync.ps._protocol import from_blob, to_blob  # noqa: E402
from lightning_sync.ps.outer import LocalSteps  # noqa: E402


class ToyOuter(torch.optim.Optimizer):
    """An outer optimizer the package does not know: SGD whose step shrinks as ``lr / sqrt(steps taken)``."""

    def __init__(self, params: Any, lr: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["steps"] = state.get("steps", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["steps"] ** 0.5)
        return None


def _placeholder() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


# ------------------------------------------------------------------------------------------------------- defaults
@pytest.mark.unit
def test_every_layer_has_one_default_today_s_outer_sgd():
    """The configs (torch-free), the strategies and the torch-level classes all default to ``None``, which stands
    for :data:`~lightning_sync.OUTER_OPTIMIZER` alone; the Hydra schema's node builds that same callable; and what
    each builds is the outer optimizer of before: SGD at lr 0.7 without momentum (nor Nesterov)."""
    assert PeriodicConfig.outer_optimizer is None and ParameterServerConfig.outer_optimizer is None
    for cls in (PeriodicSyncStrategy, ParameterServerStrategy, PeriodicAverager):
        assert inspect.signature(cls).parameters["outer_optimizer"].default is None, cls
    assert ps.PSConfig().outer_optimizer is None
    node = hydra.utils.instantiate(SCHEMA_DEFAULTS["outer_optimizer"])
    assert SCHEMA_DEFAULTS["outer_optimizer"] == {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.7}
    assert (
        (node.func, node.keywords) == (OUTER_OPTIMIZER.func, OUTER_OPTIMIZER.keywords) == (torch.optim.SGD, {"lr": 0.7})
    )
    expected = torch.optim.SGD(_placeholder(), lr=0.7, momentum=0.0).defaults
    assert expected["momentum"] == 0 and expected["nesterov"] is False
    averager = PeriodicSyncStrategy(mode="diloco", sync_every=16).averager
    assert averager is not None and averager.outer_optimizer(_placeholder()).defaults == expected
    settings = ps_settings(ParameterServerStrategy(mode="async", local_steps=8).config)
    assert settings.new_outer_optimizer(_placeholder()).defaults == expected


@pytest.mark.unit
def test_ps_default_steps_bit_for_bit_as_the_delayed_nesterov_it_replaces():
    """Before, the servers' default was DelayedNesterov(lr 0.7, momentum 0, delay=W); now torch's SGD at lr 0.7."""
    gen = torch.Generator().manual_seed(0)
    old = nn.Parameter(torch.randn(64, generator=gen))
    new = nn.Parameter(old.detach().clone())
    before = DelayedNesterov([old], lr=0.7, momentum=0.0, nesterov=True, delay=3)
    after = ps.PSConfig(local_steps=4).new_outer_optimizer([new])
    for _ in range(7):
        grad = torch.randn(64, generator=gen)
        old.grad, new.grad = grad.clone(), grad.clone()
        before.step()
        after.step()
        assert torch.equal(old, new)


# --------------------------------------------------------------------------------------------------- what is taken
@pytest.mark.unit
def test_ps_takes_any_callable_and_sends_the_servers_plain_values():
    """A partial, a class, a lambda (what LightningCLI's ``class_path`` gives is a partial of its own): the worker
    describes what the callable builds, that description travels as plain values (``weights_only``), and a server
    rebuilds it over its shard."""
    for factory in (functools.partial(ToyOuter, lr=0.3), lambda params: ToyOuter(params, lr=0.3)):
        config = ps.PSConfig(mode="async", local_steps=4, outer_optimizer=factory)
        travelled = ps.PSConfig(**from_blob(to_blob(config.as_dict())))
        assert travelled == config
        built = travelled.new_outer_optimizer(_placeholder())
        assert isinstance(built, ToyOuter) and built.defaults == {"lr": 0.3}
    built = ps.PSConfig(outer_optimizer=functools.partial(DelayedNesterov, momentum=0.9, delay=4))
    assert built.new_outer_optimizer(_placeholder()).defaults == {
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
        "delay": 4,
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, message",
    [
        (0.7, r"outer_optimizer=0\.7 is not allowed; it must be a callable from parameters to a torch\.optim"),
        (functools.partial(torch.optim.SGD, lr=-1.0), r"outer_optimizer=.* is not allowed: Invalid learning rate"),
        (functools.partial(ToyOuter, lr=0.0), r"outer_optimizer=.* is not allowed: Invalid learning rate: 0\.0"),
        (functools.partial(torch.optim.SGD, lrr=0.7), r"outer_optimizer=.* is not allowed: .*unexpected keyword"),
        (lambda params: list(params), r"outer_optimizer=.* is not allowed: it returned a list"),
    ],
)
def test_a_bad_outer_optimizer_is_named_before_any_process_starts(value, message):
    with pytest.raises(ConfigError, match=rf"^strategy\.{message}"):
        PeriodicSyncStrategy(mode="diloco", outer_optimizer=value)
    with pytest.raises(ConfigError, match=rf"^strategy\.{message}"):
        ParameterServerStrategy(mode="async", local_steps=4, outer_optimizer=value)


# ---------------------------------------------------------------------------------------------- periodic, 2 ranks
def _diloco_ranks(rank: int, world: int, factory: Callable[..., torch.optim.Optimizer], fragments: int) -> None:
    """DiLoCo (or streaming DiLoCo with ``fragments > 1``: one outer optimizer per fragment, each synced one step
    late) on a least-squares problem, each rank on batches of its own; the loss on a common set must go down."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    evaluation = torch.randn(256, 8, generator=torch.Generator().manual_seed(2))

    def loss(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), x @ target)

    streaming = StreamingOptions(fragments=fragments, sync_delay=1 if fragments > 1 else 0)
    averager = PeriodicAverager(sync_every=4, outer=True, outer_optimizer=factory, streaming=streaming)
    averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
    inner = torch.optim.SGD(model.parameters(), lr=0.02)
    with torch.no_grad():
        start = float(loss(evaluation))
    for step in range(80):
        averager.start_step()
        inner.zero_grad()
        loss(torch.randn(32, 8, generator=torch.Generator().manual_seed(1000 * rank + step))).backward()
        inner.step()
        averager.step([inner])
    averager.finish([inner])
    averager.close()
    with torch.no_grad():
        end = float(loss(evaluation))
    outers = [group.outer for group in averager.groups]
    assert len(outers) == fragments and all(isinstance(o, type(factory(_placeholder()))) for o in outers), outers
    assert all(o is not None and o.state for o in outers)  # every fragment's outer optimizer has stepped
    assert end < 0.25 * start, (start, end)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_adam_as_the_outer_optimizer_trains_diloco():
    run_ranks(_diloco_ranks, functools.partial(torch.optim.Adam, lr=0.02), 1)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2], ids=["diloco", "streaming"])
def test_an_outer_optimizer_of_this_file_runs_through_periodic(fragments):
    run_ranks(_diloco_ranks, functools.partial(ToyOuter, lr=0.9), fragments)


# ------------------------------------------------------------------------------------------------ ps, 2 workers
def _ps_worker(rank: int, port: int, factory: Callable[..., torch.optim.Optimizer], steps: int) -> list:
    """Async local SGD in sync mode, 3 local steps per push; the colocated server (a thread of worker 0, forked
    from this test process) builds the outer optimizer from the class path it is sent."""
    _, server, group = _join(rank, port, 2, 1, timeout_s=10)
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    client = _client(group, model, inner, mode="sync", local_steps=3, outer_optimizer=factory)
    if rank == 0:
        client.init_servers()
    client.pull()
    local = LocalSteps(client, 3, lambda: ps.current_lrs(inner))
    local.start()
    for step in range(steps):
        _backward(model, rank, step)
        inner.step()
        local.after_step()
    client.close()
    if server is not None:
        server.finish(10)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_an_outer_optimizer_of_this_file_runs_through_ps(procs):  # noqa: F811
    factory, rounds = functools.partial(ToyOuter, lr=0.9), 4
    port = _free_port()
    for rank in range(2):
        procs.start(f"worker{rank}", _ps_worker, rank, port, factory, 3 * rounds)
    out = procs.ok(["worker0", "worker1"], timeout=40)
    expected = _diloco_reference(3, rounds, factory)
    plain = _diloco_reference(3, rounds, functools.partial(torch.optim.SGD, lr=0.9))
    got = out["worker0"]
    assert all(torch.allclose(g, e, atol=1e-6, rtol=0) for g, e in zip(got, expected)), (got, expected)
    assert not all(torch.allclose(g, e, atol=1e-3, rtol=0) for g, e in zip(got, plain))  # the toy's steps, not SGD's
    assert all(torch.equal(a, b) for a, b in zip(got, out["worker1"]))
