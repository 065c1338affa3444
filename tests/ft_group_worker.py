"""One replica group of one rank, in plain torch, for tests/test_ft.py: DiLoCo across groups through torchft.

Run as ``python ft_group_worker.py LIGHTHOUSE GROUP GROUPS MIN_REPLICAS STEPS SYNC_EVERY OUT [STEP_SLEEP_S]``. The
model and each group's data are the same as :func:`ordinary_rank` uses on an ordinary rank of the same index, so the
two runs can be compared. Prints ``step N`` after every optimizer step and ``done`` at the end, with the saved
parameters in ``OUT``.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 16
OUTER = dict(outer=True, outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, WIDTH))


def batch(group: int, step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1000 * group + step))


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def state_of(model: nn.Module, inner: torch.optim.Optimizer) -> torch.Tensor:
    """The parameters and the inner optimizer's momentum, flat."""
    momenta = [inner.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters() if p in inner.state]
    return torch.cat([flat(model), *momenta])


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    (model(x) - x.flip(1)).pow(2).mean().backward()
    optimizer.step()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def streaming(spec: str) -> object:
    """``"k,tau,alpha[,outer_compression]"`` as :class:`StreamingOptions` (``""``: plain DiLoCo)."""
    from lightning_sync.comm.periodic import StreamingOptions

    if not spec:
        return StreamingOptions()
    k, tau, alpha, *codec = spec.split(",")
    return StreamingOptions(
        fragments=int(k),
        sync_delay=int(tau),
        fragment_alpha=float(alpha),
        outer_compression=codec[0] if codec else "none",
    )


def ordinary_rank(rank: int, world: int, steps: int, sync_every: int, out: str, spec: str = "") -> None:
    """The same training on an ordinary rank of a ``world``-rank gloo group (no fault tolerance)."""
    from lightning_sync.comm.meter import CommMeter
    from lightning_sync.comm.periodic import PeriodicAverager

    model = make_model()
    inner = make_inner(model)
    averager = PeriodicAverager(sync_every=sync_every, streaming=streaming(spec), **OUTER)  # type: ignore[arg-type]
    averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
    for step in range(steps):
        inner_step(model, inner, batch(rank, step))
        averager.step([inner])
    averager.finish([inner])
    averager.close()
    torch.save(flat(model), f"{out}.rank{rank}")


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    ranks = int(argv[8]) if len(argv) > 8 else 1
    if ranks == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the group's own world
        train(argv, 0, 1)
        return
    import multiprocessing

    init = f"file://{argv[6]}.pg"  # the group's own world of ``ranks`` ranks; rank 0 is this process
    children = [multiprocessing.get_context("fork").Process(target=_rank, args=(argv, r, ranks, init)) for r in
                range(1, ranks)]  # fmt: skip
    for child in children:
        child.start()
    print(f"rank pids {[child.pid for child in children]}", flush=True)
    _rank(argv, 0, ranks, init)
    for child in children:
        child.join(60)
    if any(child.exitcode != 0 for child in children):
        raise SystemExit(f"a rank of this group failed: {[child.exitcode for child in children]}")


