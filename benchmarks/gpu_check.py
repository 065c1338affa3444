"""The GPU path, checked: every sync mode on the char_lm example, the core collectives on CUDA tensors, the int8/int4
quantizer's throughput, and the modes' step times at one rank; one JSON and one markdown report.

    python benchmarks/gpu_check.py                     # on a CUDA machine: report in benchmarks/results/gpu/
    python benchmarks/gpu_check.py --device cpu        # the same cases on CPU (a trial of the check itself)
    python benchmarks/gpu_check.py --allow-cpu         # CUDA if there is one, else CPU
    python benchmarks/gpu_check.py --cases 'strategy/allreduce*' 'collective/int4'

Sections (a case is ``section/name``; ``--list`` prints them all):

``strategy``
    ``Trainer(accelerator=gpu, devices=1)`` fits of the char_lm example (:func:`lightning_sync.examples.models.
    build_char_lm`) for a few steps with each mode: ``ddp`` with each comm hook, ``allreduce`` with each
    compression, ``periodic`` local SGD, DiLoCo and streaming DiLoCo with int8/int4 outer compression, ``ps`` sync
    and async, and Lightning's own single-device strategy as the baseline; each in 32-bit and in bf16-mixed. One rank: the collectives return at once, so these cases check
    the strategies' device handling (hooks, buckets, global copies, the parameter server's copies) and the
    precision plugins; the collectives themselves are the next section's.
``collective``
    The core (:mod:`lightning_sync.comm`, :mod:`lightning_sync.ps`) on CUDA tensors, with two processes on the one
    GPU joined by gloo: NCCL refuses two ranks on one device, and gloo takes CUDA tensors (it stages them through
    host memory). Bucketed gradient sync, PowerSGD, top-k, int8/int4 averaging, the streaming outer sync on its
    worker thread, the replica check, and the parameter-server client's copies between the device and the wire.
    Each result is compared with a reference computed independently on the CPU.
``nccl``
    One process, a one-rank NCCL group: the package's collectives on tensors it makes itself (a CUDA run only;
    on CPU the same calls run on gloo).
``quantizer``
    Encode and decode throughput of the block-wise int8/int4 codec (:mod:`lightning_sync.comm.compression.quantized`) on the
    GPU and on the CPU, in GB/s of fp32 input.

A case that fails is recorded with its error and the others still run; the exit status is 1 when any failed. The
step-time table is read off the ``strategy`` fits (median wall time of a training step after the first few, the
device synchronized at both ends).

Internal: ``--worker NAME`` runs one rank of a two-rank ``collective`` case (the check starts two such processes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import fnmatch
import functools
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu"
CPU_OUT = REPO / "outputs" / "gpu_check_cpu"
SCHEMA = 1
HOST = "127.0.0.1"
DEFAULT_BUDGET_S = 450.0  # 7.5 minutes: the cases left when it runs out are recorded as skipped
PAIR_TIMEOUT_S = 120.0  # one two-rank case, both processes, start-up included
GLOO_NOTE = (
    "The two-rank cases run two processes on the one GPU joined by gloo: NCCL refuses two ranks on one device "
    "('Duplicate GPU detected'), and gloo takes CUDA tensors for its collectives, staging them through host memory. "
    "So they check the package's device handling with CUDA tensors, not NCCL's transport; NCCL runs in the "
    "one-rank strategy fits and in the nccl section."
)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# processes this check starts (the ranks of a pair, a ps strategy's server) import lightning_sync from the checkout
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


# ================================================================================================= cases and results
@dataclass
class CaseResult:
    """One case's outcome: ``ok``, ``failed`` (with the error) or ``skipped`` (with why)."""

    section: str
    name: str
    status: str
    seconds: float
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def case(self) -> str:
        return f"{self.section}/{self.name}"


@dataclass(frozen=True)
class StrategyCase:
    """A Lightning fit of the char_lm example with one strategy."""

    name: str
    mode: str  # ddp | allreduce | periodic | ps, or lightning (the baseline: Lightning's own strategy)
    knobs: dict[str, Any]
    precision: str
    what: str


def _strategy_cases() -> list[StrategyCase]:
    from lightning_sync.comm.compression import PowerSGDCompression

    base: list[tuple[str, str, dict[str, Any], str]] = [
        ("lightning_single_device", "lightning", {}, "Lightning's own single-device strategy: the baseline")
    ]
    for hook in ("none", "fp16", "bf16", "powersgd", "topk"):
        knobs: dict[str, Any] = {"comm_hook": PowerSGDCompression(start_iter=2) if hook == "powersgd" else hook}
        base.append((f"ddp_{hook}", "ddp", knobs, f"torch DDP, comm hook {hook}"))
    for compression in ("none", "fp16", "bf16", "powersgd", "topk"):
        knobs = {"compression": PowerSGDCompression(start_iter=2) if compression == "powersgd" else compression}
        base.append((f"allreduce_{compression}", "allreduce", knobs, f"bucketed all-reduce, compression {compression}"))
    base += [
        ("periodic_local_sgd", "periodic", {"mode": "local_sgd", "sync_every": 3}, "local SGD, sync every 3 steps"),
        ("periodic_diloco", "periodic", {"mode": "diloco", "sync_every": 3}, "DiLoCo, outer step every 3 steps"),
    ]
    for codec in ("int8", "int4"):
        knobs = {"mode": "diloco", "sync_every": 4, "fragments": 2, "sync_delay": 1, "fragment_alpha": 0.5}
        knobs["outer_compression"] = codec
        base.append((f"periodic_streaming_{codec}", "periodic", knobs, f"streaming DiLoCo (2 fragments), {codec}"))
    base += [
        ("ps_sync", "ps", {"mode": "sync"}, "parameter server, sync (a dedicated server process)"),
        ("ps_async", "ps", {"mode": "async"}, "parameter server, async (a dedicated server process)"),
    ]
    return [
        StrategyCase(f"{name}_{'bf16' if precision == 'bf16-mixed' else 'fp32'}", mode, knobs, precision, what)
        for name, mode, knobs, what in base
        for precision in ("32-true", "bf16-mixed")
    ]


