"""The unsharded reference of a mixed-precision run (``--precision bf16|fp16``): one optimizer step under
the policy, re-started every step from the trainer's own float32 masters.

One step (:func:`policy_step`), as a data-parallel trainer takes it:

1. the float32 masters are copied to ``param_dtype`` (round to nearest even);
2. every micro-batch of every rank (K x world, in (rank, micro-batch) order) runs forward and backward
   on that copy; under fp16 the loss is multiplied by the loss scale first (in the loss's dtype, as
   ``scaler.scale(loss)`` does);
3. each micro-batch gradient is cast to ``reduce_dtype`` and added up in ``reduce_dtype`` (the sum of
   all K x world, then one division by their number, in ``reduce_dtype``): accumulation happens in the
   reduction dtype;
4. the mean is cast to float32 and unscaled (divided by the loss scale, float32); a non-finite value
   anywhere (any rank's micro-batch) means overflow: the step is skipped;
5. ``clip_grad_norm_`` in float32 on the unscaled gradient, then a ``torch.optim`` step
   (``foreach=False``) on the float32 masters and float32 optimizer state.

Why re-started (from rank 0's masters and, where the trainer exposes it, its optimizer state) and not
free-running: low-precision compute makes two valid trainers drift apart step after step (a
different rounding in step 1 changes every later step's gradient), so a free-running comparison
mixes the step under test with every earlier step's noise. Re-started, each step is judged on the
update it takes from where the trainer actually is; an error that builds up (no float32 master)
shows in every step's own update.

The *perturbed* step (``perturb=True``) is the same computation in another valid way: the compute copy
rounded after a relative perturbation of half a unit in the last place of ``param_dtype`` per element
(seeded signs; about half the elements round to the neighbouring value), and the micro-batch
gradients divided before they are summed, in reverse order. Its distance from the plain step is the
noise a correct low-precision trainer is allowed (:mod:`zerosim.checks.mixed_precision`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checks.rounding import UNIT_ROUNDOFF
from .reference import make_optimizer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a taken step whose gradients overflow at the trainer's scale is compared at the largest finite scale below
MAX_SCALE_HALVINGS = 40


@dataclass
class PolicyStep:
    """One reference step under the policy (arrays float32 as float64 numpy, keyed by parameter name)."""

    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]]
    grad: dict[str, np.ndarray]  # the unscaled mean gradient in float32, before clipping
    grad_norm: float  # its norm (float32), before clipping
    overflow: bool  # non-finite scaled gradients at ``scale``: the step was skipped
    scale: float | None  # the loss scale the step used (None: no loss scaling)


def policy_step(
    model: torch.nn.Module,
    masters: Mapping[str, np.ndarray],
    state: Mapping[str, Mapping[str, np.ndarray]] | None,
    optim: Mapping[str, Any],
    batches: Sequence[tuple[Any, Any]],
    policy: Mapping[str, Any],
    *,
    scale: float | None = None,
    perturb: bool = False,
    seed: int = 0,
) -> PolicyStep:
    """One step of ``model``'s structure from ``masters`` (and optimizer ``state``; None: fresh) on
    ``batches`` under ``policy`` (see the module docstring). ``scale``: fp16's loss scale."""
    master = copy.deepcopy(model).to(device="cpu", dtype=torch.float32)
    names = [n for n, _ in master.named_parameters()]
    params = dict(master.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].copy_(torch.as_tensor(np.asarray(masters[name]), dtype=torch.float32))
    param_dtype = TORCH_DTYPES[policy["param_dtype"]]
    reduce_dtype = TORCH_DTYPES[policy["reduce_dtype"]]
    compute = copy.deepcopy(master).to(param_dtype)
    if perturb:
        _perturb_copy(master, compute, policy["param_dtype"], seed)
    compute_params = dict(compute.named_parameters())
    order = list(reversed(batches)) if perturb else list(batches)
    n = len(order)
    acc = {name: torch.zeros(p.shape, dtype=reduce_dtype) for name, p in params.items()}
    for inputs, targets in order:
        compute.zero_grad(set_to_none=True)
        loss = compute(inputs, targets)
        (loss * scale if scale is not None else loss).backward()
        for name in names:
            g = compute_params[name].grad
            if g is None:
                continue
            g = g.to(reduce_dtype)
            acc[name] += g / n if perturb else g
    grad = {}
    for name in names:
        mean = acc[name] if perturb else acc[name] / n
        g32 = mean.to(torch.float32)
        grad[name] = g32 / scale if scale is not None else g32
    overflow = not all(bool(torch.isfinite(g).all()) for g in grad.values())
    before_state = {k: dict(v) for k, v in (state or {}).items()}
    if overflow:
        return PolicyStep(_arrays(params), {k: {s: np.asarray(a, dtype=np.float64) for s, a in v.items()}
                                            for k, v in before_state.items()},
                          {k: v.double().numpy() for k, v in grad.items()}, math.inf, True, scale)
    for name in names:
        params[name].grad = grad[name].clone()
    plist = [params[n] for n in names]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in plist])))
    if optim.get("max_grad_norm") is not None:
        torch.nn.utils.clip_grad_norm_(plist, optim["max_grad_norm"], foreach=False)
    opt = make_optimizer(plist, dict(optim))
    for name in names:
        entry = (state or {}).get(name)
        if entry:
            opt.state[params[name]] = {
                k: torch.as_tensor(np.asarray(v), dtype=torch.float32).reshape(
                    () if k == "step" else params[name].shape).clone()
                for k, v in entry.items()
            }
    opt.step()
    out_state = {
        name: {k: v.detach().double().numpy().copy() for k, v in opt.state.get(params[name], {}).items()
               if torch.is_tensor(v)}
        for name in names
    }
    return PolicyStep(_arrays(params), out_state, {k: v.double().numpy() for k, v in grad.items()}, norm,
                      False, scale)


