"""Measured memory, traffic and equivalence error from engine runs, next to the closed-form models.

C-ZERO-004 / C-ZERO-005 from the cost side: what the backends allocate and send (their own
counters: live-array bytes in ``Holding``, the memory tracker's event timeline, the traffic
counters) is compared with :func:`~zerosim.cost.memory_model.memory_per_rank` and
:func:`~zerosim.cost.comm_model.comm_for_run`, category by category, with the reason for every
non-zero difference spelled out.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ..cost.comm_model import comm_for_run
from ..cost.memory_model import MemoryEstimate, memory_per_rank
from ..cost.memory_settings import ENGINE_PRECISION, MemorySettings
from ..engine.config import ResolvedRun, RunConfig
from ..errors import ConfigError
from ..files import datafile
from ..values.observe import STORED_TYPES, RankObservation
from ..values.strategy import Topology

MODEL_STATE = ("params", "grads", "optimizer_states")
_HOLDING_KIND = {"params": "params", "grads": "grads", "optimizer_states": "optimizer"}


# ---------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------
def engine_memory_settings(run: ResolvedRun) -> MemorySettings:
    """The memory model's settings for an engine run: its precision policy, optimizer, offload, prefetch
    and ZeRO-1 gradient reduction (``zero1_grad_reduce``)."""
    states = len(run.spec.state_names)
    optimizer = {0: "sgd", 1: "sgd-momentum", 2: "adamw"}.get(states)
    if optimizer is None:
        raise ConfigError("optimizer", run.spec.name, f"{states} state buffers: no memory-model equivalent")
    offload = "grads+optimizer" if run.cfg.offload else "none"
    return MemorySettings(ENGINE_PRECISION[run.precision.name], optimizer, offload, run.prefetch,
                          zero1_grad_reduce=run.zero1_grad_reduce)


def modelled_for_run(
    run: ResolvedRun, packing: str = "engine", partitioner: str | None | bool = True
) -> MemoryEstimate:
    """The memory model for ``run``: ``packing="engine"`` with the run's partitioner reproduces the
    engine's buffers; ``partitioner=None`` gives the ZeRO paper's even split (no partitioner padding)."""
    part = run.partitioner if partitioner is True else (partitioner or None)
    if part is None and packing == "engine":
        packing = "partitioner"
    return memory_per_rank(run.layout, run.strategy, run.topology, engine_memory_settings(run), part,
                           packing=packing)


def _replay(timeline: Sequence[dict[str, Any]], step: int) -> dict[str, int]:
    """Peaks during ``step`` from the tracker's events: transient (gathered + grad_buffers on the
    device, at the same instant), activations, and the device total."""
    live: dict[tuple[str, str], int] = {}
    peaks = {"transient": 0, "activations": 0, "device": 0, "host": 0, "seen": 0}
    for e in timeline:
        key = (e["category"], e["location"])
        live[key] = live.get(key, 0) + e["delta"]
        if e["step"] != step:
            continue
        peaks["seen"] = 1
        transient = live.get(("gathered", "device"), 0) + live.get(("grad_buffers", "device"), 0)
        peaks["transient"] = max(peaks["transient"], transient)
        peaks["activations"] = max(peaks["activations"], live.get(("activations", "device"), 0))
        peaks["device"] = max(peaks["device"], e["device_total"])
        peaks["host"] = max(peaks["host"], e["host_total"])
    return peaks


def measured_memory(obs: RankObservation, step: int | None = None) -> dict[str, Any]:
    """One rank's measured bytes: model states from its live arrays (``Holding``) after ``step``
    (default the last), transient and activation peaks from the tracker's timeline of that step
    (or the last step the timeline kept)."""
    so = obs.steps[-1] if step is None else next(s for s in obs.steps if s.step == step)
    out: dict[str, Any] = {}
    for cat in MODEL_STATE:
        h = so.holdings[_HOLDING_KIND[cat]]
        out[cat] = {"device": h.nbytes if h.location == "device" else 0,
                    "host": h.nbytes if h.location == "host" else 0,
                    "stored_numel": h.stored_numel, "padding": h.padding}
    out["total"] = {p: sum(out[c][p] for c in MODEL_STATE) for p in ("device", "host")}
    steps_in_timeline = sorted({e["step"] for e in obs.memory_timeline if e["step"] >= 0})
    t_step = (
        so.step if so.step in steps_in_timeline else (steps_in_timeline[-1] if steps_in_timeline else None)
    )
    peaks = _replay(obs.memory_timeline, t_step) if t_step is not None else {}
    out["transient"] = {"device": peaks.get("transient", 0)}
    out["activations"] = {"device": peaks.get("activations", 0)}
    out["peak"] = {"device": peaks.get("device", 0), "host": peaks.get("host", 0)}
    out["timeline_step"] = t_step
    return out


def _rel(measured: float, model: float) -> float:
    if model == 0:
        return 0.0 if measured == 0 else float("inf")
    return (measured - model) / model


def memory_comparison(run: ResolvedRun, observations: Sequence[RankObservation]) -> dict[str, Any]:
    """Model vs measured per category for one run: the worst rank of each, relative differences vs the
    engine-packing model and vs the ZeRO paper's even split, and what explains every difference."""
    engine_model = modelled_for_run(run, "engine")
    paper_model = modelled_for_run(run, "partitioner", partitioner=None)
    per_rank = [measured_memory(o) for o in observations]
    rows = []
    explain_padding = (
        engine_model.per_rank.numel["optimizer_states"] - paper_model.per_rank.numel["optimizer_states"]
    )
    for cat in (*MODEL_STATE, "total", "transient"):
        if cat == "transient":
            meas = max(m["transient"]["device"] for m in per_rank)
            meas_min = min(m["transient"]["device"] for m in per_rank)
            em, pm = engine_model.per_rank.transient_device, paper_model.per_rank.transient_device
            placement_ok = True
        else:
            meas = max(m[cat]["device"] + m[cat]["host"] for m in per_rank)
            meas_min = min(m[cat]["device"] + m[cat]["host"] for m in per_rank)
            em = engine_model.per_rank.category(cat).total
            pm = paper_model.per_rank.category(cat).total
            placed = engine_model.per_rank.category(cat)
            placement_ok = all((m[cat]["device"] == 0) == (placed.device == 0) and
                               (m[cat]["host"] == 0) == (placed.host == 0) for m in per_rank if meas)
        rel_e, rel_p = _rel(meas, em), _rel(meas, pm)
        why = []
        if not placement_ok:
            why.append("UNEXPLAINED: device / host placement differs from the model's offload setting")
        if rel_e != 0:
            why.append(
                "transient: the engine's schedule differs from the modelled phases"
                if cat == "transient"
                else "UNEXPLAINED: the engine holds bytes the model does not predict"
            )
        if rel_p != 0 and cat != "transient":
            if explain_padding and (cat != "params" or run.strategy.shards_params) and (
                    cat != "grads" or run.strategy.shards_grads):
                why.append(
                    f"padding: the engine stores {engine_model.per_rank.numel['optimizer_states']} elements "
                    f"per shard ({run.partitioner} packing), the paper's even split "
                    f"{paper_model.per_rank.numel['optimizer_states']}"
                )
            else:
                why.append("padding")
        if cat == "transient" and rel_p != 0 and rel_e == 0:
            units = engine_model.units
            if run.strategy.shards_params and any(u.unpack_copy for u in units):
                why.append(
                    f"{run.partitioner} packing is not in unit order: each gathered block is also copied "
                    "to unit order (gathered bytes x2)"
                )
            if any(u.packed_numel > u.numel for u in units):
                why.append(f"padding: {run.partitioner} packs {sum(u.packed_numel for u in units)} elements "
                           f"for {sum(u.numel for u in units)}")
        rows.append({"category": cat, "measured_max_rank": meas, "measured_min_rank": meas_min,
                     "model_engine": em, "model_paper": pm, "placement_matches": placement_ok,
                     "rel_diff_vs_engine_model": rel_e,
                     "rel_diff_vs_paper_model": rel_p, "explanation": "; ".join(why) or "exact"})
    return {"strategy": run.strategy.name, "world_size": run.world_size, "precision": run.precision.name,
            "optimizer": run.spec.name, "partitioner": run.partitioner, "num_params": run.layout.total_numel,
            "activations_measured_max_rank": max(m["activations"]["device"] for m in per_rank),
            "rows": rows, "measured_per_rank": per_rank,
            "model_engine": engine_model.to_json(), "model_paper": paper_model.to_json()}


