"""The end of one optimizer step on one rank: reduce, average, norm, clip, step, refresh, observe.

Plain functions over :class:`~zerosim.engine.rank_state.RankState`. A schedule opens the step
(:func:`begin_step`), runs its micro-batches (handing gradients to :mod:`zerosim.engine.gradients`),
then calls :func:`finish_step`, which returns the step's
:class:`~zerosim.values.observe.StepObservation`. After the gradients (C-ZERO-005 counts each collective):

* the global gradient norm is the float64 sum of squares over the elements each rank *owns*
  (padding excluded), all-reduced once over the shard group (replicas hold identical reduced
  gradients: summing over them would over-count); all-reduce ZeRO-1 holds the full reduced
  gradient but sums only its owned chunk too, which halves that pass at world 2 for one scalar
  all-reduce; NO_SHARD sums its full gradient and needs no collective for it;
* clipping by that norm, then the optimizer step on the master shard (C-ZERO-002);
* the refresh of the working parameters: ZeRO-1/2 one ``all_gather`` of the updated chunks, ZeRO-3
  the cast (or copy) of the shard, mixed-precision NO_SHARD the cast of the master.

Where the rank's fault acts (:meth:`RankState.corruption`), the function applies its corruption and
otherwise does what the reference engine does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..numerics.xp import SUMSQ_CHUNK
from ..values.flat_buffers import FlatUnit
from ..values.observe import StepObservation
from . import wire
from .faults import Hook
from .gradients import (
    finish_accumulation,
    owned_grad,
    reduce_full_grad,
    replicate_reduce,
)
from .observation import holdings, observe, snapshot, traffic_delta
from .rank_state import RankState

#: all-reduce ZeRO-1: up to this many gradient elements each rank sums every rank's range itself
#: (one sum-of-squares chunk: less work than the round trip of a scalar all-reduce)
LOCAL_NORM_MAX_NUMEL = SUMSQ_CHUNK


@dataclass(frozen=True)
class StepStart:
    """What :func:`begin_step` noted at the start of a step: its index, the traffic so far, the clock."""

    step: int
    traffic: dict
    t0: float


def begin_step(s: RankState, step: int, *, align: bool) -> StepStart:
    """C-ZERO-005/007: open optimizer step ``step`` (``align``: every rank starts it together, a
    barrier on the control group, which carries no data traffic)."""
    before = snapshot(s.comm.traffic)
    if align:
        s.control.barrier()
    t0 = time.perf_counter()
    s.tracker.begin_step(step)
    s.step_index = step
    s.micro_grads = {}
    return StepStart(step, before, t0)


def finish_step(s: RankState, start: StepStart, losses: list[float], *, settled: bool = False,
                keeps_history: bool = True) -> StepObservation:
    """C-ZERO-002/005/008: everything after the last micro-batch's gradients: the reduction (unless the
    schedule ``settled`` it during backward), the average over micro-batches, the global norm, clip,
    the optimizer step, the refresh of the working parameters, and the step's observation (taken
    after the timed part; ``keeps_history`` False keeps only the latest step's)."""
    xp, tr, step = s.xp, s.tracker, start.step
    tr.set_phase("reduce")
    grad_shard = None  # ZeRO-1 with reduce_scatter: the rank's averaged gradient chunk
    if settled:
        pass  # the schedule finished the reduction it started during backward
    elif not s.sharded_grads:
        grad_shard = reduce_full_grad(s, step)
    elif s.hybrid and s.replicate_comm is not None:
        s.grad_acc = replicate_reduce(s, s.grad_acc)
    tr.alloc("grads", "grads", xp.nbytes(s.grad_acc), s.optimizer_location if s.sharded_grads else "device")
    local_norm = norm_is_local(s)
    if s.all_reduce_zero1:  # the owned part of the summed full gradient, averaged in place
        grad = owned_grad(s, whole=local_norm)
    else:
        grad = s.grad_acc if grad_shard is None else grad_shard
    finish_accumulation(s, s.grad_acc if local_norm else grad)
    # ---- norm, clip, step ---------------------------------------------------------------------
    tr.set_phase("optimizer")
    if local_norm:  # every rank's owned sum, in rank order, as the scalar all-reduce would add them
        sumsq = 0.0
        for j, (lo, hi) in enumerate(s.grad_order.regions):
            sumsq += wire.owned_sumsq(xp, s.grad_acc[lo:hi], s.units, j)
    elif s.sharded_optim:
        sumsq = global_sumsq(s, wire.owned_sumsq(xp, grad, s.units, s.local))
    else:
        sumsq = xp.sum_of_squares(grad)
    norm, coef = wire.clip_(xp, grad, sumsq, s.run.spec.max_grad_norm, s.state_dtype)
    optimizer_step(s, grad)
    s.stepped_grad = grad
    # ---- refresh the working parameters ----------------------------------------------------
    tr.set_phase("params")
    refresh_params(s)
    extra_step_collectives(s)
    tr.free("grad_chunk")
    local_loss = sum(losses) / len(losses)
    loss_arr = xp.asarray([local_loss], dtype=xp.dtype("float64"), device=xp.device)
    loss = xp.to_float(s.control.all_reduce(loss_arr, "avg")[0])
    t1 = time.perf_counter()
    memory = tr.end_step()
    obs = StepObservation(step, loss, local_loss, norm, coef, int(s.opt_state["step"]),
                          holdings(s), traffic_delta(start.traffic, snapshot(s.comm.traffic)), memory,
                          start.t0, t1)
    if s.offload:
        s.obs.offload.setdefault("steps", []).append(dict(s.moved))
        s.moved = {"host_to_device": 0, "device_to_host": 0}
    observe(s, obs)
    if not keeps_history:  # a trainer runs for as long as its user trains
        del s.obs.steps[:-1]
        del s.tracker.steps[:-1]
    if s.run.cfg.reshard_at == step:
        reshard_round_trip(s)
    return obs