def policy_step_finite(
    model: torch.nn.Module,
    masters: Mapping[str, np.ndarray],
    state: Mapping[str, Mapping[str, np.ndarray]] | None,
    optim: Mapping[str, Any],
    batches: Sequence[tuple[Any, Any]],
    policy: Mapping[str, Any],
    *,
    scale: float | None,
    perturb: bool = False,
    seed: int = 0,
) -> PolicyStep:
    """:func:`policy_step` at ``scale``, halved until the gradients are finite: the update a taken step
    makes when a trainer's own arithmetic did not overflow where this copy does (e.g. under autocast,
    which keeps the loss in float32)."""
    step = policy_step(model, masters, state, optim, batches, policy, scale=scale, perturb=perturb, seed=seed)
    halvings = 0
    while step.overflow and scale is not None and halvings < MAX_SCALE_HALVINGS:
        scale /= 2
        halvings += 1
        step = policy_step(model, masters, state, optim, batches, policy, scale=scale, perturb=perturb,
                           seed=seed)
    return step


def _perturb_copy(master: torch.nn.Module, compute: torch.nn.Module, param_dtype: str, seed: int) -> None:
    """Round each master to ``param_dtype`` after a relative change of +-half an ulp (seeded signs)."""
    half_ulp = UNIT_ROUNDOFF[param_dtype]  # half an ulp, relative
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (_, p32), (_, p) in zip(master.named_parameters(), compute.named_parameters(), strict=True):
            signs = torch.randint(0, 2, p32.shape, generator=gen).to(torch.float32) * 2 - 1
            p.copy_((p32 * (1 + half_ulp * signs)).to(p.dtype))


def _arrays(params: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: p.detach().double().numpy().copy() for n, p in params.items()}


