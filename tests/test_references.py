"""Our algorithms against torch's own implementations of them, on the same inputs over a real 2-rank gloo group.

* PowerSGD (:class:`~lightning_sync.comm.compression.PowerSGDCompression`) against torch's DDP communication hook
  ``powerSGD_hook`` with its ``PowerSGDState``;
* local SGD (:class:`~lightning_sync.comm.periodic.PeriodicAverager` in local SGD mode) against torch's
  ``PeriodicModelAverager``.

Each test names, in its docstring, what differs between the two implementations and so why they agree to a tolerance
instead of bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from lightning_sync.comm.compression import FlatBucket, PowerSGDCompression
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.periodic import PeriodicAverager

# --------------------------------------------------------------------------------------------------------- PowerSGD
# Compressed at ranks 1, 2 and 4: a 32x48 matrix, a conv-like 8x3x3x3 weight (viewed as 8x27) and a 16x32 matrix, all
# of different shapes (torch's hook groups the matrices by shape, ours keeps the bucket's order: with distinct shapes
# the two orders, and so the random draws for Q, are the same). Sent as they are: the biases and a 3x4 matrix too
# small to gain (4 * (3 + 4) >= 12).
_SHAPES = [(32, 48), (32,), (8, 3, 3, 3), (8,), (16, 32), (16,), (3, 4)]
_START_ITER = 2  # torch refuses start_powerSGD_iter <= 1 with error feedback or warm start
_STEPS = 8
_TORCH_SEED = 0  # PowerSGDState's random_seed


class _GradBucket:
    """What ``powerSGD_hook`` reads of DDP's ``GradBucket``: the bucket's flat gradient, its per-parameter views, its
    index, and whether it is the step's last bucket (one bucket: always)."""

    def __init__(self, index: int, buffer: torch.Tensor, shapes: list[tuple[int, ...]]) -> None:
        self._index, self._buffer, self._shapes = index, buffer, shapes

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            numel = math.prod(shape)
            out.append(self._buffer[offset : offset + numel].view(shape))
            offset += numel
        return out

    def is_last(self) -> bool:
        return True


def _gradient(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s flat gradient of step ``step`` (a different one per rank and step)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.cat([torch.randn(*shape, generator=gen).reshape(-1) for shape in _SHAPES])


def _exact_mean(world_size: int, step: int) -> torch.Tensor:
    return torch.stack([_gradient(r, step) for r in range(world_size)]).mean(dim=0)


def _compare_powersgd(rank: int, world_size: int) -> None:
    for approximation_rank, warm_start, error_feedback in [(1, True, True), (4, True, True), (2, False, True),
                                                           (4, True, False)]:  # fmt: skip
        config = f"rank={approximation_rank} warm_start={warm_start} error_feedback={error_feedback}"
        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=approximation_rank,
            start_powerSGD_iter=_START_ITER,
            min_compression_rate=1,  # ours compresses iff rank * (n + m) < n * m
            use_error_feedback=error_feedback,
            warm_start=warm_start,
            orthogonalization_epsilon=0,
            random_seed=_TORCH_SEED,
        )
        # torch draws Q with torch's generator seeded by numpy's RandomState(random_seed).randint(10**9), one seed
        # per fresh draw; ours with a generator seeded seed + bucket index, set here to the same seed before each
        # fresh draw (the first through ``seed``, a later one through the state dict), so both start from one Q.
        seeds = np.random.RandomState(_TORCH_SEED)
        ours = PowerSGDCompression(
            rank=approximation_rank,
            start_iter=_START_ITER,
            error_feedback=error_feedback,
            warm_start=warm_start,
            seed=int(seeds.randint(1_000_000_000)),
        )
        meter = CommMeter()
        for step in range(_STEPS):
            if step > _START_ITER and not warm_start:  # a fresh Q every compressed step
                saved = ours.state_dict()
                generator = torch.Generator().manual_seed(int(seeds.randint(1_000_000_000)))
                saved["buckets"][0]["generator"] = generator.get_state()
                ours.load_state_dict(saved)
            grad = _gradient(rank, step)
            bucket = FlatBucket(index=0, buffer=grad.clone(), shapes=[torch.Size(s) for s in _SHAPES])
            got = ours.average(bucket, meter).wait()
            ours.advance()
            expected = powerSGD_hook(state, _GradBucket(0, grad.clone(), _SHAPES)).wait()
            where = f"{config}, step {step}"
            if step < _START_ITER:  # both the plain mean; divided by 2 before or after the sum, exactly the same
                assert torch.equal(got, expected), where
                continue
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m, w=where: f"{w}: {m}")
            lossy = (got - _exact_mean(world_size, step)).norm() / _exact_mean(world_size, step).norm()
            assert lossy > 0.1, f"{where}: compression changed nothing ({float(lossy):.3g})"  # the test can fail
        assert state.iter == _STEPS, state.iter


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_powersgd_matches_torchs_powersgd_hook():
    """Our PowerSGD and torch's ``powerSGD_hook`` on the same gradients of a bucket (2 ranks, 8 steps, PowerSGD from
    step 2): at ranks 1, 2 and 4, with and without warm start and error feedback, the same mean before
    ``start_iter`` (bit for bit) and the same approximation after it, to 1e-4 (the differences, all rounding, grow
    from about 1e-7 to 1e-5 over the 6 compressed steps; a ``Q`` drawn from another seed moves the result by about
    1, and each approximation is more than 10% off the exact mean).

    The two are the same algorithm (Vogels et al. 2019): one step of power iteration per matrix ``M`` of shape
    ``(shape[0], prod(shape[1:]))``, ``P = M Q`` all-reduced and orthonormalized, ``Q = M^T P`` all-reduced and
    divided by the world size, ``P Q^T`` written back; error feedback keeps ``M + e - P Q^T``; warm start reuses
    ``Q``. The options matched: rank (torch's ``matrix_approximation_rank``), ``start_iter``
    (``start_powerSGD_iter``), ``error_feedback`` (``use_error_feedback``), ``warm_start``; torch's
    ``min_compression_rate=1`` is our rule (compress iff ``rank * (n + m) < n * m``) and its
    ``orthogonalization_epsilon=0`` our orthonormalization (none added). They are not bit for bit equal because:

    * torch orthonormalizes ``Q`` before ``P = M Q`` (the random one, and the warm-started one); ours does not.
      ``M Q`` and ``M Q R^-1`` span the same columns, so the orthonormalized ``P`` and the approximation
      ``P P^T mean(M)`` are the same but for rounding;
    * torch orthonormalizes by Gram-Schmidt at ranks 1 and 2 and by QR above; ours always by (Householder) QR: the
      same columns but for rounding and their signs, which cancel in ``P Q^T``;
    * torch's error feedback covers the whole bucket, the tensors sent as they are too (their local value minus
      the mean, which sums to zero over the ranks but for rounding); ours keeps residuals of the compressed matrices
      only. The means are the same but for rounding;
    * the random ``Q``: torch draws it from its global generator seeded from numpy, ours from a per-bucket
      ``torch.Generator``; the test seeds ours with torch's seeds (the same normals for the same shapes in the same
      order). With warm start neither draws again (ours would redraw a column that became all zeros: not here).
    """
    run_ranks(_compare_powersgd)