def norm_is_local(s: RankState) -> bool:
    """All-reduce ZeRO-1 on a gradient of at most :data:`LOCAL_NORM_MAX_NUMEL` elements: every rank
    holds every rank's reduced range, so it averages them all and adds every rank's owned sum of
    squares itself, in rank order, instead of waiting on a scalar all-reduce (whose latency is the
    larger cost at that size). The same float64 sums added in the same order: the same norm."""
    fault = s.fault  # a norm fault keeps the collective on every rank, so that all ranks call it alike
    return (s.all_reduce_zero1 and s.total <= LOCAL_NORM_MAX_NUMEL
            and (fault is None or fault.hook is not Hook.GLOBAL_NORM))


def global_sumsq(s: RankState, local: float) -> float:
    """Sum of squares over every gradient element: one scalar all-reduce over the shard group (bug
    class 3 keeps the rank-local sum; bug class 4 sums over the world, counting every replica)."""
    how = s.corruption(Hook.GLOBAL_NORM)
    if how == "rank-local":
        return local
    x = s.xp.asarray([local], dtype=s.xp.dtype("float64"), device=s.xp.device)
    group = s.control if how == "world" else s.shard_control
    return s.xp.to_float(group.all_reduce(x, "sum")[0])


def optimizer_step(s: RankState, grad: Any) -> None:
    """The optimizer step on the master shard (C-ZERO-002); bug class 11 advances the counter twice.
    A gradient shorter than the shard (all-reduce ZeRO-1's view, which stops before the shard's
    trailing padding) steps the same leading elements of the master and the state: the padding has
    zero gradient, parameter and state, and an elementwise update leaves it zero."""
    m = int(grad.shape[0])
    if m == int(s.master.shape[0]):
        wire.optimizer_step(s.opt, s.master, grad, s.opt_state)
    else:
        state = {**s.opt_state, **{name: s.opt_state[name][:m] for name in s.run.spec.state_names}}
        wire.optimizer_step(s.opt, s.master[:m], grad, state)
        s.opt_state["step"] = state["step"]
    if s.corruption(Hook.OPTIMIZER_STEP) == "count-twice":
        s.opt_state["step"] += 1


