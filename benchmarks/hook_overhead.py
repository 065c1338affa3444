"""What packing gradients into buckets costs, and where: in per-tensor hooks during backward, or after it.

Single process, no communication: the 40 x 256 MLP's backward (82 parameter tensors) followed by the packing, timed
together. Modes: no hooks and no packing; hooks that do nothing (what ``overlap``'s readiness hooks cost);
hooks that copy each gradient, divided, into its bucket slot (how ``GradientSynchronizer`` packed before); and one
``torch.cat`` of all gradients into the bucket plus an in-place divide after backward (how it packs now). Modes
alternate; medians over rounds.

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
        torch.div(p.grad, 2, out=slots[p])

    def cat_after() -> None:
        torch.cat([p.grad.view(-1) for p in params], out=buffer)
        buffer.div_(2)

    modes = {
        "no hooks": (None, None),
        "no-op hooks": (noop, None),
        "copy-in hooks": (copy_in, None),
        "cat after backward": (None, cat_after),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, (hook, after) in modes.items():
            handles = [p.register_post_accumulate_grad_hook(hook) for p in params] if hook else []
            per_step = []
            for _ in range(steps):
                for p in params:
                    p.grad = None
                start = time.perf_counter()
                ((model(x) - y) ** 2).mean().backward()
                if after is not None:
                    after()
                per_step.append(time.perf_counter() - start)
            times[mode].append(statistics.median(per_step) * 1e3)
            for h in handles:
                h.remove()
    base = statistics.median(times["no hooks"])
    print(
        f"forward+backward(+packing) of a 40 x 256 MLP ({len(params)} tensors), median of {rounds} alternating rounds"
    )
    for mode, values in times.items():
        med = statistics.median(values)
        print(f"{mode:<19} {med:7.2f} ms  (+{med - base:5.2f} ms, {1e3 * (med - base) / len(params):5.1f} us/tensor)")


if __name__ == "__main__":
    main()
