"""Time StepProbe.project against the formula it replaced (the four rows concatenated, the int8 signs
converted on every call) on one thread, over the gradients of a 1.07M-parameter model (an MLP
16 -> 512 -> 512 x 4 -> 16), and check the two agree bitwise on every tensor and dtype.

    python tools/bench_projection.py [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from zerosim.checks.grad_accounting import BLOCK
from zerosim.monitor.step_probe import PROJECTIONS, StepProbe


def concatenated(g: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The projection before: one (4, n) copy of the rows, the int8 signs converted on the call."""
    flat = g.detach().reshape(-1)
    n = flat.numel()
    s = signs[:, :n]
    rows = [flat.unsqueeze(0) * s.to(flat.dtype), flat.abs().unsqueeze(0), (flat * flat).unsqueeze(0)]
    parts = torch.cat(rows)
    whole = n // BLOCK * BLOCK
    sums = parts[:, :whole].reshape(parts.shape[0], -1, BLOCK).sum(-1).to(torch.float64).sum(-1)
    return sums + parts[:, whole:].to(torch.float64).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    widths = [16] + [512] * 5 + [16]
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    model = torch.nn.Sequential(*layers)
    probe = StepProbe(model, None, "ddp", every=1, replay_every=None, max_grad_norm=None)
    gen = torch.Generator().manual_seed(0x5EED)
    signs = torch.randint(0, 2, (PROJECTIONS, max(p.numel() for p in probe.params)), generator=gen,
                          dtype=torch.int8) * 2 - 1
    print(f"{sum(p.numel() for p in probe.params):,} parameters in {len(probe.params)} tensors, "
          f"{torch.get_num_threads()} thread(s)")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        grads = [torch.randn(p.shape).to(dtype) for p in probe.params]
        for g in grads:
            got, want = probe.project(g), concatenated(g, signs)
            assert got.numpy().tobytes() == want.numpy().tobytes(), (dtype, g.shape, got, want)
        best: dict[str, float] = {}
        ways = (("concatenated", lambda g: concatenated(g, signs)), ("StepProbe", probe.project))
        for name, project in ways * 2:
            start = time.perf_counter()
            for _ in range(args.repeats):
                for g in grads:
                    project(g)
            ms = (time.perf_counter() - start) / args.repeats * 1e3
            best[name] = min(best.get(name, ms), ms)
        print(f"{str(dtype).removeprefix('torch.'):>9}: bitwise equal; one model projection "
              f"{best['concatenated']:.1f} ms before, {best['StepProbe']:.1f} ms now")


if __name__ == "__main__":
    main()