STRATEGY_CASES = _strategy_cases()
COLLECTIVE_CASES = ("bucketing", "powersgd", "topk", "int8", "int4", "streaming_outer", "replica_check", "ps_client")
NCCL_CASES = ("package_tensors",)
QUANTIZER_CASES = ("int8", "int4")
CASE_HELP = {
    "collective/bucketing": "GradientSynchronizer, overlap and flat, none/fp16/bf16, vs. the mean of the ranks' grads",
    "collective/powersgd": "PowerSGD rank 2 on a rank-1 matrix and a bias: the exact mean, identical on both ranks",
    "collective/topk": "top-k 10% with error feedback vs. each rank's top-k mean computed on the CPU",
    "collective/int8": "int8 averaging vs. the same codec on CPU tensors, and within its error bound of the mean",
    "collective/int4": "int4 averaging vs. the same codec on CPU tensors, and within its error bound of the mean",
    "collective/streaming_outer": "streaming outer sync (int4) on its worker thread, outer step, alpha mix",
    "collective/replica_check": "find_mismatches on device tensors: equal replicas pass, a changed one is named",
    "collective/ps_client": "PS client with device parameters: init, pull, 2 sync pushes, codec round trips",
    "nccl/package_tensors": "one rank, NCCL (gloo on CPU): bucketing=auto's decision and the used-mask",
    "quantizer/int8": "encode + decode GB/s of fp32 input, on the device and on the CPU",
    "quantizer/int4": "encode + decode GB/s of fp32 input, on the device and on the CPU",
}


def all_case_names() -> list[str]:
    return (
        [f"strategy/{c.name}" for c in STRATEGY_CASES]
        + [f"collective/{n}" for n in COLLECTIVE_CASES]
        + [f"nccl/{n}" for n in NCCL_CASES]
        + [f"quantizer/{n}" for n in QUANTIZER_CASES]
    )


def select_cases(patterns: list[str] | None) -> list[str]:
    """The case names matching any of ``patterns`` (shell globs, or a section name alone); all without patterns.

    Raises:
        SystemExit: a pattern that matches no case.
    """
    names = all_case_names()
    if not patterns:
        return names
    chosen: list[str] = []
    for pattern in patterns:
        glob = pattern if "/" in pattern or any(ch in pattern for ch in "*?[") else f"{pattern}/*"
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not hits:
            raise SystemExit(f"error: --cases {pattern!r} matches no case; see --list")
        chosen += [n for n in hits if n not in chosen]
    return [n for n in names if n in chosen]


def _error_text(exc: BaseException) -> str:
    """The exception's type and message, and the last frames of its traceback (enough to find the line)."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(frames[-3:]).strip()
    return tail[-3000:]


class RankFailure(RuntimeError):
    """A case that failed in the processes it ran in; the message holds their errors already."""


def _timed(section: str, name: str, fn: Callable[[], dict[str, Any]]) -> CaseResult:
    started = time.perf_counter()
    try:
        details = fn()
        return CaseResult(section, name, "ok", time.perf_counter() - started, details=details)
    except Exception as exc:  # noqa: BLE001 - recorded; the other cases still run
        error = str(exc) if isinstance(exc, RankFailure) else _error_text(exc)
        return CaseResult(section, name, "failed", time.perf_counter() - started, error=error)


# ================================================================================================= environment
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: str) -> dict[str, Any]:
    """What ran the check: the device, the library versions, the CPU."""
    import lightning
    import torch

    info: dict[str, Any] = {
        "type": device,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
            bf16_supported=bool(torch.cuda.is_bf16_supported()),
        )
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


# ================================================================================================= strategy fits
@dataclass
class Sizes:
    """The char_lm model and data of the fits: the example's defaults on a GPU, a smaller one on CPU."""

    d_model: int
    n_layer: int
    n_head: int
    block_size: int
    batch_size: int

    @classmethod
    def for_device(cls, device: str) -> Sizes:
        if device == "cuda":
            return cls(d_model=128, n_layer=2, n_head=4, block_size=64, batch_size=16)  # conf/model/char_gpt.yaml
        return cls(d_model=32, n_layer=1, n_head=2, block_size=32, batch_size=8)


