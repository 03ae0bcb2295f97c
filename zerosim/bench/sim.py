"""``zerosim bench sim``: the simulator's cost, measured side by side in one run.

For each world size N (default 8 and 32) on the ``sim-10m`` preset:

1. **time ratio**: one simulated ZeRO-3 step of N ranks (every rank: its micro-batch forward and
   backward block by block, all-gathers, reduce-scatters, the grad-norm all-reduce, its optimizer
   shard) divided by one *unsharded* numpy step doing the same arithmetic: the same model on the
   same N micro-batches, one after the other, gradients accumulated in float32, the global norm,
   clipping, the full optimizer step. Both are timed alternately, ``--repeats`` times after a
   warm-up; the ratio of the medians and of the minima are reported (the minimum is the least
   disturbed by other processes on a shared machine). Target: at most 1.1 up to 8 ranks, at most
   1.3 beyond (:func:`target_ratio`).
2. **memory**: the peak of the process's traced allocations (``tracemalloc``: numpy registers
   every array) during one simulated step, against the sum over ranks of what each rank holds at its
   own peak (the engine's memory tracker: shards, gathered blocks, gradient buffers, activations),
   and against one full float32 copy of the model per rank. A simulator that kept a hidden full copy
   per rank would exceed the sum by about N model copies.

Writes ``bench_sim.json`` in a new ``reports/bench-sim-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

from ..engine.config import ResolvedRun, RunConfig
from ..errors import ConfigError
from ..files.outputs import output_file, write_text
from ..numerics.flat import flatten, unflatten
from ..numerics.model import BlockModel, init_params, synthetic_batch
from ..numerics.optim import apply_clip_, clip_coefficient, global_norm_from_sumsq, make_optimizer
from ..numerics.xp import numpy_namespace

DEFAULT_OUT = "a new reports/bench-sim-<timestamp>/bench_sim.json"


def target_ratio(world_size: int) -> float:
    """The simulated step's target, as a multiple of the unsharded numpy step: 1.1 up to 8 ranks, 1.3
    beyond (more ranks: more collectives and more, smaller shards per unit of arithmetic)."""
    return 1.1 if world_size <= 8 else 1.3


def baseline_step(
    run: ResolvedRun, master: Any, state: dict[str, Any], step: int, model: BlockModel, opt: Any
) -> float:
    """One unsharded step with the same arithmetic as the N simulated ranks; returns seconds."""
    xp = numpy_namespace()
    layout, cfg = run.layout, run.model_cfg
    t = time.perf_counter()
    params = unflatten(run.precision.to_params(master, xp), layout)
    acc = None
    for rank in range(run.world_size):
        for micro in range(run.micro_batches):
            tokens, targets = synthetic_batch(cfg, run.seed, step, rank, micro)
            _, grads = model.loss_and_grads(params, tokens, targets)
            g = xp.astype(flatten(grads, layout), "float32")
            if acc is None:
                acc = g
            else:
                acc += g
    assert acc is not None
    acc /= run.world_size * run.micro_batches
    norm = global_norm_from_sumsq(xp.sum_of_squares(acc))
    if run.spec.max_grad_norm is not None:
        apply_clip_(acc, clip_coefficient(norm, run.spec.max_grad_norm), xp)
    opt.step(master, acc, state)
    return time.perf_counter() - t


def sim_step_times(run: ResolvedRun) -> tuple[list[float], list[Any]]:
    """Wall time of every simulated step: first start to last end over all ranks."""
    from ..engine.spmd import simulate_observations

    obs = simulate_observations(run)
    times = []
    for s in range(run.steps):
        rows = [o.steps[s] for o in obs]
        times.append(max(r.t_end for r in rows) - min(r.t_start for r in rows))
    return times, obs


def measure(world_size: int, args: Any) -> dict[str, Any]:
    """``--repeats`` rounds, each: one simulated run of 2 steps (warm-up + timed), then 2 unsharded
    steps (warm-up + timed). Alternating whole rounds exposes both sides to the same machine load."""
    reps = args.repeats
    cfg = RunConfig(
        model=args.model,
        world_size=world_size,
        strategy=args.strategy,
        partitioner=args.partitioner,
        optimizer=args.optimizer,
        steps=2,
        observe="none",
        schedule=args.schedule,
    )
    run = cfg.resolve()
    xp = numpy_namespace()
    model = BlockModel(run.model_cfg, xp)
    opt = make_optimizer(run.spec, xp)
    master = flatten(init_params(run.model_cfg, run.seed), run.layout)
    state = opt.init_state(run.layout.total_numel)
    base: list[float] = []
    sim: list[float] = []
    sim_warm: list[float] = []
    for i in range(reps):
        times, _ = sim_step_times(run)
        sim_warm.append(times[0])
        sim.append(times[1])
        baseline_step(run, master, state, 2 * i, model, opt)  # warm-up
        base.append(baseline_step(run, master, state, 2 * i + 1, model, opt))
    # memory: one simulated step under tracemalloc
    mem_run = RunConfig(
        model=args.model,
        world_size=world_size,
        strategy=args.strategy,
        partitioner=args.partitioner,
        optimizer=args.optimizer,
        steps=1,
        observe="none",
        schedule=args.schedule,
    ).resolve()
    del master, state
    tracemalloc.start()
    tracemalloc.reset_peak()
    start_bytes = tracemalloc.get_traced_memory()[0]
    _, mobs = sim_step_times(mem_run)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rank_peaks = [
        o.steps[0].memory.peak_by_location.get("device", 0)
        + o.steps[0].memory.peak_by_location.get("host", 0)
        for o in mobs
    ]
    init_peaks = [sum(o.init_peak_bytes.values()) for o in mobs]
    model_bytes = run.layout.total_numel * 4
    process_peak = peak - start_bytes
    result = {
        "world_size": world_size,
        "num_params": run.layout.total_numel,
        "tokens_per_step": run.model_cfg.tokens_per_micro_batch * world_size * run.micro_batches,
        "sim_step_s": sim,
        "sim_first_step_s": sim_warm,
        "baseline_step_s": base,
        "ratio_median": statistics.median(sim) / statistics.median(base),
        "ratio_min": min(sim) / min(base),
        "target_ratio": target_ratio(world_size),
        "memory": {
            "process_peak_bytes": process_peak,
            "sum_rank_peak_bytes": sum(rank_peaks),
            "max_rank_peak_bytes": max(rank_peaks),
            "sum_rank_init_state_bytes": sum(init_peaks),
            "full_model_fp32_bytes": model_bytes,
            "process_peak_over_sum_rank_peaks": process_peak / max(1, sum(rank_peaks)),
            "hidden_full_copies_per_rank_upper_bound": max(
                0.0, (process_peak - sum(rank_peaks)) / (model_bytes * world_size)
            ),
        },
    }
    return result


def run(args: Any) -> int:
    try:
        sizes = [int(x) for x in str(args.world_sizes).split(",") if x.strip()]
    except ValueError:
        raise ConfigError("world_sizes", args.world_sizes, "must be comma-separated integers") from None
    if not sizes or any(n <= 0 for n in sizes):
        raise ConfigError("world_sizes", args.world_sizes, "must be positive integers")
    if isinstance(args.repeats, bool) or args.repeats < 1:
        raise ConfigError("repeats", args.repeats, "must be >= 1")
    RunConfig(model=args.model, world_size=sizes[0], strategy=args.strategy, partitioner=args.partitioner,
              optimizer=args.optimizer).validate()
    out = output_file(args.out, "bench-sim", "bench_sim.json")  # refused before anything runs
    results = []
    for n in sizes:
        if not args.json:
            print(f"measuring {args.model} {args.strategy} on {n} simulated ranks ...", flush=True)
        results.append(measure(n, args))
    report = {
        "benchmark": "sim",
        "model": args.model,
        "strategy": args.strategy,
        "partitioner": args.partitioner,
        "optimizer": args.optimizer,
        "schedule": args.schedule,
        "repeats": args.repeats,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "results": results,
    }
    write_text(out, json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_table(report, out)
    return 0


def _print_table(report: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    from ..files.text_tables import print_table

    t = Table(title=f"zerosim bench sim: {report['model']} {report['strategy']} ({report['partitioner']})")
    for col in ("ranks", "sim step (s, median)", "unsharded step (s, median)", "ratio median", "ratio min",
                "target", "process peak (MB)", "sum of rank peaks (MB)", "peak / sum"):
        t.add_column(col, justify="right")
    for r in report["results"]:
        m = r["memory"]
        t.add_row(str(r["world_size"]), f"{statistics.median(r['sim_step_s']):.3f}",
                  f"{statistics.median(r['baseline_step_s']):.3f}", f"{r['ratio_median']:.2f}",
                  f"{r['ratio_min']:.2f}", f"<= {r['target_ratio']}", f"{m['process_peak_bytes'] / 1e6:.1f}",
                  f"{m['sum_rank_peak_bytes'] / 1e6:.1f}", f"{m['process_peak_over_sum_rank_peaks']:.2f}")
    print_table(t)
    print(f"report: {out}")
