"""What one rank observes of its optimizer's step for C-ZERO-002's ``update`` clause (the check is
:mod:`zerosim.checks.update_formula`): ``register_step_pre_hook`` / ``register_step_post_hook`` on the
optimizer that steps the parameters (ZeroRedundancyOptimizer's local one), so that what the loop does
outside the step is not counted.

On a due step, before the step: each sampled tensor's hyperparameters, step counter, and the
parameter, gradient and state entries at its sampled elements; after it: the parameter and state
there. SGD, Adam and AdamW step each element alone: :data:`SAMPLED` fixed elements of every tensor.
Adafactor and Muon step a tensor as a whole: whole tensors, taken in turn from one check to the next
until :data:`WHOLE_BUDGET` elements (a tensor above it is never taken, and said so); their samples are
written to the rank's file while a check's stay under :data:`WHOLE_WRITTEN` elements, else the file
keeps the finding only (``zerosim check trace`` then judges that finding, as the live run did). The
finding is recomputed in float64 on the host. The probe reads its samples at the step where the host is
free to read them (``defer_reads=False``, the CPU). With ``defer_reads=True`` (the default on a CUDA
device, :func:`~zerosim.monitor.staged_reads.defers`) it reads nothing during the step: the step
counter and the sampled values stay on the device (:attr:`UpdateProbe.pending`) and the step probe
stages them to the host without a wait (:mod:`zerosim.monitor.staged_reads`), to be recomputed at its
next check (:meth:`UpdateProbe.finding`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks.update_formula import ENTRIES, FORMULAS, WHOLE_TENSOR, recompute_update
from .hook_guard import HookGuard
from .layouts import local_tensor
from .row import to_device

#: elements of each tensor whose update is recomputed (elementwise optimizers)
SAMPLED = 8
#: elements of whole tensors recomputed at one check (Adafactor, Muon)
WHOLE_BUDGET = 1 << 18
#: whole-tensor samples of a check written to the rank's file up to this many elements
WHOLE_WRITTEN = 1 << 14
#: the hyperparameters a formula reads from the parameter group
HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening", "nesterov",
         "decoupled_weight_decay", "beta2_decay", "d", "ns_coefficients", "ns_steps", "adjust_lr_fn")


#: why the update is not recomputed where the framework steps its own optimizer out of the monitor's reach
_HIDDEN = {
    "deepspeed": "update: DeepSpeed steps its own optimizer (torch's Adam/AdamW with torch_adam, else its "
                 "built FusedAdam or DeepSpeedCPUAdam ops) on flat fp32 partitions inside engine.step(), "
                 "not on the model's tensors: no sample maps to a named tensor, not recomputed",
    "zerogpu": "update: a ZeroTrainer steps its optimizer on its own shards inside trainer.step(), with "
               "no optimizer handed to the monitor, not recomputed",
}


def formula_of(optimizer: Any) -> str | None:
    """The torch.optim class whose formula ``optimizer`` follows (a subclass follows its base's)."""
    for cls in type(optimizer).__mro__:
        if cls.__name__ in FORMULAS and cls.__module__.startswith("torch.optim"):
            return cls.__name__
    return None


def _plain(value: Any, keep: bool = False) -> Any:
    """A hyperparameter as JSON holds it (a tensor's number, a tuple's list); ``keep``: a tensor kept
    as it is, read later (:mod:`zerosim.monitor.staged_reads`)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if keep else float(value)
    if isinstance(value, tuple | list):
        return [_plain(v, keep) for v in value]
    return value


class UpdateProbe:
    """One rank's observation of its optimizer's due steps (see the module docstring)."""

    def __init__(self, module: Any, optimizer: Any, adapter: str = "", guard: HookGuard | None = None,
                 defer_reads: bool = False):
        self.optimizer = optimizer
        self.defer_reads = bool(defer_reads)
        self.formula = formula_of(optimizer) if optimizer is not None else None
        self.whole = self.formula in WHOLE_TENSOR
        self.names = {id(p): n for n, p in (module.named_parameters() if module is not None else [])}
        self.off: str | None = None
        self._hooks: list[Any] = []
        if optimizer is None:
            self.off = _HIDDEN.get(adapter.split("-")[0], "update: no torch.optim optimizer to hook")
        elif self.formula is None:
            self.off = (f"update: no formula recomputed for {type(optimizer).__name__} (SGD, Adam, AdamW, "
                        "Adafactor, Muon are)")
        else:
            large = [n for n, p in (module.named_parameters() if module is not None else [])
                     if self.whole and (p.numel() > WHOLE_BUDGET or local_tensor(p).numel() != p.numel())]
            if large:
                self.off = (f"update: {len(large)} tensor(s) above {WHOLE_BUDGET:,} elements or sharded "
                            f"({large[0]} ...) are not recomputed ({self.formula} needs a whole tensor "
                            "on one host)")
            guard = guard or HookGuard()
            self._hooks = [optimizer.register_step_pre_hook(guard.wrap(self._before, "update (before)")),
                           optimizer.register_step_post_hook(guard.wrap(self._after, "update (after)"))]
        self._index: dict[tuple[int, Any], torch.Tensor] = {}
        self._turn = 0
        self.arm(False)

    def arm(self, due: bool) -> None:
        """Observe the next step if ``due``; the last observation dropped."""
        self.due = due
        self._depth = 0  # step calls entered and not left: a subclass's step around its base's nests them
        self.update: dict[str, Any] | None = None
        self.update_samples: list[dict[str, Any]] | None = None
        self._samples: list[dict[str, Any]] = []
        #: deferring: the due step's samples with their values still tensors, and the dtype named
        self.pending: tuple[list[dict[str, Any]], str] | None = None
        self._pre: list[tuple[Any, dict[str, Any], torch.Tensor, dict[str, torch.Tensor]]] = []

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _sample_index(self, n: int, device: torch.device) -> torch.Tensor:
        found = self._index.get((n, device))
        if found is None:
            gen = torch.Generator().manual_seed(n)
            found = to_device(torch.randint(0, n, (min(SAMPLED, n),), generator=gen), device)
            self._index[(n, device)] = found
        return found

    def _stepped(self, optimizer: Any) -> list[tuple[Any, dict[str, Any]]]:
        """(parameter, its group's hyperparameters) of every tensor this step samples."""
        found = []
        for group in optimizer.param_groups:
            hp = {k: _plain(v, self.defer_reads) for k, v in group.items() if k in HYPER}
            for p in group["params"]:
                local = local_tensor(p)
                if (p.grad is None or not p.requires_grad or id(p) not in self.names or not local.numel()
                        or not local.is_floating_point()):
                    continue
                if self.whole and (local.numel() != p.numel() or p.numel() > WHOLE_BUDGET):
                    continue  # a whole-tensor formula needs all of it
                found.append((p, hp))
        if not self.whole or not found:
            return found
        start, chosen, total = self._turn % len(found), [], 0
        for k in range(len(found)):
            p, hp = found[(start + k) % len(found)]
            if total + p.numel() > WHOLE_BUDGET:
                break
            chosen.append((p, hp))
            total += p.numel()
        self._turn = start + len(chosen)
        return chosen

    def _read(self, p: Any, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The parameter and its state entries at the sampled elements (whole, for a whole formula)."""
        local = local_tensor(p).detach().reshape(-1)
        at = None if self.whole else self._sample_index(local.numel(), local.device)
        out = {"param": local if at is None else local[at]}
        for k, v in state.items():
            if k not in ENTRIES or not isinstance(v, torch.Tensor):
                continue
            flat = local_tensor(v).detach().reshape(-1)
            if at is None:
                out[k] = flat
            elif v.numel() == p.numel():
                out[k] = flat[at]
        return {k: v.clone() for k, v in out.items()}

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # torch runs the hooks around every hooked class's step: a subclass whose step calls its base's
        # (both hooked once an instance of each exists) runs them twice, nested; the outermost call is
        # the step the loop made, so only it is observed
        self._depth += 1
        if not self.due or self._depth > 1:
            return
        for p, hp in self._stepped(optimizer):
            state = optimizer.state.get(p, {})
            step = state.get("step", 0)
            # a fused optimizer keeps its counter on the device and steps it in place: kept as it is now
            deferred = self.defer_reads and isinstance(step, torch.Tensor)
            step = step.detach().clone() if deferred else float(step)
            head = {"tensor": self.names[id(p)], "hp": hp, "step": step}
            if self.whole:
                head["shape"] = list(p.shape)
            pre = self._read(p, state)
            grad = local_tensor(p.grad).detach().reshape(-1)
            at = None if self.whole else self._sample_index(grad.numel(), grad.device)
            self._pre.append((p, head, (grad if at is None else grad[at]).clone(), pre))

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth or not self._pre:
            return
        dtype = str(self._pre[0][0].dtype).removeprefix("torch.")
        if self.defer_reads:  # the values stay tensors, read without a wait (the step probe stages them)
            self.pending = ([{**head, "grad": grad, "pre": pre,
                              "post": self._read(p, optimizer.state.get(p, {}))}
                             for p, head, grad, pre in self._pre], dtype)
            self._pre = []
            return
        for p, head, grad, pre in self._pre:
            post = self._read(p, optimizer.state.get(p, {}))
            self._samples.append({**head, "grad": grad.double().cpu().tolist(),
                                  "pre": {k: v.double().cpu().tolist() for k, v in pre.items()},
                                  "post": {k: v.double().cpu().tolist() for k, v in post.items()}})
        self._pre = []
        self.update, self.update_samples = self.finding(self._samples, dtype)

    def finding(self, samples: list[dict[str, Any]], dtype: str) -> tuple[dict[str, Any], Any]:
        """C-ZERO-002 ``update``: the finding recomputed in float64 from ``samples`` (values as lists),
        and the samples the rank's file keeps (None: too many whole-tensor values, the finding only)."""
        finding = recompute_update(self.formula or "AdamW", samples, dtype)
        written = sum(len(s["grad"]) for s in samples)
        return {**finding, "dtype": dtype}, None if self.whole and written > WHOLE_WRITTEN else samples
