"""The exact optimizer's Adam/AdamW update as one Triton pass over a flat shard on a GPU (C-ZERO-002).

zerosim's reference optimizer (:mod:`zerosim.numerics.optim`) writes torch's single-tensor Adam as a sequence
of float32 operations, each rounded once: products, sums, a correctly rounded square root and
divisions, and two fused multiply-adds (torch's ``lerp`` and ``addcmul``). Run as torch operations
on a device that is eleven passes over the shard, with float64 temporaries for the emulated
multiply-adds: about a tenth of the copy bandwidth on an H200.

:func:`adam_pass` writes the same operations, in the same order and with the same float32
coefficients, as one Triton kernel: each element's parameter, gradient and both moments are read
once and the three updated arrays written once (28 bytes per element, what a copy of 14 bytes per
element moves). Each operation is the IEEE operation the reference rounds it with:

- products, sums and differences: float32 ``*``, ``+``, ``-`` with the compiler's floating-point
  contraction switched off (``enable_fp_fusion=False``), so no product is fused into a sum the
  reference rounds separately;
- the two multiply-adds the reference fuses (the ``lerp`` of ``exp_avg``, ``v + ((1 - b2) g) g``;
  Adam's L2 term ``p wd + g``): ``tl.fma``, one rounding;
- the square root and both divisions: ``tl.sqrt_rn`` and ``tl.div_rn``, correctly rounded (Triton's
  plain ``/`` and ``sqrt`` are approximate on CUDA).

Every operation then has the reference's single rounding, so on a GPU the result is the reference's
bits: ``tests/test_zerogpu_triton_kernel.py`` and ``zerosim gpu-check``'s ``kernel`` step compare it
with the CPU's reference bit for bit. Under Triton's interpreter (``TRITON_INTERPRET=1``, numpy on the
CPU) ``tl.fma`` is computed as a float32 product and a sum, rounded twice: within C-ZERO-002's one-step
bound, which counts every multiply-add as a product and a sum; that is what the CPU test checks.

The coefficients change every step (the bias corrections) and are passed as float32 kernel arguments
(each is a float32 value already, so passing it rounds nothing), so one compiled kernel serves every
step.
"""

from __future__ import annotations

from typing import Any

from zerosim.numerics.optim import OptimizerSpec, _scalar_for, make_optimizer
from zerosim.numerics.xp import ArrayNamespace

#: elements per Triton program (a power of two: 8 warps x 32 threads x 8 float32 each)
BLOCK = 2048


def triton_available() -> bool:
    """Whether Triton can be imported here (it ships with torch's CUDA builds, not its CPU builds)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    """The Triton kernel, defined on first use (Triton is imported only where a GPU run needs it)."""
    global _ADAM_KERNEL
    if _ADAM_KERNEL is not None:
        return _ADAM_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, wd, w, b2, omb2, bc2s, eps, neg_step,
                    DECAY: tl.constexpr, LERP_LOW: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        if DECAY == 1:  # AdamW: p * (1 - lr wd)
            p = p * wd
        if DECAY == 2:  # Adam: g + wd p, fused as torch's add(alpha=)
            g = tl.fma(p, wd, g)
        d = g - m
        if LERP_LOW:  # torch's lerp: fma(w, end - start, start) for |w| < 0.5
            m = tl.fma(d, w, m)
        else:  # else fma(w - 1, end - start, end)
            m = tl.fma(d, w, g)
        v = tl.fma(g * omb2, g, v * b2)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2s) + eps
        p = p + tl.div_rn(m * neg_step, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    _ADAM_KERNEL = adam_kernel
    return adam_kernel


_ADAM_KERNEL: Any = None

#: ``DECAY``: no weight decay, AdamW's decoupled decay, Adam's L2 term
DECAY_CODES = {"none": 0, "decoupled": 1, "l2": 2}


def adam_coefficients(spec: OptimizerSpec, t: int) -> tuple[str, bool, list[float]]:
    """The decay kind, the ``lerp`` branch and the float32 coefficients ``[wd, w, b2, 1 - b2,
    sqrt(1 - b2^t), eps, -lr / (1 - b1^t)]`` of step ``t``, formed as :class:`zerosim.numerics.optim.Adam`
    forms them (bias corrections in float64 on the host, each coefficient then rounded to float32)."""
    r = _scalar_for("float32")
    beta1, beta2 = spec.betas
    wd = spec.weight_decay or 0.0
    decay = "none" if wd == 0 else "decoupled" if spec.name == "adamw" else "l2"
    w = r(1.0 - beta1)
    lerp_low = abs(w) < 0.5
    bc1, bc2 = 1.0 - beta1 ** float(t), 1.0 - beta2 ** float(t)
    coeffs = [r(1.0 - spec.lr * wd) if decay == "decoupled" else r(wd), w if lerp_low else r(w - 1.0),
              r(beta2), r(1.0 - beta2), r(bc2**0.5), r(spec.eps), r(-(spec.lr / bc1))]
    return decay, lerp_low, [float(c) for c in coeffs]


def adam_pass(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, spec: OptimizerSpec, t: int) -> None:
    """Step ``t`` of Adam/AdamW on flat contiguous float32 tensors, in place, in one Triton pass."""
    import triton

    decay, lerp_low, (wd, w, b2, omb2, bc2s, eps, neg_step) = adam_coefficients(spec, t)
    n = int(param.numel())
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    _kernel()[grid](param, grad, exp_avg, exp_avg_sq, n, wd, w, b2, omb2, bc2s, eps, neg_step,
                    DECAY=DECAY_CODES[decay], LERP_LOW=lerp_low, BLOCK=BLOCK, num_warps=8,
                    enable_fp_fusion=False)


class TritonExactAdam:
    """The engine's optimizer interface (``init_state``, ``step``): the reference optimizer, with its
    Adam/AdamW update of a contiguous float32 shard on a device run as :func:`adam_pass` (the same
    bits, one pass); anything else (SGD, other dtypes, strided shards) steps through the reference."""

    def __init__(self, spec: OptimizerSpec, xp: ArrayNamespace):
        self.spec = spec
        self.xp = xp
        self._reference = make_optimizer(spec, xp)

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        return self._reference.init_state(n, dtype)

    def _one_pass(self, param: Any, grad: Any, state: dict[str, Any]) -> bool:
        import torch

        arrays = (param, grad, state.get("exp_avg"), state.get("exp_avg_sq"))
        return (self.spec.name in ("adam", "adamw") and not getattr(self.spec, "amsgrad", False)
                and all(isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.is_contiguous()
                        and a.device == param.device for a in arrays))

    def step(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        """One step in place on ``param`` and ``state`` (``state["step"]`` counts as in
        :mod:`zerosim.numerics.optim`): C-ZERO-002's full optimizer step on the owned elements."""
        if not self._one_pass(param, grad, state):
            self._reference.step(param, grad, state)
            return
        self._reference._check(param, grad, state)
        t = int(state["step"]) + 1
        adam_pass(param, grad, state["exp_avg"], state["exp_avg_sq"], self.spec, t)
        state["step"] = t

