"""``zerosim bench host-adam``: the offload host tier's AdamW kernels on one flat float32 shard, side by side.

ZeRO-Offload steps the fp32 master and optimizer state on the host, so the host kernel's speed is
part of every offloaded step. This benchmark steps one flat shard of ``--elements`` float32 values
(parameter, gradient, ``exp_avg``, ``exp_avg_sq``; a gpt-50m-sized shard by default) with:

* ``torch-forloop``: ``torch.optim.AdamW(foreach=False)``, torch's single-tensor CPU kernel;
* ``torch-foreach``: ``torch.optim.AdamW(foreach=True)``;
* ``host-fused``: :class:`zerogpu.host_optimizer.HostOptimizer` with ``kernel="fused"`` (torch's
  fused CPU kernel: one vectorised pass), the host tier's default;
* ``host-reference``: the same with ``kernel="reference"`` (zerosim's exact optimizer; where torch's
  CPU build runs fused multiply-adds, torch's fused kernel on the shard's first multiple of 16
  elements and the emulation on the rest: :mod:`zerogpu.exact_optimizer`).

Each round times every kernel once (one step each, the order rotating from round to round so no
kernel always follows another), after one untimed warm-up round; a kernel's figure is the median of
its rounds and its range, and its speed-up over ``torch-forloop`` is the median (and range) of the
per-round ratios, both measured in the same round. All kernels step the same arrays in turn (the
values drift by a few steps of AdamW; no kernel's cost depends on them).

Correctness, beside the timings: every kernel takes one step from the same values on a
``CHECK_ELEMENTS`` shard and is compared with zerosim's reference as it emulates torch's operations
(:func:`zerosim.numerics.optim.make_optimizer`): values unequal (bitwise where
the arithmetic is the same: zero) and the largest error as a fraction of C-ZERO-002's one-step
rounding bound (:func:`zerosim.bench.optimizer_bandwidth.one_step_bound`). Exit 0 when every kernel
stays within the bound, the reference kernel bitwise; 1 otherwise; 2 bad input.

JSON: ``bench_host_adam.json`` in a new ``reports/bench-host-adam-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import require_positive_int
from ..files.outputs import output_file, write_text

DEFAULT_OUT = "a new reports/bench-host-adam-<timestamp>/bench_host_adam.json"
DEFAULT_ELEMENTS = 50_000_000  #: about gpt-50m's parameters: one rank's whole master at world 1
CHECK_ELEMENTS = 1 << 16
KERNELS = ("torch-forloop", "torch-foreach", "host-fused", "host-reference")
BASELINE = "torch-forloop"


def _spec() -> Any:
    from zerosim.numerics.optim import OptimizerSpec

    from .optimizer_bandwidth import SPEC

    return OptimizerSpec.parse("adamw", **{k: v for k, v in SPEC.items() if k != "name"})


def _arrays(n: int, seed: int) -> dict[str, Any]:
    from .optimizer_bandwidth import _arrays as seeded

    return seeded(n, "cpu", seed)


def make_kernel(kernel: str, arrays: dict[str, Any], t0: int) -> Callable[[], None]:
    """A function stepping ``arrays`` in place with ``kernel``, the state at step ``t0`` before its first
    call."""
    import torch

    spec = _spec()
    if kernel.startswith("torch-"):
        p = torch.nn.Parameter(arrays["param"], requires_grad=True)
        p.grad = arrays["grad"]
        opt = torch.optim.AdamW([p], lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                weight_decay=spec.weight_decay or 0.0, foreach=kernel == "torch-foreach")
        opt.state[p] = {"step": torch.tensor(float(t0)), "exp_avg": arrays["exp_avg"],
                        "exp_avg_sq": arrays["exp_avg_sq"]}
        return opt.step
    from zerogpu.host_optimizer import HostOptimizer

    # the host tier's buffers are the benchmark's arrays (no copy): the same memory every kernel steps
    state = {"step": t0, "exp_avg": arrays["exp_avg"], "exp_avg_sq": arrays["exp_avg_sq"]}
    host = HostOptimizer.over(spec, arrays["param"], arrays["grad"], state,
                              kernel=kernel.removeprefix("host-"))
    return host.step


def _emulated_step(arrays: dict[str, Any], t: int) -> None:
    """Step ``t`` of zerosim's reference optimizer as it emulates torch's operations (the kernel every
    other one is checked against), in place."""
    from zerosim.numerics.optim import make_optimizer
    from zerosim.numerics.xp import torch_namespace

    state = {"step": t - 1, "exp_avg": arrays["exp_avg"], "exp_avg_sq": arrays["exp_avg_sq"]}
    make_optimizer(_spec(), torch_namespace("cpu")).step(arrays["param"], arrays["grad"], state)


def check(kernel: str, t: int = 3) -> dict[str, Any]:
    """One step of ``kernel`` from seeded values against zerosim's reference from the same values."""
    from .optimizer_bandwidth import one_step_bound

    start = _arrays(CHECK_ELEMENTS, seed=7)
    before = {k: a.numpy().copy() for k, a in start.items()}
    got_arrays = {k: a.clone() for k, a in start.items()}
    want_arrays = {k: a.clone() for k, a in start.items()}
    make_kernel(kernel, got_arrays, t - 1)()
    _emulated_step(want_arrays, t)
    bounds = one_step_bound(before, {k: a.numpy() for k, a in want_arrays.items()}, t)
    unequal, ratio = 0, 0.0
    for name in ("param", "exp_avg", "exp_avg_sq"):
        got = got_arrays[name].numpy().astype(np.float64)
        want = want_arrays[name].numpy().astype(np.float64)
        diff = np.abs(got - want)
        unequal += int(np.count_nonzero(diff))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = max(ratio, float(np.max(np.where(diff == 0, 0.0, diff / bounds[name]))))
    passed = unequal == 0 if kernel == "host-reference" else ratio <= 1.0
    return {"values_unequal": unequal, "error_over_bound": ratio, "passed": passed}


