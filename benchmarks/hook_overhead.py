"""What a Python post-accumulate-grad hook costs per backward, the price the ``overlap`` bucketing pays per tensor.

Single process, no communication: the 40 x 256 MLP's backward (82 parameter tensors) with no hooks, with hooks that
do nothing, and with hooks that copy each gradient (scaled) into a bucket slot, as ``GradientSynchronizer`` does.
Modes alternate; medians over rounds.

    python benchmarks/hook_overhead.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import statistics
import time

import torch
from torch import nn


def main(rounds: int = 5, steps: int = 20) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(40):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(256, 1))
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    slots, offset = {}, 0
    for p in params:
        slots[p] = buffer[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    x, y = torch.randn(64, 256), torch.randn(64, 1)

    def noop(p: torch.Tensor) -> None:
        return None

    def copy_in(p: torch.Tensor) -> None:
        torch.mul(p.grad, 0.5, out=slots[p])

    modes = {"no hooks": None, "no-op hooks": noop, "copy-in hooks": copy_in}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, hook in modes.items():
            handles = [p.register_post_accumulate_grad_hook(hook) for p in params] if hook else []
            per_step = []
            for _ in range(steps):
                for p in params:
                    p.grad = None
                start = time.perf_counter()
                ((model(x) - y) ** 2).mean().backward()
                per_step.append(time.perf_counter() - start)
            times[mode].append(statistics.median(per_step) * 1e3)
            for h in handles:
                h.remove()
    base = statistics.median(times["no hooks"])
    print(f"forward+backward of a 40 x 256 MLP ({len(params)} tensors), median of {rounds} alternating rounds")
    for mode, values in times.items():
        med = statistics.median(values)
        print(f"{mode:<15} {med:7.2f} ms  (+{med - base:5.2f} ms, {1e3 * (med - base) / len(params):5.1f} us/tensor)")


if __name__ == "__main__":
    main()
