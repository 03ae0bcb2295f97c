"""Muon and Adafactor on numpy, stepped on whole tensors inside a flat array.

Neither is elementwise. Muon (torch 2.13's ``torch.optim.Muon``, torch's recipe: Muon for every 2-D
tensor, AdamW for the others) orthogonalises each whole 2-D update with a Newton-Schulz iteration;
Adafactor (``torch.optim.Adafactor``) keeps a matrix's second moment as row and column statistics and
scales its step by the RMS of the whole tensor. A flat slice of a tensor stepped alone gets another
update, so these optimizers are built over :class:`TensorSlot` s, the whole tensors (name, shape,
where they start) inside the flat array the engine or the ground truth steps:
:func:`layout_optimizer` for a whole model, :func:`whole_tensor_slots` for the tensors a rank owns
(a ConfigError names a tensor its pieces split).

Formulas and operation order follow torch's single-tensor CPU code (``_single_tensor_muon``,
``_single_tensor_adafactor``): lerps and ``add(alpha=)`` as fused multiply-adds with the weights
rounded to the master's dtype, norms as torch's float reductions returned as Python floats (``.item()``).
Two documented departures:

* **Newton-Schulz runs in the master's dtype** (float32; float64 for a float64 model), not in
  bfloat16 as torch's ``_zeropower_via_newtonschulz`` does. The simulator asks whether sharding
  changes the step, so the iteration must be the same deterministic function for the engine and
  for the unsharded references; its matrix products are computed by :func:`_matmul` in float64
  and rounded once to the master's dtype, so the engine's ranks (threads or processes) and the
  references (in a child process with one BLAS thread, where that pays) get the same bits.
  Against torch's bfloat16 iteration the update differs by bfloat16 rounding (measured in
  tests/test_optim_matrix.py).
* **Adafactor's factored statistics are held expanded**: ``row_var`` holds each row's value at
  every element of the row, ``col_var`` each column's at every element of the column (``variance``
  as torch holds it, for vectors; zeros elsewhere), and Muon's ``momentum_buffer`` and AdamW's
  ``exp_avg`` / ``exp_avg_sq`` are zero on the tensors the other optimizer steps. Every state is
  then a flat array sharded exactly like the parameters (C-ZERO-002 compares it element by
  element, checkpoints and C-ZERO-004 count it as such); the values are torch's, the memory is one
  array per state name (three per element), not Adafactor's ``rows + columns``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, require_non_negative_int
from ..values.layout import ParamLayout
from .optim import AdamW, OptimizerSpec, _lerp, _Optimizer, _scalar_for, make_optimizer
from .xp import ArrayNamespace, get_namespace, numpy_namespace


@dataclass(frozen=True)
class TensorSlot:
    """A tensor the optimizer steps: its name, shape and first element in the flat array."""

    name: str
    shape: tuple[int, ...]
    position: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout_slots(layout: ParamLayout) -> list[TensorSlot]:
    """Every tensor of ``layout`` at its flat offset (the unsharded model)."""
    return [TensorSlot(t.name, tuple(t.shape), g0)
            for t, g0 in zip(layout.tensors, layout.offsets, strict=True) if t.numel]


def whole_tensor_slots(layout: ParamLayout, pieces: Iterable[tuple[int, int, int]],
                       partitioner: str = "?") -> list[TensorSlot]:
    """The tensors inside a rank's owned ``(global start, global end, position in the shard)`` pieces,
    placed at their shard positions; ConfigError naming ``partitioner`` and the first tensor the
    pieces hold only part of."""
    pieces = sorted(pieces)
    out = []
    for t, g0 in zip(layout.tensors, layout.offsets, strict=True):
        g1 = g0 + t.numel
        inside = [(a, b, pos) for a, b, pos in pieces if a < g1 and b > g0]
        if not t.numel or not inside:
            continue
        a, b, pos = inside[0]
        if len(inside) > 1 or a > g0 or b < g1:
            raise ConfigError("partitioner", partitioner,
                              f"splits tensor {t.name} {tuple(t.shape)} between ranks; a non-elementwise "
                              "optimizer needs whole tensors (zero-redundancy, round-robin or contiguous)")
        out.append(TensorSlot(t.name, tuple(t.shape), pos + g0 - a))
    return out


def sliced_slots(layout: ParamLayout, pieces: Iterable[tuple[int, int, int]]) -> list[TensorSlot]:
    """A deliberately wrong layout: every owned piece of a tensor stepped as if it were the tensor (a
    piece of whole rows of a matrix as those rows, any other piece of a matrix as one row), what a
    flat ZeRO split does to a matrix optimizer. C-ZERO-002 must fail it."""
    out = []
    for t, g0 in zip(layout.tensors, layout.offsets, strict=True):
        g1 = g0 + t.numel
        for a, b, pos in sorted(pieces):
            lo, hi = max(a, g0), min(b, g1)
            if lo >= hi:
                continue
            n, shape = hi - lo, tuple(t.shape)
            if len(shape) == 2:
                cols = shape[1]
                whole_rows = (lo - g0) % cols == 0 and n % cols == 0
                shape = (n // cols, cols) if whole_rows else (1, n)
            else:
                shape = (n,)
            out.append(TensorSlot(t.name, shape, pos + lo - a))
    return out


def layout_optimizer(spec: OptimizerSpec, layout: ParamLayout,
                     xp: ArrayNamespace | str | None = None) -> Any:
    """The optimizer that steps ``layout``'s whole flat vector: :func:`zerosim.numerics.optim.make_optimizer`
    for an elementwise spec, a :class:`MatrixOptimizer` over every tensor otherwise."""
    if spec.elementwise:
        return make_optimizer(spec, xp)
    return MatrixOptimizer(spec, layout_slots(layout), xp)


def _matmul(a: np.ndarray, b: np.ndarray, dtype: Any) -> np.ndarray:
    """``a @ b`` in float64 (BLAS dgemm, which splits the output among its threads, never a sum) rounded
    once to ``dtype``: the same bits in every rank and process of a run, whatever the thread count."""
    return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(dtype)


def _norm(x: np.ndarray, dtype: Any, axis: int | None = None) -> Any:
    """The 2-norm of ``x`` (over ``axis``, kept) as torch returns it in ``dtype``: the float64 sum of
    squares, its root rounded once."""
    sumsq = np.sum(np.square(x, dtype=np.float64), axis=axis, keepdims=axis is not None)
    return np.sqrt(sumsq).astype(dtype)


def newton_schulz(grad: np.ndarray, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> np.ndarray:
    """torch's ``_zeropower_via_newtonschulz`` in ``grad``'s dtype: the quintic iteration on the
    (wide) matrix normalised by its Frobenius norm (at least ``eps``)."""
    dtype = grad.dtype
    r = _scalar_for(dtype.name)
    a, b, c = (r(v) for v in coefficients)
    x = grad.T.copy() if grad.shape[0] > grad.shape[1] else grad.copy()
    x /= max(_norm(x, dtype), dtype.type(r(eps)))
    for _ in range(steps):
        gram = _matmul(x, x.T, dtype)
        gram_update = gram * dtype.type(b) + _matmul(gram, gram, dtype) * dtype.type(c)
        x = x * dtype.type(a) + _matmul(gram_update, x, dtype)
    return x.T.copy() if grad.shape[0] > grad.shape[1] else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch's ``_adjust_lr``: ``lr sqrt(max(1, A / B))`` ("original", the default) or
    ``0.2 lr sqrt(max(A, B))`` ("match_rms_adamw")."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class MatrixOptimizer(_Optimizer):
    """Muon (with AdamW for tensors that are not 2-D) or Adafactor over the whole tensors ``slots`` of a
    flat array: the engine's optimizer interface (``init_state(n, dtype)``, ``step(param, grad,
    state)``, in place), on numpy arrays. Elements outside every slot (a shard's padding) are never
    read or written."""

    def __init__(self, spec: OptimizerSpec, slots: list[TensorSlot], xp: ArrayNamespace | str | None = None):
        if spec.elementwise:
            raise ConfigError("optimizer", spec.name, "is elementwise: use "
                                                      "zerosim.numerics.optim.make_optimizer")
        ns = get_namespace(xp)
        if ns.backend != "numpy":
            raise ConfigError("xp", ns.backend, f"{spec.name} runs on numpy arrays (xp='numpy')")
        super().__init__(spec, ns)
        for slot in slots:
            if len(slot.shape) > 2:
                raise ConfigError("tensor", f"{slot.name} {slot.shape}",
                                  f"{spec.name} here steps 1-D and 2-D tensors only")
        self.slots = list(slots)
        adamw = OptimizerSpec("adamw", lr=spec.lr if spec.adamw_lr is None else spec.adamw_lr,
                              betas=spec.adamw_betas, eps=spec.adamw_eps,
                              weight_decay=spec.adamw_weight_decay)
        self._adamw = AdamW(adamw, numpy_namespace())

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        require_non_negative_int("n", n)
        end = max((s.position + s.numel for s in self.slots), default=0)
        if end > n:
            raise ConfigError("n", n, f"the tensors stepped reach element {end}")
        return super().init_state(n, dtype)

    def step(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        """One step of every slot's tensor, in place on ``param`` and ``state``."""
        self._check(param, grad, state)
        t = int(state["step"]) + 1
        for slot in self.slots:
            lo, hi = slot.position, slot.position + slot.numel
            views = {k: state[k][lo:hi] for k in self.spec.state_names}
            if self.spec.name == "muon":
                self._muon(slot, param[lo:hi], grad[lo:hi], views, t)
            else:
                self._adafactor(slot, param[lo:hi], grad[lo:hi], views, t)
        state["step"] = t

    # ---- Muon ------------------------------------------------------------------------------------
    def _muon(self, slot: TensorSlot, p: np.ndarray, g: np.ndarray, st: dict[str, np.ndarray],
              t: int) -> None:
        s, xp = self.spec, self.xp
        if len(slot.shape) != 2:  # torch's recipe: AdamW for every tensor that is not 2-D
            self._adamw.step(p, g, {"step": t - 1, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]})
            return
        r = _scalar_for(p.dtype.name)
        buf = st["momentum_buffer"]
        xp.assign(buf, _lerp(xp, buf, g, 1.0 - s.momentum))
        update = _lerp(xp, g, buf, s.momentum) if s.nesterov else buf
        ortho = newton_schulz(update.reshape(slot.shape), s.ns_coefficients, s.ns_steps, s.eps)
        lr = adjusted_lr(s.lr, s.adjust_lr_fn, slot.shape)
        weight_decay = s.weight_decay or 0.0
        p *= r(1.0 - s.lr * weight_decay)
        xp.assign(p, xp.fma(ortho.reshape(-1), -lr, p))

    # ---- Adafactor -------------------------------------------------------------------------------
    def _adafactor(self, slot: TensorSlot, p: np.ndarray, g: np.ndarray, st: dict[str, np.ndarray],
                   t: int) -> None:
        s, xp = self.spec, self.xp
        dtype = p.dtype
        r = _scalar_for(dtype.name)
        eps1 = float(np.finfo(dtype).eps) if s.eps1 is None else s.eps1
        step = float(t)
        weight = step ** s.beta2_decay
        rho = min(s.lr, 1.0 / step**0.5)
        alpha = max(s.eps, float(_norm(p, dtype)) / slot.numel**0.5) * rho
        weight_decay = s.weight_decay or 0.0
        if weight_decay != 0:
            p *= r(1.0 - s.lr * weight_decay)
        if len(slot.shape) == 2:
            rows, cols = slot.shape
            grad = g.reshape(slot.shape)
            row_full, col_full = st["row_var"].reshape(slot.shape), st["col_var"].reshape(slot.shape)
            row_mean = np.square(_norm(grad, dtype, axis=1)) / dtype.type(cols)
            row_var = _lerp(xp, row_full[:, :1], row_mean, weight)
            col_mean = np.square(_norm(grad, dtype, axis=0)) / dtype.type(rows)
            col_var = _lerp(xp, col_full[:1, :], col_mean, weight)
            row_full[...] = row_var
            col_full[...] = col_var
            estimate = row_var * col_var  # (rows, 1) @ (1, cols): one product per element
            row_mean_var = (np.sum(row_var, axis=0, keepdims=True, dtype=np.float64) / rows).astype(dtype)
            estimate /= np.maximum(row_mean_var, dtype.type(r(eps1)))
            estimate = estimate.reshape(-1)
        else:
            variance = st["variance"]
            xp.assign(variance, _lerp(xp, variance, g * g, weight))
            estimate = variance.copy()
        update = dtype.type(1.0) / np.sqrt(np.maximum(estimate, dtype.type(r(eps1 * eps1))))
        update *= g
        denom = max(1.0, float(_norm(update, dtype)) / (slot.numel**0.5 * s.d))
        xp.assign(p, xp.fma(update, -alpha / denom, p))
