"""The array-namespace seam: the only way the model, the optimizers and the engine touch arrays.

The ZeRO engine, the block model and the reference optimizers are written once against an
:class:`ArrayNamespace` and run unchanged on numpy (the simulator, the MPI backend) and on torch
tensors (zerogpu, and the test that runs the engine on torch CPU tensors and matches numpy). None of
those modules imports numpy or torch to compute.

The seam is thin: every standard operation (``matmul``, ``exp``, ``sum``, ``reshape``, ``take``,
``where``, ...) is the Python array API, reached through attribute delegation (``ns.matmul`` is
``numpy.matmul`` or ``array_api_compat.torch.matmul``). numpy from 2.1 on is itself a namespace of the
2023.12 standard and is used as it is: ``array_api_compat.numpy``, which an older numpy needs, imports
every numpy submodule when it is built (``f2py``, ``testing``, ``ma``, ...: about 0.2 CPU-s
in each process, and an MPI run starts one per rank). Only the handful of operations where the two
libraries differ, or where zerosim needs a guarantee the array API does not give, are defined here;
each says why.

Bitwise-identity guarantees (what C-ZERO-002 and the numpy-vs-torch engine test lean on):

* elementwise ``+ - * /`` on float32 are IEEE correctly rounded in both libraries;
* :meth:`ArrayNamespace.sqrt` is correctly rounded in both (torch's vectorised CPU ``sqrt`` is not:
  on an AVX-512 build about 0.7% of float32 results differ from the correctly rounded one by 1 ulp);
* :meth:`ArrayNamespace.fma` is the same float64-emulated fused multiply-add in both;
* :func:`divide_` divides by a number with one IEEE division on every device (torch's CUDA kernels
  divide by a host number as a multiplication by its rounded reciprocal, an ulp off for some values).

So an optimizer step written with these ops gives bit-identical results on numpy and torch CPU.
Matrix products are *not* bitwise across libraries (different BLAS blockings): model
forward/backward agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import array_api_compat
import ml_dtypes
import numpy as np

from ..errors import ConfigError, install_hint
from ..values.dtypes import canonical_dtype

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
#: numpy is an array-API namespace of its own (2023.12: numpy 2.1 and later)
NUMPY_IS_ARRAY_API = getattr(np, "__array_api_version__", "") >= "2023.12"
SUMSQ_CHUNK = 1 << 18  # elements per float64 chunk of sum_of_squares (2 MiB: stays in cache)

_NUMPY_DTYPES: dict[str, Any] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "array_namespace", "torch", f"torch is not installed ({install_hint('torch')})"
        ) from None
    return torch


class ArrayNamespace:
    """One array library (``backend`` = "numpy" or "torch") on one device, plus zerosim's extras.

    Standard array-API functions are delegated to ``self.xp`` (numpy itself, or an
    ``array_api_compat`` namespace); the methods defined below are the extras. ``zeros``, ``empty``
    and ``astype`` take zerosim dtype *names* ("float32", "bfloat16", "fp16", ...) so callers never
    hold library dtype objects; the raw array-API versions remain available as ``ns.xp.zeros`` etc.
    """

    def __init__(self, backend: str, device: str | None = None):
        if backend == "numpy":
            xp = np if NUMPY_IS_ARRAY_API else array_api_compat.array_namespace(np.zeros(0))
            device = "cpu"
        elif backend == "torch":
            torch = _torch()
            xp = array_api_compat.array_namespace(torch.zeros(0))
            device = str(torch.device(device or "cpu"))
        else:
            raise ConfigError("array_namespace", backend, "must be 'numpy' or 'torch'")
        self.backend = backend
        self.device = device
        self.xp = xp

    def __getattr__(self, name: str) -> Any:
        # Called only for names not defined on the class: the standard array-API functions.
        if name.startswith("__") or name in ("xp", "backend", "device"):
            raise AttributeError(name)
        return getattr(self.xp, name)

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (the engine may ship it to worker processes): rebuilt from backend and device.
        return (ArrayNamespace, (self.backend, self.device))

    def __repr__(self) -> str:
        return f"ArrayNamespace({self.backend!r}, device={self.device!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArrayNamespace) and (self.backend, self.device) == (
            other.backend,
            other.device,
        )

    def __hash__(self) -> int:
        return hash((self.backend, self.device))

    # ---- dtypes --------------------------------------------------------------------------------
    def dtype(self, name: str) -> Any:
        """The library dtype for a zerosim dtype name. Why: bfloat16 is ``ml_dtypes`` in numpy."""
        key = canonical_dtype(name)
        if self.backend == "numpy":
            return _NUMPY_DTYPES[key]
        return getattr(_torch(), key)

    def dtype_name(self, x: Any) -> str:
        """The zerosim name of an array's dtype ("float32", "bfloat16", ...)."""
        if self.backend == "numpy":
            return "bfloat16" if x.dtype == _NUMPY_DTYPES["bfloat16"] else x.dtype.name
        return str(x.dtype).removeprefix("torch.")

    def astype(self, x: Any, name: str) -> Any:
        """Cast to dtype ``name``; no copy when it already has that dtype. Round-to-nearest-even
        in both libraries (ml_dtypes and torch agree bit for bit on fp32 -> bf16 / fp16)."""
        dt = self.dtype(name)
        if self.backend == "numpy":
            return x.astype(dt, copy=False)
        return x.to(dtype=dt)

    # ---- crossing the seam -------------------------------------------------------------------
    def from_numpy(self, a: Any, copy: bool = False) -> Any:
        """A numpy array (bfloat16 as ``ml_dtypes``) as an array of this namespace, on its device.
        Shares memory on CPU unless ``copy`` (like ``torch.from_numpy``)."""
        a = np.asarray(a)
        if self.backend == "numpy":
            return a.copy() if copy else a
        torch = _torch()
        if not a.flags.writeable:  # torch cannot share a read-only buffer: hand it a private copy
            a, copy = a.copy(), False
        if a.dtype == _NUMPY_DTYPES["bfloat16"]:
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
        t = t.to(self.device)
        return t.clone() if copy and t.device.type == "cpu" else t

    def to_numpy(self, x: Any, copy: bool = False) -> np.ndarray:
        """A numpy array (bfloat16 -> ``ml_dtypes.bfloat16``, bit-exact). Shares memory with a CPU
        array unless ``copy``. Why: contracts and observations are numpy."""
        if self.backend == "numpy" or isinstance(x, np.ndarray):
            a = np.asarray(x)
            return a.copy() if copy else a
        torch = _torch()
        t = x.detach()
        if t.device.type != "cpu":
            t, copy = t.cpu(), False
        if t.dtype == torch.bfloat16:
            a = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            a = t.numpy()
        return a.copy() if copy else a

    def ensure(self, x: Any) -> Any:
        """``x`` as an array of this namespace: numpy arrays (e.g. token batches) are converted,
        arrays already in this namespace returned as they are."""
        if self.backend == "torch" and isinstance(x, np.ndarray):
            return self.from_numpy(x)
        if self.backend == "numpy" and not isinstance(x, np.ndarray):
            if array_api_compat.is_torch_array(x):
                return namespace_of(x).to_numpy(x)
            return np.asarray(x)
        return x

    # ---- creation --------------------------------------------------------------------------------
    def zeros(self, shape: int | Sequence[int], name: str = "float32") -> Any:
        """Zero-filled array of dtype ``name`` on this namespace's device."""
        return self.xp.zeros(_shape(shape), dtype=self.dtype(name), device=self.device)

    def empty(self, shape: int | Sequence[int], name: str = "float32") -> Any:
        """Uninitialised array of dtype ``name`` (contents are garbage: write before reading)."""
        return self.xp.empty(_shape(shape), dtype=self.dtype(name), device=self.device)

    def concat(self, arrays: Sequence[Any], axis: int = 0) -> Any:
        """Concatenate along ``axis``. Why here: numpy's ``concatenate`` and torch's ``cat`` take
        ml_dtypes / torch bfloat16 alike through this one name."""
        return self.xp.concat(list(arrays), axis=axis)

    def copy(self, x: Any) -> Any:
        """An independent copy (numpy ``copy`` / torch ``clone``)."""
        return x.copy() if self.backend == "numpy" else x.clone()

    # ---- in-place writes ---------------------------------------------------------------------
    def assign(self, dst: Any, src: Any) -> None:
        """Write ``src`` into ``dst`` in place, casting to ``dst``'s dtype (round to nearest even).
        ``dst`` may be a slice view (``ns.assign(flat[a:b], shard)``). Why: numpy writes with
        ``dst[...] = src``, torch with ``dst.copy_(src)``; only the latter broadcasts scalars and
        casts identically on every device."""
        if self.backend == "numpy":
            dst[...] = src
        else:
            if not hasattr(src, "dtype"):
                dst.fill_(src)
            else:
                dst.copy_(src)

    def index_add_rows(self, n_rows: int, indices: Any, values: Any) -> Any:
        """``out = zeros(n_rows, d); out[indices[i]] += values[i]`` in order of ``i``, repeated
        indices accumulated (embedding backward). Why: the array API has no scatter-add; numpy's
        ``add.at`` and torch's ``index_add_`` both accumulate sequentially, so results agree."""
        out = self.xp.zeros((n_rows, values.shape[1]), dtype=values.dtype, device=self.device)
        if self.backend == "numpy":
            np.add.at(out, indices, values)
        else:
            out.index_add_(0, indices, values)
        return out

    # ---- numerics with guarantees ---------------------------------------------------------------
    def fma(self, a: Any, b: Any, c: Any) -> Any:
        """``a * b + c`` with a single rounding (a fused multiply-add), for float32 arrays; ``b`` an
        array or a Python float (rounded to float32 first, as torch does with a scalar ``alpha``).

        Why: torch's CPU kernels for ``add(x, alpha=)``, ``lerp`` and ``addcmul`` use fused
        multiply-adds, so matching them bit for bit needs one. Emulated in float64: a float32 product
        is exact in float64 (48 <= 53 significand bits) and the sum is rounded to float64 and then
        to float32. This equals the true FMA except when the float64 sum lands exactly on a float32
        rounding midpoint (about 2**-29 of random inputs). Same code on both backends, so numpy and
        torch results are identical. float64 inputs: plain ``a * b + c`` in float64.
        """
        name = self.dtype_name(c)
        if name == "float64":
            return a * b + c
        scalar = isinstance(b, (int, float, np.integer, np.floating))
        if scalar:
            b = float(np.float32(b))
        if self.backend == "numpy":
            # The ufuncs cast their inputs to float64 in buffered blocks: one float64 temporary.
            out = np.empty(np.broadcast_shapes(np.shape(a), np.shape(c)), dtype=c.dtype)
            prod = np.multiply(a, b, dtype=np.float64)
            np.add(prod, c, out=out, dtype=np.float64, casting="same_kind")
            return out
        # one float64 temporary: the float32 operands are promoted exactly inside the in-place ops
        r = a.to(dtype=self.dtype("float64"))
        r.mul_(b)
        r.add_(c)
        return self.astype(r, name)

    def sqrt(self, x: Any) -> Any:
        """Correctly rounded square root. Why: torch's vectorised CPU float32 ``sqrt`` is not
        correctly rounded (1-ulp differences), numpy's is; for float32 on torch we take the float64
        root and round once more, which is exact for sqrt (53 >= 2*24 + 2 bits), so both backends
        agree bit for bit. Other dtypes: the library's sqrt."""
        if self.backend == "torch" and self.dtype_name(x) == "float32":
            return self.xp.sqrt(x.to(dtype=self.dtype("float64"))).to(dtype=x.dtype)
        return self.xp.sqrt(x)

    def sum_of_squares(self, x: Any) -> float:
        """``sum(x**2)`` as a Python float, accumulated in **float64** (each square of a float32 /
        bf16 / fp16 value is exact in float64). Used for the global gradient norm: per-shard sums
        added across ranks differ from the unsharded sum only by float64 rounding (relative
        <= n * 2**-53), far below float32 resolution, so the clip coefficient is the same."""
        if len(x.shape) != 1:
            y = self.astype(x, "float64")
            return float(self.xp.sum(y * y))
        # chunk by chunk: each float64 copy stays in cache instead of one full-size float64 temporary
        # (~10x faster on a 50M-element gradient); the chunk sums add in float64 like any other order
        n = int(x.shape[0])
        if self.backend == "torch":  # summed on the array's device: one synchronisation, not one per chunk
            total = self.xp.zeros((), dtype=self.dtype("float64"), device=self.device)
            for lo in range(0, n, SUMSQ_CHUNK):
                y = self.astype(x[lo:lo + SUMSQ_CHUNK], "float64")
                total += y.dot(y)
            return float(total)
        acc = 0.0
        for lo in range(0, n, SUMSQ_CHUNK):
            y = self.astype(x[lo:lo + SUMSQ_CHUNK], "float64")
            acc += float(np.dot(y, y))
        return acc

    def isfinite_all(self, x: Any) -> bool:
        """True when no element is NaN or Inf (the non-finite gradient check). A NaN or Inf anywhere
        makes the sum non-finite, so a finite sum settles it in one pass; a non-finite sum (a NaN, an
        Inf, or an overflow of finite values) is decided element by element."""
        # numpy warns on an overflowing sum, which is expected here, not an error
        quiet = np.errstate(over="ignore", invalid="ignore") if self.backend == "numpy" else nullcontext()
        with quiet:
            total = self.xp.sum(x)
        if bool(self.xp.isfinite(total)):
            return True
        return bool(self.xp.all(self.xp.isfinite(x)))

    def nbytes(self, x: Any) -> int:
        """Bytes the array's elements occupy (memory accounting: C-ZERO-004)."""
        if self.backend == "numpy":
            return int(x.nbytes)
        return int(x.numel() * x.element_size())

    def to_float(self, x: Any) -> float:
        """A 0-d (or one-element) array as a Python float."""
        return float(x.item()) if hasattr(x, "item") else float(x)


