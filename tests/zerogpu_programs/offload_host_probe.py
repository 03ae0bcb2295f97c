"""Under torchrun: an offloaded ZeroTrainer steps through the host tier, against the same run without offload.

ZeRO-3 on the verify model's ``gpt``, AdamW with weight decay, three steps on each rank's batches.
Trainers: without offload (``optimizer_kernel`` reference and fused) and with offload (``reference``,
``compiled``, ``fused``: the host tier's kernels). Each offloaded trainer's host step is wrapped so
that every step is also taken by zerosim's exact reference from the same master, gradient and state
(copies); the fused kernel's step is compared with it element by element against C-ZERO-002's
one-step rounding bound (:mod:`zerosim.checks.rounding`). Rank 0 prints one JSON line per offloaded
trainer: losses and full parameters / optimizer state equal to the run without offload with the
same kernel, bit for bit, and per step and rank the elements that differ from the reference and the
largest excess over the bound (at most 0 when within it).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerogpu.module_units import describe_module
from zerogpu.offload import OffloadConfig
from zerogpu.trainer import ZeroTrainer
from zerosim.checks.rounding import UNIT_ROUNDOFF, OptimizerHyper, RoundingBound, StepValues
from zerosim.numerics.optim import make_optimizer
from zerosim.numerics.xp import torch_namespace
from zerosim.verify.model import build_model, micro_batch

STEPS = 3
OPTIM = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_against_reference(trainer: ZeroTrainer, rows: list[dict[str, Any]]) -> None:
    """Wrap the trainer's host step: each step is also taken by the reference from copies of the same
    values, the difference measured against the one-step bound."""
    host_step = trainer.host_step
    assert host_step is not None
    spec = host_step.spec
    reference = make_optimizer(spec, torch_namespace("cpu"))
    hyper = OptimizerHyper.from_mapping({**spec.to_dict(), "max_grad_norm": None}, name=spec.name)
    bound = RoundingBound(hyper, u=UNIT_ROUNDOFF["float32"], n=1)
    stepped = host_step.step

    def step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        before, p0, g0 = param.double().numpy(), param.clone(), grad.clone()
        s0 = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        stepped(param, grad, state)
        reference.step(p0, g0, s0)
        f64 = {"param": p0.double().numpy(), **{k: s0[k].double().numpy() for k in spec.state_names}}
        values = StepValues(t=int(s0["step"]), params_before={"x": before}, params={"x": f64["param"]},
                            state={"x": {k: f64[k] for k in spec.state_names}},
                            grad={"x": g0.double().numpy()}, grad_terms={"x": np.zeros_like(f64["param"])},
                            grad_norm=0.0, clip_coef=1.0)
        b = bound.step(values)
        got = {"param": param, **{k: state[k] for k in spec.state_names}}
        worst, unequal = -np.inf, 0
        for key, want in f64.items():
            have = got[key].double().numpy()
            limit = b.params["x"] if key == "param" else b.state["x"][key]
            unequal += int(np.count_nonzero(have != want))
            if have.size:
                worst = max(worst, float(np.max(np.abs(have - want) - limit)))
        rows.append({"rank": dist.get_rank(), "step": int(s0["step"]), "n": int(param.numel()),
                     "unequal": unequal, "worst_excess": worst})

    host_step.step = step  # type: ignore[method-assign]


def train(kernel: str, offload: bool) -> tuple[ZeroTrainer, list[float], list[dict[str, Any]]]:
    model = build_model("gpt", "float32")
    cfg = None
    if offload:
        layout = describe_module(model).layout  # a budget of the two largest units' shards
        sizes = sorted(sum(layout.tensors[i].numel for i in b.tensor_indices) for b in layout.blocks)
        budget = sum(4 * (-(-s // dist.get_world_size()) + 64) for s in sizes[-2:])
        cfg = OffloadConfig(device_budget_bytes=budget, prefetch_depth=1)
    trainer = ZeroTrainer(model, OPTIM, "zero3", offload=cfg, optimizer_kernel=kernel)
    rows: list[dict[str, Any]] = []
    if offload:
        check_against_reference(trainer, rows)
    rank = dist.get_rank()
    losses = [trainer.step(*micro_batch(rank, s)) for s in range(1, STEPS + 1)]
    return trainer, losses, rows


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = {k: train(k, offload=False) for k in ("reference", "fused")}
    for kernel in ("reference", "compiled", "fused"):
        trainer, losses, rows = train(kernel, offload=True)
        base_kernel = "fused" if kernel == "fused" else "reference"
        base, base_losses, _ = plain[base_kernel]
        params, base_params = trainer.full_parameters(), base.full_parameters()
        state, base_state = trainer.full_optimizer_state(), base.full_optimizer_state()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        host_step = trainer.host_step
        assert host_step is not None and host_step.host is not None
        assert trainer.offload is not None
        perf = trainer.offload.performance_stats()
        if rank == 0:
            print(json.dumps({
                "kernel": kernel, "host_kernel": host_step.host.kernel, "compared_with": base_kernel,
                "host_steps": host_step.steps, "fetches": perf["fetches"],
                "losses_equal": losses == base_losses,
                "params_equal": all(bits(params[n]) == bits(base_params[n]) for n in base_params),
                "state_equal": all(bits(state[n][k]) == bits(base_state[n][k])
                                   for n in base_state for k in base_state[n]),
                "steps": [r for per_rank in gathered for r in per_rank],
            }), flush=True)
        trainer.close()
    for trainer, _, _ in plain.values():
        trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
