"""References the engine is compared against (C-ZERO-002).

Two of them, for two different questions:

* :func:`independent_reference` adapts the model helper's ground truth
  (:func:`zerosim.numerics.groundtruth.train_ground_truth`): the model trained unsharded on the
  concatenation of every rank's micro-batches. It shares no reduction code with the engine, so
  agreeing with it within the derived per-element rounding bound (:mod:`zerosim.checks.rounding`,
  propagated step by step from the ground truth's own values: :func:`rounding_bound`) says the
  *semantics* are right (the right divisor, the global norm, every replica reduced, no stale
  parameter). Where the ground truth goes non-finite (loss or state) it stops: ``diverged_at``.
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

import numpy as np

from ..checks.rounding import UNDERFLOW, UNIT_ROUNDOFF, OptimizerHyper, RoundingBound, StepBounds, StepValues
from ..comm.sim import reduce_in_rank_order
from ..numerics.flat import flatten, unflatten
from ..numerics.groundtruth import GroundTruth, local_gradients, mean_gradient, train_ground_truth
from ..numerics.model import BlockModel, init_params
from ..numerics.optim import apply_clip_, clip_coefficient, global_norm_from_sumsq
from ..numerics.optim_matrix import layout_optimizer
from ..numerics.xp import numpy_namespace
from ..values.layout import ParamLayout
from .config import ResolvedRun
from .matrix_bound import matrix_independent_reference
from .reference_steps import Reference, ReferenceStep, reduction_length

__all__ = ["Reference", "ReferenceStep", "independent_reference", "ordered_reference", "reduction_length",
           "rounding_bound"]


def independent_reference(run: ResolvedRun) -> Reference:
    """The model helper's unsharded ground truth, step by step, with its per-element rounding bounds.

    fp32: ``grad_mode="concat"`` (one batch of every rank's micro-batches: different matrix shapes,
    nothing shared with the engine but the model). bf16/fp16: ``grad_mode="micro"`` (per micro-batch
    gradients rounded to 16 bits, then averaged in float32), because that *is* the data-parallel
    computation; the concatenated batch rounds the mean gradient to 16 bits once and differs by
    16-bit rounding, which Adam's normalisation turns into O(lr) parameter differences. Muon and
    Adafactor are not elementwise: their bound is estimated (:mod:`zerosim.engine.matrix_bound`)."""
    if not run.spec.elementwise:  # Muon, Adafactor: an estimated per-tensor bound
        return matrix_independent_reference(run)
    mode = "micro" if run.precision.is_mixed else "concat"
    gt = train_ground_truth(run.model_cfg, run.spec, run.precision, run.world_size, run.micro_batches,
                            run.steps, run.seed, grad_mode=mode, record_terms=True)
    ref = Reference(f"ground_truth[{mode}]", diverged_at=gt.diverged_at)
    bound = rounding_bound(run, mode)
    kinds = ["master"] + [f"optimizer.{k}" for k in run.spec.state_names]
    for i, snap in enumerate(gt.snapshots):
        b = bound.step(step_values(gt, i))
        ref.steps.append(ReferenceStep(
            i, snap.params, dict(snap.state), snap.optimizer_step, snap.loss, snap.grad_norm, snap.clip_coef,
            bounds=flat_bounds(b, gt.layout, kinds), grad_norm_bound=b.grad_norm, clip_coef_bound=b.clip_coef,
        ))
    return ref


def rounding_bound(run: ResolvedRun, grad_mode: str | None = None) -> RoundingBound:
    """The rounding model of :mod:`zerosim.checks.rounding` for this run: float32 masters and optimizer;
    mixed precision computes with the master cast to 16 bits and rounds each local gradient to 16 bits
    once: the engine the unscaled gradient (then divides by K = world x micro-batches), the ground
    truth the gradient already scaled by 1/K, so underflow costs f16 once and K f16. With
    ``grad_mode`` the model probes the ground truth's gradient (computed that way) at perturbed
    masters (:meth:`RoundingBound.probed_response`)."""
    xp = numpy_namespace()
    probe = None
    if grad_mode is not None:
        model, layout, prec_ = BlockModel(run.model_cfg, xp), run.layout, run.precision

        def probe(values: StepValues, master: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            flat = np.concatenate([master[t.name] for t in layout.tensors]).astype(np.float32)
            params = unflatten(prec_.to_params(flat, xp), layout)
            # the ground truth's optimizer step t trains on the batch of data step t - 1
            _, grad = mean_gradient(model, params, prec_, run.model_cfg, run.seed, values.t - 1,
                                    run.world_size, run.micro_batches, grad_mode)
            return _named(np.asarray(grad), layout)

    prec, spec = run.precision, run.spec
    mx = spec.max_grad_norm
    clip = None if mx is None else (lambda norm: clip_coefficient(norm, mx))
    cast = None
    grad_roundoff = grad_floor = 0.0
    if prec.is_mixed:
        def cast(a: np.ndarray) -> np.ndarray:
            return np.asarray(prec.to_params(np.asarray(a, dtype=np.float32), xp)).astype(np.float64)

        local = run.world_size * run.micro_batches
        grad_roundoff = UNIT_ROUNDOFF[prec.grad_dtype]
        grad_floor = (local + 1) * UNDERFLOW[prec.grad_dtype]
    return RoundingBound(OptimizerHyper.from_mapping(spec.to_dict()), u=UNIT_ROUNDOFF[prec.master_dtype],
                         n=reduction_length(run), working_cast=cast, grad_roundoff=grad_roundoff,
                         grad_floor=grad_floor, clip_function=clip, probe=probe)


def _named(flat: np.ndarray, layout: ParamLayout) -> dict[str, np.ndarray]:
    return {t.name: flat[g0:g0 + t.numel] for t, g0 in zip(layout.tensors, layout.offsets, strict=True)}


def step_values(gt: GroundTruth, i: int) -> StepValues:
    """The ground truth's step ``i`` (0-based) as the rounding model reads it, per tensor."""
    snap, layout = gt.snapshots[i], gt.layout
    if snap.grad is None or snap.grad_terms is None:
        raise ValueError("the ground truth was trained without record_terms")
    state = {k: _named(v, layout) for k, v in snap.state.items()}
    return StepValues(
        t=snap.optimizer_step,
        params_before=_named(gt.params_after(i), layout),
        params=_named(snap.params, layout),
        state={t.name: {k: state[k][t.name] for k in state} for t in layout.tensors},
        grad=_named(snap.grad, layout),
        grad_terms=_named(snap.grad_terms, layout),
        grad_norm=snap.grad_norm,
        clip_coef=snap.clip_coef,
    )


