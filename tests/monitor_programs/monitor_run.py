"""Under torchrun: a tiny training loop per scenario with zerosim.monitor checking it, for
tests/test_monitor_live.py (one launch runs many scenarios).

argv: RESULTS_JSONL OUT_ROOT SCENARIO...; a scenario is ``NAME=ADAPTER,STEPS,EVERY,MONITOR[,FAULT]``
with ADAPTER one of ddp, zero-redundancy, fsdp2, hsdp, zerogpu-zero2, zerogpu-zero3, zerogpu-hybrid;
MONITOR 1, 2 or 0 (1: the monitor with its default overlap, 2: without overlap, 0: the same loop without a
monitor, for the bitwise comparison); FAULT a live
``ZEROSIM_FAULT`` text with ``;`` for ``:``. Rank 0 appends one JSON line per scenario: the
violations the monitor returned (step, contract, clause, ranks, tensor), its summary, a digest of
the final full parameters and, with ``$MONITOR_COMPARE_AFTER`` = K below the run's steps, a digest of
them after step K (``params_after``: a long monitored run compared with a K-step run without it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zerogpu.comm_setup import resolve_device
from zerogpu.rank import leave_rank  # os._exit after the teardown: a gloo finalizer can abort at exit
from zerosim.bench.monitor_rank import rank_backend
from zerosim.monitor import Monitor
from zerosim.monitor.faults import LiveFault

MAX_NORM = 1.0
TIMEOUT_S = 120  # a collective that waits longer ends the run (a rank died or hung)
DEVICE = torch.device(resolve_device(os.environ.get("MONITOR_DEVICE", "cpu")))
COMPARE_AFTER = int(os.environ.get("MONITOR_COMPARE_AFTER", "0"))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Linear(6, 10)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)])
        self.head = torch.nn.Linear(10, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=gen).to(DEVICE), torch.randn(4, 3, generator=gen).to(DEVICE)


def build(adapter: str) -> tuple[object, object, object]:
    """(what the loop steps, the monitor's model, the optimizer)."""
    model = Tiny().to(DEVICE)
    world = dist.get_world_size()
    if adapter.startswith("zerogpu-"):
        from zerogpu.trainer import ZeroTrainer

        strategy = adapter.removeprefix("zerogpu-")
        mesh = (2, world // 2) if strategy == "hybrid" else None
        trainer = ZeroTrainer(model, {"name": "adamw", "lr": 0.01}, strategy, mesh=mesh)
        return trainer, trainer, None
    if adapter == "ddp-layout-change":  # DDP whose rank 1 shows no gradient at DROP_GRADS_AT (run)
        adapter = "ddp"
    if adapter in ("ddp", "zero-redundancy"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if adapter == "ddp":
            return ddp, ddp, torch.optim.AdamW(model.parameters(), lr=0.01)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
        return ddp, ddp, zero
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if adapter == "hsdp":
        mesh = init_device_mesh(DEVICE.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE.type, (world,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model, torch.optim.AdamW(model.parameters(), lr=0.01)


def full_digest(model: object) -> str:
    module = getattr(model, "module", model)
    if hasattr(module, "engine"):
        named = module.full_parameters().items()
    else:
        named = ((n, p.full_tensor() if hasattr(p, "full_tensor") else p)
                 for n, p in module.named_parameters())
    h = hashlib.sha256()
    for name, p in named:
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


#: the step after which rank 1 of a ``ddp-layout-change`` run drops its gradients before the check: its
#: layout loses the gradient pieces at that check and gains them back at the next
DROP_GRADS_AT = 5


def run(name: str, spec: str, out_root: Path) -> dict:
    adapter, steps, every, with_monitor, *fault_text = spec.split(",")
    rank = dist.get_rank()
    fault = LiveFault.from_env(rank, fault_text[0].replace(";", ":")) if fault_text else None
    stepper, watched, optimizer = build(adapter)
    monitor = (Monitor(watched, optimizer, every=int(every), out=out_root / name, max_norm=MAX_NORM,
                       log=lambda line: None, overlap=with_monitor == "1") if with_monitor != "0" else None)
    found = []
    params_after = None
    for step in range(int(steps)):
        x, y = batch(rank, step)
        norm = None
        loss: float
        if hasattr(stepper, "engine"):
            loss = stepper.step(x, y)
        else:
            optimizer.zero_grad()
            value = stepper(x, y)
            value.backward()
            if fault is not None:
                fault.grads(step, stepper)
            total = torch.nn.utils.clip_grad_norm_(list(stepper.parameters()), MAX_NORM)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
            if fault is not None:
                fault.optimizer_step(step, optimizer)
            else:
                optimizer.step()
            loss = float(value.detach())
        if fault is not None:
            fault.after_step(step, stepper, optimizer)
        if adapter == "ddp-layout-change" and rank == 1 and step == DROP_GRADS_AT:
            optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            for v in monitor.after_step(step, loss=loss, grad_norm=norm):
                found.append({"step": v.step, "contract": v.contract, "clause": v.clause,
                              "ranks": list(v.ranks), "tensor": v.tensor, "text": str(v)})
        if step + 1 == COMPARE_AFTER < int(steps):
            params_after = full_digest(stepper)
    if monitor is not None:
        for v in monitor.flush():  # the last check's, when its exchange overlapped the loop's end
            found.append({"step": v.step, "contract": v.contract, "clause": v.clause,
                          "ranks": list(v.ranks), "tensor": v.tensor, "text": str(v)})
    summary = monitor.close() if monitor is not None else None
    digest = full_digest(stepper)
    if hasattr(stepper, "close"):
        stepper.close()
    return {"name": name, "adapter": adapter, "violations": found, "summary": summary, "params": digest,
            "params_after": params_after}


def main() -> None:
    results, out_root, *scenarios = sys.argv[1:]
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    backend = rank_backend(DEVICE, int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    for scenario in scenarios:
        name, spec = scenario.split("=", 1)
        record = run(name, spec, Path(out_root))
        if dist.get_rank() == 0:
            with open(results, "a") as f:
                f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)


if __name__ == "__main__":
    main()
