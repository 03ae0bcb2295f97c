"""The mixed-precision policy of a ``zerosim verify`` run (``--precision bf16|fp16``, ``--reduce-dtype``).

Under ``--precision bf16`` or ``fp16`` the model arrives in float32, the master dtype. The trainer
receives the policy as ``optim["mixed_precision"]`` (:func:`policy`)::

    {"param_dtype": "bfloat16" | "float16", "reduce_dtype": "float32" | "bfloat16" | "float16",
     "loss_scale": {...}}   # fp16 only: dynamic loss scaling, LOSS_SCALE

and computes forward and backward in ``param_dtype``, reduces gradients in ``reduce_dtype``, keeps
float32 masters and optimizer state; ``full_parameters()`` and ``full_optimizer_state()`` return the
float32 masters. Under fp16 a step whose gradients overflow (on any rank) is skipped, and the scale
backs off; it grows after ``growth_interval`` clean steps, as ``torch.amp.GradScaler`` does. In full
precision (the default) the key is absent.

The dtypes each backend all-reduces were measured with torch 2.13 (``dist.all_reduce`` and
``reduce_scatter_tensor`` on two ranks): gloo on the CPU reduces float32, bfloat16 and float16, and
so does NCCL; a ``--reduce-dtype`` outside :data:`BACKEND_REDUCE_DTYPES` of the run's backend is
refused before any rank starts.
"""

from __future__ import annotations

from typing import Any

from zerosim.errors import ConfigError
from zerosim.values.dtypes import canonical_dtype, precision_name

FULL = "full"
PRECISIONS = (FULL, "bf16", "fp16")
PARAM_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
MASTER_DTYPE = "float32"
REDUCE_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_REDUCE_DTYPE = "float32"
# what each backend all-reduces (measured, see the module docstring); cpu runs on gloo, cuda on NCCL
BACKEND_REDUCE_DTYPES = {"gloo": REDUCE_DTYPES, "nccl": REDUCE_DTYPES}
BACKEND_OF_DEVICE = {"cpu": "gloo", "cuda": "nccl"}
LOSS_SCALE = {"init": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1000}


def is_mixed(precision: str) -> bool:
    """True under ``--precision bf16`` or ``fp16``."""
    return precision != FULL


def policy(precision: str, reduce_dtype: str = DEFAULT_REDUCE_DTYPE) -> dict[str, Any] | None:
    """``optim["mixed_precision"]`` for a run (None in full precision: the key is absent)."""
    if not is_mixed(precision):
        return None
    out: dict[str, Any] = {"param_dtype": PARAM_DTYPES[precision], "reduce_dtype": reduce_dtype}
    if precision == "fp16":
        out["loss_scale"] = dict(LOSS_SCALE)
    return out


def precision_option(text: str | None, dtype: str | None) -> tuple[str | None, str | None]:
    """``--precision`` in either spelling -> (precision, dtype). bf16 / bfloat16 and fp16 / float16 name
    the mixed policies (``dtype`` unchanged: the master's); fp32 / float32 and fp64 / float64 name full
    precision in that dtype (a ``dtype`` given too must be the same); ``full`` is everything in ``dtype``;
    None (no option) stays None."""
    if text is None or str(text).strip().lower() == FULL:
        return (None if text is None else FULL), dtype
    try:
        short = precision_name(text, "precision", allowed=("bf16", "fp16", "fp32", "fp64"))
    except ConfigError:
        raise ConfigError("precision", text, "must be bf16 (bfloat16) or fp16 (float16) for mixed precision, "
                          "or fp32 (float32), fp64 (float64) or full for everything in one dtype") from None
    if short in PARAM_DTYPES:
        return short, dtype
    whole = canonical_dtype(short)
    if dtype is not None and dtype != whole:
        raise ConfigError("dtype", dtype, f"--precision {text} trains everything in {whole}: drop --dtype "
                          f"or give {whole}")
    return FULL, whole


def reduce_dtype_option(text: str | None) -> str | None:
    """``--reduce-dtype`` in either spelling (bfloat16 or bf16, ...) -> the canonical dtype name."""
    return None if text is None else canonical_dtype(text, "reduce_dtype", allowed=REDUCE_DTYPES)


def resolve_dtype(precision: str | None, dtype: str | None) -> str:
    """The run's (master) dtype: an explicit ``dtype``, else float32 under mixed precision, else float64."""
    if dtype is not None:
        return dtype
    return MASTER_DTYPE if precision is not None and is_mixed(precision) else "float64"


def require_reduce_dtype_option(precision: str | None, reduce_dtype: str | None) -> None:
    """ConfigError when ``--reduce-dtype`` is given without ``--precision`` (full precision reduces in
    the run's dtype; there is no policy to change)."""
    if reduce_dtype is not None and (precision is None or not is_mixed(precision)):
        raise ConfigError("reduce_dtype", reduce_dtype,
                          "applies under --precision bf16|fp16 only (full precision reduces in --dtype)")


def resolve_precision(precision: str | None, reduce_dtype: str | None,
                      dtype: str | None) -> tuple[str, str, str]:
    """(precision, reduce_dtype, dtype) of a verify run (C-ZERO-005's reduction dtype among them) from
    what a user gave, each in either spelling, None for not given: the one place they are resolved
    (``zerosim verify``'s options and :func:`zerosim.verify.verify`'s arguments both come here).
    ``fp32`` / ``fp64`` as the precision are full precision in that dtype; the dtype defaults to
    float32 (the master dtype) under bf16 / fp16, else float64; a reduce dtype without bf16 / fp16 is a
    ConfigError."""
    precision, dtype = precision_option(precision, dtype)
    reduce_dtype = reduce_dtype_option(reduce_dtype)
    require_reduce_dtype_option(precision, reduce_dtype)
    return (precision or FULL), (reduce_dtype or DEFAULT_REDUCE_DTYPE), resolve_dtype(precision, dtype)


def require_precision(precision: Any, reduce_dtype: Any, dtype: Any, device: Any) -> None:
    """ConfigError (one line naming the field and value) unless the precision options fit together."""
    if precision not in PRECISIONS:
        raise ConfigError("precision", precision,
                          "must be bf16 or fp16 (or full, the default: everything in --dtype)")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError("reduce_dtype", reduce_dtype, f"must be one of {', '.join(REDUCE_DTYPES)}")
    if not is_mixed(precision):
        if reduce_dtype != DEFAULT_REDUCE_DTYPE:
            raise ConfigError("reduce_dtype", reduce_dtype,
                              "applies under --precision bf16|fp16 only (full precision reduces in --dtype)")
        return
    if dtype != MASTER_DTYPE:
        raise ConfigError("dtype", dtype, f"--precision {precision} keeps float32 master weights and "
                          "optimizer state: the master dtype is float32 (drop --dtype or give float32)")
    backend = BACKEND_OF_DEVICE.get(str(device))
    if backend is not None and reduce_dtype not in BACKEND_REDUCE_DTYPES[backend]:
        raise ConfigError("reduce_dtype", reduce_dtype,
                          f"{backend} (--device {device}) cannot all-reduce it; it reduces "
                          f"{', '.join(BACKEND_REDUCE_DTYPES[backend])}")
