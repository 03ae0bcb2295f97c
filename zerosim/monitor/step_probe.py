"""What one rank observes of its training step for C-ZERO-002's step clauses (``grad_accounting``,
``update``, ``replay``; the checks are in :mod:`zerosim.checks.grad_accounting`,
:mod:`zerosim.checks.update_formula`, :mod:`zerosim.checks.replay`), and the part of the check's row
that carries it.

* **Local gradients.** On a step whose check is due, a hook on every parameter that needs a gradient
  (``Tensor.register_hook``: it sees each micro-batch's local gradient before DDP's reducer takes it)
  adds the gradient's projections on k shared random +-1 vectors, its L1 norm and a micro-batch count;
  the last micro-batch's projections are kept for replay. The hooks are registered after the check
  before a due step and removed at its ``optimizer.step()``: a step that is not due runs no hook.
* **The consumed gradient.** ``register_step_pre_hook`` on the optimizer: the projections, L1 norm and
  sum of squares of every parameter's ``.grad`` as the optimizer takes it.
* **The update.** :class:`~zerosim.monitor.update_probe.UpdateProbe`: the step pre- and post-hooks of
  the optimizer that steps the parameters, at sampled elements or whole sampled tensors.
* **Reading them.** On the CPU the row's fields are read at the check that observed them
  (:meth:`StepProbe.take`). With ``defer_reads`` (the default on a CUDA device) nothing is read back
  during the step or at its check: the check stages the device values to pinned host memory behind a
  CUDA event (:meth:`StepProbe.stage`, :mod:`zerosim.monitor.staged_reads`), and the monitor posts
  that check's row at a later call, once the copy has landed (or at ``flush``/``close``): each row
  still describes the one step it observed.
* **Replay** (:meth:`StepProbe.replay`): the same micro-batch's backward again, without reducing
  (``no_sync``, DDP's forward buffer sync off) and without touching ``.grad`` (``torch.autograd.grad``).

What it cannot see: FSDP2 reduce-scatters inside its own post-backward and a ZeroTrainer or a
DeepSpeed engine inside its step, so no local gradient is seen before the reduction there
(``grad_accounting`` and ``replay`` off); a DDP communication hook (compression) changes the reduction
the bound assumes (``grad_accounting`` off); the update is recomputed for torch.optim's SGD, Adam,
AdamW, Adafactor and Muon (and their subclasses), off for other optimizers and where no torch.optim
optimizer is handed to the monitor (a ZeroTrainer, a DeepSpeed engine). Each off clause is named in
the rank's file (``step_checks_off``) and in the summary's notes.

Why one module of this length: the hooks, the replay and the row's section read and reset the same
per-step accumulators (what was armed, the local and consumed projections, the samples).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch

from ..checks.grad_accounting import BLOCK
from ..checks.update_formula import ENTRIES, FORMULAS
from .hook_guard import HookGuard
from .staged_reads import Staged, defers
from .update_probe import UpdateProbe

#: random +-1 vectors each gradient is projected on
PROJECTIONS = 2
#: the gradient dtypes a row can name
DTYPES = ("float32", "bfloat16", "float16", "float64")
#: the row's head: accounting, update finding, replay finding (float64 values)
HEAD = (
    "acc_has",
    "n_tensors",
    "max_grad_norm",
    "dtype",
    "upd_has",
    "upd_optimizer",
    "upd_checked",
    "upd_bad",
    "upd_tensor",
    "upd_entry",
    "upd_expected",
    "upd_got",
    "upd_bound",
    "upd_worst",
    "rep_has",
    "rep_step",
    "rep_checked",
    "rep_tensor",
    "rep_contributed",
    "rep_first",
    "rep_second",
    "rep_bound",
    "acc_step",
    "upd_step",
)
PER_TENSOR = 2 * (PROJECTIONS + 2)


def _nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def _none(value: float) -> float | None:
    return None if math.isnan(value) else value


class Observed:
    """A check's observation staged to the host (C-ZERO-002 ``grad_accounting``, ``update``): the step it
    belongs to, its values on their way (:class:`~zerosim.monitor.staged_reads.Staged`), and how the
    update's finding is recomputed from them."""

    def __init__(self, step: int, staged: Staged, dtype: str, finding: Any):
        self.step, self.staged, self.dtype, self._finding = step, staged, dtype, finding

    def fields(self) -> dict[str, Any]:
        """The check's step-check fields (as :meth:`StepProbe.take` gives them), each finding naming
        the ``step`` it belongs to; waits for a copy still under way."""
        tree = self.staged.result()
        out: dict[str, Any] = {}
        if "accounting" in tree:
            out["accounting"] = {**tree["accounting"], "step": self.step}
        if "samples" in tree:
            update, out["update_samples"] = self._finding(tree["samples"], self.dtype)
            out["update"] = {**update, "step": self.step}
        return out


