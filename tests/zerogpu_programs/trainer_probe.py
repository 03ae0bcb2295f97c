"""Under torchrun: ZeroTrainer on a probe whose gradients are given, against the engine arithmetic in numpy.

The probe's loss is ``sum_t (p_t * G_t).sum()``, so autograd's gradient of ``p_t`` is exactly ``G_t``
(a seeded float32 array per rank and step). One parameter of block 1 is never used (gradient zero),
so the engine's path for blocks autograd never completes runs too. What remains is the engine: the
averaging reduction, the global-norm clip and the optimizer step. Rank 0 repeats that arithmetic on
the full flat vector in numpy (rank-order sum divided by the world size, :mod:`zerosim.numerics.optim`) and
prints one JSON line per (strategy, optimizer): the largest difference of parameters and optimizer
state. At two ranks a sum is one commutative addition, so the difference must be exactly 0; at more
ranks gloo adds in its own order and the test allows the reordering bound instead. Each line also
counts the all-reduces over the world group per step.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist

from zerogpu.trainer import ZeroTrainer
from zerosim.numerics.optim import OptimizerSpec, clip_coefficient, global_norm_from_sumsq, make_optimizer

SHAPES = {"a.weight": (7, 5), "a.bias": (7,), "blocks.0.w": (11, 3), "blocks.1.w": (13,),
          "blocks.1.unused": (4,), "head.w": (3, 3)}
UNUSED = {"blocks.1.unused"}  # never in the graph: autograd never completes block 1, its gradient is zero
STEPS = 3


class Probe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.a = torch.nn.Module()
        self.a.weight = torch.nn.Parameter(torch.randn(*SHAPES["a.weight"], generator=gen))
        self.a.bias = torch.nn.Parameter(torch.randn(*SHAPES["a.bias"], generator=gen))
        self.blocks = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        self.blocks[0].w = torch.nn.Parameter(torch.randn(*SHAPES["blocks.0.w"], generator=gen))
        self.blocks[1].w = torch.nn.Parameter(torch.randn(*SHAPES["blocks.1.w"], generator=gen))
        self.blocks[1].unused = torch.nn.Parameter(torch.randn(*SHAPES["blocks.1.unused"], generator=gen))
        self.head = torch.nn.Module()
        self.head.w = torch.nn.Parameter(torch.randn(*SHAPES["head.w"], generator=gen))
        for i, block in enumerate(self.blocks):
            block.forward = self._block_forward(i)  # type: ignore[method-assign]

    def _block_forward(self, i: int):
        def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
            return (self.blocks[i].w * x[f"blocks.{i}.w"]).sum()
        return forward

    def forward(self, grads: dict[str, torch.Tensor], _: object = None) -> torch.Tensor:
        loss = (self.a.weight * grads["a.weight"]).sum() + (self.a.bias * grads["a.bias"]).sum()
        for block in self.blocks:
            loss = loss + block(grads)
        return loss + (self.head.w * grads["head.w"]).sum()


def gradients(rank: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return {n: (rng.standard_normal(s) * (n not in UNUSED)).astype(np.float32) for n, s in SHAPES.items()}


def reference(spec: OptimizerSpec, world: int, names: list[str]) -> tuple[np.ndarray, dict]:
    model = Probe()
    params = dict(model.named_parameters())
    master = np.concatenate([params[n].detach().numpy().reshape(-1) for n in names]).astype(np.float32)
    opt = make_optimizer(spec, "numpy")
    state = opt.init_state(master.shape[0])
    for step in range(STEPS):
        total = None
        for r in range(world):
            g = np.concatenate([gradients(r, step)[n].reshape(-1) for n in names])
            total = g if total is None else total + g
        grad = (total / np.float32(world)).astype(np.float32)
        if spec.max_grad_norm is not None:
            norm = global_norm_from_sumsq(float(np.sum(grad.astype(np.float64) ** 2)))
            coef = clip_coefficient(norm, spec.max_grad_norm)
            if coef != 1.0:
                grad *= np.float32(coef)
        opt.step(master, grad, state)
    return master, state


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    strategies = ["ddp", "zero1", "zero2", "zero3"] + (["hybrid"] if world % 2 == 0 else [])
    specs = {"sgd": OptimizerSpec("sgd", lr=0.1, momentum=0.9),
             "adamw": OptimizerSpec("adamw", lr=0.01, max_grad_norm=0.5)}
    for strategy in strategies:
        for opt_name, spec in specs.items():
            model = Probe()
            trainer = ZeroTrainer(model, spec, strategy)
            for step in range(STEPS):
                trainer.step({n: torch.from_numpy(g) for n, g in gradients(rank, step).items()})
            names = [t.name for t in trainer.state.layout.tensors]
            full = trainer.full_parameters()
            state = trainer.full_optimizer_state()
            if rank == 0:
                want, want_state = reference(spec, world, names)
                got = torch.cat([full[n].reshape(-1) for n in names]).numpy()
                diffs = {"params": float(np.max(np.abs(got - want)))}
                for key in spec.state_names:
                    got_s = torch.cat([state[n][key].reshape(-1) for n in names]).numpy()
                    diffs[key] = float(np.max(np.abs(got_s - want_state[key])))
                scale = float(np.max(np.abs(want)))
                records = trainer.state.comm.traffic.records
                data_all_reduces = sum(r.calls for (group, kind), r in records.items()
                                       if kind == "all_reduce" and group == trainer.state.comm.group_name)
                print(json.dumps({"strategy": strategy, "optimizer": opt_name, "world": world,
                                  "diffs": diffs, "scale": scale,
                                  "data_all_reduces_per_step": data_all_reduces / STEPS}), flush=True)
            trainer.schedule.remove_hooks()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from zerogpu.rank import leave_rank

    leave_rank(main())