def _step_timer(device: str) -> Any:
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        """Wall time of each training batch, the device synchronized at both ends."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.devices: set[str] = set()  # where the parameters were during training (teardown moves them to CPU)
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            _sync(device)
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            _sync(device)
            self.seconds.append(time.perf_counter() - self._start)
            self.devices.update(p.device.type for p in module.parameters())

    return StepTimer()


def _make_strategy(case: StrategyCase) -> Any:
    import lightning_sync

    if case.mode == "lightning":
        return "auto"  # one device: Lightning's SingleDeviceStrategy

    classes = {
        "ddp": lightning_sync.DDPSyncStrategy,
        "allreduce": lightning_sync.AllReduceStrategy,
        "periodic": lightning_sync.PeriodicSyncStrategy,
        "ps": lightning_sync.ParameterServerStrategy,
    }
    return classes[case.mode](timeout_s=60.0, **case.knobs)


def _forget_process_group() -> None:
    """Each fit starts its own process group (a fit joins an existing default group instead of making one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"):
        os.environ.pop(key, None)


def run_strategy_case(case: StrategyCase, device: str, steps: int, warmup: int, data: Any = None) -> dict[str, Any]:
    """Fits the char_lm example for ``steps`` steps with ``case``'s strategy on one ``device``.

    Checks: the fit ran every step, the strategy's root device and the parameters are on ``device``, the loss is
    finite, the parameters moved. Returns the median step time after ``warmup`` steps and what was checked.
    """
    import lightning.pytorch as pl

    from lightning_sync.examples.data import TextDataModule
    from lightning_sync.examples.models import CharGPT

    sizes = Sizes.for_device(device)
    if data is None:
        data = TextDataModule(block_size=sizes.block_size, batch_size=sizes.batch_size, val_windows=16)
    _forget_process_group()
    pl.seed_everything(0, verbose=False)
    model = CharGPT(
        vocab_size=data.vocab_size,
        block_size=sizes.block_size,
        d_model=sizes.d_model,
        n_layer=sizes.n_layer,
        n_head=sizes.n_head,
    )
    before = [p.detach().clone() for p in model.parameters()]
    timer = _step_timer(device)
    strategy = _make_strategy(case)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=1,
            strategy=strategy,
            precision=case.precision,
            max_steps=steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
            default_root_dir=root,
        )
        try:
            trainer.fit(model, datamodule=data)
        finally:
            _forget_process_group()
    problems = []
    if trainer.global_step != steps:
        problems.append(f"trainer.global_step={trainer.global_step}, expected {steps}")
    root_device = trainer.strategy.root_device.type
    if root_device != device:
        problems.append(f"the strategy's root device is {root_device}, expected {device}")
    devices = sorted(timer.devices)
    if devices != [device]:
        problems.append(f"the parameters were on {devices} during training, expected [{device!r}]")
    loss = trainer.callback_metrics.get("train/loss_step", trainer.callback_metrics.get("train/loss"))
    loss_value = float(loss) if loss is not None else math.nan
    if not math.isfinite(loss_value):
        problems.append(f"train/loss={loss_value}")
    moved = max(float((p.detach().cpu() - b.cpu()).abs().max()) for p, b in zip(model.parameters(), before))
    if not moved > 0:
        problems.append("no parameter changed")
    if problems:
        raise AssertionError("; ".join(problems))
    timed = timer.seconds[warmup:] or timer.seconds
    return {
        "mode": case.mode,
        "knobs": case.knobs,
        "precision": case.precision,
        "steps": steps,
        "median_step_ms": 1e3 * statistics.median(timed),
        "timed_steps": len(timed),
        "train_loss": loss_value,
        "max_param_change": moved,
        "model": vars(sizes),
    }


# ================================================================================================= two-rank cases
def _gather_cpu(tensor: Any) -> list[Any]:
    """Every rank's copy of ``tensor``, on the CPU, in rank order (a CPU gloo all-gather: the reference path)."""
    import torch
    import torch.distributed as dist

    mine = tensor.detach().to("cpu").contiguous()
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return out


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _on_device(tensors: Any, device: str, what: str) -> None:
    where = sorted({t.device.type for t in tensors if t is not None})
    _check(where == [device], f"{what} are on {where}, expected [{device!r}]")


def _mlp(device: str) -> Any:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)
    )
    return model.to(device)


def case_bucketing(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """GradientSynchronizer on CUDA gradients: overlap and flat launch points, none/fp16/bf16 on the wire."""
    import torch

    from lightning_sync.comm.bucketing import GradientSynchronizer
    from lightning_sync.comm.compression import resolve_codec
    from lightning_sync.comm.meter import CommMeter

    tolerance = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}  # relative to the largest gradient entry
    errors: dict[str, float] = {}
    buckets = 0
    for bucketing in ("overlap", "flat"):
        for compression in ("none", "fp16", "bf16"):
            model = _mlp(device)
            params = list(model.parameters())
            sync = GradientSynchronizer(
                params, resolve_codec(compression)(), CommMeter(), bucketing=bucketing,
                bucket_cap_mb=0.02, first_bucket_mb=0.01, gradient_as_bucket_view=True,
            )  # fmt: skip
            buckets = len(sync.buckets)
            gen = torch.Generator().manual_seed(100 + rank)
            x, y = torch.randn(16, 32, generator=gen).to(device), torch.randint(0, 10, (16,), generator=gen).to(device)
            # the local gradients first, without a round (the reference), then the same backward inside one
            loss = torch.nn.functional.cross_entropy(model(x), y)
            local = [g.detach().clone() for g in torch.autograd.grad(loss, params)]
            sync.start_round()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sync.finish()
            sync.remove_hooks()
            _on_device([p.grad for p in params], device, "the synced gradients")
            worst = 0.0
            for p, g in zip(params, local):
                expected = torch.stack(_gather_cpu(g)).mean(dim=0)
                scale = float(expected.abs().max()) or 1.0
                worst = max(worst, float((p.grad.detach().cpu() - expected).abs().max()) / scale)
            key = f"{bucketing}/{compression}"
            errors[key] = worst
            _check(worst <= tolerance[compression], f"{key}: relative error {worst:.3g} > {tolerance[compression]}")
            same = all(torch.equal(a, b) for p in params for a, b in [_gather_cpu(p.grad)])
            _check(same, f"{key}: the ranks' synced gradients differ")
    return {"buckets": buckets, "max_relative_error": errors}