# -------------------------------------------------------------------------------------------------------- local SGD
_LR, _MOMENTUM, _LOCAL_STEPS = 0.05, 0.9, 20


def _model() -> nn.Module:
    """A model without buffers: torch's averager averages parameters only."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def _sgd_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, all_reduce: bool) -> None:
    """One SGD step on rank ``rank``'s batch; during warmup the gradients are all-reduced first (what DDP, or torch's
    ``post_localSGD_hook``, does), the same on both sides."""
    opt.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    if all_reduce:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
    opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _compare_local_sgd(rank: int, world_size: int) -> None:
    for period, warmup in [(4, 0), (4, 3), (5, 2)]:
        ours_model, torch_model, shifted_model = _model(), _model(), _model()
        models = (ours_model, torch_model, shifted_model)
        opts = [torch.optim.SGD(m.parameters(), lr=_LR, momentum=_MOMENTUM) for m in models]
        ours = PeriodicAverager(sync_every=period, warmup_steps=warmup)
        ours.setup(ours_model.named_parameters(), ours_model.named_buffers(), CommMeter())
        # torch counts its first call as step 0 and averages at step warmup_steps: after optimizer step w + 1 (its
        # post-local SGD's first local step), then every ``period``; ours after step w + period, then every period.
        reference = PeriodicModelAverager(period=period, warmup_steps=warmup + period - 1)
        shifted = PeriodicModelAverager(period=period, warmup_steps=warmup)  # torch's own offset: not the same
        synced = []
        for step in range(_LOCAL_STEPS):
            in_warmup = ours.in_warmup
            for model, opt in zip(models, opts):
                _sgd_step(model, opt, rank, step, all_reduce=in_warmup)
            if ours.step([opts[0]]):
                synced.append(step + 1)
            reference.average_parameters(torch_model.parameters())
            shifted.average_parameters(shifted_model.parameters())
            where = f"period={period} warmup={warmup}, after step {step + 1}"
            diff = float((_flat(ours_model) - _flat(torch_model)).abs().max())
            assert diff <= 1e-6, f"{where}: ours and torch's differ by {diff:.3g}"
        expected = list(range(warmup + period, _LOCAL_STEPS + 1, period))
        assert synced == expected, (period, warmup, synced)
        # the test can fail: torch's averager one step off ours ends elsewhere
        assert float((_flat(shifted_model) - _flat(torch_model)).abs().max()) > 1e-3, (period, warmup)
        # the replicas are one model right after a sync, on both sides
        gathered = [torch.empty_like(_flat(ours_model)) for _ in range(world_size)]
        dist.all_gather(gathered, _flat(ours_model))
        if synced and synced[-1] == _LOCAL_STEPS:
            assert torch.equal(gathered[0], gathered[1]), (period, warmup)
        ours.close()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_local_sgd_matches_torchs_periodic_model_averager():
    """Local SGD against torch's ``PeriodicModelAverager`` on the same model (no buffers: torch's averager averages
    parameters only), data and SGD with momentum, 2 ranks, 20 steps, at periods 4 and 5 with warmups 0, 2 and 3:
    the parameters agree to 1e-6 after every step, and ours syncs after steps ``w + H``, ``w + 2H``, ...

    The same algorithm: each replica steps on its own data; every ``H`` steps after the warmup every parameter
    becomes the mean over the ranks (momentum stays local on both sides, our ``average_optimizer_state`` being off).
    What differs:

    * torch counts its first call as step 0 and averages at call ``warmup_steps``, which is after optimizer step
      ``w + 1`` (post-local SGD's first local step), then every ``period``; ours syncs after step ``w + H``, then
      every ``H``. The test gives torch ``warmup_steps = w + H - 1``, which puts its averages on ours (and checks
      that torch's ``warmup_steps = w``, one step off, ends elsewhere);
    * neither averages the gradients during the warmup: torch leaves them to DDP with its ``post_localSGD_hook``,
      ours to its owner (``in_warmup``); the test all-reduces them, the same on both sides;
    * torch averages the parameters as ``sum(p / W)``; ours as ``anchor + mean(p - anchor)`` from the global copy
      (the deltas that a compressor would take): equal but for rounding, hence 1e-6, not bit for bit.
    """
    run_ranks(_compare_local_sgd)
