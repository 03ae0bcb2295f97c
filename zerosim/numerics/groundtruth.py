"""Ground truth: the model trained unsharded, in one process, on every rank's micro-batches at once.

This is what a correct data-parallel run must reproduce (C-ZERO-002/003 compare the engine against
it). Per optimizer step ``s`` (0-based, the ``step`` of :func:`~zerosim.numerics.model.synthetic_batch`):

1. working parameters = the float32 master cast to the precision's ``param_dtype``;
2. the batch = concatenation of ``synthetic_batch(cfg, seed, s, rank, micro)`` over every rank and
   micro-batch, rank-major then micro order (``world_size * micro_batches * batch_size`` sequences);
3. loss = mean cross-entropy over all those tokens; gradients = those of that mean loss, returned
   by the model in ``grad_dtype`` and upcast to float32;
4. global norm over all gradient elements (float64 sum of squares); clipping with it when
   ``spec.max_grad_norm`` is set;
5. the full optimizer steps the float32 master (Muon and Adafactor: every tensor whole,
   :func:`zerosim.numerics.optim_matrix.layout_optimizer`).

``perturb`` (the estimated bound of the matrix optimizers, :mod:`zerosim.engine.matrix_bound`):
``perturb(step, grad, terms)`` changes each step's float32 mean gradient in place before the norm,
``terms`` the recorded mean of the local gradients' magnitudes.

Because every micro-batch has the same number of tokens, the mean over the concatenation equals the
average of per-micro-batch means, which is what data parallelism with gradient accumulation
computes (``grad_mode="micro"`` computes it that way instead: each (rank, micro) gradient with loss
scale ``1 / (world_size * micro_batches)`` in ``grad_dtype``, upcast and summed in rank-major order;
the two agree to float32 rounding in fp32, to 16-bit rounding in bf16/fp16).

With ``record_terms`` each snapshot also keeps what C-ZERO-002's rounding bound
(:mod:`zerosim.checks.rounding`) needs: the mean gradient before clipping and, per element, the mean
over the ``world_size * micro_batches`` local gradients of their absolute values (in ``"concat"``
mode these are computed besides the concatenated batch, at the same working parameters).

Divergence: a step whose loss, gradient, master weights or optimizer state is not finite ends the
training there: ``diverged_at`` is that step (0-based) and no snapshot is taken of it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, require_non_negative_int, require_positive_int
from ..values.layout import ParamLayout
from .flat import flatten, unflatten
from .model import BlockModel, SimModelConfig, init_params, sim_layout, synthetic_batch
from .optim import OptimizerSpec, apply_clip_, clip_coefficient, global_norm_from_sumsq
from .optim_matrix import layout_optimizer
from .precision import Precision
from .xp import ArrayNamespace, get_namespace

GRAD_MODES = ("concat", "micro")


@dataclass
class StepSnapshot:
    """State after optimizer step ``step`` (1-based: the first step's snapshot has ``step == 1``)."""

    step: int
    params: np.ndarray                 # float32 flat master, sim_layout order
    state: dict[str, np.ndarray]       # flat float32 optimizer state by torch name
    loss: float                        # mean loss of this step's batch, before the update
    grad_norm: float                   # global 2-norm of the (float32) gradient, before clipping
    clip_coef: float = 1.0             # factor applied to the gradient (1.0: none)
    optimizer_step: int = 0            # the optimizer's step counter after the step
    grad: np.ndarray | None = None        # float32 mean gradient before clipping (record_terms)
    grad_terms: np.ndarray | None = None  # mean over local gradients of |local gradient| (record_terms)


@dataclass
class GroundTruth:
    """The run's configuration, initial master parameters and one snapshot per step."""

    config: SimModelConfig
    spec: OptimizerSpec
    precision: Precision
    world_size: int
    micro_batches: int
    seed: int
    layout: ParamLayout
    initial_params: np.ndarray
    snapshots: list[StepSnapshot] = field(default_factory=list)
    grad_mode: str = "concat"
    diverged_at: int | None = None  # the 0-based step whose loss or state went non-finite (not snapshotted)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.snapshots]

    @property
    def final_params(self) -> np.ndarray:
        return self.snapshots[-1].params if self.snapshots else self.initial_params

    def params_after(self, step: int) -> np.ndarray:
        """Flat master after ``step`` steps (0 = the initial parameters)."""
        require_non_negative_int("step", step)
        if step > len(self.snapshots):
            raise ConfigError("step", step, f"ground truth has {len(self.snapshots)} steps")
        return self.initial_params if step == 0 else self.snapshots[step - 1].params

    def named_params(self, step: int) -> dict[str, np.ndarray]:
        return unflatten(self.params_after(step), self.layout)


def global_batch(
    cfg: SimModelConfig, seed: int, step: int, world_size: int, micro_batches: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's micro-batches of ``step``, concatenated rank-major then micro along the batch axis
    (read-only arrays: the last few steps' batches are kept and shared by every caller)."""
    return _global_batch(cfg, seed, step, world_size, micro_batches)


@functools.lru_cache(maxsize=8)
def _global_batch(
    cfg: SimModelConfig, seed: int, step: int, world_size: int, micro_batches: int
) -> tuple[np.ndarray, np.ndarray]:
    pairs = [synthetic_batch(cfg, seed, step, r, m) for r in range(world_size) for m in range(micro_batches)]
    tokens, targets = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    tokens.flags.writeable = False
    targets.flags.writeable = False
    return tokens, targets


#: elements (gradients, or one micro-batch's widest activations) a stack of local passes holds at
#: once: :func:`local_gradients` runs as many micro-batches per stacked pass as fit
STACK_ELEMENTS = 1 << 22


def local_gradients(model: BlockModel, params: dict[str, Any], precision: Precision, cfg: SimModelConfig,
                    seed: int, step: int, world_size: int, micro_batches: int,
                    loss_scale: float = 1.0) -> Iterator[tuple[list[float], Any]]:
    """Every (rank, micro) local loss and float32 flat gradient (of ``loss_scale * loss``, in
    ``grad_dtype`` then upcast) of step ``step``, rank-major then micro order, in stacks: each item
    is (the stack's losses, its gradients as an (S, P) array). Each row is bitwise the gradient of
    that micro-batch computed alone (:meth:`BlockModel.stacked_loss_and_grads`)."""
    layout, ns = model.layout, model.xp
    count = world_size * micro_batches
    tokens, targets = global_batch(cfg, seed, step, world_size, micro_batches)
    tokens = tokens.reshape(count, cfg.batch_size, cfg.seq_len)
    targets = targets.reshape(count, cfg.batch_size, cfg.seq_len)
    widest = cfg.tokens_per_micro_batch * max(cfg.vocab_size, cfg.d_ff, cfg.d_model)
    size = max(1, min(count, STACK_ELEMENTS // max(layout.total_numel, widest, 1)))
    for start in range(0, count, size):
        stop = min(count, start + size)
        losses, grads = model.stacked_loss_and_grads(params, tokens[start:stop], targets[start:stop],
                                                     loss_scale)
        flat = ns.concat([ns.reshape(grads[t.name], (stop - start, -1)) for t in layout.tensors], axis=1)
        yield losses, precision.grad_to_master(flat, ns)


def train_ground_truth(cfg: SimModelConfig, spec: OptimizerSpec, precision: Precision | str, world_size: int,
                       micro_batches: int, steps: int, seed: int, xp: ArrayNamespace | str | None = None,
                       grad_mode: str = "concat", record_terms: bool = False,
                       perturb: Callable[[int, Any, np.ndarray | None], None] | None = None) -> GroundTruth:
    """Train unsharded for ``steps`` steps and snapshot after each (see the module docstring)."""
    if not isinstance(cfg, SimModelConfig):
        raise ConfigError("cfg", cfg, "expected a SimModelConfig")
    if not isinstance(spec, OptimizerSpec):
        raise ConfigError("optimizer", spec, "expected an OptimizerSpec")
    precision = Precision.parse(precision)
    require_positive_int("world_size", world_size)
    require_positive_int("micro_batches", micro_batches)
    require_non_negative_int("steps", steps)
    require_non_negative_int("seed", seed)
    if grad_mode not in GRAD_MODES:
        raise ConfigError("grad_mode", grad_mode, f"must be one of {GRAD_MODES}")
    ns = get_namespace(xp)
    layout = sim_layout(cfg)
    model = BlockModel(cfg, ns)
    initial = flatten(init_params(cfg, seed), layout)
    master = ns.from_numpy(initial, copy=True)
    opt = layout_optimizer(spec, layout, ns)
    state = opt.init_state(layout.total_numel)
    gt = GroundTruth(
        cfg, spec, precision, world_size, micro_batches, seed, layout, initial.copy(), grad_mode=grad_mode
    )
    for s in range(steps):
        params = unflatten(precision.to_params(master, ns), layout)
        terms: np.ndarray | None = None
        if grad_mode == "concat":
            loss, grad = mean_gradient(model, params, precision, cfg, seed, s, world_size, micro_batches,
                                       "concat")
            if record_terms:
                terms = _micro_terms(model, params, layout, precision, ns, cfg, seed, s, world_size,
                                     micro_batches)
        else:
            loss, grad, terms = _micro_mean(
                model, params, layout, precision, ns, cfg, seed, s, world_size, micro_batches, record_terms
            )
        if not (math.isfinite(loss) and ns.isfinite_all(grad)):
            gt.diverged_at = s
            break
        if perturb is not None:
            perturb(s, grad, terms)
        norm = global_norm_from_sumsq(ns.sum_of_squares(grad))
        unclipped = ns.to_numpy(grad, copy=True) if record_terms else None
        coef = 1.0
        if spec.max_grad_norm is not None:
            coef = clip_coefficient(norm, spec.max_grad_norm)
            apply_clip_(grad, coef, ns)
        opt.step(master, grad, state)
        arrays = [v for k, v in state.items() if k != "step"]
        if not all(ns.isfinite_all(a) for a in [master, *arrays]):
            gt.diverged_at = s
            break
        gt.snapshots.append(StepSnapshot(
            step=s + 1,
            params=ns.to_numpy(master, copy=True),
            state={k: ns.to_numpy(v, copy=True) for k, v in state.items() if k != "step"},
            loss=loss,
            grad_norm=norm,
            clip_coef=coef,
            optimizer_step=int(state["step"]),
            grad=unclipped,
            grad_terms=terms,
        ))
    return gt


def mean_gradient(model: BlockModel, params: dict[str, Any], precision: Precision, cfg: SimModelConfig,
                  seed: int, step: int, world_size: int, micro_batches: int,
                  grad_mode: str) -> tuple[float, Any]:
    """The mean loss and float32 mean gradient of step ``step``'s global batch at the working
    parameters ``params``, computed as ``train_ground_truth`` computes it in ``grad_mode``."""
    layout, ns = model.layout, model.xp
    if grad_mode == "concat":
        tokens, targets = global_batch(cfg, seed, step, world_size, micro_batches)
        loss, grads = model.loss_and_grads(params, tokens, targets)
        return loss, precision.grad_to_master(flatten(grads, layout, ns), ns)  # a new array: flatten copies
    loss, grad, _ = _micro_mean(model, params, layout, precision, ns, cfg, seed, step, world_size,
                                micro_batches)
    return loss, grad


def _micro_mean(model: BlockModel, params: dict[str, Any], layout: ParamLayout, precision: Precision,
                ns: ArrayNamespace, cfg: SimModelConfig, seed: int, step: int, world_size: int,
                micro_batches: int, record_terms: bool = False) -> tuple[float, Any, np.ndarray | None]:
    """Mean loss and float32 gradient as the average of per-(rank, micro) gradients, and (with
    ``record_terms``) the float64 mean of their absolute values."""
    scale = 1.0 / (world_size * micro_batches)
    total = ns.zeros(layout.total_numel, "float32")
    terms = np.zeros(layout.total_numel) if record_terms else None
    loss = 0.0
    for losses, stack in local_gradients(model, params, precision, cfg, seed, step, world_size,
                                         micro_batches, loss_scale=scale):
        absolute = np.abs(ns.to_numpy(stack).astype(np.float64)) if terms is not None else None
        for i, lm in enumerate(losses):  # added one local gradient at a time, in rank-major order
            total += stack[i]
            if terms is not None and absolute is not None:
                terms += absolute[i]
            loss += lm * scale
    return loss, total, terms


def _micro_terms(model: BlockModel, params: dict[str, Any], layout: ParamLayout, precision: Precision,
                 ns: ArrayNamespace, cfg: SimModelConfig, seed: int, step: int, world_size: int,
                 micro_batches: int) -> np.ndarray:
    """The float64 mean over every (rank, micro) gradient of its absolute value, per element."""
    terms = np.zeros(layout.total_numel)
    for _, stack in local_gradients(model, params, precision, cfg, seed, step, world_size, micro_batches):
        for row in np.abs(ns.to_numpy(stack).astype(np.float64)):  # one local gradient at a time
            terms += row
    return terms / (world_size * micro_batches)
