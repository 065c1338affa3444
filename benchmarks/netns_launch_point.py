"""Where should buckets launch, during backward or after it? Loopback against an emulated slow network.

Two ranks train the same MLP with torch DDP and with :class:`~lightning_sync.comm.bucketing.GradientSynchronizer`
launching buckets during backward (``overlap``), after it (``flat``) and as ``auto`` decides; modes alternate within
one run and the figure is the median step time over rounds (rank 0). ``--rate`` picks the network:

* ``loopback``: both ranks on 127.0.0.1. Gloo's transfers are CPU work on the cores backward uses.
* a tc rate such as ``1gbit``: each rank in its own network namespace (:func:`lightning_sync.apps.netns.emulated_hosts`),
  with a ``tbf`` rate limit on both ends of every link. The link, not the CPU, bounds the transfer, and the CPU is
  idle while it waits.

Needs root for the namespaces; it touches only namespaces it creates (prefix ``lsnb``) and removes them on exit.

    python benchmarks/netns_launch_point.py --rate loopback
    python benchmarks/netns_launch_point.py --rate 1gbit
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import json
import statistics
import sys
import time

from _two_ranks import launch_two_ranks

from lightning_sync.apps.netns import burst_bytes, emulated_hosts

MODES = ("ddp", "overlap", "flat", "auto")


def worker(args: argparse.Namespace) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment): alternates the modes."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_sync.comm.bucketing import GradientSynchronizer
    from lightning_sync.comm.compression import NoCompression
    from lightning_sync.comm.meter import CommMeter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x, y = torch.randn(args.batch_size, args.width), torch.randn(args.batch_size, 1)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    decisions: list[dict] = []
    for _ in range(args.rounds):
        for mode in MODES:
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(args.depth):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            model = nn.Sequential(*layers, nn.Linear(args.width, 1))
            net, sync = model, None
            if mode == "ddp":
                net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
            else:
                sync = GradientSynchronizer(
                    list(model.parameters()),
                    NoCompression(),
                    CommMeter(),
                    bucketing=mode,
                    bucket_cap_mb=args.bucket_cap_mb,
                )
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                opt.zero_grad()
                if sync is not None:
                    sync.start_round()
                ((net(x) - y) ** 2).mean().backward()
                if sync is not None:
                    sync.finish()
                opt.step()
                steps.append(time.perf_counter() - start)
            times[mode].append(1e3 * statistics.median(steps[args.warmup :]))
            if mode == "auto":
                decisions.append({"launch_point": sync.launch_point, **sync.tuner.medians_ms})
    if rank == 0:
        print(json.dumps({"times": times, "auto": decisions}), flush=True)
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, hosts: list | None) -> dict:
    return launch_two_ranks(__file__, sys.argv[1:], hosts, 29611, args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="'loopback', or a tc rate for the emulated links")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=512,
        help="per rank (512: backward about as long as a 1 Gbit all-reduce of the 10.5 MB of gradients)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=2.0,
        help="for DDP and ours (2: five buckets of the "
        "10.5 MB, so that launching during backward has something to overlap)",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out (auto tunes on its first 19)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds the ranks may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.rate == "loopback":
        result = _launch(args, None)
    else:
        try:
            burst_bytes(args.rate)  # a bad rate fails here, before any namespace exists
        except ValueError as err:
            raise SystemExit(f"error: --rate: {err}; or 'loopback'") from None
        if os.geteuid() != 0:
            raise SystemExit("error: --rate other than loopback needs root (ip netns, tc)")
        with emulated_hosts(2, args.rate, prefix="lsnb") as hosts:
            result = _launch(args, hosts)
    med = {m: statistics.median(v) for m, v in result["times"].items()}
    print(
        f"MLP {args.depth} x {args.width}, batch {args.batch_size}/rank, 2 ranks gloo, network {args.rate}, "
        f"buckets of {args.bucket_cap_mb} MB, "
        f"median of {args.rounds} alternating rounds ({args.steps} steps, {args.warmup} warm-up)"
    )
    for mode, value in med.items():
        runs = " ".join(f"{t:.1f}" for t in result["times"][mode])
        print(f"{mode:<10}{value:9.2f} ms/step {value / med['ddp']:6.2f}x ddp   {runs}")
    for d in result["auto"]:
        print(
            f"auto chose {d['launch_point']}: step median during backward {d['during_backward']:.1f} ms, "
            f"after backward {d['after_backward']:.1f} ms"
        )


if __name__ == "__main__":
    main()