def case_powersgd(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """PowerSGD on a rank-1 matrix (recovered exactly by rank 2) and a bias (sent plainly), twice (warm start)."""
    import torch

    from lightning_sync.comm.compression import FlatBucket, PowerSGDCompression
    from lightning_sync.comm.meter import CommMeter

    gen = torch.Generator().manual_seed(7)
    u, v = torch.randn(64, generator=gen), torch.randn(48, generator=gen)
    compressor, meter = PowerSGDCompression(2, start_iter=0), CommMeter()
    worst = 0.0
    for call in range(2):
        matrix = (rank + 1 + call) * torch.outer(u, v)
        bias = torch.randn(48, generator=torch.Generator().manual_seed(10 * call + rank))
        expected = [torch.stack(_gather_cpu(t)).mean(dim=0) for t in (matrix, bias)]
        buffer = torch.cat([matrix.reshape(-1), bias]).to(device)
        bucket = FlatBucket(index=0, buffer=buffer, shapes=[matrix.shape, bias.shape])
        compressor.average(bucket, meter).wait()
        compressor.advance()
        _on_device([buffer], device, "the averaged bucket")
        got = [view.detach().cpu() for view in bucket.views()]
        for name, g, e in zip(("matrix", "bias"), got, expected):
            error = float((g - e).abs().max()) / float(e.abs().max())
            worst = max(worst, error)
            # for a failure: the result's multiple of the expected mean, and what is left outside that direction
            along = float((g * e).sum() / (e * e).sum())
            off = float((g - along * e).norm() / e.norm())
            _check(
                error < 1e-4,
                f"call {call}: {name} relative error {error:.3g} (rank {rank}: result = {along:.4g} "
                f"x the mean + {off:.3g} of it elsewhere)",
            )
        copies = _gather_cpu(buffer)
        _check(torch.equal(copies[0], copies[1]), f"call {call}: the ranks' averages differ")
    return {"max_relative_error": worst, "bytes_sent": meter.total.bytes_sent}


def case_topk(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """Top-k (10%, error feedback) vs. the mean of each rank's own top-k, computed on the CPU."""
    import torch

    from lightning_sync.comm.compression import FlatBucket, TopKCompression
    from lightning_sync.comm.meter import CommMeter

    compressor, meter = TopKCompression(0.1), CommMeter()
    values = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    everyone = _gather_cpu(values)
    expected = torch.zeros(1000)
    for mine in everyone:
        keep = mine.abs().topk(100).indices
        expected[keep] += mine[keep]
    expected /= world
    buffer = values.clone().to(device)  # a copy also on the CPU: the bucket's buffer receives the mean
    bucket = FlatBucket(index=0, buffer=buffer, shapes=[buffer.shape])
    compressor.average(bucket, meter).wait()
    _on_device([buffer, compressor.residuals[0]], device, "the averaged bucket and the residual")
    error = float((buffer.cpu() - expected).abs().max())
    _check(error < 1e-6, f"top-k mean differs from the CPU reference by {error:.3g}")
    left = values.clone()
    left[values.abs().topk(100).indices] = 0.0
    residual_error = float((compressor.residuals[0].cpu() - left).abs().max())
    _check(residual_error == 0.0, f"the residual is not what was left out (max diff {residual_error:.3g})")
    return {"max_abs_error": error, "bytes_sent": meter.total.bytes_sent}


def _quantized_case(bits: int, rank: int, world: int, device: str) -> dict[str, Any]:
    import torch

    from lightning_sync.comm.compression import FlatBucket
    from lightning_sync.comm.compression.quantized import Int4Compression, Int8Compression
    from lightning_sync.comm.meter import CommMeter

    make = Int8Compression if bits == 8 else Int4Compression
    numel = 3000  # not a multiple of 2 x 256: the padding is exercised
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    exact = torch.stack(_gather_cpu(values)).mean(dim=0)
    results = {}
    for where in (device, "cpu"):
        buffer = values.clone().to(where)
        make().average(FlatBucket(index=0, buffer=buffer, shapes=[buffer.shape]), CommMeter()).wait()
        _on_device([buffer], where, f"the {where} average")
        results[where] = buffer.cpu()
    largest = float(torch.stack(_gather_cpu(values)).abs().max())
    levels = 2 ** (bits - 1) - 1
    bound = 1.1 * largest / levels  # half a step of each rank's codes, and half a step of the requantized sum
    error = float((results[device] - exact).abs().max())
    _check(error <= bound, f"int{bits}: error {error:.3g} vs. the exact mean exceeds its bound {bound:.3g}")
    cross = float((results[device] - results["cpu"]).abs().max())
    _check(cross <= 1e-6 * largest, f"int{bits}: the {device} average differs from the CPU one by {cross:.3g}")
    copies = _gather_cpu(results[device])
    _check(torch.equal(copies[0], copies[1]), f"int{bits}: the ranks' averages differ")
    return {"max_abs_error": error, "error_bound": bound, "max_diff_vs_cpu": cross}


def case_int8(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """int8 block-quantized averaging (all-to-all, then all-gather) on CUDA tensors."""
    return _quantized_case(8, rank, world, device)


def case_int4(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """int4 block-quantized averaging (all-to-all, then all-gather) on CUDA tensors."""
    return _quantized_case(4, rank, world, device)


def case_streaming_outer(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """Streaming DiLoCo's outer sync: int4 pseudo-gradients averaged on the worker thread (its own group), an
    outer SGD step (lr 1, no momentum: the global copy moves by the mean delta), then ``alpha = 0.5`` mixing."""
    import torch

    from lightning_sync.comm.averaging import ModelAverager
    from lightning_sync.comm.compression.quantized import Int4Compression
    from lightning_sync.comm.meter import CommMeter
    from lightning_sync.comm.streaming import new_stream_group

    torch.manual_seed(0)
    start = [torch.randn(40, 30), torch.randn(30)]
    params = [torch.nn.Parameter(t.clone().to(device)) for t in start]
    group = new_stream_group(None, 60.0)
    averager = ModelAverager(params, Int4Compression(), CommMeter(timeout_s=60.0), bucket_cap_mb=1.0, group=group)
    outer = torch.optim.SGD(averager.anchors, lr=1.0)
    gen = torch.Generator().manual_seed(20 + rank)
    deltas = [torch.randn(t.shape, generator=gen) * 0.1 for t in start]
    with torch.no_grad():
        for p, d in zip(params, deltas):
            p.add_(d.to(device))
    local = [p.detach().cpu().clone() for p in params]
    worker = concurrent.futures.ThreadPoolExecutor(1)
    try:
        flight = averager.launch_(-1.0, 0, worker=worker)
        applied = averager.apply_(flight, outer, alpha=0.5, timeout_s=60.0)
    finally:
        worker.shutdown()
    _check(applied, "the outer step was skipped")
    _on_device([*params, *averager.anchors], device, "the parameters and the global copy")
    mean_delta = [torch.stack(_gather_cpu(d)).mean(dim=0) for d in deltas]
    largest = max(float(torch.stack(_gather_cpu(d)).abs().max()) for d in deltas)
    bound = 1.1 * largest / 7
    worst = 0.0
    for p, s, m, mine in zip(params, start, mean_delta, local):
        global_copy = s + m
        expected = 0.5 * mine + 0.5 * global_copy
        worst = max(worst, float((p.detach().cpu() - expected).abs().max()))
    _check(worst <= 0.5 * bound + 1e-6, f"parameters after apply differ by {worst:.3g} (bound {0.5 * bound:.3g})")
    anchors = [_gather_cpu(a) for a in averager.anchors]
    _check(all(torch.equal(a[0], a[1]) for a in anchors), "the ranks' global copies differ")
    return {"max_abs_error": worst, "error_bound": 0.5 * bound}


def case_replica_check(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """The replica check on CUDA tensors: identical replicas pass, a tensor changed on rank 1 is named."""
    import torch

    from lightning_sync.comm.consistency import find_mismatches

    torch.manual_seed(0)
    named = {"a.weight": torch.randn(20, 10).to(device), "b.bias": torch.randn(10).to(device)}
    _check(find_mismatches(named) == [], "identical replicas reported as different")
    if rank == 1:
        named["b.bias"][3] += 0.5
    found = find_mismatches(named)
    _check([m.name for m in found] == ["b.bias"], f"expected b.bias to be named, got {found}")
    _check(found[0].ranks == (1,), f"expected rank 1, got {found[0].ranks}")
    return {"named": [m.name for m in found]}


def case_ps_client(rank: int, world: int, device: str, port: int) -> dict[str, Any]:
    """The parameter server's client with CUDA parameters (a colocated server on rank 0): worker 0's init copies
    them to the wire, pulls and pushes copy the servers' replies into them; two sync SGD pushes equal the averaged
    gradient steps computed on the CPU. Then the push codecs' encodings of CUDA gradients against CPU ones."""
    import torch

    import lightning_sync.ps as ps
    from lightning_sync.comm.compression import TopKCompression, resolve_codec

    torch.manual_seed(0)
    start = [torch.randn(24, 16), torch.randn(24), torch.randn(5, 24)]
    params = [torch.nn.Parameter(t.clone().to(device)) for t in start]
    optimizer = torch.optim.SGD(params, lr=0.1)
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=60)
    server = ps.start_servers("colocated", rank, HOST, port, world, 1, timeout_s=60) if rank == 0 else None
    group = ps.PSGroup(store, rank, world, 1, 60.0, connect_timeout_s=60)
    client = ps.PSClient(group, params, ps.optimizer_spec(optimizer, params), ps.PSConfig(mode="sync"))
    expected = [t.clone() for t in start]
    try:
        if rank == 0:
            client.init_servers()
        client.pull()
        for step in range(2):
            grads = {r: [torch.randn(t.shape, generator=torch.Generator().manual_seed(100 * step + r)) for t in start]
                     for r in range(world)}  # fmt: skip
            for p, g in zip(params, grads[rank]):
                p.grad = g.to(device)
            reply = client.push(ps.current_lrs(optimizer))
            _check(reply.applied, f"push {step} not applied")
            for e, *gs in zip(expected, *grads.values()):
                e.sub_(0.1 * torch.stack(gs).mean(dim=0))
        client.close()
        if server is not None:
            server.finish(30)
    finally:
        if server is not None:
            server.stop()
    _on_device(params, device, "the parameters after the replies")
    worst = max(float((p.detach().cpu() - e).abs().max()) for p, e in zip(params, expected))
    _check(worst < 1e-5, f"parameters after 2 sync pushes differ from the CPU reference by {worst:.3g}")
    codecs = {}
    layout = client.layouts[0]
    grads_cpu = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)) for t in start]
    for compression in ("none", "fp16", "bf16", "topk"):

        def codec(name: str = compression) -> Any:
            return TopKCompression(density=0.2) if name == "topk" else resolve_codec(name)()

        on_device = codec().pack(layout.flat_fp32([g.to(device) for g in grads_cpu]), 0)
        on_cpu = codec().pack(layout.flat_fp32(grads_cpu), 0)
        _on_device([on_device], "cpu", f"the {compression} wire payload")
        if compression == "topk":  # the same entries and values, in whatever order topk returned them
            decoded = [codec().unpack(x, layout.numel) for x in (on_device, on_cpu)]
            same = torch.equal(*decoded)
        else:
            same = torch.equal(on_device, on_cpu)
        codecs[compression] = same
        _check(same, f"codec {compression}: the encoding of CUDA gradients differs from the CPU one")
    return {"max_abs_error": worst, "codecs_equal_to_cpu": codecs}


CASE_FUNCTIONS: dict[str, Callable[[int, int, str, int], dict[str, Any]]] = {
    "bucketing": case_bucketing,
    "powersgd": case_powersgd,
    "topk": case_topk,
    "int8": case_int8,
    "int4": case_int4,
    "streaming_outer": case_streaming_outer,
    "replica_check": case_replica_check,
    "ps_client": case_ps_client,
}


def worker_main(name: str, rank: int, world: int, device: str, init_file: str, port: int, result: str) -> int:
    """One rank of a two-rank case: joins the gloo group, runs the case, writes ``{"status", ...}`` to ``result``."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: dict[str, Any]
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=dt.timedelta(seconds=60)
        )
        try:
            outcome = {"status": "ok", "details": CASE_FUNCTIONS[name](rank, world, device, port)}
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        outcome = {"status": "failed", "error": _error_text(exc)}
    Path(result).write_text(json.dumps(outcome, default=str))
    return 0 if outcome["status"] == "ok" else 1


def run_pair(name: str, device: str, timeout_s: float = PAIR_TIMEOUT_S) -> dict[str, Any]:
    """Runs two-rank case ``name`` in two fresh processes (CUDA cannot be used in a forked child of a process that
    has initialized it); returns rank 0's details, or raises with every rank's error."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "pg")
        results = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(2)]  # noqa: SIM115 - closed below
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    name,
                    "--rank",
                    str(r),
                    "--world-size",
                    "2",
                    "--device",
                    device,
                    "--init-file",
                    init,
                    "--port",
                    str(port),
                    "--result",
                    results[r],
                ],
                env=env,
                stdout=logs[r],
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )  # fmt: skip
            for r in range(2)
        ]
        deadline = time.monotonic() + timeout_s
        hung = []
        for r, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung.append(r)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        outcomes = []
        for r in range(2):
            if os.path.exists(results[r]):
                outcomes.append(json.loads(Path(results[r]).read_text()))
            else:
                logs[r].seek(0)
                output = logs[r].read()[-2000:]
                why = f"still running after {timeout_s:g} s" if r in hung else f"exited {procs[r].returncode}"
                outcomes.append({"status": "failed", "error": f"rank {r} {why} without a result; output:\n{output}"})
        for log in logs:
            log.close()
    errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if o["status"] != "ok"]
    if errors:
        raise RankFailure("\n".join(errors))
    return dict(outcomes[0]["details"])


