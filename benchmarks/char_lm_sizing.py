"""The language-model example's size against the two conditions it is sized for (docs/guide/language-model.md).

One process, one thread: forward, backward and AdamW step of ``CharGPT`` at its defaults (batch 16 x 64
characters), no communication. Prints the parameter count, the fp32 gradient bytes, the median CPU time and wall
time of a step (CPU time is what one core spends; the wall time also counts waiting for a core on a shared
machine), and the time one 2-rank ring all-reduce of the gradients takes at 100 Mbit/s against the CPU step.

    OMP_NUM_THREADS=1 python benchmarks/char_lm_sizing.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from lightning_sync.examples.models import build_char_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps timed (the first 10 are left out)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, data = build_char_lm(seed=0)
    data.setup("fit")
    optimizer = model.configure_optimizers()
    batches = iter(data.train_dataloader())
    params = sum(p.numel() for p in model.parameters())
    cpu, wall = [], []
    for _ in range(args.steps):
        batch = next(batches)
        c, w = time.process_time(), time.perf_counter()
        loss = model.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    step_cpu, step_wall = statistics.median(cpu[10:]), statistics.median(wall[10:])
    allreduce = 4 * params / 12.5e6  # 2 ranks: a ring sends the gradient bytes once per rank; 100 Mbit/s
    print(f"parameters {params:,}; fp32 gradients {4 * params:,} bytes")
    print(f"step: {1e3 * step_cpu:.1f} ms CPU, {1e3 * step_wall:.1f} ms wall (median of {args.steps - 10})")
    print(f"1,000 steps: {step_cpu * 1000:.0f} s CPU per rank")
    print(f"one all-reduce at 100 Mbit/s: {1e3 * allreduce:.0f} ms = {allreduce / step_cpu:.1f}x the CPU step")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
