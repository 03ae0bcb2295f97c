"""ZeroTrainer on a device against the same training on the CPU, every strategy at world 1.

``python -m zerosim.cli.gpu_check_steps trainer_devices --device cuda --out FILE``: for each strategy, two
:class:`zerogpu.trainer.ZeroTrainer` s train the same float32 verify model (``zerosim.verify.model``)
on the same batches with AdamW, one on the CPU (the host run) and one on ``--device`` (the device
run). After every step the full parameters and optimizer state of the two runs are compared:

* **bitwise** where the arithmetic is the same: the device is the CPU (``--device cpu``, what CI
  runs), so both runs execute the same kernels in the same order and must agree bit for bit;
* **bounded** otherwise: a GPU's matrix products add in another order than the CPU's (and TF32 is
  switched off, so both round to float32), so the runs may differ by rounding only. The bound is
  C-ZERO-002's per-element rounding model (:mod:`zerosim.checks.tolerance`, derived in
  :mod:`zerosim.checks.rounding` from the unit roundoff 2^-24 and the reduction length of the
  model's gradient), propagated along verify's float64 torch.optim reference of the same training.
  Each run must lie within that bound ``b`` of the reference, so by the triangle inequality the two
  runs lie within ``2 b`` of each other; the report gives every error / bound ratio.

In both modes each run is also checked against the reference on its own (ratio <= 1), so a device
run that is wrong in the same way as nothing else is caught even where bitwise agreement is not
asked for. ``--perturb`` moves one parameter of the device run past twice its bound before the last
comparison: the check's own test that it can fail, and says where.

Writes one JSON document (``--out``); exit 0 when every strategy passed, 1 otherwise, 2 bad input.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EXIT_BAD_INPUT, ConfigError, ZeroSimError, require_positive_int
from .gpu_session import require_device, world_of_one, write_json

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hybrid", "hybrid_zero2")
#: AdamW as verify trains it; the weight decay is spelled out so the bound and the trainer read the same
OPTIM = {"name": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
STATE_NAMES = ("exp_avg", "exp_avg_sq")


def _validate(args: Any) -> list[str]:
    from ..verify.model import require_model

    require_positive_int("steps", args.steps)
    require_model(args.model)
    require_device(args.device)
    names = [s.strip() for s in str(args.strategies).split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise ConfigError("strategies", args.strategies, f"known: {', '.join(STRATEGIES)}")
    return names


def _ratio(diff: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """diff / bound elementwise: 0 where both are 0, inf where only the bound is."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = diff / bound
    r[diff == 0] = 0.0
    return r


class Worst:
    """The largest ratio seen, and where (for the report's one-line diagnostic)."""

    def __init__(self) -> None:
        self.ratio = 0.0
        self.diff = 0.0
        self.where = ""
        self.unequal = 0

    def see(self, got: np.ndarray, want: np.ndarray, bound: np.ndarray, where: str) -> None:
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        ratio = _ratio(diff, bound)
        self.unequal += int(np.count_nonzero(got != want))
        self.diff = max(self.diff, float(diff.max(initial=0.0)))
        if ratio.size and float(ratio.max()) > self.ratio:
            i = int(np.argmax(ratio))
            self.ratio = float(ratio.flat[i])
            self.where = (f"{where}[{i}]: |diff| {diff.flat[i]:.3g}, bound {bound.flat[i]:.3g}")


def _values(trainer: Any) -> dict[str, np.ndarray]:
    """Parameters and optimizer state of one run, float32 on the host, keyed ``name`` / ``name.state``."""
    out = {n: t.detach().cpu().numpy().ravel() for n, t in trainer.full_parameters().items()}
    for n, st in trainer.full_optimizer_state().items():
        for k in STATE_NAMES:
            out[f"{n}.{k}"] = st[k].detach().cpu().numpy().ravel()
    return out


def _reference_values(ref_step: Any) -> dict[str, np.ndarray]:
    """Verify's float64 reference after one step, keyed as :func:`_values`."""
    values = {n: a.ravel() for n, a in ref_step.params.items()}
    for n, st in ref_step.state.items():
        for k in STATE_NAMES:
            values[f"{n}.{k}"] = st[k].ravel()
    return values


def _bounds(step_bounds: Any) -> dict[str, np.ndarray]:
    out = {n: np.asarray(b, dtype=np.float64).ravel() for n, b in step_bounds.params.items()}
    for n, st in step_bounds.state.items():
        for k in STATE_NAMES:
            out[f"{n}.{k}"] = np.asarray(st[k], dtype=np.float64).ravel()
    return out


