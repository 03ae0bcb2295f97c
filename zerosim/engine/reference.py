"""References the engine is compared against (C-ZERO-002).

Two of them, for two different questions:

* :func:`independent_reference` adapts the model helper's ground truth
  (:func:`zerosim.groundtruth.train_ground_truth`): the model trained unsharded on the
  concatenation of every rank's micro-batches. It shares no reduction code with the engine, so
  agreeing with it within the documented tolerance says the *semantics* are right (the right
  divisor, the global norm, every replica reduced, no stale parameter).
* :func:`ordered_reference` is the same unsharded computation with the engine's *order of
  floating-point operations*: per-(rank, micro-batch) gradients from the unsharded model, reduced
  in the simulator's rank order with the strategy's grouping (reduce-scatter per micro-batch for
  ZeRO-2/3, local accumulation then all-reduce (or reduce-scatter) for NO_SHARD/ZeRO-1, shard
  group then replicate group for hybrid), the norm summed shard by shard as the ranks sum it. Every
  optimizer is elementwise, so a correct engine matches it **bit for bit**; any single flipped bit is
  a finding.

Both run in one process on numpy, never sharded, never through a communicator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..comm.sim import reduce_in_rank_order
from ..flat import flatten, unflatten
from ..groundtruth import train_ground_truth
from ..model import BlockModel, init_params, synthetic_batch
from ..optim import apply_clip_, clip_coefficient, global_norm_from_sumsq, make_optimizer
from ..xp import numpy_namespace
from .config import ResolvedRun


@dataclass
class ReferenceStep:
    """Full (unsharded) state after step ``step`` (0-based), as float32 numpy arrays."""

    step: int
    master: np.ndarray
    state: dict[str, np.ndarray]
    optimizer_step: int
    loss: float
    grad_norm: float
    clip_coef: float
    grads: np.ndarray | None = None       # the clipped gradient the optimizer consumed (ordered only)
    params: np.ndarray | None = None      # working params after the step (param dtype)


@dataclass
class Reference:
    name: str
    steps: list[ReferenceStep] = field(default_factory=list)


def independent_reference(run: ResolvedRun) -> Reference:
    """The model helper's unsharded ground truth, step by step.

    fp32: ``grad_mode="concat"`` (one batch of every rank's micro-batches: different matrix shapes,
    nothing shared with the engine but the model). bf16/fp16: ``grad_mode="micro"`` (per micro-batch
    gradients rounded to 16 bits, then averaged in float32), because that *is* the data-parallel
    computation; the concatenated batch rounds the mean gradient to 16 bits once and differs by
    16-bit rounding, which Adam's normalisation turns into O(lr) parameter differences."""
    mode = "micro" if run.precision.is_mixed else "concat"
    gt = train_ground_truth(run.model_cfg, run.spec, run.precision, run.world_size, run.micro_batches,
                            run.steps, run.seed, grad_mode=mode)
    ref = Reference(f"ground_truth[{mode}]")
    for i, snap in enumerate(gt.snapshots):
        ref.steps.append(ReferenceStep(i, snap.params, dict(snap.state), snap.optimizer_step, snap.loss,
                                       snap.grad_norm, snap.clip_coef))
    return ref


def ordered_reference(run: ResolvedRun) -> Reference:
    """The unsharded computation in the engine's floating-point order (bitwise equal when correct)."""
    xp = numpy_namespace()
    layout, cfg, prec = run.layout, run.model_cfg, run.precision
    model = BlockModel(cfg, xp)
    opt = make_optimizer(run.spec, xp)
    master = flatten(init_params(cfg, run.seed), layout).astype(np.float32)
    state = opt.init_state(layout.total_numel)
    n, k, r, m_count = run.world_size, run.k, run.replicas, run.micro_batches
    strategy = run.strategy
    units = run.unit_plan
    ref = Reference("ordered")
    for step in range(run.steps):
        params = unflatten(prec.to_params(master, xp), layout)
        grads: dict[tuple[int, int], np.ndarray] = {}
        losses = []
        for rank in range(n):
            for micro in range(m_count):
                tokens, targets = synthetic_batch(cfg, run.seed, step, rank, micro)
                loss, g = model.loss_and_grads(params, tokens, targets)
                grads[(rank, micro)] = flatten(g, layout).astype(np.float32)
                losses.append(loss)
        if not strategy.shards_grads:  # NO_SHARD, ZeRO-1: local accumulation, one all-reduce (or a
            # reduce-scatter: the simulator sums every element in the same rank order either way)
            accs = []
            for rank in range(n):
                acc = grads[(rank, 0)].copy()
                for micro in range(1, m_count):
                    acc += grads[(rank, micro)]
                accs.append(acc)
            total = reduce_in_rank_order(accs, "avg") if n > 1 else accs[0]
        else:  # ZeRO-2/3 and hybrids: reduce-scatter per micro-batch in the shard group, then replicas
            group_accs = []
            for grp in range(r):
                acc = None
                for micro in range(m_count):
                    red = reduce_in_rank_order([grads[(grp * k + j, micro)] for j in range(k)], "avg")
                    acc = red if acc is None else acc + red
                group_accs.append(acc)
            total = (
                reduce_in_rank_order(group_accs, "avg") if (strategy.is_hybrid and r > 1) else group_accs[0]
            )
        if m_count > 1:
            total /= m_count
        # norm exactly as the ranks sum it (reduce-scatter ZeRO-1 holds only its chunk, like ZeRO-2)
        if strategy.shards_grads or run.zero1_reduce_scatter:
            partial = []
            for j in range(k):
                local = 0.0
                for unit in units.units:
                    local += xp.sum_of_squares(_concat_pieces(total, unit.owned_global(j)))
                partial.append(np.array([local], dtype=np.float64))
            sumsq = float(reduce_in_rank_order(partial, "sum")[0])
        else:
            sumsq = xp.sum_of_squares(total)
        norm = global_norm_from_sumsq(sumsq)
        coef = 1.0
        if run.spec.max_grad_norm is not None:
            coef = clip_coefficient(norm, run.spec.max_grad_norm)
            apply_clip_(total, coef, xp)
        opt.step(master, total, state)
        ref.steps.append(
            ReferenceStep(
                step,
                master.copy(),
                {kk: v.copy() for kk, v in state.items() if kk != "step"},
                int(state["step"]),
                float(np.mean(losses)),
                norm,
                coef,
                total.copy(),
                np.asarray(prec.to_params(master, xp)).copy(),
            )
        )
    return ref


def _concat_pieces(full: np.ndarray, pieces: list[tuple[int, int]]) -> np.ndarray:
    """A rank's owned elements of one unit, in shard order (what it sums squares over)."""
    if len(pieces) == 1:
        g0, g1 = pieces[0]
        return full[g0:g1]
    return np.concatenate([full[g0:g1] for g0, g1 in pieces]) if pieces else full[:0]