# ---------------------------------------------------------------------------------------------------
# traffic
# ---------------------------------------------------------------------------------------------------
def measured_link_traffic(observations: Sequence[RankObservation], topology: Topology,
                          step: int = -1) -> dict[str, Any]:
    """Data bytes each rank sent during one step, split intra- / inter-node by ring successor
    (the same attribution as the comm model), mean over ranks; control traffic apart."""
    tot = {"intra": Fraction(0), "inter": Fraction(0), "control": Fraction(0), "sent": Fraction(0)}
    per_rank_sent = []
    for o in observations:
        so = o.steps[step]
        sent = Fraction(0)
        for t in so.traffic:
            if t.channel == "control":
                tot["control"] += Fraction(t.bytes_sent)
                continue
            if t.channel != "data":
                continue
            members = list(o.groups.get(t.group, ()))
            if len(members) > 1 and o.rank in members:
                succ = members[(members.index(o.rank) + 1) % len(members)]
                tot["intra" if topology.same_node(o.rank, succ) else "inter"] += Fraction(t.bytes_sent)
            sent += Fraction(t.bytes_sent)
        tot["sent"] += sent
        per_rank_sent.append(float(sent))
    n = len(observations)
    return {
        "intra": float(tot["intra"] / n),
        "inter": float(tot["inter"] / n),
        "sent_mean": float(tot["sent"] / n),
        "sent_max_rank": max(per_rank_sent),
        "sent_min_rank": min(per_rank_sent),
        "control_mean": float(tot["control"] / n),
    }


