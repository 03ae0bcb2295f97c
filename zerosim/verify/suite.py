"""The verification suite: by default an SGD-with-momentum phase, then an AdamW phase whose clip binds.

Why two phases: Adam divides by the root of its second moment, so a gradient summed instead of
averaged (a constant factor) hides from Adam; SGD shows it in the first update. The SGD phase
therefore runs without a clip (a binding clip would normalise the scale too). The AdamW phase clips
with a threshold chosen from the reference's own gradient norms
(:func:`zerosim.verify.reference.choose_clip`) so that it binds in at least one step, where the
data allow not in the first: a divergence that starts at the first binding step points at the clip.
Each phase builds a fresh trainer from the same initial model; steps are numbered globally. Other
phases (``adam``, ``adafactor``, ``muon``, a user's ``MODULE:FACTORY``) run unclipped with the
hyper-parameters of :mod:`zerosim.verify.optimizers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zerosim.errors import ConfigError

from .optimizers import BUILT_IN, PHASE_CONFIGS, phase_config, require_optimizer_name

__all__ = ["DEFAULT_STEPS", "MAX_STEPS", "OPTIMIZERS", "PHASE_CONFIGS", "Phase", "build_phases",
           "require_optimizers"]

#: the default phases (``--optimizers`` takes any of :data:`zerosim.verify.optimizers.BUILT_IN` and
#: ``MODULE:FACTORY``)
OPTIMIZERS = ("sgd", "adamw")
# 12 steps per phase: a bug that starts late in a phase (a rank that stops updating after a few
# steps, a counter that wraps) shows under the defaults
DEFAULT_STEPS = 24
# rank 0 keeps every rank's full parameters and optimizer state of every step for the evaluation:
# 1,000 steps at world 4 on the built-in GPT is over 1.2 GB, and about 70 s of training on 2 cores
MAX_STEPS = 1000
@dataclass
class Phase:
    name: str
    optim: dict[str, Any]
    first_step: int  # global, 1-based
    steps: int
    data_offset: int = 0  # the phase's step s trains on the micro-batches of step s + data_offset
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def step_numbers(self) -> range:
        return range(self.first_step, self.first_step + self.steps)


def require_optimizers(optimizers: Sequence[str] | str) -> tuple[str, ...]:
    names = (
        tuple(o.strip() for o in optimizers.split(",")) if isinstance(optimizers, str) else tuple(optimizers)
    )
    if not names or len(set(names)) != len(names):
        raise ConfigError("optimizers", ",".join(map(str, names)),
                          f"a non-empty selection without repeats of {', '.join(BUILT_IN)}, MODULE:FACTORY")
    for name in names:
        require_optimizer_name(name)
    return tuple(o for o in BUILT_IN if o in names) + tuple(o for o in names if o not in BUILT_IN)


def build_phases(optimizers: Sequence[str] | str = OPTIMIZERS, steps: int | None = None) -> list[Phase]:
    """The phases for ``optimizers`` sharing ``steps`` (default 24; the first phase gets the odd one)."""
    names = require_optimizers(optimizers)
    total = DEFAULT_STEPS if steps is None else steps
    if isinstance(total, int) and not isinstance(total, bool) and total > MAX_STEPS:
        raise ConfigError(
            "steps",
            steps,
            f"at most {MAX_STEPS}: rank 0 keeps every step's full parameters and optimizer state of "
            "every rank for the evaluation",
        )
    if isinstance(total, bool) or not isinstance(total, int) or total < 2 * len(names):
        raise ConfigError(
            "steps",
            steps,
            f"must be an integer >= {2 * len(names)} (at least 2 steps per "
            f"phase: {', '.join(names)}), so a divergence after the first step "
            "is seen",
        )
    phases = []
    first = 1
    for i, name in enumerate(names):
        n = total // len(names) + (1 if i < total % len(names) else 0)
        phases.append(Phase(name, phase_config(name), first, n))
        first += n
    return phases
