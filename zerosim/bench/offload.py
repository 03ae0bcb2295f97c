"""``zerosim bench offload``: ZeRO-3 with and without CPU offload of the parameter shards, side by side.

The same model is trained by two :class:`zerogpu.trainer.ZeroTrainer`s at ZeRO-3, one of them with
``offload=OffloadConfig(device_budget_bytes=B)``, where ``B`` is what the ``--budget-units`` largest
units' shards take (2 by default: the tier cannot hold every unit, so eviction and prefetch run
every step). Steps alternate between the two trainers, so both see the same machine state. The
benchmark reports:

* the median step time of each, and their ratio (what offload costs);
* the device tier's peak against its budget (the budget is C-ZERO-004's bound for that tier);
* the offload manager's statistics: prefetch hits and misses, evictions, bytes and seconds copied,
  and the overlap fraction (on a CPU-only machine copies overlap nothing: 0 by construction);
* whether the two runs stayed bitwise equal (they must: offload moves bits, it computes nothing);
* the schedule a GPU step with the optimizer on the host would follow for the same units and budget
  (:func:`zerogpu.offload_plan.plan_step`: its device peak with gradient shards counted, bytes each
  way per step, and the share of copied bytes issued ahead of use), and the same for budgets of the 2,
  3 and all largest units at prefetch depths 1 and 2.

It runs on one rank in this process (a one-rank gloo group) unless torch.distributed is already
initialised, as under ``torchrun ... -m zerosim bench offload`` (then every rank runs it and rank 0
writes). ``--device cuda`` puts the model on the GPU; the host tier is then pinned and copies go
over a side stream. JSON: ``bench_offload.json`` in a new
``reports/bench-offload-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, require_non_negative_int, require_positive_int
from ..files.outputs import output_file, write_text

DEFAULT_OUT = "a new reports/bench-offload-<timestamp>/bench_offload.json"
DEVICES = ("cpu", "cuda")


def _validate(args: Any) -> None:
    require_positive_int("steps", args.steps)
    require_non_negative_int("warmup", args.warmup)
    require_positive_int("budget_units", args.budget_units)
    require_non_negative_int("prefetch", args.prefetch)
    if args.device not in DEVICES:
        raise ConfigError("device", args.device, f"must be one of {', '.join(DEVICES)}")
    from ..verify.model import require_model

    require_model(args.model)


def run(args: Any) -> int:
    _validate(args)
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "no CUDA device is visible here")
    own_group = not dist.is_initialized()
    out = None
    if own_group or dist.get_rank() == 0:  # refused before anything runs
        out = output_file(args.out, "bench-offload", "bench_offload.json")
    with tempfile.TemporaryDirectory(prefix="zerosim-offload-") as tmp:
        if own_group:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            report = measure(args)
        finally:
            if own_group:
                dist.destroy_process_group()
    if report["rank"] == 0:
        assert out is not None
        write_text(out, json.dumps(report, indent=2) + "\n")
        _print(report, out)
    held = report["device_peak_bytes"] <= report["device_budget_bytes"]
    return 0 if report["bitwise_equal"] and held else 1


def measure(args: Any) -> dict[str, Any]:
    """Both trainers, steps interleaved; the figures of the module docstring."""
    import torch
    import torch.distributed as dist

    from zerogpu.offload import OffloadConfig
    from zerogpu.offload_plan import plan_step
    from zerogpu.trainer import ZeroTrainer

    from ..verify.model import build_model, micro_batch, parameter_count

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else None
    optim = {"name": "adamw", "lr": 1e-3}

    def model() -> torch.nn.Module:
        m = build_model(args.model, "float32")
        return m.to(device) if device is not None else m

    plain = ZeroTrainer(model(), optim, "zero3")
    itemsize = 4
    chunks = sorted(u.chunk * itemsize for u in plain.state.units.units)
    budget = sum(chunks[-args.budget_units:])
    offloaded = ZeroTrainer(model(), optim, "zero3",
                            offload=OffloadConfig(device_budget_bytes=budget, prefetch_depth=args.prefetch))
    times: dict[str, list[float]] = {"plain": [], "offload": []}
    for step in range(1, args.warmup + args.steps + 1):
        x, y = micro_batch(rank, step, model=args.model)
        if device is not None:
            x, y = x.to(device), y.to(device)
        for name, trainer in (("plain", plain), ("offload", offloaded)):
            _sync(device)
            t0 = time.perf_counter()
            trainer.step(x, y)
            _sync(device)
            if step > args.warmup:
                times[name].append(time.perf_counter() - t0)
    a, b = plain.full_parameters(), offloaded.full_parameters()
    equal = all(torch.equal(a[n], b[n]) for n in a)
    manager = offloaded.offload
    assert manager is not None
    memory, perf = manager.memory_stats(), manager.performance_stats()
    medians = {k: statistics.median(v) for k, v in times.items()}
    units = [(u.name, u.chunk * itemsize) for u in plain.state.units.units]
    plan = plan_step(units, budget, prefetch_depth=args.prefetch)
    sweep = [{"budget_units": k, "prefetch_depth": d, **plan_step(units, sum(chunks[-k:]), prefetch_depth=d)
              .to_dict()} for k in sorted({2, 3, len(chunks)}) if k <= len(chunks) for d in (1, 2)]
    return {
        "benchmark": "offload", "rank": rank, "world": world, "model": args.model,
        "parameters": parameter_count(plain.model), "device": str(device or "cpu"),
        "units": len(chunks), "unit_shard_bytes": chunks, "device_budget_bytes": budget,
        "device_peak_bytes": memory["device"]["peak"], "host_peak_bytes": memory["host"]["peak"],
        "median_step_s": medians, "offload_over_plain": medians["offload"] / medians["plain"],
        "samples_s": times, "bitwise_equal": equal, "memory_stats": memory, "performance_stats": perf,
        "schedule_plan": plan.to_dict(), "schedule_sweep": sweep,
        "prefetch_depth": args.prefetch, "machine": {"python": platform.python_version(),
                                                    "cpus": os.cpu_count(), "torch": torch.__version__},
    }


def _sync(device: Any) -> None:
    if device is not None:
        import torch

        torch.cuda.synchronize(device)


def _print(report: dict[str, Any], out: Path) -> None:
    med = report["median_step_s"]
    perf = report["performance_stats"]
    print(f"zerosim bench offload: {report['model']} ({report['parameters']:,} parameters), "
          f"{report['units']} units, world {report['world']}, {report['device']}")
    print(f"  step: {med['plain'] * 1e3:.1f} ms without offload, {med['offload'] * 1e3:.1f} ms with "
          f"({report['offload_over_plain']:.2f}x)")
    print(f"  device tier: peak {report['device_peak_bytes']:,} B of a "
          f"{report['device_budget_bytes']:,} B budget")
    print(f"  fetches {perf['fetches']}: {perf['prefetch_hits']} prefetch hits, {perf['resident_hits']} "
          f"resident hits, {perf['misses']} misses; {perf['evictions']} evictions; "
          f"{perf['bytes_host_to_device']:,} B copied in {perf['seconds_copying'] * 1e3:.1f} ms; "
          f"overlap {perf['overlap_fraction']:.2f}")
    plan = report["schedule_plan"]
    print(f"  the GPU schedule for these units and budget (zerogpu.offload_plan, gradient shards copied "
          f"down): device peak {plan['device_peak']:,} B, {plan['bytes_host_to_device']:,} B up and "
          f"{plan['bytes_device_to_host']:,} B down a step, {plan['ahead_fraction']:.2f} of it issued ahead "
          f"of use")
    print(f"  bitwise equal to the run without offload: {'yes' if report['bitwise_equal'] else 'NO'}")
    print(f"  written: {out}")
