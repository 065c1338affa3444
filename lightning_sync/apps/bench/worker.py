"""One rank of one benchmark run, started by torchrun: ``python -m lightning_sync.apps.bench.worker <spec.json>``.

The spec names the case, the workload and the benchmark config (:mod:`lightning_sync.apps.bench.launch` writes it).
Rank 0 writes the run's measurements to ``spec["result"]``. Three kinds of run:

* a Lightning case (ours, Lightning's DDP, the no-communication floor): a Trainer on the ranks torchrun made;
* a plain torch loop (``torch_ddp``, ``torch_local_sgd``): the same module, data order, optimizer and loss, no
  Lightning;
* the payload workload: one gradient payload all-reduced by our synchronizer or by ``dist.all_reduce``.

Step time is rank 0's median over the steps after ``warmup_steps`` (forward, backward, sync, optimizer step; data
loading excluded). Time to accuracy is rank 0's training wall time from the first step until rank 0's replica first
scores ``target_accuracy`` on the test split; the test runs every ``eval_every`` optimizer steps with the clock
stopped, and rank 0 broadcasts the decision, so all ranks stop together.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import datetime
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_sync.apps.bench.clock import AccuracyClock
from lightning_sync.apps.bench.config import WORKLOADS, BenchConfig, NetworkConfig, Workload

TORCH_LOOPS = ("torch_ddp", "torch_local_sgd")


def _make_module(workload: Workload) -> Any:
    from lightning_sync.examples.models import DigitsClassifier, SyntheticMLP

    return (
        DigitsClassifier(**workload.model) if workload.metric == "time_to_accuracy" else SyntheticMLP(**workload.model)
    )


def _make_data(workload: Workload, cfg: BenchConfig, world: int, batch_size: int) -> Any:
    from lightning_sync.examples.data import DigitsDataModule, SyntheticDataModule

    if workload.metric == "time_to_accuracy":
        return DigitsDataModule(batch_size=batch_size, seed=cfg.seed)
    return SyntheticDataModule(
        in_features=workload.model["width"],
        batch_size=batch_size,
        num_samples=batch_size * world * cfg.steps,
        seed=cfg.seed,
    )


def _loss(workload: Workload, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if workload.metric == "time_to_accuracy":
        return F.cross_entropy(output, target)
    return F.mse_loss(output, target)


def _strategy(case: str, cfg: BenchConfig) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    import lightning_sync
    from lightning_sync.apps.bench.lightning_parts import NoSyncStrategy

    timeout = {"timeout_s": cfg.timeout_s}
    if case in ("lightning_ddp", "lightning_ddp_view"):
        return DDPStrategy(
            gradient_as_bucket_view=case == "lightning_ddp_view", timeout=datetime.timedelta(seconds=cfg.timeout_s)
        )
    made: dict[str, Callable[[], Any]] = {
        "single": lambda: SingleDeviceStrategy("cpu"),
        "sync_ddp": lambda: lightning_sync.DDPSyncStrategy(**timeout),
        "allreduce": lambda: lightning_sync.AllReduceStrategy(**timeout),
        "allreduce_flat": lambda: lightning_sync.AllReduceStrategy(bucketing="flat", **timeout),
        "allreduce_overlap": lambda: lightning_sync.AllReduceStrategy(bucketing="overlap", **timeout),
        "periodic": lambda: lightning_sync.PeriodicSyncStrategy(mode="local_sgd", sync_every=cfg.sync_every, **timeout),
        "powersgd": lambda: lightning_sync.AllReduceStrategy(compression="powersgd", powersgd_rank=4, **timeout),
        "topk": lambda: lightning_sync.AllReduceStrategy(compression="topk", topk_density=0.01, **timeout),
        "floor": lambda: NoSyncStrategy(skip_nonfinite=False, **timeout),  # compute and Lightning's loop only
    }
    return made[case]()


def _lightning_run(case: str, workload: Workload, cfg: BenchConfig) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_sync.apps._console import quiet_lightning
    from lightning_sync.apps.bench.lightning_parts import TimeToAccuracy
    from lightning_sync.callbacks import SyncReport

    quiet_lightning()
    pl.seed_everything(cfg.seed, verbose=False)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ["WORLD_SIZE"])
    report = SyncReport(warmup_steps=cfg.warmup_steps)
    callbacks: list[Any] = [report]
    accuracy = workload.metric == "time_to_accuracy"
    if accuracy:
        callbacks.append(TimeToAccuracy(cfg.target_accuracy, cfg.eval_every))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=_strategy(case, cfg),
        max_steps=-1 if accuracy else cfg.steps,
        max_epochs=cfg.max_epochs if accuracy else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    model = _make_module(workload)
    batch_size = workload.batch_size * (2 if case == "single" else 1)  # single: the 2 ranks' global batch
    trainer.fit(model, datamodule=_make_data(workload, cfg, world, batch_size))
    result = {k: report.summary.get(k) for k in ("step_time_ms", "bytes_sent_per_step", "launch_point")}
    if accuracy:
        result.update(callbacks[-1].clock.result())
    return result


def _torch_loop(case: str, workload: Workload, cfg: BenchConfig) -> dict[str, Any]:
    """The anchors without Lightning: DDP, or torch's post-local SGD (PeriodicModelAverager, no warmup)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.utils.data import DataLoader, DistributedSampler

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    module = _make_module(workload)
    data = _make_data(workload, cfg, world, workload.batch_size)
    data.setup("fit")
    train = data.splits["train"]
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train, batch_size=workload.batch_size, sampler=sampler, drop_last=True)
    optimizer = module.configure_optimizers()
    net: nn.Module = module
    if case == "torch_ddp":
        net = nn.parallel.DistributedDataParallel(module)
    else:
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
        optimizer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=cfg.sync_every, warmup_steps=0))
    accuracy = workload.metric == "time_to_accuracy"
    max_steps = cfg.max_epochs * len(loader) if accuracy else cfg.steps
    clock = None
    if accuracy:
        clock = AccuracyClock(*data.splits["test"].tensors, cfg.target_accuracy, cfg.eval_every, _broadcast_float)
        clock.start()
    seconds: list[float] = []
    epoch = 0
    while len(seconds) < max_steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            started = time.perf_counter()
            optimizer.zero_grad()
            _loss(workload, net(x), y).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - started)
            if len(seconds) >= max_steps or (clock is not None and clock.check(module, len(seconds))):
                max_steps = len(seconds)
                break
    timed = seconds[min(cfg.warmup_steps, len(seconds) - 1) :]
    result: dict[str, Any] = {"step_time_ms": 1e3 * statistics.median(timed)}
    if clock is not None:
        result.update(clock.result())
    return result


