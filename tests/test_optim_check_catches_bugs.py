"""The optimizer-vs-torch check (tests/optim_rounding.py) fails on real optimizer bugs and names the
step, the array and the element: deliberately wrong optimizers (subclasses of zerosim.numerics.optim's, built
here only) are run through the same teacher-forced and free-running checks as the real ones."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import optim_rounding
import pytest
from optim_rounding import free_running_run, teacher_forced_run

from zerosim.numerics import optim
from zerosim.numerics.optim import OptimizerSpec

pytest.importorskip("torch")

N = 257
STEPS = 4
LINE = re.compile(r"^step (\d+) (param|exp_avg|exp_avg_sq|momentum_buffer)\[(\d+)\]: zerosim=\S+ torch=\S+ "
                  r"\|diff\|=\S+ > bound=\S+ \(exact \S+\)$")


class AdamBiasCorrectionOffByOne(optim.Adam):
    """Bias corrections use step t + 1."""

    def _update(self, p, g, st, t):
        super()._update(p, g, st, t + 1)


class AdamWDecayTwice(optim.AdamW):
    """Decoupled weight decay applied twice."""

    def _update(self, p, g, st, t):
        p *= np.float32(1.0 - self.spec.lr * self.spec.weight_decay)
        super()._update(p, g, st, t)


class AdamEpsInsideSqrt(optim.Adam):
    """``denom = sqrt(v / bc2 + eps)`` instead of ``sqrt(v) / sqrt(bc2) + eps``."""

    def _update(self, p, g, st, t):
        b1, b2 = self.spec.betas
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m += np.float32(1.0 - b1) * (g - m)
        v *= np.float32(b2)
        v += np.float32(1.0 - b2) * g * g
        denom = np.sqrt(v / np.float32(1.0 - b2**t) + np.float32(self.spec.eps))
        p += (m * np.float32(-self.spec.lr / (1.0 - b1**t))) / denom


class AdamBeta1Swapped(optim.Adam):
    """First moment averaged with weight beta1 instead of 1 - beta1."""

    def __init__(self, spec, xp=None):
        b1, b2 = spec.betas
        super().__init__(dataclasses.replace(spec, betas=(1.0 - b1, b2)), xp)


class AdamStepCounterNotCarried(optim.Adam):
    """The step counter is not advanced in the state dict: every step is step 1 for the bias
    corrections. A teacher-forced step cannot see it (the counter is handed in); a free run does."""

    def step(self, param, grad, state):
        t = state["step"]
        super().step(param, grad, state)
        state["step"] = t


class SGDDampeningIgnored(optim.SGD):
    """``buf = m buf + g`` instead of ``m buf + (1 - dampening) g``."""

    def __init__(self, spec, xp=None):
        super().__init__(dataclasses.replace(spec, dampening=0.0), xp)


class SGDFirstStepDecays(optim.SGD):
    """The first step dampens the gradient into the zero buffer instead of copying it."""

    def _update(self, p, g, st, t):
        super()._update(p, g, st, max(t, 2))


class SGDNesterovIgnored(optim.SGD):
    """Plain momentum where Nesterov was asked for."""

    def __init__(self, spec, xp=None):
        super().__init__(dataclasses.replace(spec, nesterov=False), xp)


class SGDWeightDecaySignFlipped(optim.SGD):
    """``g - wd * p``."""

    def __init__(self, spec, xp=None):
        super().__init__(dataclasses.replace(spec, weight_decay=0.0), xp)
        self.decay = spec.weight_decay

    def _update(self, p, g, st, t):
        super()._update(p, self.xp.fma(p, -self.decay, g), st, t)


def _maker(cls):
    return lambda spec, xp=None: cls(spec, xp)


ADAM = OptimizerSpec.parse("adam", lr=1e-2, weight_decay=0.1)
ADAMW = OptimizerSpec.parse("adamw", lr=1e-2, weight_decay=0.1)
SGD_DAMPENED = OptimizerSpec.parse("sgd", lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
SGD_NESTEROV = OptimizerSpec.parse("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)

# (mutant, spec, the first violation's step and array under teacher forcing; None: invisible there)
MUTANTS = [
    (AdamBiasCorrectionOffByOne, ADAM, (1, "param")),
    (AdamWDecayTwice, ADAMW, (1, "param")),
    (AdamEpsInsideSqrt, ADAM, (1, "param")),
    (AdamBeta1Swapped, ADAM, (1, "exp_avg")),
    (AdamStepCounterNotCarried, ADAM, None),
    (SGDDampeningIgnored, SGD_DAMPENED, (2, "momentum_buffer")),
    (SGDFirstStepDecays, SGD_DAMPENED, (1, "momentum_buffer")),
    (SGDNesterovIgnored, SGD_NESTEROV, (1, "param")),
    (SGDWeightDecaySignFlipped, SGD_DAMPENED, (1, "momentum_buffer")),
]


def _first(lines: list[str]) -> tuple[int, str, int]:
    assert lines, "the check passed a wrong optimizer"
    m = LINE.match(lines[0])
    assert m, f"diagnostic does not name step, array and element: {lines[0]!r}"
    return int(m.group(1)), m.group(2), int(m.group(3))


@pytest.mark.parametrize("mutant,spec,first", MUTANTS, ids=[m[0].__name__ for m in MUTANTS])
def test_teacher_forced_check_names_the_first_wrong_step_and_element(mutant, spec, first):
    lines = teacher_forced_run(spec, N, STEPS, seed=0, make=_maker(mutant))
    if first is None:
        assert not lines, lines[:3]  # the counter is handed in: this bug needs the free run
        return
    step, array, element = _first(lines)
    assert (step, array) == first, lines[0]
    assert 0 <= element < N


@pytest.mark.parametrize("mutant,spec,first", MUTANTS, ids=[m[0].__name__ for m in MUTANTS])
def test_free_running_check_fails_on_every_mutant(mutant, spec, first):
    lines = free_running_run(spec, N, STEPS, seed=1, make=_maker(mutant))
    step, _, _ = _first(lines)
    assert step <= STEPS


@pytest.mark.parametrize("bug", ["no_clip", "norm_is_the_sum_of_squares"])
def test_clipping_bugs_are_caught(monkeypatch, bug):
    """zerosim's side of the clipped step with its clip factor wrong: never clipping, or taking the sum
    of squares for the norm."""
    if bug == "no_clip":
        monkeypatch.setattr(optim_rounding, "clip_coefficient", lambda norm, max_norm: 1.0)
    else:
        monkeypatch.setattr(optim_rounding, "global_norm_from_sumsq", lambda sumsq: float(sumsq))
    spec = OptimizerSpec.parse("sgd", lr=1e-2, momentum=0.9, max_grad_norm=1e-3)
    step, array, _ = _first(teacher_forced_run(spec, N, STEPS, seed=0))
    assert (step, array) == (1, "momentum_buffer")