def refresh_params(s: RankState) -> None:
    """C-ZERO-003: after the step (or a load of the state), the working copy the next forward uses
    (bug class 12: the offloaded update is accounted for as copied back, but never reaches the device
    shard). ZeRO-1/2 receive the gathered chunks straight into the parameters where the state asks
    for it (``receives_into_params``) and the communicator can."""
    xp = s.xp
    if s.corruption(Hook.PARAM_REFRESH) == "skip-copy-back":
        s.moved["host_to_device"] += xp.nbytes(s.param_shard)
        return
    if s.sharded_params:
        if s.mixed or s.offload:
            work = s.precision.to_params(s.master, xp)
            s.param_shard = xp.copy(work) if work is s.master else work
            s.tracker.alloc("params", "params", xp.nbytes(s.param_shard))
            if s.offload:  # the updated working shard goes back to the device
                s.moved["host_to_device"] += xp.nbytes(s.param_shard)
    elif s.sharded_optim:
        assert s.shard_comm is not None
        work = s.precision.to_params(s.master, xp)
        gather_into = getattr(s.shard_comm, "all_gather_into", None)
        if s.receives_into_params and callable(gather_into):
            # every rank's updated chunk is received straight into the parameters it covers
            gather_into(work, _param_destinations(s))
            return
        gathered = s.shard_comm.all_gather(work)
        s.tracker.alloc("gathered:params", "gathered", xp.nbytes(gathered))
        write_gathered_params(s, gathered, s.units.units[0])
        del gathered
        s.tracker.free("gathered:params")
    elif s.mixed:
        xp.assign(s.params_full, s.precision.to_params(s.master, xp))


def _param_destinations(s: RankState) -> list[list[tuple[int, Any]]]:
    """Per shard-group rank, where each piece of its chunk lives in the full parameters:
    ``(position in the chunk, view of params_full)``, the all-gather's unpacking done by the
    receive itself (C-ZERO-003: every rank then holds the same full parameters)."""
    cached = s.__dict__.get("_destinations")
    if cached is None or cached[0] is not s.params_full:
        dests = [[(pos, s.params_full[g0:g1]) for g0, g1, pos in s.units.owned_global(j)]
                 for j in range(s.k)]
        cached = s.__dict__["_destinations"] = (s.params_full, dests)
    return cached[1]


def write_gathered_params(s: RankState, gathered: Any, unit: FlatUnit) -> None:
    """ZeRO-1/2: copy the all-gathered updated chunks into the replicated parameters (bug class 7:
    a stale rank ignores them, or every chunk but the last rank's is written back)."""
    how = s.corruption(Hook.GATHERED_PARAMS)
    if how == "stale":
        return
    if how == "drop-last-chunk":
        for segs in unit.segments[:-1]:
            for seg in segs:
                s.xp.assign(s.params_full[seg.unit_start:seg.unit_start + seg.length],
                            gathered[seg.packed_start:seg.packed_start + seg.length])
        return
    wire.unpack_into(s.xp, s.params_full, gathered, unit)


def extra_step_collectives(s: RankState) -> None:
    """Nothing: the schedule has no other collectives (a fault adds an all-gather of the shards)."""
    if s.corruption(Hook.STEP_COLLECTIVES) == "extra-all-gather":
        assert s.shard_comm is not None
        s.shard_comm.all_gather(s.master)


def reshard_round_trip(s: RankState) -> None:
    """Save the full state dict and load it back at the same world size, between two steps.

    Every sharded float32 state (master, optimizer moments) is all-gathered over the shard group,
    assembled into the full flat array by the plan (:meth:`RankState.assemble_full_state`), and this rank
    keeps its own pieces. Correct code changes no bit, which C-ZERO-002 checks at the next step.
    The traffic falls between steps, outside every step's C-ZERO-005 count."""
    if not s.sharded_optim or s.shard_comm is None:
        return  # every rank already holds the full state
    arrays = [s.master, *(s.opt_state[n] for n in s.run.spec.state_names)]
    for arr in arrays:
        full = s.assemble_full_state(s.shard_comm.all_gather(arr))
        s.xp.assign(arr, s.own_chunk(full))