def _rank(argv: list[str], rank: int, ranks: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    train(argv, rank, ranks)


def train(argv: list[str], rank: int, ranks: int) -> None:
    """Trains rank ``rank`` of a group of ``ranks`` ranks (the group's world is the default process group)."""
    from lightning_sync.comm.meter import CommMeter
    from lightning_sync.ft import FaultTolerance
    from lightning_sync.ft.averager import FaultTolerantAverager
    from lightning_sync.ft.replica import ReplicaGroupLink

    lighthouse, group, groups, min_replicas, steps, sync_every = argv[:6]
    out = argv[6] if rank == 0 else f"{argv[6]}.rank{rank}"
    sleep_s = float(argv[7]) if len(argv) > 7 else 0.0
    shard = int(group) * ranks + rank
    torch.set_num_threads(1)
    config = FaultTolerance(
        lighthouse=lighthouse,
        replica_group=int(group),
        num_replica_groups=int(groups),
        min_replicas=int(min_replicas),
        timeout_s=3.0,
        heartbeat_timeout_s=1.0,
        join_timeout_s=5.0,
    )
    link = ReplicaGroupLink(config, group_rank=rank, group_world_size=ranks, hostname="localhost")
    model = make_model()
    inner = make_inner(model)
    link.register_state(  # a healing group pulls the model and the inner optimizer too
        "training",
        lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["inner"])),
    )
    spec = argv[9] if len(argv) > 9 else ""
    nan_at = int(argv[10]) if len(argv) > 10 else -1
    averager = FaultTolerantAverager(link, sync_every=int(sync_every), streaming=streaming(spec), **OUTER)  # type: ignore[arg-type]
    averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
    snapshots: dict[int, torch.Tensor] = {}  # the state at each quorum's start, by step (a healing source's)
    healed: dict[int, torch.Tensor] = {}  # the state right after a heal, by step
    join_quorum = link.start

    def start() -> bool:
        snapshots[averager.steps] = state_of(model, inner) if inner.state else flat(model)
        did_heal = join_quorum()
        if did_heal:
            healed[averager.steps] = state_of(model, inner)
        return did_heal

    link.start = start  # type: ignore[method-assign]
    try:
        while averager.steps < int(steps):  # the step count heals with the rest: data and schedule follow it
            inner_step(model, inner, batch(shard, averager.steps))
            if averager.steps + 1 == nan_at:  # a non-finite contribution from this group, at its next sync
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")
            synced = averager.step([inner])
            if synced:
                print(f"sync at step {averager.steps} t={time.time():.3f} committed={link.stats.commits} "
                      f"failed={link.stats.failed_commits} members={link.stats.participants}", flush=True)  # fmt: skip
            print(f"step {averager.steps}", flush=True)
            if sleep_s:
                time.sleep(sleep_s)
        averager.finish([inner])
        print(f"finish committed={link.stats.commits} failed={link.stats.failed_commits}", flush=True)
        torch.save({"params": flat(model), "snapshots": snapshots, "healed": healed}, out + ".state")
        torch.save(flat(model), out)
    finally:
        averager.close()
        dist.destroy_process_group()
    print("done", flush=True)


def lightning_group(
    lighthouse: str, group: int, groups: int, steps: int, out: str, mode: str = "diloco", ckpt: str = ""
) -> None:
    """One replica group of one rank as a Lightning ``Trainer`` with ``PeriodicSyncStrategy(fault_tolerance=...)``:
    DiLoCo every 4 steps on a shared regression set (64 samples); saves the final parameters, the sample indices this
    group read and the ``ft/*`` metrics logged."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sync import AllReduceStrategy, PeriodicSyncStrategy
    from lightning_sync.ft import FaultTolerance

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.seen: list[int] = []
            self.metrics: dict[str, float] = {}

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            index, x = batch
            self.seen += index.tolist()
            return (self.net(x) - x.flip(1)).pow(2).mean()

        def on_train_batch_end(self, *args: object) -> None:
            self.metrics.update({k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("ft/")})

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(torch.arange(64), data), batch_size=4, shuffle=False)
    ft = FaultTolerance(lighthouse=lighthouse, replica_group=group, num_replica_groups=groups, min_replicas=groups,
                        timeout_s=3.0, heartbeat_timeout_s=1.0, join_timeout_s=5.0,
                        quorum_timeout_s=30.0)  # fmt: skip  # the groups' Lightning start-ups may differ by seconds
    if mode == "allreduce":
        strategy: object = AllReduceStrategy(fault_tolerance=ft)
    else:
        strategy = PeriodicSyncStrategy(mode=mode, sync_every=4, fault_tolerance=ft)
    module = Regression()
    from lightning.pytorch.callbacks import ModelCheckpoint

    saving = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=16, save_top_k=-1)] if ckpt else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=bool(ckpt),
        callbacks=saving,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    resume = [str(p) for p in sorted(Path(ckpt).glob("*step=16.ckpt"))] if ckpt and Path(ckpt).exists() else []
    trainer.fit(module, loader, ckpt_path=resume[0] if resume else None)
    torch.save({"params": flat(module.net), "seen": module.seen, "metrics": module.metrics}, out)
    print("done", flush=True)


def run_lightning_group(args: list[object], log_path: str) -> None:
    """:func:`lightning_group` with stdout and stderr sent to ``log_path``, in an environment without another
    world's rendezvous: a replica group is a job of its own, and a ``MASTER_PORT`` inherited from the process that
    started the forkserver would make both groups' Lightning bind that one port."""
    import os

    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        os.environ.pop(key, None)
    _redirect(log_path)
    lightning_group(*args)  # type: ignore[arg-type]


def _redirect(log_path: str) -> None:
    import os

    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def run_group(argv: list[str], log_path: str) -> None:
    """:func:`main` with stdout and stderr sent to ``log_path`` (a ``multiprocessing`` target; exits non-zero on
    an error, as the script does)."""
    _redirect(log_path)
    main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
