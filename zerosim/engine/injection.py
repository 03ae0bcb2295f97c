"""The gradient-corruption test hook of a run: where a NaN (or an infinity) enters one rank's gradient.

:class:`NanInjection` is the value ``RunConfig.inject_nan`` carries; :func:`resolve_injection`
validates it against the resolved run (rank, step, micro-batch and tensor must exist) or reads the
same hook from ``$ZEROSIM_FAULT`` (:mod:`zerosim.comm.fault_plan`). Every bad value is a
:class:`~zerosim.errors.ConfigError` naming the field, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..comm.fault_plan import FAULT_ENV, GRADIENT_KINDS, FaultPlan
from ..errors import ConfigError


@dataclass(frozen=True)
class NanInjection:
    """Test hook: put ``value`` (``"nan"``, ``"inf"`` or ``"-inf"``) into ``tensor``'s gradient on ``rank``
    at ``step`` / ``micro`` (element 0). Also set by ``ZEROSIM_FAULT=nan|inf|-inf:rank=R:step=S[:micro=M]
    [:tensor=NAME]`` (:mod:`zerosim.comm.fault_plan`) when ``RunConfig.inject_nan`` is None."""

    rank: int
    step: int
    tensor: str
    micro: int = 0
    value: str = "nan"


def resolve_injection(raw: Any, run: Any) -> NanInjection | None:
    """``inject_nan`` validated against ``run`` (a ResolvedRun); when None, the gradient fault of
    ``$ZEROSIM_FAULT`` (nan, inf, -inf), if any. A malformed ``$ZEROSIM_FAULT`` of any kind is a ConfigError
    here, before any rank starts."""
    field = "inject_nan"
    plan = FaultPlan.from_env()
    if plan is not None and plan.kind in GRADIENT_KINDS:
        if raw is not None:
            raise ConfigError(FAULT_ENV, plan.text, "inject_nan is set too; use one of them")
        field = FAULT_ENV
        raw = NanInjection(plan.rank, plan.step, plan.tensor or run.layout.tensors[0].name, plan.micro,
                           plan.kind)
    if raw is None:
        return None
    if isinstance(raw, dict):
        unknown = set(raw) - {"rank", "step", "tensor", "micro", "value"}
        if unknown:
            raise ConfigError(
                "inject_nan", raw,
                f"unknown keys {sorted(unknown)}; expected rank, step, tensor, micro, value",
            )
        try:
            raw = NanInjection(
                int(raw["rank"]), int(raw.get("step", 0)), str(raw["tensor"]), int(raw.get("micro", 0)),
                str(raw.get("value", "nan")),
            )
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                "inject_nan", raw, "expected {'rank': int, 'step': int, 'tensor': name}"
            ) from None
    if not isinstance(raw, NanInjection):
        raise ConfigError("inject_nan", raw, "expected a dict or a NanInjection")
    if raw.value not in GRADIENT_KINDS:
        raise ConfigError(f"{field}.value", raw.value, f"known: {', '.join(GRADIENT_KINDS)}")
    if not 0 <= raw.rank < run.world_size:
        raise ConfigError(f"{field}.rank", raw.rank, f"must be in [0, {run.world_size})")
    if not 0 <= raw.step < run.steps:
        raise ConfigError(f"{field}.step", raw.step, f"must be in [0, {run.steps})")
    if not 0 <= raw.micro < run.micro_batches:
        raise ConfigError(f"{field}.micro", raw.micro, f"must be in [0, {run.micro_batches})")
    run.layout.tensor_range(raw.tensor)  # ConfigError for an unknown tensor
    return raw
