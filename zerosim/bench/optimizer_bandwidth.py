"""The sharded AdamW update's throughput on a device against the device's own copy bandwidth.

``python -m zerosim.cli.gpu_check_steps optimizer_bandwidth --device cuda --elements N --out FILE``: one flat
float32 shard of ``N`` elements (parameter, gradient, ``exp_avg``, ``exp_avg_sq``) on the device,
stepped by each kernel the engine can run (:data:`zerogpu.optimizer_kernels.OPTIMIZER_KERNELS`:
``reference``, zerosim's exact optimizer and ZeroTrainer's default; ``torch``; ``fused``;
``compiled``, the reference's operations fused into one pass by torch.compile, the exact reference
on a CPU), and a
device-to-device copy that moves the same bytes, timed the same way (device synchronised before and
after each call, median of ``--repeats`` after one untimed call).

An AdamW step reads four arrays and writes three: 28 bytes per element at the least. The copy
copies a buffer of 14 bytes per element, which also reads and writes 28 bytes per element, so the
ratio of the two times is the kernel's bandwidth as a fraction of what the device's memory delivers
to a plain copy: ``copy_s / kernel_s``. The goal is at least :data:`GOAL` on a GPU for the kernel
ZeroTrainer runs by default; on a CPU the figure is reported but not judged (a shared CPU's timings
say nothing about a device).

Every kernel is also checked on a smaller shard against the host: the ``reference`` kernel on the
device must equal zerosim's optimizer on the CPU bit for bit (it emulates each float32 operation);
torch's kernels must lie within the one-step rounding bound of :mod:`zerosim.checks.rounding` (the
same gradient on both sides: every float32 operation faithful). ``--perturb`` moves one element of
the device's result past its bound: the check's own test that it can fail.

Beside the kernels, the same way: zerosim.monitor's digest (:func:`zerosim.monitor.digest.tensor_digest`)
of the parameter array, which reads its 4 bytes per element once and writes 16 bytes in all; its
``bandwidth_gb_s`` counts the bytes read, so its ``fraction_of_copy`` near 1 is a digest that costs one
read of the parameters at the rate the device moves bytes. Reported, not judged.

Exit 0 when every kernel is correct and the goal is met where it applies, 1 otherwise, 2 bad input.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from ..errors import EXIT_BAD_INPUT, ZeroSimError, require_positive_int
from .gpu_session import full_precision_float32, require_device, synchronize, write_json

GOAL = 0.7  #: the fraction of the copy bandwidth the engine's default kernel should reach on a GPU
BYTES_PER_ELEMENT = 28  #: AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them (float32)
CHECK_ELEMENTS = 1 << 16  #: the shard the correctness check compares with the host
SPEC = {"name": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
DEFAULT_KERNEL = "reference"  #: ZeroTrainer's optimizer_kernel default


def _arrays(n: int, device: Any, seed: int) -> dict[str, Any]:
    """param, grad and a state as after some steps (exp_avg_sq > 0), float32, seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = 1e-2 * torch.randn(n, generator=gen)
    m = 1e-3 * torch.randn(n, generator=gen)
    v = 1e-5 * torch.rand(n, generator=gen)
    return {k: a.to(device) for k, a in {"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v}.items()}


def _optimizer(kernel: str, device: str) -> Any:
    from zerogpu.optimizer_kernels import make_step_optimizer
    from zerosim.numerics.optim import OptimizerSpec
    from zerosim.numerics.xp import torch_namespace

    spec = OptimizerSpec.parse("adamw", **{k: v for k, v in SPEC.items() if k != "name"})
    return make_step_optimizer(spec, torch_namespace(device), kernel)


def _step(kernel: str, device: str, arrays: dict[str, Any], t: int) -> None:
    """One update of ``arrays`` in place, the state at step count ``t - 1`` before it."""
    opt = _optimizer(kernel, device)
    state = {"step": t - 1, "exp_avg": arrays["exp_avg"], "exp_avg_sq": arrays["exp_avg_sq"]}
    opt.step(arrays["param"], arrays["grad"], state)


def _median_seconds(run: Any, device: str, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_seconds(n: int, device: str, repeats: int) -> float:
    """Median time of a device-to-device copy that reads and writes the bytes an update of ``n``
    elements moves (a buffer of ``n * BYTES_PER_ELEMENT / 2`` bytes, copied)."""
    import torch

    src = torch.empty(n * BYTES_PER_ELEMENT // 8, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return _median_seconds(lambda: dst.copy_(src), device, repeats)


def one_step_bound(before: dict[str, np.ndarray], after: dict[str, np.ndarray],
                   t: int) -> dict[str, np.ndarray]:
    """Per-element bound of two faithful float32 computations of one AdamW step from the same values
    (:class:`zerosim.checks.rounding.RoundingBound` with no gradient difference: n = 1, no terms)."""
    from ..checks.rounding import OptimizerHyper, RoundingBound, StepValues

    f64 = {k: np.asarray(a, dtype=np.float64) for k, a in after.items()}
    bound = RoundingBound(OptimizerHyper.from_mapping(SPEC), u=2.0**-24, n=1)  # no difference carried in
    values = StepValues(t=t, params_before={"x": np.asarray(before["param"], dtype=np.float64)},
                        params={"x": f64["param"]},
                        state={"x": {"exp_avg": f64["exp_avg"], "exp_avg_sq": f64["exp_avg_sq"]}},
                        grad={"x": np.asarray(before["grad"], dtype=np.float64)},
                        grad_terms={"x": np.zeros(f64["param"].shape)}, grad_norm=0.0, clip_coef=1.0)
    b = bound.step(values)
    state = b.state["x"]
    return {"param": b.params["x"], "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def check_kernel(kernel: str, device: str, perturb: bool, t: int = 3) -> dict[str, Any]:
    """``kernel`` on the device against zerosim's optimizer on the CPU, from the same values."""
    host = _arrays(CHECK_ELEMENTS, "cpu", seed=7)
    before = {k: a.numpy().copy() for k, a in host.items()}
    dev = {k: a.to(device) for k, a in host.items()}
    _step("reference", "cpu", host, t)
    _step(kernel, device, dev, t)
    want = {k: a.numpy() for k, a in host.items()}
    got = {k: a.cpu().numpy().copy() for k, a in dev.items()}
    bitwise = kernel == "reference"
    bounds = one_step_bound(before, want, t)
    if perturb:
        got["param"][0] += 2 * np.float32(bounds["param"][0]) + abs(got["param"][0]) * 1e-3 + 1e-3
    unequal, ratio, where = 0, 0.0, ""
    for name in ("param", "exp_avg", "exp_avg_sq"):
        diff = np.abs(got[name].astype(np.float64) - want[name].astype(np.float64))
        unequal += int(np.count_nonzero(got[name] != want[name]))
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(diff == 0, 0.0, diff / bounds[name])
        i = int(np.argmax(r))
        if float(r[i]) > ratio:
            ratio, where = float(r[i]), f"{name}[{i}]: |diff| {diff[i]:.3g}, bound {bounds[name][i]:.3g}"
    passed = unequal == 0 if bitwise else ratio <= 1
    return {"comparison": "bitwise" if bitwise else "bounded", "values_unequal": unequal,
            "error_over_bound": ratio, "worst": where, "passed": passed}


def measure(device: str, n: int, repeats: int, perturb: bool) -> dict[str, Any]:
    import torch

    from zerogpu.optimizer_kernels import OPTIMIZER_KERNELS

    from ..monitor.digest import tensor_digest

    full_precision_float32()
    copy_s = copy_seconds(n, device, repeats)
    arrays = _arrays(n, device, seed=1)
    kernels: list[dict[str, Any]] = []
    for kernel in OPTIMIZER_KERNELS:
        if kernel == "fused" and torch.device(device).type == "cpu" and not _fused_on_cpu():
            continue
        seconds = _median_seconds(lambda k=kernel: _step(k, device, arrays, 2), device, repeats)
        check = check_kernel(kernel, device, perturb)
        kernels.append({"kernel": kernel, "seconds": seconds, "fraction_of_copy": copy_s / seconds,
                        "bandwidth_gb_s": n * BYTES_PER_ELEMENT / seconds / 1e9, "check": check})
    digest_s = _median_seconds(lambda: tensor_digest(arrays["param"]), device, repeats)
    digest = {"seconds": digest_s, "bandwidth_gb_s": n * 4 / digest_s / 1e9,
              "fraction_of_copy": (n * 4 / digest_s) / (n * BYTES_PER_ELEMENT / copy_s)}
    judged = torch.device(device).type == "cuda"
    default = next(k for k in kernels if k["kernel"] == DEFAULT_KERNEL)
    problems = kernel_problems(kernels, judged)
    return {
        "step": "kernel", "device": device, "elements": n, "repeats": repeats,
        "bytes_per_element": BYTES_PER_ELEMENT, "copy_seconds": copy_s,
        "copy_bandwidth_gb_s": n * BYTES_PER_ELEMENT / copy_s / 1e9, "goal": GOAL,
        "goal_judged": judged, "default_kernel": DEFAULT_KERNEL,
        "default_fraction_of_copy": default["fraction_of_copy"], "kernels": kernels,
        "monitor_digest": digest,
        "perturbed": perturb, "problems": problems, "passed": not problems,
    }


def kernel_problems(kernels: list[dict[str, Any]], judged: bool) -> list[str]:
    """One line per kernel whose result is wrong, and one when the default kernel misses :data:`GOAL`
    on a device where the goal is ``judged`` (a GPU)."""
    problems = [f"{k['kernel']} kernel: {_what_failed(k['check'])}: {k['check']['worst']}"
                for k in kernels if not k["check"]["passed"]]
    default = next(k for k in kernels if k["kernel"] == DEFAULT_KERNEL)
    if judged and default["fraction_of_copy"] < GOAL:
        met = [k["kernel"] for k in kernels if k["fraction_of_copy"] >= GOAL]
        problems.append(f"the {DEFAULT_KERNEL} kernel (ZeroTrainer's default) reaches "
                        f"{default['fraction_of_copy']:.2f} of the copy bandwidth, below the goal {GOAL}; "
                        f"kernels that meet it: {', '.join(met) or 'none'}")
    return problems


def _what_failed(check: dict[str, Any]) -> str:
    if check["comparison"] == "bitwise":
        return f"{check['values_unequal']} values differ from the host optimizer (bitwise expected)"
    return f"beyond the one-step rounding bound (error/bound {check['error_over_bound']:.3g})"


def _fused_on_cpu() -> bool:
    """Whether this torch has a fused AdamW for CPU tensors."""
    try:
        _step("fused", "cpu", _arrays(8, "cpu", seed=0), 1)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def main(args: Any) -> int:
    """The step, its options parsed by :func:`zerosim.cli.gpu_check_steps.optimizer_bandwidth_parser`."""
    try:
        require_positive_int("elements", args.elements)
        require_positive_int("repeats", args.repeats)
        require_device(args.device)
        doc = measure(args.device, args.elements, args.repeats, args.perturb)
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_json(args.out, doc)
    print(f"copy: {doc['copy_bandwidth_gb_s']:.1f} GB/s ({args.elements:,} elements x {BYTES_PER_ELEMENT} B)")
    for k in doc["kernels"]:
        verdict = "pass" if k["check"]["passed"] else "FAIL"
        print(f"{k['kernel']:>10}: {k['bandwidth_gb_s']:.1f} GB/s = {k['fraction_of_copy']:.2f} of the copy; "
              f"{k['check']['comparison']} check {verdict}")
    d = doc["monitor_digest"]
    print(f"{'digest':>10}: {d['bandwidth_gb_s']:.1f} GB/s read = {d['fraction_of_copy']:.2f} of the copy "
          "(zerosim.monitor's digest of the parameters)")
    for line in doc["problems"]:
        print(line, file=sys.stderr)
    return 0 if doc["passed"] else 1