def divide_(x: Any, divisor: float) -> Any:
    """``x /= divisor`` in place, correctly rounded on every device for float32 and float64 arrays;
    returns ``x``. Why: torch's CUDA kernels divide a tensor by a host number (a Python or numpy scalar,
    a CPU 0-d tensor) as a multiplication by the divisor's rounded reciprocal, which differs from the
    division by an ulp for some values unless the divisor is a power of two; the CPU kernels and numpy
    divide. So on a device the divisor goes as a 0-d tensor on that device (``torch.full``: a kernel
    argument, no copy, no synchronisation), which takes the IEEE division. The divisor is rounded to
    ``x``'s dtype either way. 16-bit arrays divide as the library does (both torch kernels multiply by
    the reciprocal in float32 there)."""
    device = getattr(x, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu" and x.dtype.is_floating_point \
            and x.element_size() >= 4:
        x.div_(_torch().full((), divisor, dtype=x.dtype, device=device))
    else:
        x /= divisor
    return x


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(s) for s in shape)


_NUMPY: ArrayNamespace | None = None
_TORCH: dict[str, ArrayNamespace] = {}


def numpy_namespace() -> ArrayNamespace:
    """The numpy namespace (the simulator's and the MPI backend's)."""
    global _NUMPY
    if _NUMPY is None:
        _NUMPY = ArrayNamespace("numpy")
    return _NUMPY


