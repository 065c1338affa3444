"""One rank of one benchmark run, started by torchrun: ``python -m lightning_sync.apps.bench.worker <spec.json>``.

The spec names the case, the workload and the benchmark config (:mod:`lightning_sync.apps.bench.launch` writes it).
Rank 0 writes the run's measurements to ``spec["result"]``. Three kinds of run:

* a Lightning case (ours, Lightning's DDP, the no-communication floor): a Trainer on the ranks torchrun made;
* a plain torch loop (``torch_ddp``, ``torch_local_sgd``): the same module, data order, optimizer and loss, no
  Lightning;
* the payload workload: one gradient payload all-reduced by our synchronizer or by ``dist.all_reduce``.

Step time is rank 0's median over the steps after ``warmup_steps`` (forward, backward, sync, optimizer step; data
loading excluded). Time to accuracy (digits) and time to loss (char_lm) are rank 0's training wall time from the
first step until rank 0's replica first scores the target (test accuracy, validation loss); the score is taken every
``eval_every`` optimizer steps (for a periodic case, at its syncs) with the clock stopped, and rank 0 broadcasts it,
so all ranks stop together (in ps async every rank scores its own replica and stops on its own).

Between emulated hosts (``spec["wire"]``) every rank also reads its interface's byte counters over the training
phase and writes them, with its meter's totals, to ``<result>.rank<r>``; the launcher adds them up.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import datetime
import json
import math
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

from lightning_sync.apps.bench.clock import TargetClock, accuracy_of, loss_of
from lightning_sync.apps.bench.config import BenchConfig, NetworkConfig
from lightning_sync.apps.bench.workloads import BOUNDS, OUR_CASES, WORKLOADS, Workload
from lightning_sync.apps.netns import InterfaceCounters

TORCH_LOOPS = ("torch_ddp", "torch_local_sgd")
_TIMED = ("time_to_accuracy", "time_to_loss")


def _make_module_and_data(workload: Workload, cfg: BenchConfig, world: int, batch_size: int) -> tuple[Any, Any]:
    """The workload's module (initial weights from ``cfg.seed``) and its data module."""
    from lightning_sync.examples.data import DigitsDataModule, SyntheticDataModule
    from lightning_sync.examples.models import DigitsClassifier, SyntheticMLP, build_char_lm

    if workload.metric == "time_to_loss":
        return build_char_lm(cfg.seed, data={**workload.data, "batch_size": batch_size}, **workload.model)
    torch.manual_seed(cfg.seed)
    if workload.metric == "time_to_accuracy":
        return DigitsClassifier(**workload.model), DigitsDataModule(batch_size=batch_size, seed=cfg.seed)
    return SyntheticMLP(**workload.model), SyntheticDataModule(
        in_features=workload.model["width"],
        batch_size=batch_size,
        num_samples=batch_size * world * cfg.steps,
        seed=cfg.seed,
    )


