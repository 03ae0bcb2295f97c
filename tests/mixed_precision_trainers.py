"""Handwritten mixed-precision data-parallel trainers for ``zerosim verify --precision bf16|fp16``: one
correct (built on nothing of this project's adapters) and the broken variants each diagnosis class
must name. Targets: ``tests.mixed_precision_trainers:<factory>``.

The correct trainer keeps float32 masters (the model's own parameters) and torch.optim state on them;
each step it copies the masters to ``param_dtype`` (a plain ``.to(dtype)`` copy, not autocast: a
different valid way from the ``ddp`` adapter's), runs forward and backward on the copy, flattens the
gradients into one buffer in ``reduce_dtype``, all-reduces it and divides by the world size, unscales
(fp16) in float32, skips the step when a gradient is not finite (on any rank: the all-reduce spreads
an inf), clips in float32 and steps. Its loss scale is handwritten from ``loss_scale``.

Broken variants (one flag each):

* ``no_master``: the model itself is cast to ``param_dtype`` and the optimizer steps the low-precision
  parameters: no float32 master (``no-fp32-master``).
* ``master_init``: the masters start from the model cast to ``param_dtype`` and back, not from the
  float32 values it arrived with, as ``deepspeed.initialize`` makes them (``master-init``).
* ``reduce_bf16``: the gradient buffer is all-reduced in bfloat16 whatever the policy says
  (``reduce-dtype``).
* ``clip_scaled``: the clip runs before unscaling, on the scaled gradients (``loss-scale``).
* ``no_unscale``: the gradients are never divided by the loss scale (``loss-scale``).
* ``unscale_twice``: they are divided by it twice (``loss-scale``).
* ``no_skip``: a step whose gradients overflowed is taken anyway (``loss-scale``).

Running this module prints, for each trainer, the error-to-bound ratios ``zerosim verify`` reports
(``python -m tests.mixed_precision_trainers [--world 4] [--precision bf16]``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HandwrittenMixedTrainer:
    """See the module docstring; ``fault`` names the broken variant (None: correct)."""

    declared_strategy = "ddp"

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any], fault: str | None = None):
        policy = optim.get("mixed_precision")
        if policy is None:
            raise NotImplementedError("this trainer runs under --precision bf16|fp16 only")
        self.fault = fault
        self.optim = optim
        self.param_dtype = DTYPES[policy["param_dtype"]]
        self.reduce_dtype = torch.bfloat16 if fault == "reduce_bf16" else DTYPES[policy["reduce_dtype"]]
        scaling = policy.get("loss_scale")
        self.scaling = dict(scaling) if scaling else None
        self.scale = float(scaling["init"]) if scaling else None
        self.clean_steps = 0
        self.model = model.to(self.param_dtype) if fault == "no_master" else model
        if fault == "master_init":
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(self.param_dtype).to(p.dtype))
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        if optim["name"] == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.params, lr=optim["lr"], momentum=optim.get("momentum", 0.0),
                weight_decay=optim.get("weight_decay", 0.0))
        else:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=optim["lr"], betas=tuple(optim.get("betas", (0.9, 0.999))),
                eps=optim.get("eps", 1e-8), weight_decay=optim.get("weight_decay", 0.0))
        self.norm = 0.0

    def step(self, inputs: Any, targets: Any) -> float:
        return self.step_accumulated([(inputs, targets)])

    def step_accumulated(self, micro_batches: list[tuple[Any, Any]]) -> float:
        compute = self.model if self.fault == "no_master" else copy.deepcopy(self.model).to(self.param_dtype)
        cparams = [p for _, p in compute.named_parameters()]
        k = len(micro_batches)
        total = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        losses = 0.0
        for inputs, targets in micro_batches:
            compute.zero_grad(set_to_none=True)
            loss = compute(inputs, targets)
            (loss * self.scale if self.scale is not None else loss).backward()
            losses += float(loss.detach().float())
            for t, p in zip(total, cparams, strict=True):
                if p.grad is not None:
                    t += p.grad.float()
        flat = torch.cat([t.reshape(-1) for t in total]).to(self.reduce_dtype)
        dist.all_reduce(flat)
        flat = flat.float() / (k * dist.get_world_size())
        grads = list(torch.split(flat, [p.numel() for p in self.params]))
        if self.fault == "clip_scaled":
            self._clip(grads)
        if self.scale is not None and self.fault != "no_unscale":
            grads = [g / self.scale for g in grads]
            if self.fault == "unscale_twice":
                grads = [g / self.scale for g in grads]
        if self.fault != "clip_scaled":
            self._clip(grads)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if self.scale is not None and not finite and self.fault != "no_skip":
            self._update_scale(skipped=True)
            return losses / k
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.reshape(p.shape).to(p.dtype)
        self.optimizer.step()
        self._update_scale(skipped=False)
        return losses / k

    def _clip(self, grads: list[torch.Tensor]) -> None:
        self.norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        max_norm = self.optim.get("max_grad_norm")
        if max_norm is not None and math.isfinite(self.norm):
            coef = min(1.0, float(max_norm) / (self.norm + 1e-6))
            for g in grads:
                g.mul_(coef)

    def _update_scale(self, skipped: bool) -> None:
        if self.scaling is None or self.scale is None:
            return
        if skipped:
            self.scale *= float(self.scaling["backoff_factor"])
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == int(self.scaling["growth_interval"]):
            self.scale *= float(self.scaling["growth_factor"])
            self.clean_steps = 0

    def last_grad_norm(self) -> float:
        return self.norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in zip(self.names, self.params, strict=True)}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for n, p in zip(self.names, self.params, strict=True):
            st = self.optimizer.state.get(p, {})
            out[n] = {k: v.detach().float().clone() for k, v in st.items() if torch.is_tensor(v)}
        return {n: e for n, e in out.items() if e}


def correct(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim)


def no_master(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "no_master")


def master_init(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "master_init")


def reduce_bf16(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "reduce_bf16")


def clip_scaled(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "clip_scaled")


def no_unscale(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "no_unscale")


def unscale_twice(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "unscale_twice")


def no_skip(model: torch.nn.Module, optim: dict[str, Any]) -> HandwrittenMixedTrainer:
    return HandwrittenMixedTrainer(model, optim, "no_skip")


# (target, precision) rows of the table ``python -m tests.mixed_precision_trainers`` prints
HERE = "tests.mixed_precision_trainers"
TABLE = [("ddp", "bf16"), ("ddp", "fp16"), (f"{HERE}:correct", "bf16"), (f"{HERE}:correct", "fp16"),
         (f"{HERE}:no_master", "bf16"),
         (f"{HERE}:master_init", "bf16"), (f"{HERE}:reduce_bf16", "bf16"), (f"{HERE}:clip_scaled", "fp16"),
         (f"{HERE}:no_unscale", "fp16"), (f"{HERE}:unscale_twice", "fp16"), (f"{HERE}:no_skip", "fp16")]


def main(argv: list[str] | None = None) -> None:
    """Verify every trainer of :data:`TABLE` and print one markdown row each: verdict, C-ZERO-002's and
    C-ZERO-008's error-to-bound ratios, the median update error, the diagnosis."""
    import argparse

    from zerosim.verify import verify

    p = argparse.ArgumentParser(prog="python -m tests.mixed_precision_trainers")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    print("| trainer | precision | verdict | C-ZERO-002 err/bound | median update error "
          "| C-ZERO-008 err/bound | C-ZERO-005 | diagnosis |")
    print("|---|---|---|---|---|---|---|---|")
    for target, precision in TABLE:
        report = verify(target, world=args.world, steps=args.steps, precision=precision)
        eq = report.contracts["C-ZERO-002"].details
        norm = report.contracts["C-ZERO-008"].details
        classes = ", ".join(d.bug_class for d in report.diagnosis) or "-"
        ratio = eq.get("error_over_tolerance")
        nratio = norm.get("error_over_tolerance")
        median = eq.get("median_update_error", float("nan"))
        print(f"| {target.split(':')[-1]} | {precision} | {report.verdict} | "
              f"{'-' if ratio is None else f'{ratio:.3g}'} | {median:.3g} | "
              f"{'-' if nratio is None else f'{nratio:.3g}'} | {report.contracts['C-ZERO-005'].status} | "
              f"{classes} |", flush=True)


if __name__ == "__main__":
    main()
