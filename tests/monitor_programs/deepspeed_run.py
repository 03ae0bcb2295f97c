"""Under torchrun: zerosim.monitor.deepspeed.attach on DeepSpeed engines of ZeRO stage 1, 2 and 3, for
tests/test_monitor_frameworks.py.

argv: RESULTS_JSONL OUT_DIR SCENARIO...; a scenario is ``NAME=STAGE,STEPS,EVERY[,HOW]``, HOW one of:

* a live ``ZEROSIM_FAULT`` text with ``;`` for ``:`` (``zero-state`` is applied to DeepSpeed's optimizer
  state after the step);
* ``own-loop``: ``Monitor(engine)`` with the loop's own ``after_step`` and DeepSpeed's logged norm,
  observation files in OUT_DIR/NAME;
* ``local-norm@K``: the same loop, logging from step K on each rank's norm of its own gradient
  partition (DeepSpeed #7718) instead of the global one;
* ``unmonitored``: no monitor at all.

Without HOW, or with a fault: ``attach`` (observation files in OUT_DIR/NAME). Rank 0 appends one JSON line per
scenario: the monitor's summary, a digest of the final parameters and, with ``$MONITOR_COMPARE_AFTER``
= K below the run's steps, a digest of them after step K (``params_after``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

from zerogpu.rank import leave_rank  # os._exit after the teardown: a gloo finalizer can abort at exit
from zerosim.comm.fault_plan import LIVE_KINDS, FaultPlan
from zerosim.monitor import Monitor
from zerosim.monitor.deepspeed import attach
from zerosim.verify.adapters.deepspeed_zero import _deepspeed, release_zero3_globals

COMPARE_AFTER = int(os.environ.get("MONITOR_COMPARE_AFTER", "0"))


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


def run(spec: str, out: Path) -> dict:
    stage, steps, every, *how_text = spec.split(",")
    how = how_text[0] if how_text else "attach"
    deepspeed = _deepspeed()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": int(stage)},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_allow_untested_optimizer": True}
    model = Tiny()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                                   config=config, dist_init_required=False)
    own_loop = how == "own-loop" or how.startswith("local-norm@")
    local_from = int(how.split("@")[1]) if how.startswith("local-norm@") else None
    monitor = None
    if own_loop:
        monitor = Monitor(engine, every=int(every), out=out, log=lambda line: None)
    elif how != "unmonitored":
        monitor = attach(engine, every=int(every), out=out, log=lambda line: None)
    plan = FaultPlan.from_env(how.replace(";", ":")) if how.split(";")[0] in LIVE_KINDS else None
    rank = dist.get_rank()
    params_after = None
    for step in range(int(steps)):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        loss = engine(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
        engine.backward(loss)
        local = _partition_norm(engine) if local_from is not None and step >= local_from else None
        engine.step()
        if own_loop:
            assert monitor is not None
            logged = local if local is not None else float(engine.get_global_grad_norm())
            monitor.after_step(engine.global_steps - 1, loss=loss, grad_norm=logged)
        if plan is not None and plan.kind == "zero-state" and plan.rank == rank and plan.step == step:
            for state in engine.optimizer.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        if step + 1 == COMPARE_AFTER < int(steps):
            params_after = _digest(engine)
    summary = monitor.close() if monitor is not None else None
    digest = _digest(engine)
    engine.destroy()
    if int(stage) == 3:
        release_zero3_globals(engine.module)
    return {"summary": summary, "params": digest, "params_after": params_after}


def _digest(engine) -> str:
    """A digest of the full fp32 parameters (gathered from the partitions: every rank calls it)."""
    return hashlib.sha256(b"".join(safe_get_full_fp32_param(p).numpy().tobytes()
                                   for p in engine.module.parameters())).hexdigest()


def _partition_norm(engine) -> float:
    """This rank's norm of its own reduced gradient partition, after backward (ZeRO-2 reduces there)."""
    grads = [g for group in engine.optimizer.averaged_gradients.values() for g in group]
    assert grads, "ZeRO-2 holds its reduced gradient partition after backward"
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def main() -> None:
    results, out, *scenarios = sys.argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for scenario in scenarios:
        name, spec = scenario.split("=", 1)
        result = run(spec, Path(out) / name)
        if dist.get_rank() == 0:
            with open(results, "a") as f:
                f.write(json.dumps({"name": name, **result}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)


if __name__ == "__main__":
    main()