def measure(elements: int, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of every kernel on one shard; the figures of the module docstring."""
    import torch

    from zerogpu.host_optimizer import fused_kernel_is_exact

    arrays = _arrays(elements, seed=1)
    steps = {k: make_kernel(k, arrays, 1) for k in KERNELS}
    samples: dict[str, list[float]] = {k: [] for k in KERNELS}
    for r in range(rounds + 1):
        order = KERNELS[r % len(KERNELS):] + KERNELS[:r % len(KERNELS)]
        for k in order:
            t0 = time.perf_counter()
            steps[k]()
            elapsed = time.perf_counter() - t0
            if r > 0:  # round 0 warms every kernel up
                samples[k].append(elapsed)
    kernels = []
    for k in KERNELS:
        ratios = [b / s for b, s in zip(samples[BASELINE], samples[k], strict=True)]
        med = statistics.median(samples[k])
        kernels.append({
            "kernel": k, "median_s": med, "min_s": min(samples[k]), "max_s": max(samples[k]),
            "gb_s": elements * 28 / med / 1e9,
            "speedup_over_forloop": statistics.median(ratios),
            "speedup_range": [min(ratios), max(ratios)], "samples_s": samples[k], "check": check(k),
        })
    return {
        "benchmark": "host-adam", "elements": elements, "rounds": rounds, "baseline": BASELINE,
        "spec": _spec().to_dict(), "bytes_per_element": 28, "kernels": kernels,
        "fused_bitwise_expected": fused_kernel_is_exact(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
                    "processor": platform.processor() or platform.machine()},
    }


def run(args: Any) -> int:
    require_positive_int("elements", args.elements)
    require_positive_int("rounds", args.rounds)
    if args.threads is not None:
        require_positive_int("threads", args.threads)
    out = output_file(args.out, "bench-host-adam", "bench_host_adam.json")
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = measure(args.elements, args.rounds)
    write_text(out, json.dumps(report, indent=2) + "\n")
    _print(report, out)
    return 0 if all(k["check"]["passed"] for k in report["kernels"]) else 1


def _print(report: dict[str, Any], out: Path) -> None:
    m = report["machine"]
    print(f"zerosim bench host-adam: AdamW on one flat float32 shard of {report['elements']:,} elements, "
          f"{report['rounds']} rounds, {m['torch_threads']} torch threads, "
          f"CPU capability {m['cpu_capability']}")
    for k in report["kernels"]:
        c = k["check"]
        lo, hi = k["speedup_range"]
        print(f"  {k['kernel']:>15}: {k['median_s'] * 1e3:8.1f} ms "
              f"[{k['min_s'] * 1e3:.1f}-{k['max_s'] * 1e3:.1f}] "
              f"{k['gb_s']:5.1f} GB/s; {k['speedup_over_forloop']:.2f}x the for-loop [{lo:.2f}-{hi:.2f}]; "
              f"vs reference: {c['values_unequal']} values unequal, error/bound {c['error_over_bound']:.2g} "
              f"({'pass' if c['passed'] else 'FAIL'})")
    print(f"  written: {out}")