def flat_bounds(b: StepBounds, layout: ParamLayout, kinds: list[str]) -> dict[str, np.ndarray]:
    """The per-tensor bounds of one step as flat arrays in layout order, by C-ZERO-002's kind names."""
    out = {}
    for kind in kinds:
        if kind == "master":
            parts = [b.params[t.name] for t in layout.tensors]
        else:
            name = kind.removeprefix("optimizer.")
            parts = [b.state[t.name][name] for t in layout.tensors]
        out[kind] = np.concatenate(parts) if parts else np.zeros(0)
    return out


def ordered_reference(run: ResolvedRun) -> Reference:
    """The unsharded computation in the engine's floating-point order (bitwise equal when correct)."""
    xp = numpy_namespace()
    layout, cfg, prec = run.layout, run.model_cfg, run.precision
    model = BlockModel(cfg, xp)
    opt = layout_optimizer(run.spec, layout, xp)
    master = flatten(init_params(cfg, run.seed), layout).astype(np.float32)
    state = opt.init_state(layout.total_numel)
    n, k, r, m_count = run.world_size, run.k, run.replicas, run.micro_batches
    strategy = run.strategy
    units = run.unit_plan
    ref = Reference("ordered")
    for step in range(run.steps):
        params = unflatten(prec.to_params(master, xp), layout)
        losses: list[float] = []
        reduce = _RankOrderReduction(strategy.shards_grads, n, k, r, m_count, strategy.is_hybrid)
        for stack_losses, stack in local_gradients(model, params, prec, cfg, run.seed, step, n, m_count):
            for i, loss in enumerate(stack_losses):  # rank-major then micro order
                reduce.add(stack[i])
                losses.append(loss)
        total = reduce.result()
        if m_count > 1:
            total /= m_count
        # norm exactly as the ranks sum it: each over its owned elements wherever the optimizer is sharded
        if strategy.shards_optimizer:
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