# ================================================================================================= nccl (one rank)
def nccl_main(device: str, result: str) -> int:
    """One process, one rank, NCCL on CUDA (gloo on CPU): the collectives the package issues on tensors it makes
    itself, reachable at one rank (the others return early there). Each call is a sub-check of its own."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from lightning_sync.comm.bucketing import GradientSynchronizer, LaunchTuner
    from lightning_sync.comm.compression import NoCompression
    from lightning_sync.comm.meter import CommMeter

    checks: dict[str, str] = {}
    try:
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, init_method=f"tcp://{HOST}:{_free_port()}", rank=0, world_size=1, timeout=dt.timedelta(seconds=60)
        )
        meter = CommMeter(timeout_s=60.0)

        def tuner_decides() -> None:
            tuner = LaunchTuner()
            tuner.times = {False: [0.010, 0.011], True: [0.020, 0.021]}
            tuner.decide(meter, None)  # bucketing=auto: the ranks' medians are summed

        def used_mask() -> None:
            model = _mlp(device)
            sync = GradientSynchronizer(list(model.parameters()), NoCompression(), meter, find_unused_parameters=True)
            sync.start_round()
            model(torch.randn(4, 32, device=device)).sum().backward()
            sync.finish()  # find_unused_parameters: the used-mask is all-reduced
            sync.remove_hooks()

        def metered_all_reduce() -> None:
            tensor = torch.ones(1000, device=device)
            meter.all_reduce(tensor)
            _check(bool((tensor == 1).all()), "a one-rank all-reduce changed the tensor")

        for name, check in (("all_reduce_of_a_device_tensor", metered_all_reduce), ("bucketing_auto_decision", tuner_decides),
                            ("find_unused_parameters_mask", used_mask)):  # fmt: skip
            try:
                check()
                checks[name] = "ok"
            except Exception as exc:  # noqa: BLE001 - recorded per sub-check
                checks[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        dist.destroy_process_group()
        outcome: dict[str, Any] = {"status": "ok", "details": {"backend": backend, "checks": checks}}
        bad = {k: v for k, v in checks.items() if v != "ok"}
        if bad:
            outcome = {"status": "failed", "error": "; ".join(f"{k}: {v}" for k, v in bad.items()), "details": checks}
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        outcome = {"status": "failed", "error": _error_text(exc)}
    Path(result).write_text(json.dumps(outcome, default=str))
    return 0


def run_nccl(device: str, timeout_s: float = PAIR_TIMEOUT_S) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(
            [sys.executable, __file__, "--nccl-worker", "--device", device, "--result", result],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if not os.path.exists(result):
            raise RankFailure(f"the one-rank process exited {proc.returncode} without a result: {proc.stderr[-2000:]}")
        outcome = json.loads(Path(result).read_text())
    if outcome["status"] != "ok":
        raise RankFailure(outcome["error"])
    return dict(outcome["details"])


# ================================================================================================= quantizer
def quantizer_throughput(bits: int, device: str, numel: int, repeats: int) -> dict[str, Any]:
    """Encode and decode GB/s (fp32 input bytes per second) of the int8/int4 codec on ``device`` and on the CPU.

    The codec's own :meth:`~lightning_sync.comm.compression.quantized.BlockQuantizedCompression.encode` and ``decode``; the
    median of ``repeats`` timed calls after one warm-up, the device synchronized around each.
    """
    import torch

    from lightning_sync.comm.compression.quantized import Int4Compression, Int8Compression

    codec = Int8Compression() if bits == 8 else Int4Compression()
    rows = []
    for where in dict.fromkeys([device, "cpu"]):
        values = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(where)
        encoded = codec.encode(values)
        decoded = codec.decode(encoded, numel)
        error = float((decoded - values).abs().max())
        bound = 0.5 * float(values.abs().max()) / codec.levels * 1.0001
        _check(error <= bound, f"int{bits} on {where}: round trip error {error:.3g} > half a step {bound:.3g}")
        for op, fn in (
            ("encode", functools.partial(codec.encode, values)),
            ("decode", functools.partial(codec.decode, encoded, numel)),
        ):
            fn()
            times = []
            for _ in range(repeats):
                _sync(where)
                started = time.perf_counter()
                fn()
                _sync(where)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            rows.append(
                {"codec": f"int{bits}", "op": op, "device": where, "mb": 4 * numel / 1e6, "ms": 1e3 * seconds,
                 "gb_per_s": 4 * numel / seconds / 1e9}
            )  # fmt: skip
    ratio = {}
    if device == "cuda":
        for op in ("encode", "decode"):
            gpu, cpu = (
                next(r["gb_per_s"] for r in rows if r["op"] == op and r["device"] == d) for d in ("cuda", "cpu")
            )
            ratio[op] = gpu / cpu
    return {"rows": rows, "gpu_over_cpu": ratio, "encoded_bytes_per_entry": encoded.numel() / numel}


# ================================================================================================= the run
@dataclass
class Options:
    device: str
    out: Path
    cases: list[str]
    steps: int
    warmup: int
    quant_numel: int
    quant_repeats: int
    budget_s: float
    commit: str | None = None  # the tree's commit, as given; else what git says in the checkout
    argv: list[str] = field(default_factory=list)  # as given on the command line, for the report


def run_check(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the chosen cases and returns the report (also written as ``report.json`` and ``report.md``)."""
    import torch

    torch.manual_seed(0)
    started = time.perf_counter()
    results: list[CaseResult] = []
    data = None
    by_name = {c.name: c for c in STRATEGY_CASES}
    for case_name in opts.cases:
        section, name = case_name.split("/", 1)
        if time.perf_counter() - started > opts.budget_s:
            results.append(CaseResult(section, name, "skipped", 0.0, error=f"time budget of {opts.budget_s:g} s spent"))
            log(f"skipped  {case_name} (time budget spent)")
            continue
        if section == "strategy":
            if data is None:
                from lightning_sync.examples.data import TextDataModule

                sizes = Sizes.for_device(opts.device)
                data = TextDataModule(block_size=sizes.block_size, batch_size=sizes.batch_size, val_windows=16)
            fn = functools.partial(run_strategy_case, by_name[name], opts.device, opts.steps, opts.warmup, data)
        elif section == "collective":
            fn = functools.partial(run_pair, name, opts.device)
        elif section == "nccl":
            fn = functools.partial(run_nccl, opts.device)
        else:
            bits = int(name.removeprefix("int"))
            fn = functools.partial(quantizer_throughput, bits, opts.device, opts.quant_numel, opts.quant_repeats)
        result = _timed(section, name, fn)
        results.append(result)
        note = "" if result.status == "ok" else f": {_headline(result.error)[:200]}"
        log(f"{result.status:8} {case_name} ({result.seconds:.1f} s){note}")
    report = build_report(opts, results, time.perf_counter() - started)
    write_report(report, opts.out)
    return report


