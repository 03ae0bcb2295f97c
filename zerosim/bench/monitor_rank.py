"""The rank side of ``zerosim bench monitor`` (under torchrun): one MLP trained by each adapter,
without the monitor and with it in each variant of
:data:`zerosim.bench.monitor_variants.VARIANTS`, interleaved.

argv: one JSON object (adapters, variants, steps, warmup, rounds, width, depth, batch, device, result
path; ``trace_dir``: where monitored runs write their observation files, None: nowhere). With
``device`` "cuda" each rank trains on GPU ``LOCAL_RANK`` modulo the GPUs visible, over NCCL when every
rank has a GPU of its own, else over gloo (ranks sharing a GPU), and the device is synchronised at
both ends of a timed run. The adapters:
DDP, ZeroRedundancyOptimizer, FSDP2, zerogpu ZeRO-3, and DeepSpeed ZeRO stages 1-3 (an engine configured
as ``zerosim verify``'s deepspeed adapters; the monitor reads it as ``Monitor(engine)``). Per adapter and
round: off, A, off, B, off, ... (A, B, ... the monitored variants, their order reversed every other
round), so each monitored run has a run without the monitor just before and just after it. The
variants ``every=N`` check without the step clauses (the probe taken away:
:func:`zerosim.bench.monitor_probe.without_step_checks`); ``every=N+step-checks`` with all three
(``grad_accounting`` and ``update`` at every check, ``replay`` at every check step too:
``replay_every=N``, the loop calling ``monitor.replay_check`` between backward and the optimizer
step), their own time measured per kind (:mod:`zerosim.bench.monitor_probe`). Each timed run is
``steps`` optimizer steps after ``warmup`` untimed ones (the monitor's first check among them, timed
apart), between two barriers; its time is the slowest rank's. A rank leaves with
:func:`zerogpu.rank.leave_rank` (``os._exit`` after the process group is torn down: an interpreter
exit that finalizes gloo objects aborts now and then with torch 2.13). Rank 0 writes the rows
(adapter, variant, round, position, seconds per step, the monitor's timed checks, violations, seconds
in timed checks and in its first check, the step checks' seconds and findings per kind, the clauses
off for the adapter) as JSON to the result path.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from zerogpu.comm_setup import resolve_device
from zerogpu.rank import leave_rank

from ..monitor import Monitor
from ..monitor.exchange import comm_device
from . import monitor_probe
from .gpu_session import synchronize
from .monitor_variants import VARIANTS

#: the adapters that need a package beyond torch (skipped, with the reason, when it is missing)
MAX_NORM = 1.0
TIMEOUT_S = 120  # a collective that waits longer ends the run (a rank died or hung)


class Stack(torch.nn.Module):
    """``depth`` tanh layers of ``width`` between an input and an output layer; MSE loss."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def rank_backend(device: torch.device, world_size: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo on the CPU and for ranks sharing a GPU."""
    return "nccl" if device.type == "cuda" and world_size <= torch.cuda.device_count() else "gloo"


