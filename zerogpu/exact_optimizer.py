"""``optimizer_kernel="reference"``: zerosim's exact optimizer, run by the fastest kernel that gives its
bits on this machine (C-ZERO-002's full optimizer step on the owned elements).

The reference (:mod:`zerosim.numerics.optim`) writes torch's single-tensor Adam as float32 operations,
each rounded once, two of them fused multiply-adds. Where another kernel computes exactly those
operations, it is the reference, faster:

- **a CUDA device with Triton**: :class:`zerogpu.triton_kernel.TritonExactAdam`, one Triton pass with
  the reference's rounding operation by operation (bitwise on an H200, 0.82 of the copy bandwidth);
- **a CPU whose torch build runs fused multiply-adds in its vector loops** (torch reports the
  capability ``AVX2`` or ``AVX512``: asked, never assumed from the processor's name):
  :class:`FusedPrefixAdam`, torch's fused CPU Adam/AdamW kernel on the shard's first ``16 k``
  elements and the reference on the rest. That kernel rounds each multiply-add once in its vector
  loop, as the reference does, and splits its work across threads at 64-byte units (16 float32), so
  a call whose length is a multiple of 16 never reaches its scalar tail, which rounds differently
  (:mod:`zerogpu.host_optimizer` measured both: bitwise on the vector loop, the tail within the
  one-step bound but not bitwise). The last ``n mod 16`` elements go through the reference;
- anywhere else (the scalar build, SGD, float64 masters, strided shards): the reference itself.
"""

from __future__ import annotations

from typing import Any

from zerosim.numerics.optim import OptimizerSpec, make_optimizer
from zerosim.numerics.xp import ArrayNamespace

from .torch_kernels import TorchKernelOptimizer, fused_kernel_is_exact
from .triton_kernel import TritonExactAdam, triton_available

#: the fused CPU kernel's work unit (64 bytes of float32): a prefix of a multiple of it has no tail
FUSED_UNIT = 16


class FusedPrefixAdam:
    """The engine's optimizer interface (``init_state``, ``step``): the reference optimizer, with its
    Adam/AdamW update of a contiguous float32 CPU shard stepped by torch's fused CPU kernel on the
    first multiple of :data:`FUSED_UNIT` elements and by the reference on the rest (the same bits:
    module docstring); anything else steps through the reference."""

    def __init__(self, spec: OptimizerSpec, xp: ArrayNamespace):
        self.spec = spec
        self.xp = xp
        self._reference = make_optimizer(spec, xp)
        self._fused = TorchKernelOptimizer(spec, xp, fused=True)

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        return self._reference.init_state(n, dtype)

    def _prefix(self, param: Any, grad: Any, state: dict[str, Any]) -> int:
        """How many leading elements the fused kernel steps (0: the reference steps them all)."""
        import torch

        arrays = (param, grad, state.get("exp_avg"), state.get("exp_avg_sq"))
        if self.spec.name not in ("adam", "adamw") or not all(
                isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.device.type == "cpu"
                and a.dim() == 1 and a.is_contiguous() for a in arrays):
            return 0
        return int(param.shape[0]) // FUSED_UNIT * FUSED_UNIT

    def step(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        """One step in place on ``param`` and ``state`` (``state["step"]`` counts as in
        :mod:`zerosim.numerics.optim`): C-ZERO-002's full optimizer step on the owned elements."""
        k = self._prefix(param, grad, state)
        if k == 0:
            self._reference.step(param, grad, state)
            return
        self._reference._check(param, grad, state)
        t = int(state["step"])
        names = self.spec.state_names
        self._fused.step(param[:k], grad[:k], {"step": t, **{n: state[n][:k] for n in names}})
        if k < int(param.shape[0]):
            self._reference.step(param[k:], grad[k:], {"step": t, **{n: state[n][k:] for n in names}})
        state["step"] = t + 1


def make_exact_optimizer(spec: OptimizerSpec, xp: ArrayNamespace) -> Any:
    """``optimizer_kernel="reference"``: zerosim's exact optimizer by the fastest kernel that gives its
    bits here (module docstring)."""
    device = str(xp.device or "cpu")
    if xp.backend == "torch" and device.startswith("cuda") and triton_available():
        return TritonExactAdam(spec, xp)
    adam = spec.name in ("adam", "adamw")
    if xp.backend == "torch" and device == "cpu" and adam and fused_kernel_is_exact():
        return FusedPrefixAdam(spec, xp)
    return make_optimizer(spec, xp)
