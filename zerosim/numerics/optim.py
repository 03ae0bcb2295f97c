"""Reference optimizers with torch.optim's exact semantics, on flat float32 arrays; global-norm clipping.

Each optimizer works on a FLAT 1-D float32 array (float64 for a float64 model: hyper-parameters are
then used unrounded, as torch's float64 kernels use them) (a rank's shard of the master parameters, or
the whole vector) with a gradient of the same length, **elementwise only**: element ``i`` of the result
depends on element ``i`` of the parameter, gradient and state and on nothing else. So a sharded step
equals the full step *bit for bit* on the same elements, whatever the shard boundaries: this is why
C-ZERO-002 (sharded optimizer step == full optimizer step) can be checked bitwise.

Formulas follow torch.optim's single-tensor CPU path (``foreach=False``), including its order of
floating-point operations: hyper-parameters are rounded to float32 where torch's kernels round them,
and torch's fused multiply-adds (``add(alpha=)``, ``lerp``, ``addcmul``) are reproduced with
:meth:`zerosim.numerics.xp.ArrayNamespace.fma`. Against torch 2.13 on CPU (tests/test_optim_vs_torch.py):
where torch's kernels fuse multiply-adds (x86 AVX2 / AVX-512, arm64) SGD is bitwise identical and
Adam / AdamW are bitwise except on elements where torch's vectorised ``sqrt`` is not correctly
rounded (ours is); on unfused kernels (``ATEN_CPU_CAPABILITY=default``) torch rounds ``a * b + c``
twice and results differ by a few ulps. On every kernel each element stays within a bound derived
from a rounding-error model of the step (tests/optim_rounding.py), clipping included (torch's
float32 norm; ours is accumulated in float64).

State: ``init_state(n)`` returns a dict with an int ``"step"`` and fp32 arrays named as in torch:
SGD with momentum ``"momentum_buffer"``; Adam / AdamW ``"exp_avg"``, ``"exp_avg_sq"``. The momentum
buffer is allocated up front (so memory is constant) but, as in torch, its first step copies the
gradient instead of decaying (torch's buffer starts as ``None``); ``"step"`` tells which.

Clipping (torch.nn.utils.clip_grad_norm_): the global 2-norm over *all* gradient elements; with
``max_grad_norm`` set, every gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))``. Sharded,
each rank sums squares over the elements it owns and one scalar all-reduce (over the shard group
only) gives the global sum: :func:`global_norm_from_sumsq` and :func:`clip_coefficient` finish it.

Why one module of this length: each optimizer's generic update and its in-place numpy update must
stay operation for operation the same (they give the same bits), so they sit side by side.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from ..errors import ConfigError, require_non_negative_int
from .xp import ArrayNamespace, divide_, get_namespace, namespace_of

OPTIMIZERS = ("sgd", "adam", "adamw", "muon", "adafactor")
#: the optimizers whose update of an element depends on that element's gradient and state alone
ELEMENTWISE = ("sgd", "adam", "adamw")
#: torch 2.13's constructor defaults of the matrix optimizers, for the fields a spec shares with the
#: others (``OptimizerSpec.parse`` fills them where not given)
MATRIX_DEFAULTS: dict[str, dict[str, Any]] = {
    "muon": {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "eps": 1e-7},
    "adafactor": {"lr": 1e-2, "weight_decay": 0.0, "eps": 1e-3},
}
#: Muon's learning-rate adjustments (torch's ``adjust_lr_fn``; None is "original")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: max_norm / (total_norm + 1e-6)
CHUNK = 1 << 15  # elements per update chunk on CPU (float64 temporaries of 256 KiB: cache-resident)


def _f32(v: float) -> float:
    """``v`` rounded to float32 (as torch rounds a Python scalar for a float32 kernel)."""
    return float(np.float32(v))


def _scalar_for(dtype: str) -> Any:
    """How torch rounds a Python scalar for a kernel on ``dtype``: to float32 for float32 (and the 16-bit
    types, which compute in float32); unchanged for float64."""
    return float if dtype == "float64" else _f32


def _real(field: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(field, value, "must be a number")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(field, value, "must be a number") from None
    if not math.isfinite(v):
        raise ConfigError(field, value, "must be finite")
    return v


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyper-parameters; validated like torch.optim's constructors.

    ``weight_decay`` defaults to torch's default for the optimizer: 0.01 for AdamW, 0.1 for Muon, 0
    otherwise. ``max_grad_norm`` (None = no clipping) turns on global-norm clipping before the step.

    The matrix optimizers (not elementwise: :mod:`zerosim.numerics.optim_matrix` steps them on whole tensors)
    read the shared fields as torch's constructors name them: Muon ``lr``, ``weight_decay``,
    ``momentum``, ``nesterov``, ``eps`` and its own ``ns_coefficients``, ``ns_steps``,
    ``adjust_lr_fn``, with the AdamW that steps its tensors that are not 2-D configured by
    ``adamw_lr`` (None: ``lr``), ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``; Adafactor
    ``lr``, ``weight_decay``, ``eps`` (torch's ``eps[1]``) and its own ``eps1`` (torch's ``eps[0]``;
    None: the dtype's machine epsilon), ``beta2_decay`` and ``d``.
    """

    name: str
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = None
    beta2_decay: float = -0.8
    eps1: float | None = None
    d: float = 1.0
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    adamw_lr: float | None = None
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01

    def __post_init__(self) -> None:
        name = str(self.name).lower()
        if name not in OPTIMIZERS:
            raise ConfigError("optimizer", self.name, f"unknown optimizer; known: {', '.join(OPTIMIZERS)}")
        object.__setattr__(self, "name", name)
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", {"adamw": 1e-2, "muon": 0.1}.get(name, 0.0))
        for f in ("lr", "momentum", "dampening", "weight_decay", "eps"):
            v = _real(f, getattr(self, f))
            if v < 0:
                raise ConfigError(f, getattr(self, f), "must be >= 0")
            object.__setattr__(self, f, v)
        if not isinstance(self.nesterov, bool):
            raise ConfigError("nesterov", self.nesterov, "must be a bool")
        if name == "sgd" and self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                "nesterov", self.nesterov, "Nesterov momentum requires momentum > 0 and dampening = 0"
            )
        if name not in ("sgd", "muon"):
            for f in ("momentum", "dampening"):
                if getattr(self, f) != 0:
                    raise ConfigError(f, getattr(self, f), f"is an SGD option; {name} has no {f}")
            if self.nesterov:
                raise ConfigError("nesterov", self.nesterov, f"is an SGD option; {name} has no nesterov")
        if name == "muon" and self.dampening != 0:
            raise ConfigError("dampening", self.dampening, "is an SGD option; muon has no dampening")
        _validate_matrix_options(self)
        given: Any = self.betas
        if isinstance(given, str):
            given = [b for b in given.replace(" ", "").split(",") if b]
        try:
            betas = tuple(given)
        except TypeError:
            raise ConfigError("betas", self.betas, "must be two numbers (beta1, beta2)") from None
        if len(betas) != 2:
            raise ConfigError("betas", self.betas, "must be two numbers (beta1, beta2)")
        b = tuple(_real("betas", x) for x in betas)
        for i, x in enumerate(b):
            if not 0.0 <= x < 1.0:
                raise ConfigError(f"betas[{i}]", x, "must be in [0, 1)")
        object.__setattr__(self, "betas", b)
        if self.max_grad_norm is not None:
            v = _real("max_grad_norm", self.max_grad_norm)
            if v <= 0:
                raise ConfigError(
                    "max_grad_norm", self.max_grad_norm, "must be > 0 (or None for no clipping)"
                )
            object.__setattr__(self, "max_grad_norm", v)

    @classmethod
    def parse(cls, name: str, **overrides: Any) -> OptimizerSpec:
        """``OptimizerSpec.parse("adamw", lr=3e-4, max_grad_norm=1.0)``; unknown fields are rejected.
        Muon and Adafactor take torch's defaults (:data:`MATRIX_DEFAULTS`) for the fields not given."""
        known = {f.name for f in fields(cls)} - {"name"}
        for key in overrides:
            if key not in known:
                raise ConfigError(key, overrides[key], f"unknown optimizer option; known: {sorted(known)}")
        given = {k: v for k, v in overrides.items()
                 if v is not None or k in ("max_grad_norm", "eps1", "adjust_lr_fn", "adamw_lr")}
        defaults = MATRIX_DEFAULTS.get(str(name).lower(), {})
        return cls(name, **{**defaults, **given})

    @property
    def elementwise(self) -> bool:
        """Whether any split of a flat vector gives the same update (sgd, adam, adamw): a flat shard
        may then be stepped alone; Muon and Adafactor need each tensor whole."""
        return self.name in ELEMENTWISE

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the per-element state arrays (torch's names). Muon's recipe holds Muon's
        ``momentum_buffer`` on its 2-D tensors and AdamW's moments on the others; Adafactor's
        factored ``row_var`` / ``col_var`` (matrices) and ``variance`` (vectors) are held expanded,
        one value per element (:mod:`zerosim.numerics.optim_matrix`), so every state shards like the
        parameters."""
        if self.name == "sgd":
            return ("momentum_buffer",) if self.momentum != 0 else ()
        if self.name == "muon":
            return ("momentum_buffer", "exp_avg", "exp_avg_sq")
        if self.name == "adafactor":
            return ("row_var", "col_var", "variance")
        return ("exp_avg", "exp_avg_sq")

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-native values; the matrix optimizers' own fields only for those."""
        d = asdict(self)
        d["betas"] = list(self.betas)
        own = {"muon": _MUON_FIELDS, "adafactor": _ADAFACTOR_FIELDS}.get(self.name, ())
        for key in _MUON_FIELDS + _ADAFACTOR_FIELDS:
            if key not in own:
                d.pop(key, None)
        for key in ("ns_coefficients", "adamw_betas"):
            if key in d:
                d[key] = list(d[key])
        return d


_MUON_FIELDS = ("ns_coefficients", "ns_steps", "adjust_lr_fn", "adamw_lr", "adamw_betas", "adamw_eps",
                "adamw_weight_decay")
_ADAFACTOR_FIELDS = ("beta2_decay", "eps1", "d")


def _numbers(spec: OptimizerSpec, field_name: str, count: int) -> tuple[float, ...]:
    given: Any = getattr(spec, field_name)
    try:
        values = tuple(given)
    except TypeError:
        raise ConfigError(field_name, given, f"must be {count} numbers") from None
    if len(values) != count:
        raise ConfigError(field_name, given, f"must be {count} numbers")
    return tuple(_real(field_name, v) for v in values)


def _validate_matrix_options(spec: OptimizerSpec) -> None:
    """The matrix optimizers' own fields, validated as torch's constructors validate them (and given
    only to the optimizer that reads them)."""
    defaults = {f.name: f.default for f in fields(OptimizerSpec)}
    own = {"muon": _MUON_FIELDS, "adafactor": _ADAFACTOR_FIELDS}.get(spec.name, ())
    for key in _MUON_FIELDS + _ADAFACTOR_FIELDS:
        value = getattr(spec, key)
        if key not in own and value != defaults[key] and not (isinstance(value, list)
                                                              and tuple(value) == defaults[key]):
            raise ConfigError(key, value, f"is not an option of {spec.name}")
    set_ = object.__setattr__
    set_(spec, "ns_coefficients", _numbers(spec, "ns_coefficients", 3))
    betas = _numbers(spec, "adamw_betas", 2)
    for i, x in enumerate(betas):
        if not 0.0 <= x < 1.0:
            raise ConfigError(f"adamw_betas[{i}]", x, "must be in [0, 1)")
    set_(spec, "adamw_betas", betas)
    if isinstance(spec.ns_steps, bool) or not isinstance(spec.ns_steps, int) or not 0 < spec.ns_steps < 100:
        raise ConfigError("ns_steps", spec.ns_steps, "must be an integer in [1, 100) (torch's limit)")
    if spec.adjust_lr_fn not in ADJUST_LR_FNS:
        raise ConfigError("adjust_lr_fn", spec.adjust_lr_fn, "must be none, original or match_rms_adamw")
    for key in ("adamw_eps", "adamw_weight_decay", "d", "beta2_decay"):
        set_(spec, key, _real(key, getattr(spec, key)))
    for key in ("adamw_lr", "eps1"):
        if getattr(spec, key) is not None:
            v = _real(key, getattr(spec, key))
            if v < 0:
                raise ConfigError(key, getattr(spec, key), "must be >= 0")
            set_(spec, key, v)
    if spec.adamw_eps < 0 or spec.adamw_weight_decay < 0:
        key = "adamw_eps" if spec.adamw_eps < 0 else "adamw_weight_decay"
        raise ConfigError(key, getattr(spec, key), "must be >= 0")
    if spec.beta2_decay > 0:
        raise ConfigError("beta2_decay", spec.beta2_decay, "must be <= 0")
    if spec.d < 1:
        raise ConfigError("d", spec.d, "must be >= 1 (Adafactor's clipping threshold)")


class _Optimizer:
    """Common part: the spec, the namespace, state allocation."""

    def __init__(self, spec: OptimizerSpec, xp: ArrayNamespace | str | None = None):
        self.spec = spec
        self.xp = get_namespace(xp)

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        """Fresh state for ``n`` elements: ``{"step": 0, <name>: zeros(n, dtype), ...}`` (``dtype`` is the
        master's: float32, or float64 for a float64 model)."""
        require_non_negative_int("n", n)
        state: dict[str, Any] = {"step": 0}
        for name in self.spec.state_names:
            state[name] = self.xp.zeros(n, dtype)
        return state

    def _check(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ConfigError(
                "state", type(state).__name__, "expected the dict from init_state (with an int 'step')"
            )
        if tuple(param.shape) != tuple(grad.shape) or len(param.shape) != 1:
            raise ConfigError(
                "grad", tuple(grad.shape), f"must be flat and match the parameter shape {tuple(param.shape)}"
            )
        for name in self.spec.state_names:
            if name not in state:
                raise ConfigError("state", name, "missing optimizer state (use init_state)")
            if tuple(state[name].shape) != tuple(param.shape):
                raise ConfigError(
                    f"state.{name}",
                    tuple(state[name].shape),
                    f"must match the parameter shape {tuple(param.shape)}",
                )

    #: torch arrays on the CPU are stepped by numpy's ufuncs on zero-copy views of the same memory: the
    #: same operations in the same order, so the same bits (every operation is IEEE-rounded and the
    #: emulated fused multiply-add is identical on both), in fewer passes (numpy casts float32 to
    #: float64 inside the ufunc), at a fraction of torch's per-call cost and with every intermediate in
    #: preallocated memory (:meth:`_update_into`): the AdamW update of 25M elements on one core takes
    #: 0.105 s instead of 0.19 s (torch.optim.AdamW itself: 0.15 s). False: torch's own operations,
    #: as on a GPU.
    cpu_via_numpy = True

    def step(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        """One optimizer step, in place on ``param`` (float32 master) and ``state``.

        The update is applied chunk by chunk (:data:`CHUNK` elements on CPU) so the float64
        temporaries of the fused multiply-adds stay in cache; elementwise, so the chunking changes
        no bit of the result."""
        self._check(param, grad, state)
        if self._numpy_views_possible(param, grad):
            xp = self.xp
            views = {k: v if k == "step" else xp.to_numpy(v) for k, v in state.items()}
            self._numpy_twin().step(xp.to_numpy(param), xp.to_numpy(grad), views)
            state["step"] = views["step"]
            return
        t = int(state["step"]) + 1
        n = int(param.shape[0])
        chunk = n if self.xp.device not in ("cpu", None) else CHUNK
        names = self.spec.state_names
        scratch = (_Scratch.for_arrays(param, grad, [state[k] for k in names], min(chunk, n))
                   if self._update_into_mirrors_update() else None)
        for lo in range(0, n, max(chunk, 1)):
            hi = min(lo + chunk, n)
            st = {k: state[k][lo:hi] for k in names}
            if scratch is None:
                self._update(param[lo:hi], grad[lo:hi], st, t)
            else:
                self._update_into(param[lo:hi], grad[lo:hi], st, t, scratch.sized(hi - lo))
        state["step"] = t

    def _numpy_views_possible(self, param: Any, grad: Any) -> bool:
        """:attr:`cpu_via_numpy` applies: torch arrays on the CPU, float32 or float64 (numpy holds both)."""
        xp = self.xp
        return (self.cpu_via_numpy and xp.backend == "torch"
                and param.device.type == "cpu" and grad.device.type == "cpu"
                and xp.dtype_name(param) in ("float32", "float64")
                and xp.dtype_name(grad) == xp.dtype_name(param))

    def _update_into_mirrors_update(self) -> bool:
        """Whether :meth:`_update_into` is the in-place form of this class's :meth:`_update`: both come
        from the same class. A subclass that overrides only ``_update`` (a variant, a deliberately
        wrong mutant) always runs its own ``_update``."""
        def owner(name: str) -> type | None:
            return next((c for c in type(self).__mro__ if name in c.__dict__), None)
        return owner("_update") is owner("_update_into")

    def _numpy_twin(self) -> _Optimizer:
        twin = self.__dict__.get("_twin")
        if twin is None:
            twin = self.__dict__["_twin"] = type(self)(self.spec, "numpy")
        return twin

    def _update(self, p: Any, g: Any, st: dict[str, Any], t: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _update_into(self, p: Any, g: Any, st: dict[str, Any], t: int,
                     scratch: _Scratch) -> None:  # pragma: no cover - abstract
        """:meth:`_update` on numpy arrays with every intermediate written into ``scratch`` and the
        state updated in place: the same ufuncs on the same operands in the same order, so the same
        bits, without a fresh temporary per operation or a copy back into the state."""
        raise NotImplementedError


class _Scratch:
    """Preallocated temporaries for :meth:`_Optimizer._update_into`, one chunk long: ``a`` and ``b`` in
    the master's dtype, ``wide`` float64 (the emulated fused multiply-add's exact product)."""

    def __init__(self, a: np.ndarray, b: np.ndarray, wide: np.ndarray):
        self.a, self.b, self.wide = a, b, wide

    @classmethod
    def for_arrays(cls, param: Any, grad: Any, state: list[Any], n: int) -> _Scratch | None:
        """Scratch for a step of numpy arrays that all share one dtype, float32 or float64; None
        otherwise (torch arrays, mixed dtypes: the generic :meth:`_Optimizer._update` runs)."""
        arrays = [param, grad, *state]
        if not all(isinstance(x, np.ndarray) for x in arrays):
            return None
        dtype = param.dtype
        if dtype not in (np.float32, np.float64) or any(x.dtype != dtype for x in arrays):
            return None
        return cls(np.empty(n, dtype), np.empty(n, dtype), np.empty(n, np.float64))

    def sized(self, n: int) -> _Scratch:
        return self if n == len(self.a) else _Scratch(self.a[:n], self.b[:n], self.wide[:n])

    def fma(self, a: Any, b: Any, c: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out = a * b + c`` exactly as :meth:`zerosim.numerics.xp.ArrayNamespace.fma` computes it on numpy
        (the product in float64, the sum rounded to float64 and then to ``out``'s dtype); ``b`` an array or
        a scalar already rounded as that method rounds it (:func:`_scalar_for` of ``out``'s dtype).
        ``out`` may be ``a`` or ``c``: every ufunc here is elementwise."""
        np.multiply(a, b, out=self.wide, dtype=np.float64)
        np.add(self.wide, c, out=out, dtype=np.float64, casting="same_kind")
        return out


class SGD(_Optimizer):
    """torch.optim.SGD (``_single_tensor_sgd``), maximize=False:

    ``g = grad + wd * p`` (fma); momentum: ``buf = g`` on the first step, else
    ``buf = buf * m`` then ``buf = buf + (1 - dampening) * g`` (fma); ``g = g + m * buf`` (fma) with
    nesterov, else ``g = buf``; ``p = p - lr * g`` (fma).
    """

    def _update(self, p: Any, g: Any, st: dict[str, Any], t: int) -> None:
        s, xp = self.spec, self.xp
        r = _scalar_for(xp.dtype_name(p))
        if s.weight_decay != 0:
            g = xp.fma(p, s.weight_decay, g)
        if s.momentum != 0:
            buf = st["momentum_buffer"]
            if t == 1:
                xp.assign(buf, g)
            else:
                buf *= r(s.momentum)
                xp.assign(buf, xp.fma(g, 1.0 - s.dampening, buf))
            g = xp.fma(buf, s.momentum, g) if s.nesterov else buf
        xp.assign(p, xp.fma(g, -s.lr, p))

    def _update_into(self, p: Any, g: Any, st: dict[str, Any], t: int, scratch: _Scratch) -> None:
        s = self.spec
        r = _scalar_for(p.dtype.name)
        if s.weight_decay != 0:
            g = scratch.fma(p, r(s.weight_decay), g, out=scratch.a)
        if s.momentum != 0:
            buf = st["momentum_buffer"]
            if t == 1:
                buf[...] = g
            else:
                np.multiply(buf, r(s.momentum), out=buf)
                scratch.fma(g, r(1.0 - s.dampening), buf, out=buf)
            g = scratch.fma(buf, r(s.momentum), g, out=scratch.a) if s.nesterov else buf
        scratch.fma(g, r(-s.lr), p, out=p)


class Adam(_Optimizer):
    """torch.optim.Adam / AdamW (``_single_tensor_adam``), amsgrad=False, maximize=False:

    ``t += 1``; AdamW: ``p = p * (1 - lr * wd)``; Adam: ``g = grad + wd * p`` (fma);
    ``m = lerp(m, g, 1 - beta1)``; ``v = v * beta2`` then ``v = v + ((1 - beta2) * g) * g`` (fma);
    ``denom = sqrt(v) / sqrt(1 - beta2**t) + eps``; ``p = p + (-lr / (1 - beta1**t) * m) / denom``.
    Bias corrections are computed in float64 on the host, as torch does with a CPU step counter.
    """

    decoupled = False

    def _update(self, p: Any, g: Any, st: dict[str, Any], t: int) -> None:
        s, xp = self.spec, self.xp
        r = _scalar_for(xp.dtype_name(p))
        beta1, beta2 = s.betas
        weight_decay = s.weight_decay or 0.0  # resolved to a number when the spec was built
        if weight_decay != 0:
            if self.decoupled:
                p *= r(1.0 - s.lr * weight_decay)
            else:
                g = xp.fma(p, weight_decay, g)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        xp.assign(m, _lerp(xp, m, g, 1.0 - beta1))
        v *= r(beta2)
        xp.assign(v, xp.fma(g * r(1.0 - beta2), g, v))
        bias_correction1 = 1.0 - beta1 ** float(t)
        bias_correction2 = 1.0 - beta2 ** float(t)
        step_size = s.lr / bias_correction1
        denom = divide_(xp.sqrt(v), r(bias_correction2**0.5))
        denom += r(s.eps)
        p += (m * r(-step_size)) / denom

    def _update_into(self, p: Any, g: Any, st: dict[str, Any], t: int, scratch: _Scratch) -> None:
        s = self.spec
        r = _scalar_for(p.dtype.name)
        beta1, beta2 = s.betas
        weight_decay = s.weight_decay or 0.0
        a, b = scratch.a, scratch.b
        if weight_decay != 0:
            if self.decoupled:
                np.multiply(p, r(1.0 - s.lr * weight_decay), out=p)
            else:
                g = scratch.fma(p, r(weight_decay), g, out=b)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        w = r(1.0 - beta1)  # torch's lerp, as _lerp computes it
        np.subtract(g, m, out=a)
        if abs(w) < 0.5:
            scratch.fma(a, w, m, out=m)
        else:
            scratch.fma(a, r(w - 1.0), g, out=m)
        np.multiply(v, r(beta2), out=v)
        np.multiply(g, r(1.0 - beta2), out=a)
        scratch.fma(a, g, v, out=v)
        bias_correction1 = 1.0 - beta1 ** float(t)
        bias_correction2 = 1.0 - beta2 ** float(t)
        step_size = s.lr / bias_correction1
        np.sqrt(v, out=a)
        np.divide(a, r(bias_correction2**0.5), out=a)
        np.add(a, r(s.eps), out=a)
        np.multiply(m, r(-step_size), out=b)
        np.divide(b, a, out=b)
        np.add(p, b, out=p)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (default 0.01)."""

    decoupled = True


def _lerp(xp: ArrayNamespace, start: Any, end: Any, weight: float) -> Any:
    """torch's CPU ``lerp`` with a scalar weight (vectorised kernel): for ``|w| < 0.5``
    ``fma(w, end - start, start)``, else ``fma(w - 1, end - start, end)``; ``w`` in float32."""
    w = _scalar_for(xp.dtype_name(start))(weight)
    diff = end - start
    if abs(w) < 0.5:
        return xp.fma(diff, w, start)
    return xp.fma(diff, _scalar_for(xp.dtype_name(start))(w - 1.0), end)


def make_optimizer(spec: OptimizerSpec, xp: ArrayNamespace | str | None = None) -> _Optimizer:
    """The optimizer for ``spec`` on namespace ``xp`` (default numpy)."""
    if not isinstance(spec, OptimizerSpec):
        raise ConfigError("optimizer", spec, "expected an OptimizerSpec (use OptimizerSpec.parse)")
    if not spec.elementwise:
        raise ConfigError("optimizer", spec.name, "is not elementwise: it steps whole tensors; build it "
                          "over the tensors it steps with zerosim.numerics.optim_matrix.layout_optimizer")
    cls = {"sgd": SGD, "adam": Adam, "adamw": AdamW}[spec.name]
    return cls(spec, xp)


# ---- global-norm clipping -------------------------------------------------------------------------

def global_norm_from_sumsq(sumsq: float) -> float:
    """The global 2-norm from the (all-reduced) sum of squares over every gradient element."""
    v = float(sumsq)
    if math.isnan(v) or v < 0:
        raise ConfigError("sumsq", sumsq, "a sum of squares must be >= 0")
    return math.sqrt(v)


def clip_coefficient(total_norm: float, max_norm: float, dtype: str = "float32") -> float:
    """torch.nn.utils.clip_grad_norm_'s factor ``min(1, max_norm / (total_norm + 1e-6))``, computed as
    torch computes it on a float32 norm: ``(1 / (norm + 1e-6)) * max_norm`` in float32 (torch's
    ``float / tensor`` is ``tensor.reciprocal() * float``). Returned as a float exactly
    representable in float32; 1.0 means "no clipping". A non-finite norm gives a non-finite factor
    (as in torch): the caller's non-finite check must catch it. ``dtype="float64"`` (a float64
    model, whose norm torch computes in float64): the same formula in float64."""
    mx = _real("max_grad_norm", max_norm)
    if mx <= 0:
        raise ConfigError("max_grad_norm", max_norm, "must be > 0")
    if dtype == "float64":
        coef64 = (1.0 / (float(total_norm) + CLIP_EPS)) * mx
        return min(coef64, 1.0) if not math.isnan(coef64) else float("nan")
    with np.errstate(all="ignore"):
        denom = np.float32(total_norm) + np.float32(CLIP_EPS)
        coef = (np.float32(1.0) / denom) * np.float32(mx)
    return float(min(coef, np.float32(1.0))) if not math.isnan(coef) else float("nan")


def apply_clip_(grad: Any, coef: float, xp: ArrayNamespace | str | None = None) -> None:
    """Scale ``grad`` in place by ``coef`` (a multiply in the gradient's dtype, as torch's ``mul_``); 1.0
    is a no-op."""
    if coef != 1.0:
        ns = get_namespace(xp) if xp is not None else namespace_of(grad)
        grad *= _scalar_for(ns.dtype_name(grad))(coef)
