"""Live-run faults (``ZEROSIM_FAULT=bitflip|skip-step|grad|zero-state:...``, :mod:`zerosim.comm.fault_plan`)
applied to a real training loop, for the monitor to catch. Test and benchmark harnesses only: a
training loop calls the three hooks of :class:`LiveFault`; nothing here runs unless a harness does.

* ``grads(step, model)``: after backward (the gradient reduced), before clipping and the step:
  ``grad`` adds 1 to element 0 of the rank's gradient of the named tensor;
* ``optimizer_step(step, optimizer)``: the step itself; ``skip-step`` skips it on the rank (under
  ``ZeroRedundancyOptimizer`` only the rank's own update is skipped, its broadcasts still run, so the
  other ranks are not left waiting);
* ``after_step(step, model, optimizer)``: ``bitflip`` flips one bit of element 0 of the rank's copy of
  the named tensor; ``zero-state`` zeroes the rank's optimizer state, step counters included.

A :class:`zerogpu.trainer.ZeroTrainer` (passed as ``model``) takes ``bitflip`` and ``zero-state`` on its
engine's arrays; its gradient and step are internal, so ``grad`` and ``skip-step`` are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.fault_plan import FAULT_ENV, LIVE_KINDS, FaultPlan
from ..errors import ConfigError

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class LiveFault:
    """One live fault for this process's ``rank`` (see the module docstring)."""

    def __init__(self, plan: FaultPlan, rank: int):
        if plan.kind not in LIVE_KINDS:
            raise ConfigError(FAULT_ENV, plan.text, f"is not a live-run fault ({', '.join(LIVE_KINDS)})")
        self.plan = plan
        self.mine = plan.rank == rank

    @classmethod
    def from_env(cls, rank: int, text: str | None = None) -> LiveFault | None:
        """The live fault of ``$ZEROSIM_FAULT`` (or ``text``) for ``rank``; None when it names none."""
        plan = FaultPlan.from_env(text)
        if plan is None or plan.kind not in LIVE_KINDS:
            return None
        return cls(plan, rank)

    def _now(self, step: int, kind: str) -> bool:
        return self.mine and self.plan.kind == kind and step == self.plan.step

    @torch.no_grad()
    def grads(self, step: int, model: Any) -> None:
        if self._now(step, "grad"):
            if _is_trainer(model):
                raise ConfigError(FAULT_ENV, self.plan.text,
                                  "a ZeroTrainer's gradient is internal to its step")
            grad = _param(model, self.plan.tensor).grad
            if grad is None:
                raise ConfigError(FAULT_ENV, self.plan.text, "the tensor has no gradient at this step")
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] += 1.0

    def optimizer_step(self, step: int, optimizer: Any) -> None:
        if not self._now(step, "skip-step"):
            optimizer.step()
            return
        if hasattr(optimizer, "_param_to_rank") and hasattr(optimizer, "optim"):
            inner = optimizer.optim
            original = inner.step
            inner.step = lambda *args, **kwargs: None
            try:
                optimizer.step()
            finally:
                inner.step = original

    @torch.no_grad()
    def after_step(self, step: int, model: Any, optimizer: Any = None) -> None:
        if self._now(step, "bitflip"):
            target = _trainer_piece(model, self.plan.tensor) if _is_trainer(model) else \
                _local(_param(model, self.plan.tensor).data)
            flat = target.reshape(-1)
            if flat.numel() == 0:
                raise ConfigError(FAULT_ENV, self.plan.text, "the rank holds no element of the tensor")
            words = flat[:1].view(_INT_OF_SIZE[flat.element_size()])
            words ^= 1 << min(self.plan.bit, 8 * flat.element_size() - 1)
        if self._now(step, "zero-state"):
            if _is_trainer(model):
                state = model.state.opt_state
                for key, value in state.items():
                    if key == "step":
                        state[key] = 0
                    else:
                        value.zero_()
                return
            states = optimizer.optim.state if hasattr(optimizer, "_param_to_rank") else optimizer.state
            for per_param in states.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        _local(value).zero_()


def _is_trainer(model: Any) -> bool:
    return hasattr(model, "engine") and hasattr(model, "local_shards")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _param(model: Any, name: str | None) -> Any:
    module = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    params = dict(module.named_parameters())
    if name not in params:
        raise ConfigError(FAULT_ENV, name, f"no such parameter; the model has {', '.join(list(params)[:8])}")
    return params[name]


def _trainer_piece(trainer: Any, name: str | None) -> torch.Tensor:
    """The engine's array holding this rank's copy of ``name`` (full, or its owned piece)."""
    e = trainer.state
    g0, g1 = e.layout.tensor_range(name)
    if e.params_full is not None:
        return e.params_full[g0:g1]
    for a, b, pos in e.owned_pieces:
        lo, hi = max(a, g0), min(b, g1)
        if lo < hi:
            return e.param_shard[pos + lo - a: pos + hi - a]
    return e.param_shard[:0]