class _RankOrderReduction:
    """The simulator's reduction of the per-(rank, micro) gradients, fed one at a time in rank-major then
    micro order, holding running sums instead of every local gradient (each sum adds its terms in the
    order :func:`~zerosim.comm.sim.reduce_in_rank_order` adds them, so the result is bitwise the same):

    * NO_SHARD / ZeRO-1: each rank accumulates its micro-batches locally; the per-rank sums are
      averaged over the world in rank order (one rank: its sum as it is);
    * ZeRO-2/3 and hybrids: per micro-batch, an average over the shard group (ranks ``g k .. g k +
      k - 1``) in rank order, accumulated over micro-batches; hybrid: the group results averaged
      over the replicas in group order (without hybrid only group 0 exists)."""

    def __init__(self, shards_grads: bool, world_size: int, k: int, replicas: int, micro_batches: int,
                 hybrid: bool):
        self.shards_grads, self.hybrid = shards_grads, hybrid
        self.n, self.k, self.r, self.m = world_size, k, replicas, micro_batches
        self.index = 0
        self.rank_acc: np.ndarray | None = None       # this rank's micro-batches so far (NO_SHARD, ZeRO-1)
        self.world_sum: np.ndarray | None = None      # the ranks' sums so far, in rank order
        self.micro_sums: list[np.ndarray | None] = [None] * micro_batches  # per micro, this shard group
        self.group_sum: np.ndarray | None = None      # the shard groups' results so far, in group order

    def add(self, grad: np.ndarray) -> None:
        rank, micro = divmod(self.index, self.m)
        self.index += 1
        if not self.shards_grads:
            if micro == 0:
                self.rank_acc = grad.copy()
            else:
                assert self.rank_acc is not None
                self.rank_acc += grad
            if micro == self.m - 1:
                if self.world_sum is None:
                    self.world_sum = self.rank_acc
                else:
                    self.world_sum += self.rank_acc
                self.rank_acc = None
            return
        group, j = divmod(rank, self.k)
        acc = self.micro_sums[micro]
        if j == 0:
            self.micro_sums[micro] = grad.copy()
        else:
            assert acc is not None
            acc += grad
        if j == self.k - 1 and micro == self.m - 1:  # the group's last local gradient: reduce the group
            group_acc = None
            for part in self.micro_sums:
                assert part is not None
                part /= self.k
                group_acc = part if group_acc is None else group_acc + part
            assert group_acc is not None
            self.micro_sums = [None] * self.m
            if group == 0:
                self.group_sum = group_acc
            elif self.hybrid:
                assert self.group_sum is not None
                self.group_sum += group_acc

    def result(self) -> np.ndarray:
        if not self.shards_grads:
            assert self.world_sum is not None
            if self.n > 1:
                self.world_sum /= self.n
            return self.world_sum
        assert self.group_sum is not None
        if self.hybrid and self.r > 1:
            self.group_sum /= self.r
        return self.group_sum


def _concat_pieces(full: np.ndarray, pieces: list[tuple[int, int]]) -> np.ndarray:
    """A rank's owned elements of one unit, in shard order (what it sums squares over)."""
    if len(pieces) == 1:
        g0, g1 = pieces[0]
        return full[g0:g1]
    return np.concatenate([full[g0:g1] for g0, g1 in pieces]) if pieces else full[:0]