def build_report(opts: Options, results: list[CaseResult], wall_s: float) -> dict[str, Any]:
    """The JSON report: environment, every case, the step-time table and the quantizer table."""
    step_times: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.section == "strategy" and r.status == "ok":
            base = r.name.rsplit("_", 1)[0]
            row = step_times.setdefault(base, {"case": base, "mode": r.details["mode"], "knobs": r.details["knobs"]})
            row[r.details["precision"]] = round(r.details["median_step_ms"], 3)
    quantizer = [row for r in results if r.section == "quantizer" and r.status == "ok" for row in r.details["rows"]]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "failed", "skipped")}
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": opts.commit or _commit(),
        "command": " ".join(["python benchmarks/gpu_check.py", *opts.argv]),
        "device": environment(opts.device),
        "settings": {
            "steps": opts.steps,
            "warmup_steps": opts.warmup,
            "quantizer_entries": opts.quant_numel,
            "quantizer_repeats": opts.quant_repeats,
            "budget_s": opts.budget_s,
            "model": vars(Sizes.for_device(opts.device)),
        },  # fmt: skip
        "wall_s": round(wall_s, 1),
        "counts": counts,
        "cases": [
            {
                "case": r.case,
                "section": r.section,
                "name": r.name,
                "status": r.status,
                "seconds": round(r.seconds, 2),
                "error": r.error,
                "details": r.details,
                "what": _what(r),
            }
            for r in results
        ],  # fmt: skip
        "step_times": list(step_times.values()),
        "quantizer": quantizer,
        "notes": [GLOO_NOTE],
    }