class StepProbe:
    """One rank's observation of its due steps (see the module docstring).

    ``defer_reads``: read the observed values back one check later, without a wait (True), or at the
    check (False); None: the class attribute :attr:`defer_reads`, else deferred on a CUDA device only
    (:func:`~zerosim.monitor.staged_reads.defers`)."""

    #: the default of ``defer_reads`` for every probe built (None: by the parameters' device)
    defer_reads: bool | None = None

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        adapter: str,
        every: int,
        replay_every: int | None,
        max_grad_norm: float | None,
        defer_reads: bool | None = None,
    ):
        from torch.distributed.tensor import DTensor

        self.model, self.every, self.replay_every = model, every, replay_every
        self.max_grad_norm = max_grad_norm
        module = getattr(model, "module", model) if isinstance(model, torch.nn.Module) else None
        params = list(module.named_parameters()) if module is not None else []
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        off = []
        self.accounting = adapter in ("ddp", "zero-redundancy") and not any(
            isinstance(p, DTensor) for p in self.params
        )
        if not self.accounting:
            off.append(
                f"grad_accounting and replay: {adapter} reduces the gradient inside its own step or "
                "post-backward, no local gradient is seen before the reduction"
            )
        elif getattr(model, "_comm_hooks", None):
            self.accounting = False
            off.append("grad_accounting: a DDP communication hook changes the reduction the bound assumes")
        device = self.params[0].device.type if self.params else "cpu"
        # replay compares bitwise: only where a recomputation gives the same bits (the CPU's kernels, or
        # deterministic algorithms asked for), so that it never flags a healthy step
        self.replay_ok = device == "cpu" or torch.are_deterministic_algorithms_enabled()
        if self.accounting and replay_every and not self.replay_ok:
            off.append(f"replay: {device} kernels may round a recomputed gradient differently; "
                       "torch.use_deterministic_algorithms(True) turns it on")
        if defer_reads is None:
            defer_reads = type(self).defer_reads
        self.defer = defers(device) if defer_reads is None else bool(defer_reads)
        if not self.accounting:
            self.names, self.params, self.index = [], [], {}
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps with its local one
        self.guard = HookGuard()  # no hook of the probe's raises into the loop's backward or step
        self.updates = UpdateProbe(module, inner, adapter, self.guard, defer_reads=self.defer)
        self.formula = self.updates.formula
        off += [self.updates.off] if self.updates.off else []
        self.off = "; ".join(off) or None
        self.dtype = str(self.params[0].dtype).removeprefix("torch.") if self.params else "float32"
        self._hooks: list[Any] = []
        self._grad_hooks: list[Any] = []
        if self.accounting and optimizer is not None:
            consume = self.guard.wrap(self._consume, "consumed-gradient")
            self._hooks.append(optimizer.register_step_pre_hook(consume))
        self._sample_names = self.updates.names if self.formula is not None else {}
        self._signs: dict[Any, torch.Tensor] = {}
        self.pending_replay: dict[str, Any] | None = None
        self.replaying = False
        self.arm(None)

    # ---- arming --------------------------------------------------------------------------------------
    def _due(self, step: int | None) -> bool:
        return (
            step is None
            or step % self.every == 0
            or bool(self.replay_every and step % self.replay_every == 0)
        )

    def arm(self, step: int | None) -> None:
        """Prepare to observe ``step`` (None: the first step, whatever its number) if a check or a
        replay is due there: the local-gradient hooks registered, the accumulators emptied."""
        self._remove_grad_hooks()
        self.expected = step
        self.local: dict[int, torch.Tensor] = {}
        self.last: dict[int, torch.Tensor] = {}
        self.consumed: dict[int, torch.Tensor] = {}
        self.armed = self._due(step)
        self.updates.arm(self.armed and self._due_check())
        self.hooked: set[int] = set()  # a parameter that needed no gradient when armed has no local one
        if self.armed and self.accounting:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    local = self.guard.wrap(lambda g, i=i: self._local(i, g), "local-gradient")
                    self._grad_hooks.append(p.register_hook(local))
                    self.hooked.add(i)

    def _remove_grad_hooks(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []

    def close(self) -> None:
        self._remove_grad_hooks()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.updates.close()

    # ---- measuring -----------------------------------------------------------------------------------
    def _sign_vectors(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """k shared random +-1 vectors (the same on every rank: a fixed seed), as long as the largest
        parameter (fixed at construction, so a tensor's vectors never change), kept in ``like``'s dtype
        on its device: drawn once as int8 and converted once per dtype and device, not per projection."""
        key = (like.device, like.dtype)
        found = self._signs.get(key)
        if found is None:
            gen = torch.Generator().manual_seed(0x5EED)
            length = max([n, *(p.numel() for p in self.params)])
            signs = torch.randint(0, 2, (PROJECTIONS, length), generator=gen, dtype=torch.int8) * 2 - 1
            found = self._signs[key] = signs.to(device=like.device, dtype=like.dtype)
        if found.shape[1] < n:
            raise ValueError(f"a gradient of {n} elements is longer than every parameter")
        return found

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """[projections..., L1 norm, sum of squares] of ``g`` in float64: blocks of :data:`BLOCK`
        elements summed in its dtype, the blocks in float64. Each row's block sums are taken from its
        own elementwise product (no concatenated copy of the four rows); the block sums and the tails
        are then stacked and summed in float64 as one (rows, blocks) tensor, as the rows always were."""
        flat = g.detach().reshape(-1)
        n = flat.numel()
        signs = self._sign_vectors(n, flat)
        whole = n // BLOCK * BLOCK
        head, tail = flat[:whole].reshape(-1, BLOCK), flat[whole:]
        blocks, tails = [], []
        for j in range(PROJECTIONS):
            blocks.append((head * signs[j, :whole].reshape(-1, BLOCK)).sum(-1))
            tails.append(tail * signs[j, whole:n])
        blocks += [head.abs().sum(-1), (head * head).sum(-1)]
        tails += [tail.abs(), tail * tail]
        return torch.stack(blocks).to(torch.float64).sum(-1) + torch.stack(tails).to(torch.float64).sum(-1)

    def _local(self, i: int, g: torch.Tensor) -> None:
        if self.replaying or not self.armed:
            return
        measured = self.project(g)
        self.last[i] = measured[:PROJECTIONS]
        row = torch.cat([measured[: PROJECTIONS + 1], measured.new_ones(1)])
        self.local[i] = row if i not in self.local else self.local[i] + row

    def _consume(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.armed:
            return
        self._remove_grad_hooks()  # the local gradients of this step are all in
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for i, p in enumerate(self.params):
            if p.grad is not None:  # one it does not take counts in the clip's norm only
                measured = self.project(p.grad)
                if id(p) not in stepped:
                    measured[: PROJECTIONS + 1] = math.nan
                self.consumed[i] = measured

    def _due_check(self) -> bool:
        return self.expected is None or self.expected % self.every == 0

    # ---- replay --------------------------------------------------------------------------------------
    def replay(self, step: int, closure: Any) -> None:
        """On a due replay step: the same micro-batch's local gradient computed again and compared, by its
        projections, with the one contributed; a mismatch computed a third time (see
        :mod:`zerosim.checks.replay`). The finding is carried by the next check's row."""
        if not (self.replay_every and self.accounting and self.replay_ok and step % self.replay_every == 0
                and self.last):
            return
        if self.expected is not None and self.expected != step:
            return
        trained = [i for i in self.last if self.params[i].requires_grad]
        first = self._recompute(closure, trained)
        differs = [
            (i, j)
            for i in trained
            for j in range(PROJECTIONS)
            if float(first[i][j]) != float(self.last[i][j])
        ]
        finding: dict[str, Any] = {
            "step": step,
            "checked": len(trained),
            "tensor": None,
            "contributed": None,
            "first": None,
            "second": None,
            "bound": 0.0,
        }
        if differs:
            i, j = differs[0]
            second = self._recompute(closure, [i])
            finding.update(
                tensor=self.names[i],
                contributed=float(self.last[i][j]),
                first=float(first[i][j]),
                second=float(second[i][j]),
            )
        if self.pending_replay is None or self.pending_replay["tensor"] is None:
            self.pending_replay = finding

    def _recompute(self, closure: Any, which: list[int]) -> dict[int, torch.Tensor]:
        model = self.model
        sync = getattr(model, "no_sync", None)
        saved = getattr(model, "require_forward_param_sync", None)
        self.replaying = True
        try:
            with sync() if sync is not None else contextlib.nullcontext():
                if saved is not None:
                    model.require_forward_param_sync = False  # no buffer broadcast: no collective
                with torch.enable_grad():
                    loss = closure()
                    grads = torch.autograd.grad(loss, [self.params[i] for i in which], allow_unused=True)
        finally:
            self.replaying = False
            if saved is not None:
                model.require_forward_param_sync = saved
        return {
            i: self.project(g)[:PROJECTIONS]
            if g is not None
            else torch.zeros(PROJECTIONS, dtype=torch.float64)
            for i, g in zip(which, grads, strict=True)
        }

    # ---- the row -------------------------------------------------------------------------------------
    def length(self) -> int:
        return len(HEAD) + PER_TENSOR * len(self.names)

    def take(self, step: int) -> dict[str, Any]:
        """This rank's step-check fields for a check at ``step`` (C-ZERO-002): what was observed if the
        probe was armed for this step (deferring: nothing observed, which :meth:`stage` sends to the
        host instead); the replay finding waiting for a check."""
        self.guard.reraise()
        mine = self.expected is None or self.expected == step
        fields: dict[str, Any] = {"step_checks_off": self.off}
        if self.defer:
            pass
        elif mine and self.consumed and self.local is not None and step % self.every == 0:
            nan = [math.nan] * (PROJECTIONS + 2)
            fields["accounting"] = {
                "tensors": list(self.names),
                "local": [
                    self.local[i].tolist()
                    if i in self.local
                    else ([0.0] * (PROJECTIONS + 1) + [1.0] if i in self.hooked else nan)
                    for i in range(len(self.names))
                ],
                "consumed": [
                    self.consumed[i].tolist() if i in self.consumed else nan for i in range(len(self.names))
                ],
                "dtype": self.dtype,
                "max_grad_norm": self.max_grad_norm,
            }
        if not self.defer and mine and self.updates.update is not None and step % self.every == 0:
            fields["update"], fields["update_samples"] = self.updates.update, self.updates.update_samples
        if step % self.every == 0 and self.pending_replay is not None:
            fields["replay"], self.pending_replay = self.pending_replay, None
        return fields

    def observe(self, step: int) -> Observed | None:
        """This rank's observation of the step just checked at ``step``, its device values staged to
        the host without a wait (C-ZERO-002 ``grad_accounting``, ``update``); None: nothing observed."""
        tree: dict[str, Any] = {}
        if self.consumed and self.local is not None:
            nan = [math.nan] * (PROJECTIONS + 2)
            tree["accounting"] = {
                "tensors": list(self.names),
                "local": [
                    self.local[i]
                    if i in self.local
                    else ([0.0] * (PROJECTIONS + 1) + [1.0] if i in self.hooked else nan)
                    for i in range(len(self.names))
                ],
                "consumed": [self.consumed.get(i, nan) for i in range(len(self.names))],
                "dtype": self.dtype,
                "max_grad_norm": self.max_grad_norm,
            }
        dtype = ""
        if self.updates.pending is not None:
            tree["samples"], dtype = self.updates.pending
            self.updates.pending = None
        return Observed(step, Staged(tree, defer=True), dtype, self.updates.finding) if tree else None

    def stage(self, step: int) -> Observed | None:
        """Deferring: this rank's observation of a check at ``step`` on its way to the host
        (:meth:`observe`), which the monitor reads once it has landed and sends in that check's row
        (C-ZERO-002 ``grad_accounting``, ``update``); None when not deferring or nothing was observed."""
        mine = self.expected is None or self.expected == step
        if not self.defer or not mine or step % self.every:
            return None
        return self.observe(step)

    def encode(self, fields: dict[str, Any], length: int) -> torch.Tensor:
        """``fields`` (:meth:`take`) as the row's float64 section of ``length`` values, int64 bits."""
        head = dict.fromkeys(HEAD, math.nan)
        values = np.full(length, np.nan)
        acc = fields.get("accounting")
        head["acc_has"] = float(acc is not None)
        head["acc_step"] = _nan(acc.get("step") if acc is not None else None)
        head["n_tensors"] = len(self.names)
        head["max_grad_norm"] = _nan(self.max_grad_norm)
        head["dtype"] = DTYPES.index(self.dtype) if self.dtype in DTYPES else 0
        if acc is not None:
            for t in range(len(self.names)):
                at = len(HEAD) + PER_TENSOR * t
                values[at : at + PER_TENSOR] = acc["local"][t] + acc["consumed"][t]
        upd = fields.get("update")
        head["upd_has"] = float(upd is not None)
        head["upd_step"] = _nan(upd.get("step") if upd is not None else None)
        if upd is not None:
            head.update(
                upd_optimizer=FORMULAS.index(upd["optimizer"]),
                upd_checked=upd["checked"],
                upd_bad=upd["bad"],
                upd_worst=upd["worst_ratio"],
                upd_tensor=self._name_index(upd["tensor"]),
                upd_entry=-1 if upd["entry"] is None else ENTRIES.index(upd["entry"]),
                upd_expected=_nan(upd["expected"]),
                upd_got=_nan(upd["got"]),
                upd_bound=_nan(upd["bound"]),
            )
        rep = fields.get("replay")
        head["rep_has"] = float(rep is not None)
        if rep is not None:
            head.update(
                rep_step=rep["step"],
                rep_checked=rep["checked"],
                rep_tensor=self._name_index(rep["tensor"]),
                rep_contributed=_nan(rep["contributed"]),
                rep_first=_nan(rep["first"]),
                rep_second=_nan(rep["second"]),
                rep_bound=rep["bound"],
            )
        values[: len(HEAD)] = [head[k] for k in HEAD]
        return torch.from_numpy(values).view(torch.int64)

    def _name_index(self, name: str | None) -> int:
        return -1 if name is None else self.all_names().index(name)

    def all_names(self) -> list[str]:
        """The names a finding's tensor index refers to (every parameter of the module)."""
        if not hasattr(self, "_all"):
            self._all = list(self._sample_names.values()) if self.formula is not None else []
            self._all += [n for n in self.names if n not in self._all]
        return self._all

    def decode(self, section: np.ndarray) -> dict[str, Any]:
        """Another rank's step-check fields from its row's section (int64 bits of float64 values)."""
        values = np.ascontiguousarray(section).view(np.float64)
        head = dict(zip(HEAD, values[: len(HEAD)].tolist(), strict=True))
        fields: dict[str, Any] = {"step_checks_off": self.off}
        names = self.all_names()
        if head["acc_has"] == 1 and int(head["n_tensors"]) == len(self.names):
            rows = [
                values[len(HEAD) + PER_TENSOR * t : len(HEAD) + PER_TENSOR * (t + 1)].tolist()
                for t in range(len(self.names))
            ]
            half = PER_TENSOR // 2
            fields["accounting"] = {
                "tensors": list(self.names),
                "local": [r[:half] for r in rows],
                "consumed": [r[half:] for r in rows],
                "dtype": DTYPES[int(head["dtype"])],
                "max_grad_norm": _none(head["max_grad_norm"]),
            }
            if not math.isnan(head["acc_step"]):
                fields["accounting"]["step"] = int(head["acc_step"])
        if head["upd_has"] == 1:
            t, e = int(head["upd_tensor"]), int(head["upd_entry"])
            fields["update"] = {
                "optimizer": FORMULAS[int(head["upd_optimizer"])],
                "checked": int(head["upd_checked"]),
                "bad": int(head["upd_bad"]),
                "tensor": names[t] if 0 <= t < len(names) else None,
                "entry": ENTRIES[e] if e >= 0 else None,
                "expected": _none(head["upd_expected"]),
                "got": _none(head["upd_got"]),
                "bound": _none(head["upd_bound"]),
                "worst_ratio": head["upd_worst"],
            }
            if not math.isnan(head["upd_step"]):
                fields["update"]["step"] = int(head["upd_step"])
        if head["rep_has"] == 1:
            t = int(head["rep_tensor"])
            fields["replay"] = {
                "step": int(head["rep_step"]),
                "checked": int(head["rep_checked"]),
                "tensor": names[t] if 0 <= t < len(names) else None,
                "contributed": _none(head["rep_contributed"]),
                "first": _none(head["rep_first"]),
                "second": _none(head["rep_second"]),
                "bound": head["rep_bound"],
            }
        return fields


def invalid_option(
    every: Any, on_violation: Any, timeout: Any, max_grad_norm: Any, replay_every: Any
) -> str | None:
    """One line naming the first bad ``Monitor`` option (or a missing process group), else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return "no torch.distributed process group (call init_process_group, e.g. under torchrun)"
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return f"invalid every={every!r}: must be a positive integer (steps between checks)"
    if on_violation not in ("log", "raise"):
        return f"invalid on_violation={on_violation!r}: must be one of log, raise"
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < 1e7:
        return f"invalid timeout={timeout!r}: must be a number of seconds above 0"
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, int | float)
        or not 0 < max_grad_norm < math.inf
    ):
        return (
            f"invalid max_grad_norm={max_grad_norm!r}: must be a positive number (the clip threshold) or None"
        )
    if replay_every is not None and (
        isinstance(replay_every, bool) or not isinstance(replay_every, int) or replay_every < 1
    ):
        return f"invalid replay_every={replay_every!r}: must be a positive integer (steps between replays)"
    return None