def _unchanged(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> bool:
    """The trainer skipped the step: every master bitwise the value it started from."""
    return all(np.array_equal(np.asarray(after[n], np.float32), np.asarray(v, np.float32))
               for n, v in before.items() if n in after)


def _complete_state(state: Any, names: Sequence[str], optim: str) -> bool:
    keys = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq", "step")}[optim]
    return isinstance(state, Mapping) and all(
        isinstance(state.get(n), Mapping) and all(k in state[n] for k in keys) for n in names)


def mixed_records(
    phases: Sequence[Any],
    phase_info: Sequence[dict[str, Any]],
    observations: Mapping[int, Sequence[Any]],
    base: torch.nn.Module,
    source: Any,
    policy: Mapping[str, Any],
    *,
    world: int,
    grad_accum: int = 1,
    resume: Any = None,
    seed: int = 0,
) -> list[Any]:
    """Every observed step of every phase that ran, beside the reference re-started from rank 0's masters
    after the step before (the phase's first step: the initial model) and from its optimizer state when
    the trainer exposes all of it (else the reference's own state of the step before). fp16: the loss
    scale follows the trainer's own skips (``LOSS_SCALE``'s rules), so each step is taken at the scale
    the trainer used (:class:`zerosim.checks.mixed_precision.MixedPrecisionStep`)."""
    from zerosim.checks.mixed_precision import MixedPrecisionStep

    info = {p["name"]: p for p in phase_info}
    names = [n for n, _ in base.named_parameters()]
    initial = {n: p.detach().to(torch.float32).double().numpy() for n, p in base.named_parameters()}
    scaling = policy.get("loss_scale")
    records = []
    for phase in phases:
        if info.get(phase.name, {}).get("status") != "ran":
            continue
        before: dict[str, np.ndarray] = initial
        state: dict[str, dict[str, np.ndarray]] | None = None
        scale = float(scaling["init"]) if scaling else None
        clean = 0
        for s in phase.step_numbers:
            ranks = sorted(observations[s], key=lambda o: o.rank)
            steps_world = resume.world_after if resume is not None and s > resume.last_step_before(
                phase.first_step) else world
            batches = [source.batch(r, s + phase.data_offset, m, steps_world)
                       for r in range(steps_world) for m in range(grad_accum)]
            skipped = scaling is not None and _unchanged(before, ranks[0].params)
            args = (base, before, state, phase.optim, batches, policy)
            if skipped:
                plain = policy_step(*args, scale=scale)
                pert = plain
            else:
                plain = policy_step_finite(*args, scale=scale)
                pert = policy_step_finite(*args, scale=plain.scale, perturb=True, seed=seed * 7919 + s)
            records.append(MixedPrecisionStep(
                s, phase.name, dict(before), plain.params, pert.params, list(ranks),
                state_before={str(k): dict(v) for k, v in (state or {}).items()}, ref_state=plain.state,
                perturbed_state=pert.state, trainer_skipped=skipped, ref_overflow=plain.overflow,
                scale=scale, grad_norm=plain.grad_norm, perturbed_grad_norm=pert.grad_norm,
                grad_deviation=_distance(plain.grad, pert.grad),
                param_dtype=str(policy["param_dtype"]),
                extra={"max_grad_norm": phase.optim.get("max_grad_norm"), "optim": dict(phase.optim)}))
            trainer_state = ranks[0].state
            state = plain.state
            if trainer_state is not None and _complete_state(trainer_state, names, phase.optim["name"]):
                state = {n: {str(k): np.asarray(v, np.float64) for k, v in trainer_state[n].items()}
                         for n in names}
            before = {n: np.asarray(v, np.float64) for n, v in ranks[0].params.items()}
            if scaling is not None and scale is not None:
                if skipped:
                    scale *= float(scaling["backoff_factor"])
                    clean = 0
                else:
                    clean += 1
                    if clean == int(scaling["growth_interval"]):
                        scale *= float(scaling["growth_factor"])
                        clean = 0
        info[phase.name]["arithmetic"] = str(policy["param_dtype"])
        info[phase.name]["master_dtype"] = "float32"
    return records


def _distance(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """||a - b||_2 over every tensor (inf when either is not finite)."""
    total = sum(float(np.sum((np.asarray(a[n], np.float64) - np.asarray(b[n], np.float64)) ** 2)) for n in a)
    return math.sqrt(total) if math.isfinite(total) else math.inf
