"""What one async push does: one optimizer step scaled by ``push_scale`` (``auto``: ``1/W``), on the gradient of
SGD-family optimizers and on the learning rate of scale-invariant ones such as AdamW.

Plain torch.distributed (no Lightning), two forked workers and a server thread of worker 0; and async's accuracy on
the digits with the order of the pushes fixed by the test, in one process and against a real server (no test here
depends on how the OS shares the CPU: the same claim through the app, where it does, is the benchmark
``benchmarks/ps_async_adamw.py``).
"""

from __future__ import annotations

import os
import statistics

os.environ["OMP_NUM_THREADS"] = "1"

import copy  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_ps_core import _backward, _client, _free_port, _join, _model, procs  # noqa: E402, F401

import lightning_sync.ps as ps  # noqa: E402
from lightning_sync.algorithms import ps_settings  # noqa: E402
from lightning_sync.config import ParameterServerConfig  # noqa: E402
from lightning_sync.errors import ConfigError  # noqa: E402


class MyAdamW(torch.optim.AdamW):
    """A user's subclass: it keeps its family (found through the class hierarchy)."""


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def _one_push(rank: int, port: int, kind: str, push_scale: float | None) -> dict:
    """Worker 0 pushes two gradients in async; worker 1 only pulls (so the server has W = 2 workers)."""
    _, server, group = _join(rank, port, 2, 1, timeout_s=10)
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    client = _client(group, model, opt, mode="async", push_scale=push_scale)
    if rank == 0:
        client.init_servers()
    client.pull()
    if rank == 0:
        for step in range(2):
            _backward(model, 0, step)
            client.push(ps.current_lrs(opt))
    stats = client.server_stats()[0] if rank == 0 else None
    client.close()
    if server is not None:
        server.finish(10)
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": stats}


def _local_steps(kind: str, scale: float, on: str = "") -> list[torch.Tensor]:
    """The same two steps in one process, ``on`` (default: SGD's gradient, AdamW's learning rate) times ``scale``."""
    on = on or ("lr" if kind == "adamw" else "grad")
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    for group in opt.param_groups if on == "lr" else []:
        group["lr"] *= scale
    for step in range(2):
        _backward(model, 0, step)
        for p in model.parameters() if on == "grad" else []:
            p.grad.mul_(scale)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind, push_scale, expected_scale",
    [("sgd", None, 0.5), ("sgd", 0.25, 0.25), ("adamw", None, 0.5), ("adamw", 0.25, 0.25)],
    ids=["sgd-auto", "sgd-0.25", "adamw-auto", "adamw-0.25"],
)
def test_async_push_is_one_step_scaled_by_push_scale(procs, kind, push_scale, expected_scale):  # noqa: F811
    port = _free_port()
    for rank in range(2):
        procs.start(f"worker{rank}", _one_push, rank, port, kind, push_scale)
    out = procs.ok(["worker0", "worker1"], timeout=40)
    assert out["worker0"]["stats"]["push_scale"] == expected_scale
    expected = _local_steps(kind, expected_scale)
    got = out["worker0"]["params"]
    assert all(torch.allclose(g, e, atol=1e-7, rtol=0) for g, e in zip(got, expected)), (got, expected)
    for other in (1.0, expected_scale * 2):  # the test can fail: another scale gives other parameters
        differs = _local_steps(kind, other)
        assert not all(torch.allclose(g, e, atol=1e-7, rtol=0) for g, e in zip(got, differs)), other
    if kind == "adamw":  # and on the gradient, the scale would not have changed AdamW's step
        on_gradient = _local_steps(kind, expected_scale, on="grad")
        assert all(torch.allclose(g, e, atol=1e-6, rtol=0) for g, e in zip(on_gradient, _local_steps(kind, 1.0)))
    start = [p.detach() for p in copy.deepcopy(_model()).parameters()]
    assert not all(torch.equal(g, s) for g, s in zip(got, start))  # it did train


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_push_scale_knob_is_checked_before_any_process_starts():
    assert ps_settings(ParameterServerConfig(mode="async")).push_scale is None  # auto: the server decides
    assert ps_settings(ParameterServerConfig(mode="ssp", push_scale=0.5)).push_scale == 0.5
    bad: list[dict[str, Any]] = [
        {"mode": "sync", "push_scale": 0.5},
        {"mode": "async", "push_scale": "half"},
        {"mode": "async", "push_scale": 0},
        {"mode": "async", "push_scale": float("nan")},
    ]
    for knobs in bad:
        with pytest.raises(ConfigError, match="push_scale="):
            ps_settings(ParameterServerConfig(**knobs))


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_push_scale_goes_on_the_learning_rate_of_scale_invariant_optimizers_only():
    params = list(torch.nn.Linear(2, 2).parameters())
    spec = ps.optimizer_spec
    assert not ps.scales_learning_rate(spec(torch.optim.SGD(params, lr=0.1, momentum=0.9), params))
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad, MyAdamW):
        assert ps.scales_learning_rate(spec(cls(params), params)), cls