def _loss(workload: Workload, module: nn.Module, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss of ``net`` (``module``, possibly wrapped in DDP) on one batch."""
    if workload.metric == "time_to_loss":
        logits = net(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    if workload.metric == "time_to_accuracy":
        return F.cross_entropy(net(x), y)
    return F.mse_loss(net(x), y)


def _scorer(workload: Workload) -> Callable[[Any], Callable[[nn.Module], float]]:
    """``datamodule -> score``: test accuracy (digits) or validation loss over the fixed windows (char_lm)."""
    if workload.metric == "time_to_loss":
        return lambda data: loss_of(list(data.val_dataloader()))
    return lambda data: accuracy_of(*data.splits["test"].tensors)


def _clock_for(
    case: str, workload: Workload, cfg: BenchConfig, spec: dict[str, Any]
) -> tuple[float | None, int, bool, float | None, int | None]:
    """``(target, every, lower_is_better, give_up_s, max_steps)`` of a timed run; ``max_steps`` ``None``: epochs."""
    if workload.metric == "time_to_accuracy":
        return cfg.target_accuracy, cfg.eval_every, False, None, None
    every = cfg.scoring_every(case)
    if cfg.window:  # step times over whole sync periods, no target
        return None, every, True, None, cfg.window_span(case)[1]
    target = spec.get("target")
    if case in BOUNDS or case == "lightning_ddp" or target is None:
        return None, every, True, None, cfg.budget_steps
    return target, every, True, spec.get("give_up_s"), math.ceil(cfg.budget_steps * cfg.max_steps_factor)


def _strategy(case: str, cfg: BenchConfig) -> Any:
    from hydra.utils import get_class
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from lightning_sync.apps.bench.lightning_parts import NoSyncStrategy
    from lightning_sync.apps.conf_store import MODES

    if case in ("lightning_ddp", "lightning_ddp_view"):
        return DDPStrategy(
            gradient_as_bucket_view=case == "lightning_ddp_view", timeout=datetime.timedelta(seconds=cfg.timeout_s)
        )
    if case == "single":
        return SingleDeviceStrategy("cpu")
    if case == "floor":  # compute and Lightning's loop only
        return NoSyncStrategy(skip_nonfinite=False, timeout_s=cfg.timeout_s)
    ours = OUR_CASES[case]
    return get_class(MODES[ours.group][0])(**ours.arguments(cfg), timeout_s=cfg.timeout_s)


def _cross_host(case: str, node: int, sent: float, recv: float) -> float:
    """The meter's bytes of this rank that cross the link: what it sent, as every collective's bytes reach a peer
    on the other host; for ps, whose server runs on node 0, node 0's worker talks to it over loopback, and another
    node's worker sends its pushes and receives the server's replies over the link."""
    if case in OUR_CASES and OUR_CASES[case].group == "ps":
        return 0.0 if node == 0 else sent + recv
    return sent


def _lightning_run(case: str, workload: Workload, cfg: BenchConfig, spec: dict[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_sync.apps._console import quiet_lightning
    from lightning_sync.apps.bench.lightning_parts import TimeToTarget, WireBytes
    from lightning_sync.callbacks import SyncReport

    quiet_lightning()
    pl.seed_everything(cfg.seed, verbose=False)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ["WORLD_SIZE"])
    report = SyncReport(warmup_steps=cfg.warmup_steps)
    callbacks: list[Any] = [report]
    timed = workload.metric in _TIMED
    max_steps: int | None = cfg.steps
    if timed:
        target, every, lower, give_up_s, max_steps = _clock_for(case, workload, cfg, spec)
        callbacks.append(TimeToTarget(_scorer(workload), target, every, lower, give_up_s))
    counters = _counters(spec)
    if counters is not None:
        callbacks.append(WireBytes(counters))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=_strategy(case, cfg),
        max_steps=-1 if max_steps is None else max_steps,
        max_epochs=cfg.max_epochs if max_steps is None else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    batch_size = workload.batch_size * (2 if case == "single" else 1)  # single: the 2 ranks' global batch
    model, data = _make_module_and_data(workload, cfg, world, batch_size)
    trainer.fit(model, datamodule=data)
    result = {k: report.summary.get(k) for k in ("step_time_ms", "bytes_sent_per_step", "launch_point")}
    if timed:
        result.update(callbacks[1].clock.result())
    if counters is not None:
        steps = report.summary.get("optimizer_steps") or 0
        sent = (report.summary.get("bytes_sent_per_step") or 0.0) * steps
        recv = (report.summary.get("bytes_recv_per_step") or 0.0) * steps
        if case.startswith("lightning_ddp"):  # no meter: the ring formula's payload of the gradients, every step
            sent = recv = _ring_payload(model) * steps
        _write_rank_wire(spec, counters, steps, sent, recv, _cross_host(case, trainer.node_rank, sent, recv))
    return result


def _ring_payload(module: nn.Module) -> float:
    """Bytes one rank sends in a ring all-reduce of ``module``'s parameters (or gradients), as the meter books it."""
    from lightning_sync.comm.meter import ring_all_reduce_bytes

    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return ring_all_reduce_bytes(nbytes, dist.get_world_size())


def _counters(spec: dict[str, Any]) -> InterfaceCounters | None:
    """This rank's interface counters when the run is between emulated hosts (else ``None``)."""
    if not spec.get("wire"):
        return None
    return InterfaceCounters(os.environ["GLOO_SOCKET_IFNAME"])


def _write_rank_wire(
    spec: dict[str, Any], counters: InterfaceCounters, steps: int, sent: float, recv: float, cross: float
) -> None:
    """Writes this rank's wire counters and meter totals over the training phase to ``<result>.rank<r>``."""
    part = {
        "tx_bytes": counters.tx_bytes,
        "rx_bytes": counters.rx_bytes,
        "steps": steps,
        "meter_sent": sent,
        "meter_recv": recv,
        "meter_cross_host": cross,
    }
    Path(f"{spec['result']}.rank{os.environ.get('RANK', '0')}").write_text(json.dumps(part))


def _torch_loop(case: str, workload: Workload, cfg: BenchConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """The anchors without Lightning: DDP, or torch's post-local SGD (PeriodicModelAverager, no warmup)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.utils.data import DataLoader, DistributedSampler

    rank, world = dist.get_rank(), dist.get_world_size()
    module, data = _make_module_and_data(workload, cfg, world, workload.batch_size)
    data.setup("fit")
    train = data.splits["train"]
    sampler: DistributedSampler[Any] = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    loader = DataLoader(train, batch_size=workload.batch_size, sampler=sampler, drop_last=True)
    optimizer = module.configure_optimizers()
    net: nn.Module = module
    if case == "torch_ddp":
        net = nn.parallel.DistributedDataParallel(module)
    else:
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
        averager = PeriodicModelAverager(period=cfg.sync_every, warmup_steps=0)
        # torch's averager averages when its count (from 0) is a multiple of the period, i.e. after steps 1, 9,
        # 17, ...; counting from 1 it averages after steps 8, 16, ..., as ours does, so the replica scored at a
        # multiple of the period is the averaged one
        averager.step = 1
        optimizer = PostLocalSGDOptimizer(optimizer, averager)
    timed = workload.metric in _TIMED
    max_steps: int | None = cfg.steps
    clock = None
    if timed:
        target, every, lower, give_up_s, max_steps = _clock_for(case, workload, cfg, spec)
        clock = TargetClock(_scorer(workload)(data), target, every, _broadcast_float, lower, give_up_s)
    if max_steps is None:
        max_steps = cfg.max_epochs * len(loader)
    counters = _counters(spec)
    if counters is not None:
        counters.start()
    if clock is not None:
        clock.start()
    seconds: list[float] = []
    epoch = 0
    while len(seconds) < max_steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            started = time.perf_counter()
            optimizer.zero_grad()
            _loss(workload, module, net, x, y).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - started)
            if len(seconds) >= max_steps or (clock is not None and clock.check(module, len(seconds))):
                max_steps = len(seconds)
                break
    if counters is not None:
        counters.stop()
        # no meter here: the ring formula's payload per step (DDP: every step; local SGD: the parameters at syncs)
        syncs = len(seconds) if case == "torch_ddp" else len(seconds) // cfg.sync_every
        payload = _ring_payload(module) * syncs
        _write_rank_wire(spec, counters, len(seconds), payload, payload, payload)
    timed_steps = seconds[min(cfg.warmup_steps, len(seconds) - 1) :]
    result: dict[str, Any] = {"step_time_ms": 1e3 * statistics.median(timed_steps)}
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
    torch.set_flush_denormal(cfg.flush_denormal)  # threads started from here on inherit it
    if case in TORCH_LOOPS or workload.metric == "bus_bandwidth":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        try:
            if workload.metric == "bus_bandwidth":
                return _payload(case, cfg)
            return _torch_loop(case, workload, cfg, spec)
        finally:
            dist.destroy_process_group()
    return _lightning_run(case, workload, cfg, spec)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    result = run_spec(spec)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["result"]).write_text(json.dumps(result))
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """Ends a finished run with exit code 0, skipping the interpreter's finalization.

    Handles a run that aborts *after* writing its result: ``terminate called without an active exception``
    (SIGABRT) while the interpreter is torn down, with no Python frame left, in the plain torch loops as well as
    under Lightning (gloo's worker threads outliving the interpreter, pytorch/pytorch#190489). The run's work is
    done and flushed at this point, so nothing is lost by leaving at once; the process group goes first.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