def _broadcast_float(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return float(tensor.item())


def _payload(case: str, cfg: BenchConfig) -> dict[str, Any]:
    """Times all-reduces of one float32 payload; each time is the slowest rank's, after a barrier."""
    from lightning_sync.comm.bucketing import GradientSynchronizer
    from lightning_sync.comm.compression import NoCompression
    from lightning_sync.comm.meter import CommMeter
    from lightning_sync.comm.tuning import MIB
    from lightning_sync.config import AllReduceConfig

    numel = int(cfg.payload_mb * MIB) // 4
    grad = torch.ones(numel)
    if case == "gloo_allreduce":

        def run() -> None:
            dist.all_reduce(grad)
    else:
        param = nn.Parameter(torch.zeros(numel))
        sync = GradientSynchronizer(
            [param], NoCompression(), CommMeter(), **AllReduceConfig().arguments_for(GradientSynchronizer)
        )

        def run() -> None:
            param.grad = grad
            sync.start_round()
            sync.finish()

    seconds = []
    for _ in range(cfg.payload_iters + 1):
        dist.barrier()
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    slowest = torch.tensor(seconds[1:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    median = float(slowest.median())
    n = dist.get_world_size()
    nbytes = numel * 4
    return {
        "payload_bytes": nbytes,
        "allreduce_s": median,
        "seconds": slowest.tolist(),
        "algbw_mbit": nbytes * 8 / median / 1e6,
        "busbw_mbit": nbytes * 2 * (n - 1) / n * 8 / median / 1e6,
    }


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs one case of one workload on this rank; returns rank 0's measurements (every rank returns its own)."""
    fields = dict(spec["config"])
    cfg = BenchConfig(**{**fields, "network": NetworkConfig(**fields["network"])})
    case, workload = spec["case"], WORKLOADS[spec["workload"]]
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if case in TORCH_LOOPS or workload.metric == "bus_bandwidth":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        try:
            return _payload(case, cfg) if workload.metric == "bus_bandwidth" else _torch_loop(case, workload, cfg)
        finally:
            dist.destroy_process_group()
    return _lightning_run(case, workload, cfg)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    result = run_spec(spec)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["result"]).write_text(json.dumps(result))
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """Ends a finished run with exit code 0, skipping the interpreter's finalization.

    Runs here sometimes aborted *after* writing their result (3 of 8 invocations of the loopback test run):
    ``terminate called without an active exception`` (SIGABRT) while the interpreter was being torn down, with no
    Python frame left, in the plain torch loops as well as under Lightning (gloo's worker threads outliving the
    interpreter, pytorch/pytorch#190489). The run's work is done and flushed at this point, so nothing is lost by
    leaving at once; the process group goes first.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