# ---------------------------------------------------------------------------- the digits, in an injected order of pushes
# Async's accuracy through the app depends on the order in which the OS lets the workers push (one run in three fell
# 2.2 points behind sync on a quiet 2-core machine): that claim, over seeds and with its spread, is the benchmark
# ``benchmarks/ps_async_adamw.py``. Here the order of the pushes is the test's: in one process, a ServerShard (the
# server's arithmetic) applies the workers' pushes in a given order (:func:`_replay`), and in two worker processes
# around a real server, each worker pushes only on its turn of that order (:func:`_turn_taking_worker`); a push is a
# request and its reply, so the server applies the pushes in exactly that order. The app's digits model and data
# (conf/model/digits.yaml, conf/data/digits.yaml) with AdamW at lr 0.003, as the benchmark runs them.
DIGITS_LR = 0.003
DIGITS_BATCH = 32
DIGITS_EPOCHS = 10


@functools.cache
def _digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The digits' fixed train and test splits, as ``(inputs, labels)``."""
    from lightning_sync.examples.data import DigitsDataModule

    data = DigitsDataModule(seed=0)
    data.setup()
    train, test = data.splits["train"].tensors, data.splits["test"].tensors
    return (train[0], train[1]), (test[0], test[1])


def _digits_model(seed: int) -> torch.nn.Module:
    """The app's digits classifier (``DigitsClassifier.net``: 64-128-128-10, ReLU), initialized from ``seed``."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, 10))


def _digits_batches(train: Any, worker: int, num_workers: int, seed: int, epochs: int) -> Any:
    """Worker ``worker``'s batches: each epoch a permutation of the train split (from ``seed`` and the epoch), the
    worker's share by stride (as Lightning's ``DistributedSampler``), batches of 32, the last partial one dropped."""
    x, y = train
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1000 * seed + epoch))
        share = order[worker::num_workers]
        for i in range(0, len(share) - DIGITS_BATCH + 1, DIGITS_BATCH):
            yield x[share[i : i + DIGITS_BATCH]], y[share[i : i + DIGITS_BATCH]]


def _digits_gradient(model: torch.nn.Module, batch: Any) -> None:
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()


def _accuracy(params: list[torch.Tensor], test: Any) -> float:
    model = _digits_model(0)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def _digits_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=DIGITS_LR)


def _round_robin(num_workers: int, burst: int = 1) -> Any:
    """Worker ids without end: ``burst`` pushes of worker 0, then of worker 1, ..."""
    k = 0
    while True:
        yield (k // burst) % num_workers
        k += 1


def _replay(
    seed: int,
    mode: str,
    order: Any = None,
    *,
    num_workers: int = 2,
    epochs: int = DIGITS_EPOCHS,
    pushes: int | None = None,
    take_every: int = 1,
) -> tuple[list[torch.Tensor], dict]:
    """Trains the digits model as ``num_workers`` workers of one server do, in this process; returns the server's
    final parameters and its stats (version, clocks, staleness).

    ``sync``: every round, each worker's gradient at the server's parameters, summed in worker order and divided by
    the workers (the server's sync step), one AdamW step. ``async``/``ssp``: the pushes in ``order`` (worker ids), each
    one AdamW step at ``lr / W`` (``push_scale`` auto on a scale-invariant optimizer) on that worker's gradient at the
    parameters of its last reply, its staleness recorded as the server does; until every worker ran out of batches
    (or ``pushes`` were made). ``take_every=k`` breaks the client on purpose: a worker copies only every ``k``-th
    reply into its model (its gradients grow stale).
    """
    train, _ = _digits()
    start = _digits_model(seed)
    params = list(start.parameters())
    spec = ps.optimizer_spec(_digits_optimizer(params), params)
    shard = ps.ServerShard(params, range(len(params)), spec, num_workers=num_workers)
    lrs = ps.current_lrs(_digits_optimizer(params))
    workers = [_digits_model(seed) for _ in range(num_workers)]
    computed_on = [0] * num_workers  # the version of each worker's parameters
    batches = [_digits_batches(train, w, num_workers, seed, epochs) for w in range(num_workers)]

    def take_reply(worker: int) -> None:
        with torch.no_grad():
            for p, value in zip(workers[worker].parameters(), shard.params):
                p.copy_(value)
        computed_on[worker] = shard.version

    def gradient(worker: int, batch: Any) -> torch.Tensor:
        _digits_gradient(workers[worker], batch)
        return shard.layout.flat_fp32([p.grad for p in workers[worker].parameters()])

    if mode == "sync":
        for round_batches in zip(*batches):
            total = torch.zeros(shard.layout.numel, dtype=torch.float32)
            for w, batch in enumerate(round_batches):
                total.add_(gradient(w, batch))
            shard.apply(total.div_(num_workers), lrs)
            for w in range(num_workers):
                shard.record(w, 0)
                take_reply(w)
        return [p.detach().clone() for p in shard.params], shard.stats()
    done: set[int] = set()
    for worker in order:
        if len(done) == num_workers or shard.version == pushes:
            break
        batch = next(batches[worker], None)
        if batch is None:
            done.add(worker)
            continue
        staleness = shard.version - computed_on[worker]
        shard.apply(gradient(worker, batch), lrs, 0, None, 1.0 / num_workers)
        shard.record(worker, staleness)
        if shard.clocks[worker] % take_every == 0:
            take_reply(worker)
    return [p.detach().clone() for p in shard.params], shard.stats()


SEEDS = (0, 1, 2)


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_async_and_ssp_with_adamw_in_a_fixed_order_of_pushes_are_within_two_points_of_sync_on_the_digits():
    """Two workers, 10 epochs of the digits, AdamW: async with its pushes alternating (every push 1 version stale),
    and ssp/2 at its bound (bursts of 2 pushes per worker: pushes up to 2 versions stale), against sync; mean test
    accuracy over seeds 0-2 within 2 points, and every run learned (>= 0.9). Deterministic on a given build;
    another build's rounding draws another sample of the spread over seeds (a seed's difference to sync: about 1
    point, so about 0.6 for a mean of 3), which the 2 points cover with room. The test can fail: a client that copies only every 10th reply into its model, and so pushes
    gradients up to 20 versions stale, falls far below."""
    _, test = _digits()
    runs: dict[str, list[float]] = {"sync": [], "async": [], "ssp/2": []}
    for seed in SEEDS:
        runs["sync"].append(_accuracy(_replay(seed, "sync")[0], test))
        params, stats = _replay(seed, "async", _round_robin(2))
        runs["async"].append(_accuracy(params, test))
        assert stats["staleness_histogram"] == [{0: 1, 1: stats["clocks"][0] - 1}, {1: stats["clocks"][1]}], stats
        params, stats = _replay(seed, "ssp", _round_robin(2, burst=2))
        runs["ssp/2"].append(_accuracy(params, test))
        assert max(max(h) for h in stats["staleness_histogram"]) == 2, stats
    mean = {case: statistics.fmean(values) for case, values in runs.items()}
    print("AdamW test accuracy, mean of seeds", SEEDS, mean, runs)
    assert min(min(values) for values in runs.values()) >= 0.9, runs
    assert abs(mean["async"] - mean["sync"]) <= 0.02 and abs(mean["ssp/2"] - mean["sync"]) <= 0.02, runs
    broken = _accuracy(_replay(0, "async", _round_robin(2), take_every=10)[0], test)
    assert broken < mean["sync"] - 0.05, (broken, runs)


def _turn_taking_worker(rank: int, port: int, mode: str, burst: int, seed: int, pushes: int, ready: Any, turn: Any):
    """Worker ``rank`` of 2 around worker 0's server thread: both pull the start, then push the digits' batches, each
    only on its turn of the order ``_round_robin(2, burst)`` (``turn`` counts the pushes made); returns its model's
    parameters after its last reply (worker 0: after the last push of all) and the server's stats."""
    _, server, group = _join(rank, port, 2, 1, timeout_s=30)
    model = _digits_model(seed)
    params = list(model.parameters())
    client = ps.PSClient(
        group, params, ps.optimizer_spec(_digits_optimizer(params), params), ps.PSConfig(mode=mode, max_staleness=2)
    )
    if rank == 0:
        client.init_servers()
    client.pull()
    ready.wait()  # both pulled version 0 before the first push
    batches = _digits_batches(_digits()[0], rank, 2, seed, epochs=2)
    lrs = ps.current_lrs(_digits_optimizer(params))

    def wait_for_turn(k: int) -> None:  # the other worker's push: its reply comes before it hands the turn on
        deadline = time.monotonic() + 30  # a bound for a failed peer only: no timing is asserted
        while turn.value != k:
            assert time.monotonic() < deadline, f"worker {rank} waited 30 s for push {k}"
            time.sleep(0.0005)

    for k, worker in zip(range(pushes), _round_robin(2, burst)):
        if worker == rank:
            wait_for_turn(k)
            _digits_gradient(model, next(batches))
            client.push(lrs)
            turn.value = k + 1
    wait_for_turn(pushes)
    stats = client.server_stats()[0]
    if rank == 0:
        client.pull()
    client.close()
    if server is not None:
        server.finish(10)
    return {"params": [p.detach().clone() for p in params], "stats": stats}


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, burst", [("async", 1), ("ssp", 2)], ids=["async-alternating", "ssp2-bursts-of-2"])
def test_a_real_server_fed_pushes_in_a_fixed_order_trains_as_the_replay(procs, mode, burst):  # noqa: F811
    """The link between the replay above and the server: two worker processes push 40 digits batches to worker 0's
    server thread in the order the replay uses, and the server's parameters are bit for bit the replay's, its
    staleness record the same. The test can fail: the replay in another order (or on the other mode's) gives other
    parameters."""
    port, pushes, seed = _free_port(), 40, 0
    ready, turn = procs.ctx.Barrier(2), procs.ctx.Value("i", 0, lock=False)
    for rank in range(2):
        procs.start(f"worker{rank}", _turn_taking_worker, rank, port, mode, burst, seed, pushes, ready, turn)
    out = procs.ok(["worker0", "worker1"], timeout=50)
    expected, expected_stats = _replay(seed, mode, _round_robin(2, burst), epochs=2, pushes=pushes)
    got, stats = out["worker0"]["params"], out["worker0"]["stats"]
    assert stats["version"] == pushes and stats["clocks"] == expected_stats["clocks"], (stats, expected_stats)
    assert stats["staleness_histogram"] == expected_stats["staleness_histogram"], (stats, expected_stats)
    assert all(torch.equal(g, e) for g, e in zip(got, expected)), max(
        (g - e).abs().max() for g, e in zip(got, expected)
    )
    other, _ = _replay(seed, mode, _round_robin(2, 3 - burst), epochs=2, pushes=pushes)
    assert not all(torch.equal(g, o) for g, o in zip(got, other))