def build(adapter: str, width: int, depth: int, device: torch.device) -> tuple[Any, Any, Any]:
    """(what steps, what the monitor watches, the optimizer) for one adapter, on ``device``."""
    model = Stack(width, depth).to(device)
    if adapter.startswith("zerogpu-"):
        from zerogpu.trainer import ZeroTrainer

        trainer = ZeroTrainer(model, {"name": "adamw", "lr": 1e-3}, adapter.removeprefix("zerogpu-"))
        return trainer, trainer, None
    if adapter in ("ddp", "zero-redundancy"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if adapter == "ddp":
            return ddp, ddp, torch.optim.AdamW(model.parameters(), lr=1e-3)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        return ddp, ddp, zero
    if adapter == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if adapter.startswith("deepspeed-"):
        return _deepspeed_engine(model, int(adapter.removeprefix("deepspeed-")))
    raise ValueError(f"unknown adapter {adapter!r}")


def _deepspeed_engine(model: torch.nn.Module, stage: int) -> tuple[Any, Any, None]:
    """A DeepSpeed engine of ZeRO ``stage``, configured as ``zerosim verify``'s deepspeed adapters (every
    parameter partitioned, AdamW in torch's implementation, ``gradient_clipping`` at MAX_NORM, nothing
    compiled); its ``close`` destroys it and drops what ZeRO-3 keeps at module level."""
    from ..verify.adapters.deepspeed_zero import _deepspeed, deepspeed_config, release_zero3_globals

    config = deepspeed_config(stage, {"name": "adamw", "lr": 1e-3, "max_grad_norm": MAX_NORM},
                              dist.get_world_size())
    engine, *_ = _deepspeed().initialize(model=model, model_parameters=list(model.parameters()),
                                         config=config, dist_init_required=False)

    def close() -> None:
        engine.destroy()
        if stage == 3:
            release_zero3_globals(engine.module)

    engine.close = close
    return engine, engine, None


def train(stepper: Any, optimizer: Any, monitor: Monitor | None, first: int, steps: int,
          batch: int, device: torch.device) -> None:
    """``steps`` optimizer steps from step ``first``, each on ``batch`` rows per rank; between backward
    and the optimizer step, ``monitor.replay_check`` with a closure of the same forward (it returns at
    once on a step not due for replay, or where replay is off)."""
    rank = dist.get_rank()
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step * 101 + rank)
        x = torch.randn(batch, 16, generator=gen).to(device)
        y = torch.randn(batch, 16, generator=gen).to(device)
        norm = None
        if hasattr(stepper, "engine"):
            loss = stepper.step(x, y)
        elif hasattr(stepper, "zero_optimization_stage"):  # a DeepSpeed engine: it clips and logs the norm
            value = stepper(x, y)
            stepper.backward(value)
            if monitor is not None:
                monitor.replay_check(step, functools.partial(stepper, x, y))
            stepper.step()
            norm, loss = stepper.get_global_grad_norm(), value.detach()
        else:
            optimizer.zero_grad()
            value = stepper(x, y)
            value.backward()
            if monitor is not None:
                monitor.replay_check(step, functools.partial(stepper, x, y))
            total = torch.nn.utils.clip_grad_norm_(list(stepper.parameters()), MAX_NORM)
            norm = total.full_tensor() if hasattr(total, "full_tensor") else total
            optimizer.step()
            loss = value.detach()
        if monitor is not None:
            monitor.after_step(step, loss=loss, grad_norm=norm)


def timed(adapter: str, variant: str, settings: dict[str, Any], out: str | None = None) -> dict[str, Any]:
    """One run: ``warmup`` untimed steps (with the monitor, so its first check, which gathers the layout
    and judges C-ZERO-001 once, is timed apart as ``first_check_s``), then ``steps`` timed ones. The
    step checks' seconds and the findings their checks carried count over the timed steps only. ``out``:
    the monitor's observation folder (None: no files)."""
    device = torch.device(resolve_device(settings["device"]))
    stepper, watched, optimizer = build(adapter, settings["width"], settings["depth"], device)
    spec = VARIANTS[variant]
    monitor = None
    if spec is not None:
        every, step_checks = spec
        with monitor_probe.timing_step_checks():
            monitor = Monitor(watched, optimizer, every=every, max_norm=MAX_NORM, log=lambda line: None,
                              replay_every=every if step_checks else None, out=out)
        if not step_checks:
            monitor_probe.without_step_checks(monitor)
    monitor_probe.reset()
    train(stepper, optimizer, monitor, 0, settings["warmup"], settings["batch"], device)
    first_check_s = monitor.seconds if monitor is not None else 0.0
    warm_checks = monitor.checks if monitor is not None else 0
    synchronize(device)
    dist.barrier()
    monitor_probe.reset()
    start = time.perf_counter()
    train(stepper, optimizer, monitor, settings["warmup"], settings["steps"], settings["batch"], device)
    synchronize(device)
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=comm_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    spent, carried = monitor_probe.snapshot()
    summary = monitor.close() if monitor is not None else {}
    if hasattr(stepper, "close"):
        stepper.close()
    # ZeRO-3's partitioned parameters report numel() 0; ds_numel is their full size
    params = sum(getattr(p, "ds_numel", p.numel())
                 for p in (watched.model if hasattr(watched, "engine") else watched).parameters())
    return {"adapter": adapter, "variant": variant, "step_s": float(elapsed) / settings["steps"],
            "checks": summary.get("checks", 0) - warm_checks, "violations": summary.get("violation_count", 0),
            "monitor_s": summary.get("monitor_seconds", 0.0) - first_check_s,
            "first_check_s": first_check_s, "local_params": params, "live_checks": summary.get("checks", 0),
            **({"trace_dir": out} if out is not None and monitor is not None else {}),
            **(step_check_fields(spent, carried, summary) if spec is not None and spec[1] else {})}


