"""What one rank holds and observes, read out of its state after the timed part of a step.

Plain functions over :class:`~zerosim.engine.rank_state.RankState`: the holdings measured from the
live arrays (C-ZERO-004), the values the contracts compare (master, optimizer state, gradients,
C-ZERO-002), the full working parameters every rank would compute with next (C-ZERO-003), and the
traffic a step issued (C-ZERO-005).
"""

from __future__ import annotations

from typing import Any

from ..comm.base import Communicator
from ..values.flat_buffers import FlatUnit
from ..values.intervals import merge_adjacent
from ..values.observe import Holding, RankObservation, ShardValues, StepObservation, TrafficItem, digest
from . import wire
from .faults import Hook
from .rank_state import RankState


def holdings(s: RankState) -> dict[str, Holding]:
    """What this rank holds, measured from its live arrays (C-ZERO-004)."""
    xp = s.xp
    own = merge_adjacent((g0, g1) for g0, g1, _ in s.owned_pieces)
    full = ((0, s.total),) if s.total else ()
    out: dict[str, Holding] = {}
    if s.sharded_params:
        out["params"] = Holding("params", own, s.param_shard.shape[0], xp.nbytes(s.param_shard),
                                s.precision.param_dtype)
    else:
        out["params"] = Holding("params", full, s.params_full.shape[0], xp.nbytes(s.params_full),
                                s.precision.param_dtype)
    out["grads"] = Holding("grads", own if s.sharded_grads else full, s.grad_acc.shape[0],
                           xp.nbytes(s.grad_acc), s.state_dtype,
                           s.optimizer_location if s.sharded_grads else "device")
    arrays = [s.opt_state[n] for n in s.run.spec.state_names]
    master_separate = not (s.master is s.param_shard or s.master is s.params_full)
    if master_separate:
        arrays.append(s.master)
    stored = s.master.shape[0]
    out["optimizer"] = Holding("optimizer", own if s.sharded_optim else full, stored,
                               sum(xp.nbytes(a) for a in arrays), s.state_dtype,
                               s.optimizer_location)
    if s.corruption(Hook.HOLDINGS) == "hidden-full-copy":
        o = out["optimizer"]
        out["optimizer"] = Holding("optimizer", ((0, s.total),), o.stored_numel + s.total,
                                   o.nbytes + xp.nbytes(s.hidden), o.dtype, o.location)
    return out


def observe(s: RankState, obs: StepObservation) -> None:
    """C-ZERO-002/003: copy what the contracts need out of the live state (after the timed part of
    the step) into ``obs``, and append it to the rank's observation."""
    xp, run = s.xp, s.run
    pieces = s.owned_pieces
    if run.observe_values:
        obs.master = ShardValues(pieces, xp.to_numpy(s.master, copy=True))
        obs.optimizer = {n: ShardValues(pieces, xp.to_numpy(s.opt_state[n], copy=True))
                         for n in run.spec.state_names}
        if run.observe_full:
            obs.grads = ShardValues(pieces, xp.to_numpy(s.stepped_grad, copy=True))
    s.stepped_grad = None
    if run.observe_gathered:
        gathered = full_params_view(s)
        if run.observe_full:
            obs.gathered = gathered
        else:
            obs.gathered_digest = tensor_digests(s.layout, gathered)
    s.obs.steps.append(obs)


def full_params_view(s: RankState) -> Any:
    """The full working parameters this rank would compute with next, as numpy (param dtype).

    ZeRO-3 all-gathers every unit's chunks and unpacks them as the forward pass does, on the
    ``.observe`` group (so the step's data traffic is untouched); C-ZERO-003 compares the ranks'."""
    xp = s.xp
    if not s.sharded_params:
        return xp.to_numpy(s.params_full, copy=True)
    out = xp.zeros(s.total, s.precision.param_dtype)
    assert s.observe_comm is not None
    for unit in s.units.units:
        _, flat = gather_unit(s, unit, s.observe_comm)
        views = use_gathered(s, unit.name, wire.tensor_views(xp, unit, flat), len(s.obs.steps) + 1)
        for name, v in views.items():
            g0, g1 = s.layout.tensor_range(name)
            xp.assign(out[g0:g1], xp.reshape(v, (-1,)))
    return xp.to_numpy(out)

def gather_unit(s: RankState, unit: FlatUnit, comm: Communicator) -> tuple[Any, Any]:
    """All-gather the unit's parameter chunks over ``comm``; returns (packed buffer, unit-space params)."""
    packed = comm.all_gather(s.param_chunk(unit))
    return packed, wire.all_gather_unit(s.xp, comm, unit, packed, s.precision.param_dtype)


def use_gathered(s: RankState, block: str, views: dict[str, Any], step: int) -> dict[str, Any]:
    """C-ZERO-003: the parameters the block computes with: the freshly gathered ones (bug class 7
    keeps those the rank gathered first)."""
    if s.corruption(Hook.GATHERED_PARAMS) != "stale":
        return views
    if block not in s.stale:
        s.stale[block] = {k: s.xp.copy(v) for k, v in views.items()}
    return s.stale[block]


def finish_observation(s: RankState) -> RankObservation:
    """After the last step: the rank's observation with its memory timeline and start-up peaks."""
    s.obs.memory_timeline = s.tracker.timeline_json()
    s.obs.init_peak_bytes = dict(s.tracker.init_peak_by_location)
    return s.obs


def tensor_digests(layout: Any, flat: Any) -> dict[str, str]:
    """Per-tensor digests of a full flat numpy array (C-ZERO-003 on large runs)."""
    return {
        t.name: digest(flat[g0 : g0 + t.numel]) for t, g0 in zip(layout.tensors, layout.offsets, strict=True)
    }


def snapshot(counter: Any) -> dict[tuple[str, str], tuple[int, Any, Any, int, dict[str, int]]]:
    """The traffic counter's totals per (collective, group), to subtract at the end of a step."""
    return {k: (r.calls, r.bytes_sent, r.bytes_received, r.payload_bytes, dict(r.dtypes))
            for k, r in counter.records.items()}


def traffic_delta(before: dict, after: dict) -> list[TrafficItem]:
    """C-ZERO-005: the collectives a step issued, the difference of two :func:`snapshot` s."""
    out = []
    for key, (calls, sent, recv, payload, dtypes) in sorted(after.items()):
        b = before.get(key, (0, 0, 0, 0, {}))
        if calls - b[0]:
            moved = {d: n - b[4].get(d, 0) for d, n in dtypes.items() if n - b[4].get(d, 0)}
            out.append(TrafficItem(key[0], key[1], calls - b[0], sent - b[1], recv - b[2], payload - b[3],
                                   moved))
    return out
