"""GradientSynchronizer on its own (plain torch.distributed, no Lightning): layouts, launch points, the auto tuner."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_ranks
from fake_clock import FakeClock
from torch import nn

from lightning_sync.comm.bucketing import BUCKETINGS, GradientSynchronizer, LaunchTuner, plan_buckets
from lightning_sync.comm.compression import NoCompression
from lightning_sync.comm.meter import CommMeter


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def _local_grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    torch.manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    model.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.unit
def test_plan_buckets_caps_first_bucket_and_dtype():
    params = [nn.Parameter(torch.zeros(10)) for _ in range(4)] + [nn.Parameter(torch.zeros(10, dtype=torch.float64))]
    # 40 bytes per fp32 tensor: first bucket closes at >= 40 bytes, the others at >= 80 bytes; dtypes never mix.
    assert plan_buckets(params, bucket_cap_bytes=80, first_bucket_bytes=40) == [[0], [1, 2], [3], [4]]


def _all_bucketings_agree(rank: int, world: int) -> None:
    results = {}
    for bucketing in BUCKETINGS:
        model = _mlp()
        tuner = LaunchTuner(warmup_rounds=0, trial_rounds=1)
        sync = GradientSynchronizer(
            list(model.parameters()),
            NoCompression(),
            CommMeter(),
            bucketing=bucketing,
            bucket_cap_mb=400 / 2**20,
            first_bucket_mb=100 / 2**20,
            tuner=tuner,
        )
        grads = []
        for step in range(4):
            sync.start_round()
            local = _local_grads(model, rank, step)
            # what every rank computes locally, gathered to check the mean
            stacked = [torch.zeros_like(g).repeat(world, *([1] * g.dim())) for g in local]
            for g, out in zip(local, stacked):
                torch.distributed.all_gather_into_tensor(out, g.unsqueeze(0).contiguous())
            assert sync.finish()
            got = [p.grad.clone() for p in model.parameters()]
            for g, out in zip(got, stacked):
                torch.testing.assert_close(g, out.mean(0), rtol=1e-6, atol=1e-7)
            grads.append(got)
        if bucketing == "auto":
            assert not tuner.deciding, "two rounds of trials should have decided the launch point"
        results[bucketing] = grads
    # overlap, flat and auto send the same buckets: the same bits on any number of ranks. naive cuts its payloads per
    # parameter: on 2 ranks (a + b == b + a) the same bits too; on 3, gloo's ring sums an element in an order that
    # depends on where it sits in its payload, so naive only matched the mean above.
    for bucketing, grads in results.items():
        if bucketing == "naive" and world > 2:
            continue
        for step, (a, b) in enumerate(zip(grads, results["overlap"])):
            for ga, gb in zip(a, b):
                assert torch.equal(ga, gb), f"{bucketing} differs from overlap at step {step}"


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_bucketing_gives_the_mean(world_size):
    """Every bucketing averages, auto too while it tries both launch points and after it decides; overlap, flat and
    auto give the very same bits on any number of ranks, naive on 2."""
    run_ranks(_all_bucketings_agree, world_size=world_size, timeout=120)


def _missing_and_in_place_grads(rank: int, world: int) -> None:
    model = _mlp()
    params = list(model.parameters())
    sync = GradientSynchronizer(params, NoCompression(), CommMeter(), bucketing="flat")
    # Step 1: rank 1 has no gradient for the last layer: it takes part with zeros.
    sync.start_round()
    _local_grads(model, rank, 0)
    if rank == 1:
        params[-1].grad = None
        params[-2].grad = None
    expected_last = torch.zeros_like(params[-1])
    if rank == 0:
        expected_last = params[-1].grad.clone()
    torch.distributed.all_reduce(expected_last)
    sync.finish()
    torch.testing.assert_close(params[-1].grad, expected_last / world)
    # Step 2: .grad are bucket views and are zeroed in place (set_to_none=False): backward accumulates straight into
    # the bucket, and the pack step must not copy a slot onto itself.
    model.zero_grad(set_to_none=False)
    slots = {id(p): slot for bucket in sync.buckets for p, slot in zip(bucket.params, bucket.slots)}
    for p in params:
        assert p.grad.data_ptr() == slots[id(p)].data_ptr(), "after a sync each .grad is its bucket slot"
    torch.manual_seed(7 + rank)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    sync.start_round()
    ((model(x) - y) ** 2).mean().backward()
    local = [p.grad.clone() for p in params]
    summed = [g.clone() for g in local]
    for g in summed:
        torch.distributed.all_reduce(g)
    sync.finish()
    for p, s in zip(params, summed):
        torch.testing.assert_close(p.grad, s / world, rtol=1e-6, atol=1e-7)


@pytest.mark.dist
def test_missing_gradients_and_gradients_already_in_the_bucket():
    run_ranks(_missing_and_in_place_grads)


def _views_attached_and_finite_verdict(rank: int, world: int) -> None:
    model = _mlp()
    params = list(model.parameters())
    sync = GradientSynchronizer(
        params,
        NoCompression(),
        CommMeter(),
        bucketing="overlap",
        bucket_cap_mb=1e-4,
        first_bucket_mb=1e-4,
        check_finite=True,
    )
    slots = {id(p): slot for bucket in sync.buckets for p, slot in zip(bucket.params, bucket.slots)}
    assert len(sync.buckets) > 1
    for step, poison in enumerate((None, float("nan"), float("inf"), None)):
        model.zero_grad(set_to_none=True)  # Lightning's default: backward would allocate fresh gradients
        sync.start_round()
        assert sync.grads_finite is None, "the verdict belongs to one round"
        for p in params:
            assert p.grad is not None and p.grad.data_ptr() == slots[id(p)].data_ptr(), "slot attached"
            assert not p.grad.any(), "attached slots start at zero"
        torch.manual_seed(11 + 3 * step + rank)
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        twin = copy.deepcopy(model)  # the same backward without a synchronizer: the local gradients
        twin.zero_grad(set_to_none=True)
        for net in (model, twin):
            loss = ((net(x) - y) ** 2).mean()
            if poison is not None and rank == 1:
                loss = loss * poison
            loss.backward()
        local = [p.grad for p in twin.parameters()]
        sync.finish()
        assert sync.grads_finite is (poison is None), (step, sync.grads_finite)
        if poison is None:
            for p, g in zip(params, local):
                summed = g.clone()
                torch.distributed.all_reduce(summed)
                torch.testing.assert_close(p.grad, summed / world, rtol=1e-6, atol=1e-7)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_bucket_views_are_attached_before_backward_and_each_bucket_is_checked_for_nonfinite():
    run_ranks(_views_attached_and_finite_verdict)


def _tuner_agrees(rank: int, world: int) -> None:
    tuner = LaunchTuner(warmup_rounds=1, trial_rounds=2)
    assert tuner.next_after_backward() is False  # warm-up round: during backward
    assert not tuner.record(False, 99.0)  # not timed
    # Rank 0 finds after-backward faster by 1 ms, rank 1 finds it slower by 3 ms: the sum decides, for both.
    during, after = (0.010, 0.009) if rank == 0 else (0.010, 0.013)
    expected_order = [False, True, False, True]
    for i, choice in enumerate(expected_order):
        assert tuner.next_after_backward() is choice
        done = tuner.record(choice, during if not choice else after)
        assert done is (i == len(expected_order) - 1)
    assert tuner.decide(CommMeter(), None) is False
    assert tuner.next_after_backward() is False
    assert tuner.medians_ms == pytest.approx({"during_backward": 10.0, "after_backward": 11.0})


@pytest.mark.unit
@pytest.mark.parametrize("prior", [True, False])
@pytest.mark.parametrize(
    ("during", "after", "expected"), [(10.0, 9.8, None), (9.8, 10.0, None), (10.0, 9.0, True), (9.0, 10.0, False)]
)
def test_tuner_margin_and_prior(during, after, expected, prior):
    """A lead under the margin (3%) is noise: the prior decides; a larger lead wins whatever the prior."""
    tuner = LaunchTuner(warmup_rounds=0, trial_rounds=1, margin=0.03, prefer_after_backward=prior)
    tuner.record(False, during)
    assert tuner.record(True, after)

    class _Meter:  # one rank: the sums are the local medians
        def all_reduce(self, tensor, group=None):
            return None

        def world_size(self, group=None):
            return 1

        def control_device(self, group=None):
            return torch.device("cpu")

    assert tuner.decide(_Meter(), None) is (prior if expected is None else expected)


@pytest.mark.dist
def test_tuner_decision_is_the_same_on_every_rank():
    run_ranks(_tuner_agrees)


def _auto_picks_what_is_faster(rank: int, world: int, slow_after: bool) -> None:
    """Each round takes 10 ms on a fake clock, 30 ms at the slow launch point: the synchronizer must book every
    round's period to the launch point it ran with, and keep the faster one."""
    model = _mlp()
    clock = FakeClock()
    # prior: the slow one, so only the timings can pick the other
    tuner = LaunchTuner(warmup_rounds=1, trial_rounds=3, prefer_after_backward=slow_after, clock=clock)
    sync = GradientSynchronizer(
        list(model.parameters()),
        NoCompression(),
        CommMeter(),
        bucketing="auto",
        bucket_cap_mb=400 / 2**20,
        first_bucket_mb=100 / 2**20,
        tuner=tuner,
    )
    tried = []
    for step in range(10):
        sync.start_round()
        tried.append(sync.after_backward)
        _local_grads(model, rank, step)
        sync.finish()
        clock.advance(0.030 if sync.after_backward == slow_after else 0.010)
    assert not tuner.deciding
    assert tried[1:7] == [False, True] * 3, tried  # the trials alternate after one warmup round
    assert tuner.medians_ms == pytest.approx(
        {"during_backward": 30.0 if not slow_after else 10.0, "after_backward": 30.0 if slow_after else 10.0}
    )
    assert sync.launch_point == ("during_backward" if slow_after else "after_backward")
    assert bool(sync._hooks) is (not sync.after_backward), "hooks are dropped once launching after backward"


