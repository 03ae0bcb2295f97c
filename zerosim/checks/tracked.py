"""A float64 value and the bound of its distance from what an optimizer computes in its own dtype: the
running error analysis the update check (:mod:`zerosim.checks.update_formula`) carries through an
optimizer's formula, element by element or over a whole tensor.

Model (first order, u the unit roundoff of the optimizer's dtype): each operation the optimizer
performs in that dtype rounds once, relative u of its result; a hyperparameter is rounded to that
dtype (relative u) before it multiplies; a sum of n terms of one sign (a norm's squares, a mean)
errs by at most gamma_n of the sum (:func:`~zerosim.checks.rounding.gamma`), in any order. Each value
carries the bound of its error through the formula; the inputs are the exact values read before the
step, so their bound is 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .rounding import gamma


class Tracked:
    """A float64 array ``v`` and the bound ``e`` of its error against the optimizer's own arithmetic."""

    def __init__(self, value: Any, err: Any = 0.0):
        self.v = np.asarray(value, dtype=np.float64)
        self.e = np.broadcast_to(np.asarray(err, dtype=np.float64), self.v.shape).copy()

    def plus(self, other: Tracked, u: float) -> Tracked:
        v = self.v + other.v
        return Tracked(v, self.e + other.e + u * np.abs(v))

    def times(self, scalar: float, u: float) -> Tracked:
        v = self.v * scalar
        return Tracked(v, self.e * abs(scalar) + 2 * u * np.abs(v))  # the scalar's and the product's

    def scaled(self, scalar: Tracked, u: float) -> Tracked:
        """Times a scalar that carries its own error bound (a norm read back to the host, say)."""
        s, ds = float(scalar.v), float(scalar.e)
        v = self.v * s
        return Tracked(v, self.e * (abs(s) + ds) + np.abs(self.v) * ds + 2 * u * np.abs(v))

    def mul(self, other: Tracked, u: float) -> Tracked:
        v = self.v * other.v
        return Tracked(
            v, np.abs(self.v) * other.e + np.abs(other.v) * self.e + self.e * other.e + u * np.abs(v)
        )

    def div(self, other: Tracked, u: float) -> Tracked:
        v = self.v / other.v
        low = np.maximum(np.abs(other.v) - other.e, 1e-300)
        return Tracked(v, (self.e + np.abs(v) * other.e) / low + u * np.abs(v))

    def sqrt(self, u: float) -> Tracked:
        v = np.sqrt(np.maximum(self.v, 0.0))
        return Tracked(v, np.sqrt(np.maximum(self.v, 0.0) + self.e) - v + u * v)

    def rsqrt(self, u: float) -> Tracked:
        """``1 / sqrt(x)`` of a positive value (two roundings: the root and the reciprocal)."""
        v = 1.0 / np.sqrt(self.v)
        low = np.maximum(self.v - self.e, 1e-300)
        return Tracked(v, 1.0 / np.sqrt(low) - v + 2 * u * v)

    def clamp_min(self, floor: float) -> Tracked:
        """``max(x, floor)``: 1-Lipschitz, so the bound carries over."""
        return Tracked(np.maximum(self.v, floor), self.e)

    def square_sum(self, axis: Any, u: float) -> Tracked:
        """The sum of squares along ``axis`` (kept), as torch's ``norm(...).square()`` forms it: the
        squares' sum within gamma_n of itself, a root and a square (two roundings each way)."""
        n = int(np.prod([self.v.shape[a] for a in np.atleast_1d(axis)])) if self.v.ndim else 1
        v = np.sum(self.v * self.v, axis=axis, keepdims=True)
        first = np.sum(2 * np.abs(self.v) * self.e + self.e * self.e, axis=axis, keepdims=True)
        return Tracked(v, first + (gamma(n, u) + 4 * u) * v)


def blend(x: Tracked, y: Tracked, beta: float, u: float) -> Tracked:
    """``beta x + (1 - beta) y`` as torch forms it (products and a sum, or ``lerp``), the coefficient
    rounded to the dtype too."""
    v = beta * x.v + (1 - beta) * y.v
    return Tracked(v, beta * x.e + (1 - beta) * y.e + 5 * u * (np.abs(x.v) + np.abs(y.v)))


def norm_of(x: Tracked, u: float) -> Tracked:
    """The 2-norm of a whole array as a scalar read back to the host (``tensor.norm().item()``)."""
    squares = x.square_sum(tuple(range(x.v.ndim)), u) if x.v.ndim else x.mul(x, u)
    value = float(np.sqrt(squares.v.reshape(-1)[0]))
    high = float(np.sqrt(squares.v.reshape(-1)[0] + squares.e.reshape(-1)[0]))
    return Tracked(value, high - value + u * value)
