"""Step time of the sync modes side by side, alternating the modes (A B C A B C ...) in one run.

Each case is a 2-rank CPU/gloo Trainer (fork) on the synthetic MLP. The figure per case is the median over rounds of
rank 0's median step time (forward, backward, sync, optimizer step). Ratios are against Lightning's own ``ddp`` and
against the compute-only floor (the same model and ranks with no communication at all).

    python benchmarks/step_time.py                      # 40 x 256 MLP (82 tensors), the latency-bound case
    python benchmarks/step_time.py --width 2048 --depth 2 --batch-size 16   # bandwidth-bound
    python benchmarks/step_time.py --cases ddp,allreduce_overlap --rounds 5
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

import lightning_sync
from lightning_sync.callbacks import SyncReport
from lightning_sync.data import SyntheticDataModule
from lightning_sync.models import SyntheticMLP

warnings.filterwarnings("ignore")


class NoSyncStrategy(lightning_sync.AllReduceStrategy):
    """The compute-only floor: replicas start identical and never communicate again."""

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        self.synchronizer.remove_hooks()
        self.synchronizer = None


def _cases() -> dict[str, Callable[[], Any]]:
    fork = {"start_method": "fork"}
    return {
        "lightning_ddp": lambda: "ddp_fork",
        "lightning_ddp_view": lambda: DDPStrategy(start_method="fork", gradient_as_bucket_view=True),
        "sync_ddp": lambda: lightning_sync.DDPSyncStrategy(**fork),
        "allreduce": lambda: lightning_sync.AllReduceStrategy(**fork),
        "allreduce_overlap": lambda: lightning_sync.AllReduceStrategy(bucketing="overlap", **fork),
        "allreduce_flat": lambda: lightning_sync.AllReduceStrategy(bucketing="flat", **fork),
        "allreduce_naive": lambda: lightning_sync.AllReduceStrategy(bucketing="naive", **fork),
        "floor": lambda: NoSyncStrategy(**fork),
    }


def extra_cases() -> dict[str, Callable[[], Any]]:
    """Cases of the periodic mode, when it is installed."""
    cls = getattr(lightning_sync, "PeriodicSyncStrategy", None)
    if cls is None:
        return {}
    return {
        "periodic_local_sgd_8": lambda: cls(mode="local_sgd", sync_every=8, start_method="fork"),
        "periodic_diloco_8": lambda: cls(mode="diloco", sync_every=8, start_method="fork"),
    }


def run_case(make_strategy: Callable[[], Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    summary_path = out / "summary.json"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=make_strategy(),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[SyncReport(path=str(summary_path), warmup_steps=args.warmup)],
    )
    model = SyntheticMLP(width=args.width, depth=args.depth)
    data = SyntheticDataModule(in_features=args.width, num_samples=args.batch_size * 2 * args.steps,
                               batch_size=args.batch_size)
    trainer.fit(model, datamodule=data)
    return json.loads(summary_path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20,
                        help="batches left out (bucketing=auto tunes on its first 19 syncs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated subset (default: all)")
    args = parser.parse_args(argv)
    cases = {**_cases(), **extra_cases()}
    if args.cases:
        unknown = set(args.cases.split(",")) - set(cases)
        if unknown:
            sys.exit(f"error: --cases {','.join(sorted(unknown))} unknown; choose from {', '.join(cases)}")
        cases = {k: cases[k] for k in args.cases.split(",")}
    times: dict[str, list[float]] = {name: [] for name in cases}
    bytes_per_step: dict[str, float | None] = {}
    launch_points: dict[str, list[str]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, make in cases.items():
                out = Path(tmp, f"{name}_{r}")
                out.mkdir()
                summary = run_case(make, args, out)
                times[name].append(summary["step_time_ms"])
                bytes_per_step[name] = summary.get("bytes_sent_per_step")
                if "launch_point" in summary:
                    launch_points[name].append(summary["launch_point"])
                print(f"round {r} {name}: {summary['step_time_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    ref = med.get("lightning_ddp")
    floor = med.get("floor")
    print(f"\nMLP {args.depth} x {args.width}, batch {args.batch_size}/rank, 2 ranks gloo, {args.steps} steps "
          f"({args.warmup} warm-up), median of {args.rounds} alternating rounds")
    print(f"{'case':<24}{'ms/step':>9}{'vs ddp':>8}{'vs floor':>10}{'bytes/step':>13}  rounds (ms)")
    for name in cases:
        vs_ddp = f"{med[name] / ref:.2f}x" if ref else "-"
        vs_floor = f"{med[name] / floor:.2f}x" if floor else "-"
        b = bytes_per_step.get(name)
        b_txt = f"{b:,.0f}" if b is not None else "-"
        runs = " ".join(f"{t:.1f}" for t in times[name])
        points = launch_points[name]
        launch = f"  launched after backward in {points.count('after_backward')}/{len(points)}" if points else ""
        print(f"{name:<24}{med[name]:>9.2f}{vs_ddp:>8}{vs_floor:>10}{b_txt:>13}  {runs}{launch}")


if __name__ == "__main__":
    main()
