"""C-ZERO-002's bound for a phase whose optimizer is not elementwise (Adafactor, Muon, a user's optimizer):
estimated from a perturbed twin of the reference, not derived.

Why not derived: the per-element model of :mod:`zerosim.checks.rounding` follows an optimizer whose
update of an element depends on that element alone. Adafactor divides by row and column statistics
and scales its step by the RMS of the whole tensor; Muon orthogonalises each whole 2-D update with a
Newton-Schulz iteration that torch runs in bfloat16 (``_zeropower_via_newtonschulz`` casts its input
to bfloat16), so a float64 rounding difference in its input can flip a bfloat16 rounding and move
the result by a bfloat16 ulp of the update, and a trainer on another device computes the iteration
with other bfloat16 matmul kernels altogether.

The estimate (as the mixed-precision bound, :mod:`zerosim.verify.mixed_reference`): a twin of the
reference runs the same phase from the same weights, free-running, with every step's mean gradient
moved to another value a correct sharded run may compute:

* every element by ``2 gamma_n (T_i + S)`` (the derived bound's reordering term: ``T_i`` the mean of
  the local gradients' magnitudes, ``S`` their largest in the tensor, ``n`` the reduction length,
  ``u`` the arithmetic's unit roundoff), seeded signs;
* for Muon's 2-D tensors, a second twin moves every element by at least half a bfloat16 ulp
  (``2^-9 |g_i|``), seeded signs: about half of the bfloat16 roundings of the Newton-Schulz input go
  the other way, every step.

Which twin judges Muon's run: the iteration's input is cast to bfloat16 and everything after the cast
is bfloat16 arithmetic on that input, so two runs on the same kernels whose inputs round to the same
bfloat16 values compute the same iteration bit for bit. At every step the first twin's distance from
the reference's Newton-Schulz input (``lerp(g, buf, momentum)``, Nesterov; ``buf`` otherwise), times
SAFETY plus the perturbation itself, bounds a correct run's distance; while no element of the
reference's input lies within that distance of a bfloat16 rounding midpoint, no correct run on the
CPU can round it differently and the float64 twin judges (an exact zero no local gradient touched,
an embedding row no token of the batch uses, is zero in every run). From the first step where one
does (or from the start, for a run on an accelerator, whose bfloat16 matmuls round in another
order), the bfloat16 twin judges.

A tensor's bound at a step, for its parameters and for each optimizer state entry, is

    bound = SAFETY x max(d_twin(tensor), gamma_n max|x(tensor)|)

``d_twin`` the largest distance of the twin from the reference in that tensor, ``gamma_n max|x|`` the
floor of one reordered reduction at the tensor's scale, and SAFETY = 10: one perturbed run is one
sample of the spread, not its maximum. The bound is per tensor, the same for every element of it: a
matrix optimizer spreads any difference across the whole tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zerosim.checks.rounding import StepBounds, gamma
from zerosim.checks.tolerance import SAFETY, ModelSizes, reduction_length, unit_roundoff
from zerosim.checks.update_muon import BF16_HALF_ULP  # the perturbation that flips half the roundings

from .model_source import ModelSource
from .reference import Reference, ReferenceStep


class TwinBound:
    """The estimated per-tensor bound of one non-elementwise phase (see the module docstring); ``step``
    is called with the reference's steps in order and returns the bounds of each."""

    def __init__(self, base: torch.nn.Module, optim: dict[str, Any], dtype: str, cfg: ModelSizes, world: int,
                 *, source: ModelSource, phase: str, data_offset: int = 0,
                 resume: tuple[int, int] | None = None, grad_accum: int = 1, bound_world: int | None = None,
                 device: str = "cpu"):
        self.u = unit_roundoff(dtype)
        self.gamma_n = gamma(reduction_length(cfg, (bound_world or world) * grad_accum), self.u)
        self.optim = optim
        self.muon = optim.get("name") == "muon"
        self.last_delta: dict[str, float] = {}

        def twin(bf16: bool) -> Reference:
            return Reference(base, optim, world, model_name=source.name, seed=source.seed, phase=phase,
                             data_offset=data_offset, resume=resume, grad_accum=grad_accum, source=source,
                             gradient_perturbation=lambda s, g, t: self._perturb(s, g, t, bf16))

        self.twin = twin(False)
        self.bf16_twin = twin(True) if self.muon else None
        #: the first step from which a correct run may round Muon's bfloat16 input differently (None: none)
        self.bf16_from: int | None = None if device == "cpu" else 0

    def _perturb(self, step: int, grads: dict[str, torch.Tensor], terms: dict[str, np.ndarray],
                 bf16: bool) -> None:
        rng = np.random.default_rng(step)
        for name, g in grads.items():
            t = np.asarray(terms[name], dtype=np.float64)
            delta = 2 * self.gamma_n * (t + (float(np.max(t)) if t.size else 0.0))
            if not bf16:
                self.last_delta[name] = float(np.max(delta, initial=0.0))
            if bf16 and g.ndim == 2:
                delta = np.maximum(delta, BF16_HALF_ULP * np.abs(g.detach().cpu().double().numpy()))
            sign = rng.choice([-1.0, 1.0], size=g.shape)
            g.add_(torch.from_numpy(sign * delta).to(g.dtype))

    def _newton_schulz_input(self, values: ReferenceStep, name: str) -> np.ndarray:
        g = values.clip_coef * np.asarray(values.grad[name], dtype=np.float64)
        buf = np.asarray(values.state[name]["momentum_buffer"], dtype=np.float64)
        if not self.optim.get("nesterov", True):
            return buf
        mu = float(self.optim.get("momentum", 0.95))
        return g + mu * (buf - g)

    def _rounding_may_differ(self, ref: ReferenceStep, twin: ReferenceStep) -> bool:
        """True when an element of a Muon input of ``ref`` lies within a correct run's distance of a
        bfloat16 rounding midpoint (see the module docstring)."""
        for name, entry in ref.state.items():
            if "momentum_buffer" not in entry or np.ndim(entry["momentum_buffer"]) != 2:
                continue
            x = self._newton_schulz_input(ref, name)
            reach = SAFETY * (float(np.max(np.abs(self._newton_schulz_input(twin, name) - x), initial=0.0))
                              + self.last_delta.get(name, 0.0))
            distance = bf16_midpoint_distance(x)
            # an element no local gradient touched is an exact zero in every order of the sums
            untouched = (x == 0) & (np.asarray(ref.grad_terms[name]) == 0)
            if np.where(untouched, np.inf, distance).min(initial=np.inf) <= reach:
                return True
        return False

    def step(self, ref: ReferenceStep) -> StepBounds:
        twin = self.twin.step(ref.step)
        if self.bf16_twin is not None:
            coarse = self.bf16_twin.step(ref.step)
            if self.bf16_from is None and self._rounding_may_differ(ref, twin):
                self.bf16_from = ref.step
            if self.bf16_from is not None:
                twin = coarse
        params = self._per_tensor({n: (ref.params[n], twin.params[n]) for n in ref.params})
        pairs = {(n, k): (v, twin.state[n][k]) for n, entry in ref.state.items() for k, v in entry.items()
                 if k != "step" and k in twin.state.get(n, {}) and np.shape(twin.state[n][k]) == np.shape(v)}
        flat = self._per_tensor({f"{n}\0{k}": pair for (n, k), pair in pairs.items()})
        state: dict[str, dict[str, np.ndarray]] = {}
        for key, bound in flat.items():
            n, k = key.split("\0")
            state.setdefault(n, {})[k] = bound
        grad = self._per_tensor({n: (ref.grad[n], twin.grad[n]) for n in ref.grad},
                                floor_terms=ref.grad_terms)
        dnorm = SAFETY * abs(twin.grad_norm - ref.grad_norm) + self.gamma_n * abs(ref.grad_norm)
        dc = SAFETY * abs(twin.clip_coef - ref.clip_coef)
        return StepBounds(params, state, grad, dnorm, dc)

    def _per_tensor(self, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                    floor_terms: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """SAFETY x max(the twin's distance, gamma_n x scale) per tensor, as an array of its shape."""
        scale: dict[str, float] = {}
        dist: dict[str, float] = {}
        for name, (ref, twin) in pairs.items():
            a = np.asarray(ref, dtype=np.float64)
            scale[name] = float(np.max(np.abs(a), initial=0.0))
            if floor_terms is not None and name in floor_terms:
                scale[name] = max(scale[name], float(np.max(np.abs(floor_terms[name]), initial=0.0)))
            dist[name] = float(np.max(np.abs(np.asarray(twin, dtype=np.float64) - a), initial=0.0))
        out = {}
        for name, (ref, _) in pairs.items():
            value = SAFETY * max(dist[name], self.gamma_n * scale[name])
            out[name] = np.full(np.shape(ref), value)
        return out


def bf16_midpoint_distance(x: np.ndarray) -> np.ndarray:
    """Each element's distance to the nearest value where rounding to bfloat16 (to nearest) changes."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    near = t.to(torch.bfloat16)
    up = torch.nextafter(near, torch.full_like(near, float("inf"))).double()
    down = torch.nextafter(near, torch.full_like(near, float("-inf"))).double()
    here = near.double()
    return torch.minimum((t - (here + up) / 2).abs(), (t - (here + down) / 2).abs()).numpy()