@pytest.mark.dist
@pytest.mark.parametrize("slow_after", [True, False])
def test_auto_keeps_the_faster_launch_point(slow_after):
    run_ranks(_auto_picks_what_is_faster, slow_after, timeout=120)


def _decision_survives_a_resume(rank: int, world: int) -> None:
    model = _mlp()
    make = lambda: GradientSynchronizer(  # noqa: E731
        list(model.parameters()),
        NoCompression(),
        CommMeter(),
        bucketing="auto",
        tuner=LaunchTuner(warmup_rounds=0, trial_rounds=2, margin=0.0, prefer_after_backward=True),
    )
    sync = make()
    for step in range(6):
        sync.start_round()
        _local_grads(model, rank, step)
        sync.finish()
    assert not sync.tuner.deciding
    state = sync.state_dict()
    sync.remove_hooks()
    resumed = make()
    resumed.load_state_dict(state)
    assert not resumed.tuner.deciding and resumed.launch_point == sync.launch_point
    assert bool(resumed._hooks) is (resumed.launch_point == "during_backward")
    resumed.start_round()  # no trial, no decision collective: the ranks stay in step
    assert resumed.launch_point == sync.launch_point
    _local_grads(model, rank, 9)
    assert resumed.finish()


@pytest.mark.dist
def test_auto_decision_survives_a_resume():
    run_ranks(_decision_survives_a_resume)