def torch_namespace(device: str = "cpu") -> ArrayNamespace:
    """The torch namespace on ``device`` ("cpu", "cuda", "cuda:1"); needs torch installed."""
    ns = ArrayNamespace("torch", device)
    return _TORCH.setdefault(ns.device, ns)


def namespace_of(array: Any) -> ArrayNamespace:
    """The namespace an array belongs to (numpy arrays, ml_dtypes arrays and numpy scalars ->
    numpy; torch tensors -> torch on the tensor's device)."""
    if isinstance(array, (np.ndarray, np.generic)):
        return numpy_namespace()
    if array_api_compat.is_torch_array(array):
        return torch_namespace(str(array.device))
    raise ConfigError("array", type(array).__name__, "is neither a numpy array nor a torch tensor")


def get_namespace(xp: ArrayNamespace | str | None) -> ArrayNamespace:
    """Resolve an ``xp`` argument: None or "numpy" -> numpy, "torch" / "torch:cuda" -> torch."""
    if xp is None:
        return numpy_namespace()
    if isinstance(xp, ArrayNamespace):
        return xp
    if isinstance(xp, str):
        if xp == "numpy":
            return numpy_namespace()
        if xp == "torch" or xp.startswith("torch:"):
            return torch_namespace(xp.partition(":")[2] or "cpu")
    raise ConfigError("xp", xp, "expected an ArrayNamespace, 'numpy', 'torch' or 'torch:<device>'")