def step_check_fields(spent: dict[str, float], carried: dict[str, int],
                      summary: dict[str, Any]) -> dict[str, Any]:
    """A run's step-check figures: seconds per kind in the timed steps (:mod:`.monitor_probe`, this
    rank's; the slowest rank's where the ranks take the maximum), the timed checks whose rows carried
    each kind's finding (this rank's), and the clauses the monitor said are off for the adapter."""
    seconds = torch.tensor([spent[k] for k in monitor_probe.KINDS], dtype=torch.float64, device=comm_device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return {"step_check_s": dict(zip(monitor_probe.KINDS, seconds.tolist(), strict=True)),
            "step_check_carried": carried, "step_checks_off": summary.get("step_checks_off")}


def collective_seconds(width: int, repeats: int = 200) -> dict[str, float]:
    """Median and least seconds of one all-gather of an int64 row of ``width`` numbers (the size of the
    monitor's row for this benchmark's model), over ``repeats`` calls after 10 untimed ones."""
    row = torch.zeros(width, dtype=torch.int64, device=comm_device())
    out = list(torch.zeros(dist.get_world_size(), width, dtype=torch.int64, device=row.device).unbind(0))
    times = []
    for i in range(repeats + 10):
        start = time.perf_counter()
        dist.all_gather(out, row)
        if i >= 10:
            times.append(time.perf_counter() - start)
    times.sort()
    return {"row_numbers": width, "median_s": times[len(times) // 2], "min_s": times[0]}


def main() -> None:
    settings = json.loads(sys.argv[1])
    device = torch.device(resolve_device(settings["device"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = rank_backend(device, int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rows = []
    # per adapter, every round times each monitored variant right after and right before a run without
    # the monitor (off, A, off, B, off, ...), the variants' order reversed every other round
    monitored = [v for v in settings["variants"] if VARIANTS[v] is not None]
    for adapter in settings["adapters"]:
        for round_ in range(settings["rounds"]):
            order = monitored if round_ % 2 == 0 else monitored[::-1]
            sequence = ["off"] + [v for variant in order for v in (variant, "off")]
            for position, variant in enumerate(sequence):
                out = None if settings.get("trace_dir") is None or VARIANTS[variant] is None else \
                    os.path.join(settings["trace_dir"], f"{adapter}-{variant}-{round_}-{position}")
                rows.append({**timed(adapter, variant, settings, out), "round": round_, "position": position})
    # the monitor's row for this model: two lanes per parameter and gradient piece, and the summary
    pieces = 2 * (2 * (settings["depth"] + 2))
    collective = collective_seconds(2 * pieces + 18)
    if dist.get_rank() == 0:
        with open(settings["result"], "w") as f:
            json.dump({"world_size": dist.get_world_size(), "rows": rows, "collective": collective}, f)
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)


if __name__ == "__main__":
    main()