def compare(device_name: str, model: str, steps: int, strategies: list[str], perturb: bool,
            bitwise: bool | None = None) -> dict[str, Any]:
    """Every strategy's host and device runs against each other and against the reference; ``bitwise``
    (default: the device is the CPU) asks for equal bits between the two runs, else the bound."""
    import torch

    from zerogpu.trainer import ZeroTrainer

    from ..checks.tolerance import ErrorModel
    from ..verify.model import build_model, micro_batch, require_model
    from ..verify.reference import Reference

    device = torch.device(device_name)
    if bitwise is None:
        bitwise = device.type == "cpu"  # the same kernels on both sides
    torch.set_num_threads(1)  # a model this small gains nothing from host threads, which only contend
    cfg = require_model(model)
    reference = Reference(build_model(model, "float32"), OPTIM, 1, model_name=model)
    error_model = ErrorModel(OPTIM, "float32", cfg, 1)
    ref_values, bounds = [], []
    for k in range(1, steps + 1):
        ref_step = reference.step(k)
        ref_values.append(_reference_values(ref_step))
        bounds.append(_bounds(error_model.step(ref_step)))
    runs = []
    for strategy in strategies:
        t0 = time.perf_counter()
        host = ZeroTrainer(build_model(model, "float32"), OPTIM, strategy)
        dev = ZeroTrainer(build_model(model, "float32").to(device), OPTIM, strategy)
        between, host_ref, dev_ref = Worst(), Worst(), Worst()
        for k in range(1, steps + 1):
            x, y = micro_batch(0, k, model=model)
            host.step(x, y)
            dev.step(x.to(device), y.to(device))
            h, d = _values(host), _values(dev)
            if perturb and k == steps:
                name = next(iter(h))
                d[name] = d[name].copy()
                d[name][0] = d[name][0] + 2 * np.float32(bounds[-1][name][0]) + abs(d[name][0]) * 1e-3 + 1e-3
            for name in h:
                bound, want = bounds[k - 1][name], ref_values[k - 1][name]
                host_ref.see(h[name], want, bound, f"step {k} {name}")
                dev_ref.see(d[name], want, bound, f"step {k} {name}")
                between.see(d[name], h[name], 0 * bound if bitwise else 2 * bound, f"step {k} {name}")
        host.close()
        dev.close()
        problems = []
        if bitwise and between.unequal:
            problems.append(f"device and host runs differ in {between.unequal} values (bitwise expected); "
                            f"worst {between.where}")
        elif between.ratio > 1:
            problems.append(f"device and host runs differ beyond twice the bound: {between.where}")
        for side, worst in (("host", host_ref), ("device", dev_ref)):
            if worst.ratio > 1:
                problems.append(f"the {side} run is beyond the bound of the float64 reference: {worst.where}")
        runs.append({
            "strategy": strategy, "comparison": "bitwise" if bitwise else "bounded",
            "max_abs_diff": between.diff, "values_unequal": between.unequal,
            "error_over_bound": between.ratio, "host_vs_reference_over_bound": host_ref.ratio,
            "device_vs_reference_over_bound": dev_ref.ratio, "worst": between.where,
            "passed": not problems, "problems": problems, "seconds": time.perf_counter() - t0,
        })
    return {
        "step": "trainer", "device": str(device), "model": model, "steps": steps, "optimizer": OPTIM,
        "bound": "C-ZERO-002 rounding model (zerosim.checks.tolerance), float32, world 1; host vs device "
                 "within twice it", "perturbed": perturb, "runs": runs,
        "passed": all(r["passed"] for r in runs),
    }


def main(args: Any) -> int:
    """The step, its options parsed by :func:`zerosim.cli.gpu_check_steps.trainer_devices_parser`."""
    try:
        strategies = _validate(args)

        with tempfile.TemporaryDirectory(prefix="zerosim-trainer-devices-") as tmp, \
                world_of_one(args.device, Path(tmp)):
            doc = compare(args.device, args.model, args.steps, strategies, args.perturb)
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_json(args.out, doc)
    for r in doc["runs"]:
        print(f"{r['strategy']:>13}  {r['comparison']:<8} max |diff| {r['max_abs_diff']:.3g}  "
              f"error/bound {r['error_over_bound']:.3g}  {'pass' if r['passed'] else 'FAIL'}")
        for line in r["problems"]:
            print(f"  {line}", file=sys.stderr)
    return 0 if doc["passed"] else 1

