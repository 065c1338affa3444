"""Streaming DiLoCo against DiLoCo and per-step all-reduce on an emulated slow link: step time and bytes.

Two ranks, each in its own network namespace behind a ``tbf``-limited link
(:func:`lightning_sync.apps.netns.emulated_hosts`), train the same MLP (8 layers of 256 x 256, 526k parameters,
2.1 MB in fp32) with AdamW from a plain torch loop; the comm algorithms are the library's own
(:class:`~lightning_sync.comm.periodic.PeriodicAverager`), without Lightning. Cases, alternated A B A B within one
pair of processes:

* ``floor``: no communication (each rank trains alone): the compute-only step time;
* ``ddp``: one flat fp32 all-reduce of the gradients per step;
* ``diloco``: ``PeriodicAverager(outer=True, sync_every=H)``, fp32 outer all-reduce, blocking;
* ``streaming_fp32``: ``fragments=4, sync_delay=2, fragment_alpha=0.5``, fp32;
* ``streaming``: the same with ``outer_compression=int4``;
* ``streaming_d4``: ``streaming`` with ``sync_delay=4``.

Reported per case: the mean step time over ``--steps`` steps after ``--warmup`` (two whole periods, so each
periodic case pays the same number of syncs), the slower rank's; compute utilization = floor / step time; ``wait``:
the mean time per step the training thread spent in the sync call (the all-reduce, or ``PeriodicAverager.step``),
which depends on the link more than on the load of the CPU; ``own util``: that case's own compute time (the step
minus the wait) over its step time, measured in the same steps, so a load that changes between cases does not
move it; bytes sent per step and the largest one-step transfer, from the communication meter, and ``wire B/step``: the
bytes rank 0's interface transmitted per measured step (kernel counters: every frame, headers included; a transfer
still in flight when the window closes counts in part). Needs root (namespaces, tc); it
touches only namespaces it creates (prefix ``lsso``) and removes them on exit.

    python benchmarks/streaming_overlap.py --rate 10mbit,100mbit,1gbit
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

from lightning_sync.apps.netns import InterfaceCounters, burst_bytes, emulated_hosts

CASES = ("floor", "ddp", "diloco", "streaming_fp32", "streaming", "streaming_d4")
STREAMING = dict(fragments=4, sync_delay=2, fragment_alpha=0.5)


def _averager(case: str, period: int):
    from lightning_sync.comm.periodic import PeriodicAverager, StreamingOptions

    streaming = {
        "diloco": StreamingOptions(),
        "streaming_fp32": StreamingOptions(**STREAMING),
        "streaming": StreamingOptions(**STREAMING, outer_compression="int4"),
        "streaming_d4": StreamingOptions(**dict(STREAMING, sync_delay=4), outer_compression="int4"),
    }.get(case)
    if streaming is None:
        return None
    return PeriodicAverager(sync_every=period, outer=True, timeout_s=300.0, streaming=streaming)


def worker(args: argparse.Namespace) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment): alternates the cases."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_sync.comm.meter import CommMeter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, list[dict]] = {case: [] for case in args.cases}
    for _ in range(args.rounds):
        for case in args.cases:
            torch.manual_seed(0)
            model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            meter = CommMeter()
            averager = _averager(case, args.sync_every)
            if averager is not None:
                averager.setup(model.named_parameters(), model.named_buffers(), meter)
            gen = torch.Generator().manual_seed(rank)
            steps = args.ddp_steps if case == "ddp" else args.steps
            warmup = 2 if case == "ddp" else args.warmup
            sent, waited, started = [], 0.0, 0.0
            computed = 0.0
            wire = InterfaceCounters(os.environ["GLOO_SOCKET_IFNAME"])
            for step in range(warmup + steps):
                if step == warmup:
                    started = time.perf_counter()
                    wire.start()
                before = meter.total.bytes_sent
                compute_start = time.perf_counter()
                x = torch.randn(args.batch_size, 256, generator=gen)
                loss = (model(x) - x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                wait_start = time.perf_counter()
                if case == "ddp":
                    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).div_(world)
                    meter.all_reduce(flat)
                    offset = 0
                    for p in model.parameters():
                        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
                wait_end = time.perf_counter()
                opt.step()
                if averager is not None:
                    wait_start = time.perf_counter()
                    averager.step([opt])
                    wait_end = time.perf_counter()
                if step >= warmup:
                    sent.append(meter.total.bytes_sent - before)
                    waited += wait_end - wait_start
                    computed += time.perf_counter() - compute_start - (wait_end - wait_start)
            seconds = torch.tensor([(time.perf_counter() - started) / steps, waited / steps, computed / steps])
            wire.stop()
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if averager is not None:
                averager.finish([opt])
                averager.close()
            dist.barrier()
            results[case].append(
                {
                    "step_s": float(seconds[0]),
                    "wait_s": float(seconds[1]),
                    "compute_s": float(seconds[2]),
                    "bytes_per_step": sum(sent) / len(sent),
                    "peak_step_bytes": max(sent),
                    "wire_bytes_per_step": (wire.tx_bytes or 0) / steps,
                }
            )
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, hosts: list) -> dict:
    return launch_two_ranks(__file__, sys.argv[1:], hosts, 29631, args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="10mbit,100mbit,1gbit", help="comma list of tc rates")
    parser.add_argument("--cases", default=",".join(CASES), type=lambda s: s.split(","))
    parser.add_argument("--sync-every", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--steps", type=int, default=64, help="measured steps (two periods of 32)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--ddp-steps", type=int, default=8, help="measured steps of ddp (slow at low rates)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the ranks may take, per rate")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rates = args.rate.split(",")
    for rate in rates:
        burst_bytes(rate)  # a bad rate fails here, before any namespace exists
    if os.geteuid() != 0:
        raise SystemExit("error: the emulated links need root (ip netns, tc)")
    print(
        f"MLP 8 x 256 (526k parameters), batch {args.batch_size}/rank, AdamW, 2 ranks gloo, sync_every "
        f"{args.sync_every}, streaming = {STREAMING}; mean step time over {args.steps} steps ({args.ddp_steps} for "
        f"ddp), slower rank, median of {args.rounds} alternating rounds"
    )
    for rate in rates:
        with emulated_hosts(2, rate, prefix="lsso") as hosts:
            result = _launch(args, hosts)
        floor = statistics.median(r["step_s"] for r in result["floor"]) if "floor" in result else None
        print(f"\n{rate}")
        print(
            f"{'case':<16}{'ms/step':>9}{'x floor':>9}{'util':>7}{'wait ms':>9}{'own util':>9}{'bytes/step':>12}"
            f"{'peak step bytes':>17}{'wire B/step':>13}  runs ms"
        )
        for case, runs in result.items():
            step = statistics.median(r["step_s"] for r in runs)
            ratio = f"{step / floor:9.2f}" if floor else f"{'':>9}"
            util = f"{floor / step:7.0%}" if floor else f"{'':>7}"
            wait = statistics.median(r["wait_s"] for r in runs)
            own = statistics.median(r["compute_s"] / r["step_s"] for r in runs)
            per_step = statistics.median(r["bytes_per_step"] for r in runs)
            peak = max(r["peak_step_bytes"] for r in runs)
            on_wire = statistics.median(r["wire_bytes_per_step"] for r in runs)
            each = " ".join(f"{1e3 * r['step_s']:.1f}" for r in runs)
            print(
                f"{case:<16}{1e3 * step:9.1f}{ratio}{util}{1e3 * wait:9.1f}{own:9.0%}{per_step:12.0f}{peak:17.0f}"
                f"{on_wire:13.0f}  "
                f"{each}"
            )


if __name__ == "__main__":
    main()