def _prior_follows_the_hosts(rank: int, world: int) -> None:
    params = list(_mlp().parameters())
    priors = {
        same: GradientSynchronizer(
            params, NoCompression(), CommMeter(), bucketing="auto", same_host_cpu=same
        ).tuner.prefer_after_backward
        for same in (None, True, False)
    }
    assert priors == {None: True, True: True, False: False}, priors


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_auto_prior_is_after_backward_on_one_host_and_during_backward_across_hosts():
    run_ranks(_prior_follows_the_hosts)


LAUNCH_POINTS = ("overlap", "flat", "auto")  # the same buckets, sent during backward, after it, or either


def _train_with_each_launch_point(rank: int, world: int, steps: int) -> None:
    final = {}
    for bucketing in LAUNCH_POINTS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # auto alternates the two launch points for its trials, then keeps one: both are in its run.
        tuner = LaunchTuner(warmup_rounds=1, trial_rounds=3)
        sync = GradientSynchronizer(
            list(model.parameters()),
            NoCompression(min_chunk_mb=4096 / 2**20),  # buckets of 8 KiB and more go as 2 concurrent slices
            CommMeter(),
            bucketing=bucketing,
            bucket_cap_mb=8192 / 2**20,
            first_bucket_mb=1024 / 2**20,
            tuner=tuner,
        )
        assert len(sync.buckets) > 2, "several buckets: the layout matters"
        for step in range(steps):
            torch.manual_seed(1000 * step + rank)  # each rank its own batch
            x, y = torch.randn(16, 32), torch.randn(16, 4)
            optimizer.zero_grad(set_to_none=True)
            sync.start_round()
            ((model(x) - y) ** 2).mean().backward()
            assert sync.finish()
            optimizer.step()
        if bucketing == "auto":
            assert not tuner.deciding and set(tuner.times) == {False, True}
        sync.remove_hooks()
        final[bucketing] = [p.detach().clone() for p in model.parameters()]
    for bucketing in LAUNCH_POINTS[1:]:
        diff = max((a - b).abs().max().item() for a, b in zip(final[bucketing], final["overlap"]))
        assert all(torch.equal(a, b) for a, b in zip(final[bucketing], final["overlap"])), (
            f"rank {rank} of {world}: {bucketing} ends {diff:.3g} away from overlap after {steps} steps"
        )


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_launch_point_trains_to_the_same_bits(world_size):
    """overlap, flat and auto differ only in when a bucket is sent: 30 steps of SGD with momentum on 2 and on 3 ranks
    end with bitwise-equal parameters (on 3 ranks a sum depends on its order, so this holds only if every launch
    point sends the same collectives)."""
    run_ranks(_train_with_each_launch_point, 30, world_size=world_size, timeout=150)