def _what(result: CaseResult) -> str:
    if result.section == "strategy":
        case = next(c for c in STRATEGY_CASES if c.name == result.name)
        return f"{case.what}, {case.precision}"
    return CASE_HELP.get(result.case, "")


# ================================================================================================= markdown
def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any], heading: str = "#") -> str:
    """The report as markdown: what ran where, every case, the step-time and quantizer tables, the notes."""
    dev = report["device"]
    where = dev.get("name") or dev["type"]
    if dev["type"] == "cuda":
        where += f" (CUDA {dev.get('cuda')}, NCCL {dev.get('nccl')}, {dev.get('memory_gib')} GiB)"
    counts = report["counts"]
    lines = [
        f"{heading} GPU check: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped",
        "",
        f"- Device: {where}; torch {dev['torch']}, Lightning {dev['lightning']}, Python {dev['python']}, "
        f"{dev['cpu_count']} CPU cores",
        f"- Run: {report['created']}, commit {report.get('commit') or 'unknown'}, {report['wall_s']} s in all"
        + (f" ({report['commit_note']})" if report.get("commit_note") else ""),
        f"- Command: `{report['command']}`",
        f"- Fits: {report['settings']['steps']} steps each, step time = median after the first "
        f"{report['settings']['warmup_steps']}; CharGPT with "
        + ", ".join(f"{k}={v}" for k, v in report["settings"]["model"].items()),
        "",
        f"{heading}# Cases",
        "",
        "| case | status | s | what | result |",
        "| --- | --- | ---: | --- | --- |",
    ]
    for c in report["cases"]:
        result = _case_summary(c)
        lines.append(f"| `{c['case']}` | {c['status']} | {c['seconds']:.1f} | {_cell(c['what'])} | {_cell(result)} |")
    if report["step_times"]:
        lines += [
            "",
            f"{heading}# Step time at one rank (ms, median)",
            "",
            "| mode | knobs | fp32 | bf16-mixed |",
            "| --- | --- | ---: | ---: |",
        ]
        for row in report["step_times"]:
            knobs = ", ".join(f"{k}={v}" for k, v in row["knobs"].items())
            fp32, bf16 = row.get("32-true"), row.get("bf16-mixed")
            lines.append(
                f"| {row['case']} | {_cell(knobs)} | {'' if fp32 is None else f'{fp32:.2f}'} | "
                f"{'' if bf16 is None else f'{bf16:.2f}'} |"
            )
    if report["quantizer"]:
        lines += [
            "",
            f"{heading}# int8/int4 codec throughput (GB/s of fp32 input)",
            "",
            "| codec | op | device | MB | ms | GB/s |",
            "| --- | --- | --- | ---: | ---: | ---: |",
        ]
        for row in report["quantizer"]:
            lines.append(
                f"| {row['codec']} | {row['op']} | {row['device']} | {row['mb']:.0f} | {row['ms']:.2f} | "
                f"{row['gb_per_s']:.2f} |"
            )
    lines += ["", f"{heading}# Notes", ""] + [f"- {note}" for note in report["notes"]]
    failed = [c for c in report["cases"] if c["status"] == "failed"]
    if failed:
        lines += ["", f"{heading}# Errors", ""]
        for c in failed:
            lines += [f"`{c['case']}`:", "", "```text", (c["error"] or "").strip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _headline(error: str | None) -> str:
    """The line that says why a case failed: the last line of its error or, for a two-rank case (``rank 0: ...``
    then ``rank 1: ...``), of the first rank's, since the other rank typically only saw its peer go."""
    lines = (error or "").strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("rank ")]
    if len(starts) > 1:
        lines = lines[: starts[1]]
    return lines[-1] if lines else ""