def traffic_comparison(run: ResolvedRun, observations: Sequence[RankObservation]) -> dict[str, Any]:
    est = comm_for_run(run)
    links = est.link_totals()
    n = run.world_size
    model = {"intra": float(links["intra"]["sent"] / n), "inter": float(links["inter"]["sent"] / n),
             "sent": float(est.bytes_sent)}
    meas = measured_link_traffic(observations, run.topology)
    return {
        "strategy": run.strategy.name,
        "world_size": n,
        "model": model,
        "measured": meas,
        "rel_diff": _rel(meas["sent_max_rank"], model["sent"]),
        "paper_elements": float(est.paper_elements()),
        "packed_numel": est.packed_numel,
        "numel": est.numel,
    }


# ---------------------------------------------------------------------------------------------------
# equivalence error per step
# ---------------------------------------------------------------------------------------------------
def equivalence_errors(
    run: ResolvedRun, observations: Sequence[RankObservation], reference: Any
) -> list[float]:
    """Per step: max over ranks and owned elements of ``|master - reference master| / max|reference master|``.

    The quantity C-ZERO-002's ``allclose`` clause bounds by ``atol_scale`` for the master weights
    (0.0 = equal). Relative to the reference's largest weight, so backends and world sizes share a scale."""
    out = []
    for s, ref in enumerate(reference.steps):
        worst = 0.0
        scale = float(np.max(np.abs(ref.master.astype(np.float64)))) if ref.master.size else 0.0
        for o in observations:
            so = next((x for x in o.steps if x.step == s), None)
            if so is None or so.master is None:
                continue
            vals = so.master.values
            for g0, g1, pos in so.master.pieces:
                got = vals[pos:pos + g1 - g0].astype(np.float64)
                exp = ref.master[g0:g1].astype(np.float64)
                if got.size:
                    worst = max(worst, float(np.max(np.abs(got - exp))))
        out.append(worst / scale if scale > 0 else worst)
    return out


# ---------------------------------------------------------------------------------------------------
# MPI: the engine under mpiexec, observations shipped back to this process
# ---------------------------------------------------------------------------------------------------
@dataclass
class MpiRun:
    observations: list[RankObservation] | None
    error: str | None
    wall_s: float


