"""Under torchrun: zerosim.monitor.deepspeed.attach on DeepSpeed engines of ZeRO stage 1, 2 and 3, for
tests/test_monitor_frameworks.py.

argv: RESULTS_JSONL SCENARIO...; a scenario is ``NAME=STAGE,STEPS,EVERY[,FAULT]`` with FAULT a live
``ZEROSIM_FAULT`` text with ``;`` for ``:`` (``zero-state`` is applied to DeepSpeed's optimizer state
after the step). Rank 0 appends one JSON line per scenario: the monitor's summary.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

from zerogpu.rank import leave_rank  # os._exit after the teardown: a gloo finalizer can abort at exit
from zerosim.comm.fault_plan import FaultPlan
from zerosim.monitor.deepspeed import attach
from zerosim.verify.adapters.deepspeed_zero import _deepspeed, release_zero3_globals


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Linear(6, 10)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)])
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def run(spec: str) -> dict:
    stage, steps, every, *fault_text = spec.split(",")
    deepspeed = _deepspeed()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": int(stage)},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_allow_untested_optimizer": True}
    model = Tiny()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                                   config=config, dist_init_required=False)
    monitor = attach(engine, every=int(every), log=lambda line: None)
    plan = FaultPlan.from_env(fault_text[0].replace(";", ":")) if fault_text else None
    rank = dist.get_rank()
    for step in range(int(steps)):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        loss = engine(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
        engine.backward(loss)
        engine.step()
        if plan is not None and plan.kind == "zero-state" and plan.rank == rank and plan.step == step:
            for state in engine.optimizer.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
    summary = monitor.close()
    engine.destroy()
    if int(stage) == 3:
        release_zero3_globals(engine.module)
    return summary


def main() -> None:
    results, *scenarios = sys.argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for scenario in scenarios:
        name, spec = scenario.split("=", 1)
        summary = run(spec)
        if dist.get_rank() == 0:
            with open(results, "a") as f:
                f.write(json.dumps({"name": name, "summary": summary}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)


if __name__ == "__main__":
    main()
