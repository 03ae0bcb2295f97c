"""Mixed precision: which dtype the model's parameters and gradients live in, and the fp32 master copy.

Semantics (the reference engine, the ground truth and the memory model all follow them):

* The model computes with parameters in ``param_dtype`` (float32, bfloat16 or float16) and returns
  gradients in ``grad_dtype`` (the same); inside each op values are upcast to float32
  (see :mod:`zerosim.numerics.model`).
* Master weights and optimizer state are float32 (``master_dtype``) and live in the rank's shard.
  Gradients are upcast to float32 **before** they are reduced across ranks, accumulated over
  micro-batches, clipped and fed to the optimizer: reductions never happen in 16 bits.
* After the optimizer step the float32 master is cast down (round to nearest even) to
  ``param_dtype``: that copy is what the next forward uses (and what ZeRO-3 all-gathers).
* A float64 torch model (:meth:`Precision.of_model_dtype`) keeps everything in float64 instead.
* No loss scaling: fp16 gradients that underflow stay underflowed (a documented gap; bf16 has
  fp32's range and needs none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..values.dtypes import SHORT_NAMES, itemsize, precision_name
from .xp import ArrayNamespace, get_namespace, namespace_of

PRECISION_NAMES = ("fp32", "bf16", "fp16")  # the policies, in --precision order
_PRECISIONS = {
    "fp32": ("float32", "float32"),
    "bf16": ("bfloat16", "bfloat16"),
    "fp16": ("float16", "float16"),
}
_ALIASES = {"mixed-bf16": "bf16", "mixed-fp16": "fp16"}


@dataclass(frozen=True)
class Precision:
    """One precision policy: ``Precision.parse("bf16")``."""

    name: str
    param_dtype: str
    grad_dtype: str
    master_dtype: str = "float32"

    @classmethod
    def parse(cls, name: str | Precision) -> Precision:
        """"fp32" | "bf16" | "fp16", in either spelling (float32 / bfloat16 / float16:
        :func:`zerosim.values.dtypes.precision_name`), or mixed-bf16 / mixed-fp16."""
        if isinstance(name, Precision):
            return name
        text = str(name).strip().lower()
        key = _ALIASES.get(text) or precision_name(name, "precision", PRECISION_NAMES)
        param, grad = _PRECISIONS[key]
        return cls(key, param, grad)

    @classmethod
    def of_model_dtype(cls, dtype: str) -> Precision:
        """The policy for a model whose parameters are all ``dtype`` (a torch model trained by zerogpu):
        float32 / bfloat16 / float16 as :meth:`parse`; float64 keeps master, gradients and optimizer
        state in float64 too ("fp64": nothing is mixed; what a float64 reference is compared with)."""
        key = str(dtype).removeprefix("torch.")
        if key == "float64":
            return cls("fp64", "float64", "float64", "float64")
        if key not in SHORT_NAMES:
            raise ConfigError("dtype", dtype, "a ZeRO model's parameters must be float64, float32, bfloat16 "
                              "or float16")
        return cls.parse(key)

    @property
    def is_mixed(self) -> bool:
        """True when the working copy is not the master dtype (a separate fp32 master exists)."""
        return self.param_dtype != self.master_dtype

    @property
    def param_bytes(self) -> int:
        return itemsize(self.param_dtype)

    @property
    def grad_bytes(self) -> int:
        return itemsize(self.grad_dtype)

    @property
    def master_bytes(self) -> int:
        return itemsize(self.master_dtype)

    def to_params(self, master: Any, xp: ArrayNamespace | str | None = None) -> Any:
        """The working copy of a float32 master array: cast down to ``param_dtype`` (a new array
        when mixed; the same array for fp32, so callers that mutate it must copy)."""
        return _ns(master, xp).astype(master, self.param_dtype)

    def grad_to_master(self, grad: Any, xp: ArrayNamespace | str | None = None) -> Any:
        """A gradient upcast to the master dtype (float32), the dtype it is reduced and stepped in."""
        return _ns(grad, xp).astype(grad, self.master_dtype)


def _ns(array: Any, xp: ArrayNamespace | str | None) -> ArrayNamespace:
    return namespace_of(array) if xp is None else get_namespace(xp)