def run_under_mpi(cfg: RunConfig, timeout_s: float = 120.0) -> MpiRun:
    """Run ``cfg`` under ``mpiexec -n world_size`` (:mod:`zerosim.report.mpi_worker`); rank 0 stores
    every rank's observations in a temporary file this process reads as plain data. Never hangs
    (launch timeout)."""
    import time

    from ..mpi.launch import mpi_unavailable_reason, run_mpiexec

    reason = mpi_unavailable_reason()
    if reason:
        return MpiRun(None, reason, 0.0)
    spec = cfg.to_json()  # the whole run, one argument; the ranks load it with RunConfig.from_json
    with tempfile.TemporaryDirectory(prefix="zerosim-mpi-") as tmp:
        out = os.path.join(tmp, "observations.safetensors")
        t0 = time.perf_counter()
        res = run_mpiexec(
            cfg.world_size,
            ["-m", "zerosim.report.mpi_worker", json.dumps(spec), out],
            timeout_s,
            env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
        )
        wall = time.perf_counter() - t0
        if res.timed_out or res.returncode != 0 or not os.path.exists(out):
            tail = (getattr(res, "stderr", "") or "").strip().splitlines()[-3:]
            return MpiRun(None, f"mpiexec exit {res.returncode}{' (timed out)' if res.timed_out else ''}: "
                          + " | ".join(tail), wall)
        return MpiRun(datafile.load(out, types=STORED_TYPES), None, wall)


# ---------------------------------------------------------------------------------------------------
# torch.distributed (gloo, CPU): the engine on torch ranks, observations shipped back likewise
# ---------------------------------------------------------------------------------------------------
@dataclass
class TorchRun:
    observations: list[list[RankObservation]] | None  # per config, per rank
    error: str | None
    wall_s: float


def torch_unavailable_reason() -> str | None:
    """Why a torch.distributed measurement cannot happen here, or None when it can."""
    import importlib.util

    for mod, why in (
        ("torch", "torch is not installed"),
        ("zerogpu.comm", "the zerogpu backend is not installed"),
    ):
        try:
            if importlib.util.find_spec(mod) is None:
                return why
        except ModuleNotFoundError:
            return why
    return None


def run_under_torch(cfgs: Sequence[RunConfig], world_size: int, timeout_s: float = 240.0) -> TorchRun:
    """Run every config (torch arrays) in one launch of ``world_size`` ranks on gloo (CPU), started as
    ``torchrun --standalone --nproc-per-node world_size`` starts them (:func:`zerogpu.launch.run_ranks`),
    via :mod:`zerosim.report.torch_worker`. The whole launch has a wall-clock timeout: on expiry
    everything it started is ended and the error says so."""
    reason = torch_unavailable_reason()
    if reason:
        return TorchRun(None, reason, 0.0)
    from zerogpu.launch import run_ranks

    specs = []
    for cfg in cfgs:
        if cfg.world_size != world_size:
            raise ConfigError(
                "world_size", cfg.world_size, f"every config of one launch needs {world_size} ranks"
            )
        specs.append(cfg.replace(xp="torch").to_json())
    with tempfile.TemporaryDirectory(prefix="zerosim-torch-") as tmp:
        out = os.path.join(tmp, "observations.safetensors")
        run = run_ranks(world_size, ["-m", "zerosim.report.torch_worker", json.dumps(specs), out], timeout_s,
                        env={"OMP_NUM_THREADS": "1"}, capture=True)
        if run.timed_out:
            return TorchRun(None, f"the {world_size} ranks did not finish within {timeout_s:g}s; killed them",
                            run.elapsed_s)
        wall = run.elapsed_s
        if run.returncode != 0 or not os.path.exists(out):
            tail = [ln for ln in (run.stderr or "").strip().splitlines() if "Warning" not in ln][-3:]
            return TorchRun(None, f"the ranks' exit {run.returncode}: " + " | ".join(tail), wall)
        return TorchRun(datafile.load(out, types=STORED_TYPES), None, wall)
