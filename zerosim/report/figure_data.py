"""The data behind each figure of ``zerosim report`` and the sentences that state it: memory by
strategy, memory against the data-parallel degree, communication volume, equivalence error and the
ZeRO-3 offload timeline. Each function reads the measured runs (:mod:`zerosim.report.runs`) and the
closed-form models, and returns a :class:`Figure`; :mod:`zerosim.report.figures` draws it.

Why one module of this length: five figures, one function each, all reading the same runs and
the same models; a reader looking for a figure's numbers finds every figure here by its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..checks.tolerance import equivalence_tolerance
from ..cost.comm_model import comm_per_step
from ..cost.memory_model import all_strategies, memory_per_rank
from ..cost.memory_settings import MemorySettings
from ..cost.memory_timeline import modelled_step_timeline
from ..engine.config import RunConfig
from ..engine.spmd import simulate_observations
from ..values.strategy import Topology
from . import figures
from .config import ReportConfig
from .measure import (
    modelled_for_run,
)
from .runs import (
    ranks_per_node_of,
    strategy_names,
)


@dataclass
class Figure:
    name: str
    title: str
    png: str
    json: str
    data: dict[str, Any]
    words: list[str] = field(default_factory=list)



def _parts(est_class: Any, with_transient: bool) -> dict[str, int]:
    d = {"params": est_class.params.total, "grads": est_class.grads.total,
         "optimizer_states": est_class.optimizer_states.total}
    if with_transient:
        d["transient"] = est_class.transient_device
    return d


def memory_by_strategy(cfg: ReportConfig, runs: dict[str, Any]) -> Figure:
    topo = Topology(cfg.large_world_size, cfg.large_ranks_per_node)
    large = {}
    for strat in all_strategies(topo):
        large[strat.name] = _parts(memory_per_rank(cfg.large_params, strat, topo).per_rank, False)
    W = cfg.measured_world_size
    small = {}
    for name in strategy_names(W, cfg.ranks_per_node):
        m = runs[f"{W}/{name}"]["memory"]
        model = m["model_engine"]["per_rank"]
        worst = max(m["measured_per_rank"], key=lambda r: r["total"]["device"] + r["total"]["host"])
        small[name] = {
            "model": {
                c: model[c]["device"] + model[c]["host"] for c in ("params", "grads", "optimizer_states")
            }
            | {"transient": model["transient"]["device"]},
            "measured": {
                c: worst[c]["device"] + worst[c]["host"] for c in ("params", "grads", "optimizer_states")
            }
            | {"transient": worst["transient"]["device"]},
        }
    data = {
        "large": {
            "model": f"{cfg.large_params:,} params",
            "world_size": cfg.large_world_size,
            "unit": "GB",
            "settings": "mixed precision + Adam (K=12)",
            "source": "modelled (ZeRO paper accounting)",
            "strategies": large,
        },
        "small": {
            "model": f"simulator '{cfg.sim_model}'",
            "world_size": W,
            "unit": "KB",
            "backend": "simulator",
            "precision": cfg.precision,
            "partitioner": cfg.partitioner,
            "strategies": small,
            "source": "left: modelled (engine packing); right: measured live arrays + tracker",
        },
    }
    z = {k: sum(v.values()) for k, v in large.items()}
    words = [
        f"Panel (a) is MODELLED: persistent model-state bytes per rank for {cfg.large_params:,} parameters "
        "at "
        f"N_d = {cfg.large_world_size} with mixed-precision Adam (K = 12), stacked as parameters / gradients "
        "/ "
        f"optimizer states. Totals: "
        + ", ".join(f"{figures.short_name(k)} {v / 1e9:.3g} GB" for k, v in z.items())
        + " (the ZeRO paper's Figure 1: 120, 31.4, 16.6, 1.88 GB).",
        "Panel (b) puts the MODEL (left bar) next to the MEASUREMENT (right, hatched bar) for the "
        "simulator's "
        f"'{cfg.sim_model}' model at world size {W} ({cfg.precision}, {cfg.optimizer}, partitioner "
        f"{cfg.partitioner}); the grey segment is the largest transient buffer of a step (gathered blocks, "
        "unsharded gradients), which the paper does not count. Activations are measured but not modelled, "
        "so they are left out of both bars.",
    ]
    return Figure("memory_by_strategy", "Per-rank memory by strategy", "memory_by_strategy.png",
                  "memory_by_strategy.json", data, words)


def memory_vs_dp(cfg: ReportConfig, runs: dict[str, Any]) -> Figure:
    degrees = sorted(set(cfg.dp_degrees))
    curves: dict[str, list[int]] = {}
    for name in ("no_shard", "shard_optimizer", "shard_grad_op", "full_shard"):
        curves[name] = [memory_per_rank(cfg.large_params, name, n).per_rank.total.device for n in degrees]
    paper = {"no_shard": "DDP 120 GB", "shard_optimizer": "P_os 31.4 GB", "shard_grad_op": "P_os+g 16.6 GB",
             "full_shard": "P_os+g+p 1.88 GB"}
    ref_points = {}
    if 64 in degrees and cfg.large_params == 7_500_000_000:
        for name, label in paper.items():
            ref_points[name] = {"world_size": 64, "bytes": curves[name][degrees.index(64)], "label": label}
    sim_ws = sorted(set(cfg.world_sizes) | {w for w in (16, 32) if w > max(cfg.world_sizes)})
    small_curves: dict[str, list[int]] = {}
    measured: dict[str, dict[str, int]] = {}
    for name in ("no_shard", "shard_optimizer", "shard_grad_op", "full_shard"):
        ys = []
        for ws in sim_ws:
            run = RunConfig(model=cfg.sim_model, world_size=ws, strategy=name, precision=cfg.precision,
                            optimizer=cfg.optimizer, partitioner=cfg.partitioner, steps=1).resolve()
            ys.append(modelled_for_run(run).per_rank.total.total)
        small_curves[name] = ys
        measured[name] = {str(ws): max(r["total"]["device"] + r["total"]["host"]
                                       for r in runs[f"{ws}/{name}"]["memory"]["measured_per_rank"])
                          for ws in cfg.world_sizes}
    data = {"large": {"title": f"(a) MODELLED: {cfg.large_params:,} params, mixed-precision Adam (K=12); "
                               "x = paper's Figure 1 values at N_d=64",
                      "world_sizes": degrees, "curves": curves, "reference_points": ref_points},
            "small": {"title": f"(b) simulator '{cfg.sim_model}' ({cfg.precision}): lines MODELLED, "
                               f"circles MEASURED at world sizes {list(cfg.world_sizes)}",
                      "world_sizes": sim_ws, "curves": small_curves, "measured": measured}}
    words = [
        "Persistent model-state bytes per rank against the data-parallel degree, log-log. Panel (a) is "
        "MODELLED "
        f"only, for {cfg.large_params:,} parameters: DDP is flat, ZeRO-1 and ZeRO-2 approach their "
        "replicated "
        "parts (4 and 2 bytes per parameter) and ZeRO-3 falls as 1/N_d; the black crosses are the paper's "
        "printed "
        "values at N_d = 64 and lie on the curves.",
        f"Panel (b) is the honest check at a size the simulator can run: the simulator's '{cfg.sim_model}' "
        "model "
        f"({cfg.precision}), model curves (lines, engine packing, extended to 32 ranks) and what every rank "
        f"measurably held after its last step (circles, worst rank) at world sizes {list(cfg.world_sizes)}. "
        "Measured points are not scaled to the large model: the two panels are different models on purpose.",
    ]
    return Figure("memory_vs_dp", "Memory per device vs data-parallel degree", "memory_vs_dp.png",
                  "memory_vs_dp.json", data, words)


def comm_volume(cfg: ReportConfig, runs: dict[str, Any]) -> Figure:
    topo = Topology(cfg.large_world_size, cfg.large_ranks_per_node)
    large = {}
    for strat in all_strategies(topo):
        est = comm_per_step(cfg.large_params, strat, topo, None, 1, 2, 2)
        links = est.link_totals()
        large[strat.name] = {
            "model": {c: float(links[c]["sent"] / topo.world_size) for c in ("intra", "inter")},
            "elements_per_psi": float(est.elements_sent) / est.numel,
        }
    W = cfg.measured_world_size
    small = {}
    for name in strategy_names(W, cfg.ranks_per_node):
        t = runs[f"{W}/{name}"]["traffic"]
        small[name] = {"model": {"intra": t["model"]["intra"], "inter": t["model"]["inter"]},
                       "measured": {"intra": t["measured"]["intra"], "inter": t["measured"]["inter"]}}
    rpn = ranks_per_node_of(W, cfg.ranks_per_node) or W
    data = {
        "large": {
            "title": f"(a) MODELLED: {cfg.large_params:,} params, {cfg.large_world_size} ranks, "
            f"{cfg.large_ranks_per_node} per node, fp16 params and grads",
            "unit": "GB",
            "strategies": large,
        },
        "small": {
            "title": f"(b) simulator '{cfg.sim_model}', {W} ranks ({rpn} per node): left MODELLED, "
            "right (hatched) MEASURED traffic counters",
            "unit": "KB",
            "strategies": small,
        },
    }
    ratio = {k: v["elements_per_psi"] for k, v in large.items()}
    words = [
        "Bytes each rank sends per optimizer step, split by the ring edge it goes over: inside a node (blue) "
        "or to "
        "another node (red); mean over ranks. Panel (a) is MODELLED (the closed-form ring model): elements "
        "per "
        "parameter are "
        + ", ".join(f"{figures.short_name(k)} {v:.3g}" for k, v in ratio.items())
        + " — DDP and ZeRO-2 move 2(N-1)/N Psi, ZeRO-3 1.5x that; ZeRO-1 here all-reduces the gradient "
        "and then all-gathers the parameters (3(N-1)/N Psi, like torch's ZeroRedundancyOptimizer); with "
        "`--zero1-reduce reduce_scatter` (DeepSpeed stage 1) it sends the paper's 2(N-1)/N Psi. Hybrid "
        "sharding keeps the gathers inside "
        "the node and sends only a 1/k shard across nodes.",
        f"Panel (b) compares the model with the simulator's traffic counters for '{cfg.sim_model}' at {W} "
        "ranks; "
        "the bars are equal (C-ZERO-005 holds exactly, padding included). Control traffic (the grad-norm "
        "scalar, "
        "non-finite flags, the loss) is counted apart and not drawn.",
    ]
    return Figure("comm_volume", "Communication volume per strategy", "comm_volume.png", "comm_volume.json",
                  data, words)


def equivalence_error(cfg: ReportConfig, runs: dict[str, Any], mpi: dict[str, Any] | None,
                     torch_runs: dict[str, Any] | None) -> Figure:
    """C-ZERO-002's master-weight error per step: every simulator world size and the launched backends,
    on one relative scale with the tolerance the verdict applies."""
    tolerance = equivalence_tolerance(cfg.precision).atol_scale
    sim_worlds = sorted({int(k.split("/", 1)[0]) for k, v in runs.items() if "ground_truth_error" in v})
    sim_series: dict[str, list[float]] = {}
    worst_at: dict[int, tuple[float, str]] = {}
    for ws in sim_worlds:
        entries = {k.split("/", 1)[1]: v["ground_truth_error"] for k, v in runs.items()
                   if k.startswith(f"{ws}/") and "ground_truth_error" in v}
        name, errs = max(entries.items(), key=lambda kv: max(kv[1]))
        sim_series[f"world {ws} (worst of {len(entries)} strategies: {figures.short_name(name)})"] = errs
        worst_at[ws] = (max(errs), name)
    ordered_max = max((max(v["ordered_reference_error"]) for v in runs.values()
                       if "ordered_reference_error" in v), default=0.0)
    backends: dict[str, Any] = {"simulator": {"title": f"world sizes {', '.join(map(str, sim_worlds))}",
                                              "series": sim_series, "ordered_reference_max": ordered_max}}
    if mpi is not None:
        backends["mpi"] = {"title": f"mpiexec -n {mpi['world_size']}",
                           "series": {k: v["ground_truth_error"] for k, v in mpi["runs"].items()},
                           "error": mpi["error"]}
    if torch_runs is not None:
        backends["torch.distributed"] = {
            "title": f"torchrun -n {torch_runs['world_size']} (gloo, CPU)",
            "series": {k: v["ground_truth_error"] for k, v in torch_runs["runs"].items()},
            "error": torch_runs["error"]}
    data = {"backends": backends, "precision": cfg.precision, "steps": cfg.steps, "tolerance": tolerance,
            "quantity": "max |master - ground truth| / max |ground truth master|"}
    worst_ws = max(worst_at, key=lambda w: worst_at[w][0]) if worst_at else None
    per_world = ", ".join(f"world {w}: {e:.3g}" for w, (e, _) in worst_at.items())
    words = [
        f"MEASURED: after each of {cfg.steps} optimizer steps, the largest difference between any rank's "
        "fp32 master shard and the unsharded ground truth (the same model trained in one process on every "
        "rank's micro-batches), divided by the ground truth's largest weight: the quantity C-ZERO-002's "
        f"allclose clause bounds, drawn against its tolerance ({tolerance:g} for {cfg.precision}, the dashed "
        "line) on one log scale shared by every panel. "
        + (f"On the simulator, the worst strategy at each world size: {per_world}; overall "
           f"{worst_at[worst_ws][0]:.3g} (world {worst_ws}, {worst_at[worst_ws][1]}), float32 rounding: the "
           "ground truth sums the batch in a different order. " if worst_ws is not None else "")
        + f"Against the reference with the engine's own reduction order the difference is {ordered_max:.3g} "
        "on every step and world size (bit-for-bit equal).",
    ]
    if mpi is not None and mpi["runs"]:
        mw = max((max(v["ground_truth_error"]) for v in mpi["runs"].values()), default=0.0)
        words.append(f"Under mpiexec with {mpi['world_size']} ranks (mpi4py) the same comparison gives at "
                     f"most {mw:.3g}.")
    elif mpi is not None:
        words.append(f"No MPI panel: {mpi['error']}.")
    if torch_runs is not None and torch_runs["runs"]:
        tw = max((max(v["ground_truth_error"]) for v in torch_runs["runs"].values()), default=0.0)
        words.append(
            f"Under torchrun with {torch_runs['world_size']} ranks (torch.distributed, gloo on CPU, torch "
            f"arrays) it is at most {tw:.3g}."
        )
    elif torch_runs is not None:
        words.append(f"No torch.distributed panel: {torch_runs['error']}.")
    else:
        words.append("No torch.distributed panel: not requested (--no-torch).")
    return Figure("equivalence_error", "Equivalence error per step per backend", "equivalence_error.png",
                  "equivalence_error.json", data, words)


def _measured_timeline(obs: Any) -> tuple[list[dict[str, Any]], int]:
    """Points of the last step the tracker kept: device bytes without activations, with them, host.
    A free immediately followed by a new allocation of the same key (a buffer replaced) is one point."""
    steps = sorted({e["step"] for e in obs.memory_timeline if e["step"] >= 0})
    step = steps[-1] if steps else 0
    events = list(obs.memory_timeline)
    live: dict[tuple[str, str], int] = {}
    states: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        key = (e["category"], e["location"])
        live[key] = live.get(key, 0) + e["delta"]
        if e["step"] != step:
            continue
        nxt = events[i + 1] if i + 1 < len(events) else None
        if e["delta"] < 0 and nxt is not None and nxt["key"] == e["key"] and nxt["delta"] > 0:
            continue  # replaced: show only the state after the new allocation
        act = live.get(("activations", "device"), 0)
        sign = "+" if e["delta"] > 0 else "-"
        states.append({"event": f"{e['phase']} {sign}{e['key']}", "device": e["device_total"] - act,
                       "device_with_activations": e["device_total"], "host": e["host_total"]})
    return states, step


def offload_timeline(cfg: ReportConfig, runs: dict[str, Any], tick: Callable[[str], None]) -> Figure:
    W = cfg.offload_world_size
    rpn = ranks_per_node_of(W, cfg.ranks_per_node)
    tick("offload: ZeRO-3 with CPU offload")
    probe = RunConfig(
        model=cfg.sim_model,
        world_size=W,
        strategy="full_shard",
        steps=1,
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        partitioner=cfg.partitioner,
        offload=True,
        prefetch=1,
        ranks_per_node=rpn,
    )
    run = probe.resolve()
    obs = simulate_observations(run)
    engine_offloads = any(h.location == "host" for h in obs[0].steps[-1].holdings.values())
    measured_pts, measured_step = _measured_timeline(obs[0])
    base = modelled_for_run(run).settings
    engine_offload = base.offload if engine_offloads else "none"

    def modelled(offload: str) -> tuple[Any, list[dict[str, Any]]]:
        est, pts = modelled_step_timeline(run.layout, run.strategy, run.topology,
                                          MemorySettings(base.precision, base.optimizer, offload, 1), 1,
                                          run.partitioner, packing="engine")
        return est, [p.to_json() for p in pts]

    est_same, pts_same = modelled(engine_offload)
    est_none, pts_none = modelled("none")
    est_all, pts_all = modelled("params+grads+optimizer")
    measured_title = (
        f"MEASURED (engine memory tracker, rank 0), ZeRO-3, prefetch 1, step {measured_step}: "
        + (
            "CPU offload on (master, optimizer state, gradient shard on the host)"
            if engine_offloads
            else "offload requested but this engine build keeps every state on the device"
        )
    )
    series = [{"label": f"modelled, offload {engine_offload} (as the measured run)", "points": pts_same,
               "show_host": True, "host_label": f"host, modelled, offload {engine_offload}"}]
    if engine_offload != "none":
        series.append({"label": "modelled, no offload", "points": pts_none, "linestyle": "--"})
    series.append(
        {
            "label": "modelled, offload params+grads+optimizer (beyond the engine)",
            "points": pts_all,
            "linestyle": "-.",
            "show_host": True,
            "host_label": "host, modelled, offload params+grads+optimizer",
        }
    )
    panels = [
        {
            "title": measured_title,
            "series": [
                {
                    "label": "device: model states + transient buffers",
                    "points": measured_pts,
                    "show_host": True,
                    "host_label": "host (measured)",
                },
                {
                    "label": "device incl. activations (not modelled)",
                    "linestyle": "--",
                    "points": [
                        {"event": p["event"], "device": p["device_with_activations"], "host": p["host"]}
                        for p in measured_pts
                    ],
                },
            ],
        },
        {
            "title": "MODELLED (per-block schedule of the memory model), same model and ranks",
            "series": series,
        },
    ]
    peak_meas = max(p["device"] for p in measured_pts) if measured_pts else 0
    host_meas = max(p["host"] for p in measured_pts) if measured_pts else 0
    data = {"unit": "KB", "panels": panels, "engine_offloads": engine_offloads, "world_size": W,
            "model": cfg.sim_model, "engine_offload_setting": engine_offload,
            "modelled_peak_same_settings": est_same.per_rank.peak_device,
            "modelled_host_same_settings": est_same.per_rank.total.host,
            "modelled_peak_no_offload": est_none.per_rank.peak_device,
            "modelled_peak_full_offload": est_all.per_rank.peak_device,
            "measured_peak_without_activations": peak_meas, "measured_host": host_meas}
    words = [
        "Device bytes after every allocation and free of one ZeRO-3 step of the simulator's "
        f"'{cfg.sim_model}' "
        f"model on {W} ranks with prefetch depth 1. Top panel MEASURED by the engine's memory tracker "
        + (
            "with CPU offload on: the fp32 master, the optimizer state and the gradient shard live in host "
            "memory, "
            "the working parameter shard and the transient buffers on the device. "
            if engine_offloads
            else "(this engine build does not offload, so everything stays on the device). "
        )
        + f"Its peak without activations is {peak_meas:,} B on the device and {host_meas:,} B on the host; "
        "the "
        f"memory model predicts {est_same.per_rank.peak_device:,} B and {est_same.per_rank.total.host:,} B "
        "for the same settings (bottom panel, MODELLED, same schedule block by block).",
        "Bottom panel, MODELLED only: without offload the device peak would be "
        f"{est_none.per_rank.peak_device:,} B; "
        "offloading the parameter shard too (which the engine does not do) would leave only the gathered "
        "blocks "
        f"and one block's gradient buffer, {est_all.per_rank.peak_device:,} B.",
    ]
    return Figure("offload_timeline", "ZeRO-3 offload device-memory timeline", "offload_timeline.png",
                  "offload_timeline.json", data, words)


