"""No crying wolf: the error-to-bound ratios of C-ZERO-002's mixed-precision mode for a correct autocast
data-parallel trainer and for one without float32 masters, over seeds, optimizers, learning rates and
gradient accumulation, in one process (every rank's micro-batch computed here; the judge and the
reference are the ones ``zerosim verify --precision`` uses).

``python -m tests.mixed_precision_calibration [--steps 6] [--world 2] [--seeds 0,1,2]`` prints one row per
configuration: the largest ratio of the correct trainer (must stay below 1) and of the trainer without
masters (normwise ratio; the exact ``master_dtype`` clause fails it regardless).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from zerosim.checks.equivalence import check_step_equivalence
from zerosim.values.observe import TrainerObservation
from zerosim.verify.mixed_precision import policy
from zerosim.verify.mixed_reference import mixed_records
from zerosim.verify.model_source import model_source
from zerosim.verify.reference import make_optimizer
from zerosim.verify.suite import Phase


def _train(base: torch.nn.Module, source: Any, optim: dict[str, Any], world: int, k: int, steps: int,
           dtype: torch.dtype, master: bool) -> dict[int, list[TrainerObservation]]:
    """An autocast trainer (``master``) or one whose parameters are ``dtype`` (no master), every rank here."""
    model = copy.deepcopy(base) if master else copy.deepcopy(base).to(dtype)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = make_optimizer(params, optim)
    out = {}
    for s in range(1, steps + 1):
        grads = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        for r in range(world):
            for m in range(k):
                model.zero_grad(set_to_none=True)
                inputs, targets = source.batch(r, s, m, world)
                with torch.autocast("cpu", dtype=dtype, enabled=master):
                    loss = model(inputs, targets)
                loss.backward()
                for g, p in zip(grads, params, strict=True):
                    g += p.grad.float()
        for g, p in zip(grads, params, strict=True):
            p.grad = (g / (world * k)).to(p.dtype)
        if optim.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, optim["max_grad_norm"], foreach=False)
        opt.step()
        values = {n: p.detach().float().numpy().copy() for n, p in zip(names, params, strict=True)}
        state = {n: {key: v.detach().float().numpy().copy() for key, v in opt.state[p].items()}
                 for n, p in zip(names, params, strict=True)} if master else None
        out[s] = [TrainerObservation(optim["name"], s, r, 0.0, values, state) for r in range(world)]
    return out


def ratio(records: list[Any]) -> tuple[float, float, bool]:
    verdict = check_step_equivalence(records)
    exact = any(v.clause == "master_dtype" for v in verdict.violations)
    normwise = verdict.details.get("error_over_tolerance", 0.0)
    return normwise, verdict.details.get("median_update_error", 0.0), exact


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.mixed_precision_calibration")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pol = policy("bf16")
    assert pol is not None
    print("| seed | optimizer | lr | K | correct: max err/bound | median e | no master: max err/bound "
          "| median e | master_dtype clause |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seed in [int(x) for x in args.seeds.split(",")]:
        source = model_source("gpt", seed)
        base = source.build("float32")
        for name, lr in [("sgd", 1e-2), ("sgd", 1e-4), ("adamw", 1e-2), ("adamw", 1e-3), ("adamw", 1e-4)]:
            for k in (1, 2):
                sgd = {"name": "sgd", "lr": lr, "momentum": 0.9, "weight_decay": 0.01}
                adamw = {"name": "adamw", "lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
                optim: dict[str, Any] = sgd if name == "sgd" else adamw
                phase = Phase(name, optim, 1, args.steps)
                info = [{"name": name, "status": "ran"}]
                rows = []
                for master in (True, False):
                    obs = _train(base, source, optim, args.world, k, args.steps, torch.bfloat16, master)
                    recs = mixed_records([phase], [dict(i) for i in info], obs, base, source, pol,
                                         world=args.world, grad_accum=k, seed=seed)
                    rows.append(ratio(recs))
                (c, cm, _), (b, bm, exact) = rows
                print(f"| {seed} | {name} | {lr:g} | {k} | {c:.3g} | {cm:.2g} | {b:.3g} | {bm:.2g} | "
                      f"{'fails' if exact else 'passes'} |", flush=True)


if __name__ == "__main__":
    main()