def _case_summary(case: dict[str, Any]) -> str:
    if case["status"] != "ok":
        return _headline(case["error"])[:160]
    d = case["details"]
    if case["section"] == "strategy":
        return f"{d['median_step_ms']:.2f} ms/step, loss {d['train_loss']:.4f}"
    if case["section"] == "quantizer":
        ratio = d.get("gpu_over_cpu") or {}
        return ", ".join(f"{op} GPU/CPU {x:.1f}x" for op, x in ratio.items()) or "CPU only"
    if case["section"] == "nccl":
        return f"{d['backend']}: " + ", ".join(f"{k} {v}" for k, v in d["checks"].items())
    if "max_relative_error" in d and isinstance(d["max_relative_error"], dict):
        return "max rel. error " + f"{max(d['max_relative_error'].values()):.2g}"
    for key, label in (("max_relative_error", "max rel. error"), ("max_abs_error", "max abs. error")):
        if key in d:
            return f"{label} {d[key]:.2g}"
    return "ok"


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(report))


# ================================================================================================= command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda (cpu with --allow-cpu and no GPU)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no CUDA device")
    parser.add_argument("--out", type=Path, help=f"report folder (default: {DEFAULT_OUT.relative_to(REPO)} on CUDA, "
                        f"{CPU_OUT.relative_to(REPO)} on CPU)")  # fmt: skip
    parser.add_argument("--cases", nargs="+", metavar="PATTERN", help="case names or globs (default: all)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--steps", type=int, help="steps per fit (default: 24 on CUDA, 6 on CPU)")
    parser.add_argument("--warmup", type=int, help="steps left out of the step time (default: 6 on CUDA, 2 on CPU)")
    parser.add_argument("--quant-entries", type=int, help="entries of the codec benchmark (default: 2**24 / 2**20)")
    parser.add_argument("--quant-repeats", type=int, help="timed repeats per codec op (default: 10 on CUDA, 3 on CPU)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="cases left after it: skipped")
    parser.add_argument(
        "--commit", help="the commit of the tree that runs, for the report, where a copied tree's git metadata is stale"
    )
    # internal: one rank of a two-rank case, or the one-rank NCCL process
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace, cuda_available: bool, argv: list[str] | None = None) -> Options:
    """The run's options; the device is checked here.

    Raises:
        SystemExit: CUDA asked for (the default) and absent, without ``--allow-cpu``.
    """
    device = args.device or ("cuda" if cuda_available or not args.allow_cpu else "cpu")
    if device == "cuda" and not cuda_available:
        raise SystemExit(
            "error: no CUDA device here (torch.cuda.is_available() is False). This check is for a GPU machine; "
            "to try it on this CPU, run it with --allow-cpu or --device cpu (its report then goes to "
            f"{CPU_OUT.relative_to(REPO)}/, never to {DEFAULT_OUT.relative_to(REPO)}/)"
        )
    cuda = device == "cuda"
    out = args.out or (DEFAULT_OUT if cuda else CPU_OUT)
    if not cuda and out.resolve() == DEFAULT_OUT.resolve():
        raise SystemExit(f"error: --out {out} holds the GPU report; a CPU run writes elsewhere")
    return Options(
        device=device,
        out=out,
        cases=select_cases(args.cases),
        steps=args.steps or (24 if cuda else 6),
        warmup=args.warmup if args.warmup is not None else (6 if cuda else 2),
        quant_numel=args.quant_entries or (2**24 if cuda else 2**20),
        quant_repeats=args.quant_repeats or (10 if cuda else 3),
        budget_s=args.budget_s,
        commit=args.commit,
        argv=list(sys.argv[1:] if argv is None else argv),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.rank, args.world_size, args.device, args.init_file, args.port, args.result)
    if args.nccl_worker:
        return nccl_main(args.device, args.result)
    if args.list:
        for name in all_case_names():
            print(name)
        return 0
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401 - sets its loggers' levels on import; quieted below
    import torch

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_sync"):
        logging.getLogger(name).setLevel(logging.WARNING)
    opts = options_from(args, torch.cuda.is_available(), argv)
    print(f"gpu_check: {len(opts.cases)} cases on {opts.device}, report to {opts.out}", flush=True)
    report = run_check(opts, log=lambda line: print(line, flush=True))
    counts = report["counts"]
    print(f"gpu_check: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in "
          f"{report['wall_s']} s; {opts.out / 'report.md'}")  # fmt: skip
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
