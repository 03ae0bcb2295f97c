"""The optimizers ``zerosim verify`` phases run, one place for the reference and for every trainer.

A phase's optimizer is one of the built-in names or a user's ``MODULE:FACTORY``:

* ``sgd``, ``adam``, ``adamw``: ``torch.optim.SGD`` (momentum, weight decay), ``torch.optim.Adam`` (L2
  weight decay), ``torch.optim.AdamW``. Elementwise: any split of a flat vector gives the same update.
* ``adafactor``: ``torch.optim.Adafactor``. Its second moment of a matrix is factored into row and
  column statistics (``row_var``, ``col_var``) and its step size scales with the RMS of the whole
  tensor, so it needs each tensor whole.
* ``muon``: torch's documented recipe, ``torch.optim.Muon`` (Newton-Schulz orthogonalisation of each
  whole 2-D update, in bfloat16 inside ``_zeropower_via_newtonschulz``) for every 2-D parameter and
  ``torch.optim.AdamW`` for the others (hyper-parameters ``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
  ``adamw_weight_decay`` in the phase's config).
* ``MODULE:FACTORY``: ``factory(params) -> torch.optim.Optimizer``, a user's optimizer, treated as
  matrix-shaped (nothing is assumed about how it combines elements).

:func:`build_optimizer` is C-ZERO-002's optimizer: the reference steps the whole model with it, and a
trainer gets it as ``optim["make_optimizer"](params)`` (:func:`trainer_config`) so that the tensors it
hands over are treated exactly as the reference treats the whole model's. The config that travels (to
ranks, into reports) is plain JSON; the callable is added on the rank that builds the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from zerosim.errors import ConfigError

from .errors import TrainerError
from .targets import import_callable

#: the built-in phases in the order a run takes them
BUILT_IN = ("sgd", "adam", "adamw", "adafactor", "muon")
#: optimizers whose update of an element depends only on that element's gradient and state
ELEMENTWISE = ("sgd", "adam", "adamw")
#: torch's state names per built-in optimizer (muon: Muon's on 2-D tensors, AdamW's on the others)
STATE_NAMES: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq", "step"),
    "adamw": ("exp_avg", "exp_avg_sq", "step"),
    "adafactor": ("row_var", "col_var", "variance", "step"),
    "muon": ("momentum_buffer", "exp_avg", "exp_avg_sq", "step"),
}
PHASE_CONFIGS: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "max_grad_norm": None},
    "adam": {"name": "adam", "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "max_grad_norm": None},
    "adamw": {  # the clip threshold is chosen per run (zerosim.verify.reference.choose_clip)
        "name": "adamw", "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1,
        "max_grad_norm": None,
    },
    "adafactor": {"name": "adafactor", "lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0,
                  "weight_decay": 0.0, "max_grad_norm": None},
    "muon": {"name": "muon", "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
             "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None,
             "adamw_lr": 1e-2, "adamw_betas": (0.9, 0.999), "adamw_eps": 1e-8, "adamw_weight_decay": 0.1,
             "max_grad_norm": None},
}


def is_user_optimizer(name: str) -> bool:
    """True for a ``MODULE:FACTORY`` optimizer name."""
    return ":" in name


def is_elementwise(name: str) -> bool:
    """True when any split of a flat vector gives the same update (sgd, adam, adamw)."""
    return name in ELEMENTWISE


def require_optimizer_name(name: Any) -> str:
    """``name`` when it is a built-in optimizer or a well-formed ``MODULE:FACTORY``; else ConfigError."""
    if isinstance(name, str) and name in BUILT_IN:
        return name
    if isinstance(name, str) and is_user_optimizer(name):
        module, _, attr = name.partition(":")
        if module and attr and all(part.isidentifier() for part in (*module.split("."), *attr.split("."))):
            return name
    raise ConfigError("optimizers", name,
                      f"each one of {', '.join(BUILT_IN)} or MODULE:FACTORY (factory(params) -> optimizer)")


def phase_config(name: str) -> dict[str, Any]:
    """The plain-JSON config of a phase: a built-in one's hyper-parameters, or for ``MODULE:FACTORY``
    its name and no clip (the factory's own defaults are added where it is imported:
    :func:`describe_user_optimizer`)."""
    if name in PHASE_CONFIGS:
        return dict(PHASE_CONFIGS[name])
    return {"name": name, "max_grad_norm": None}


def resolve_user_factory(name: str) -> Callable[..., Any]:
    """The callable ``MODULE:FACTORY`` names, imported with the current directory first on ``sys.path``;
    TrainerError (one line) when it cannot be imported or is not callable."""
    module_name, _, attr = require_optimizer_name(name).partition(":")
    return import_callable(module_name, attr, f"optimizer {name!r}")


def describe_user_optimizer(name: str) -> dict[str, Any]:
    """The JSON-plain defaults (``lr``, ``weight_decay``, ...) of the optimizer ``MODULE:FACTORY``
    builds, read from one it builds for a 2 x 2 tensor; TrainerError when the factory raises or
    returns something without ``step()`` and ``zero_grad()``."""
    probe = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = _call_user_factory(name, [probe])
    defaults = getattr(optimizer, "defaults", {}) or {}
    plain = (int, float, bool, str, type(None))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in defaults.items()
            if isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v))}


def _call_user_factory(name: str, params: list[torch.Tensor]) -> Any:
    factory = resolve_user_factory(name)
    try:
        optimizer = factory(params)
    except Exception as e:  # noqa: BLE001 - the user's factory raised: bad input, named
        raise TrainerError(f"optimizer {name!r}: the factory raised {type(e).__name__}: {e}") from None
    for method in ("step", "zero_grad"):
        if not callable(getattr(optimizer, method, None)):
            raise TrainerError(f"optimizer {name!r}: the factory returned {type(optimizer).__name__}, "
                               f"which has no {method}() method")
    return optimizer


class ParameterSplitOptimizer:
    """Two optimizers over disjoint parameter sets stepped as one (the Muon recipe: Muon for 2-D
    tensors, AdamW for the rest). ``state`` maps every parameter to its own optimizer's state;
    ``param_groups`` lists both optimizers' groups; ``state_dict`` holds both."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        out: dict[torch.Tensor, Any] = {}
        for part in self.parts:
            out.update(part.state)
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)


def optimizer_class(optim: Mapping[str, Any],
                    ndim: int = 2) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(torch.optim class, keyword arguments) a built-in phase uses for a tensor of ``ndim`` dimensions
    (muon: Muon for 2-D, AdamW otherwise); ConfigError for a user's optimizer or an unknown name."""
    name = optim.get("name")
    if name == "sgd":
        return torch.optim.SGD, {"lr": optim["lr"], "momentum": optim.get("momentum", 0.0),
                                 "weight_decay": optim.get("weight_decay", 0.0)}
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls, {"lr": optim["lr"], "betas": tuple(optim.get("betas", (0.9, 0.999))),
                     "eps": optim.get("eps", 1e-8), "weight_decay": optim.get("weight_decay", 0.0)}
    if name == "adafactor":
        return torch.optim.Adafactor, {"lr": optim["lr"], "beta2_decay": optim.get("beta2_decay", -0.8),
                                       "eps": tuple(optim.get("eps", (None, 1e-3))), "d": optim.get("d", 1.0),
                                       "weight_decay": optim.get("weight_decay", 0.0)}
    if name == "muon" and ndim == 2:
        return torch.optim.Muon, {
            "lr": optim["lr"], "weight_decay": optim.get("weight_decay", 0.1),
            "momentum": optim.get("momentum", 0.95), "nesterov": bool(optim.get("nesterov", True)),
            "ns_coefficients": tuple(optim.get("ns_coefficients", (3.4445, -4.775, 2.0315))),
            "eps": optim.get("eps", 1e-7), "ns_steps": int(optim.get("ns_steps", 5)),
            "adjust_lr_fn": optim.get("adjust_lr_fn"),
        }
    if name == "muon":
        return torch.optim.AdamW, {"lr": optim.get("adamw_lr", 1e-2),
                                   "betas": tuple(optim.get("adamw_betas", (0.9, 0.999))),
                                   "eps": optim.get("adamw_eps", 1e-8),
                                   "weight_decay": optim.get("adamw_weight_decay", 0.1)}
    raise ConfigError("optim.name", name, f"a built-in optimizer ({', '.join(BUILT_IN)})")


def build_optimizer(params: Iterable[torch.Tensor], optim: Mapping[str, Any], *,
                    single_tensor: bool = False) -> Any:
    """The optimizer of phase ``optim`` over exactly ``params``, treating them as the reference treats
    the whole model's (see the module docstring). ``single_tensor``: torch's per-tensor code path
    (``foreach=False``; the reference's). An empty muon part is left out."""
    params = list(params)
    name = str(optim.get("name"))
    if is_user_optimizer(name):
        return _call_user_factory(name, params)
    loop: dict[str, Any] = {"foreach": False} if single_tensor else {}
    if name != "muon":
        cls, kwargs = optimizer_class(optim)
        return cls(params, **kwargs, **loop)
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    parts: list[torch.optim.Optimizer] = []
    if matrices:
        cls, kwargs = optimizer_class(optim, 2)
        parts.append(cls(matrices, **kwargs))  # Muon has one (single-tensor) code path
    if others:
        cls, kwargs = optimizer_class(optim, 1)
        parts.append(cls(others, **kwargs, **loop))
    return ParameterSplitOptimizer(parts)


def trainer_config(optim: Mapping[str, Any]) -> dict[str, Any]:
    """What ``make_trainer`` receives: the phase's config plus ``make_optimizer(params)``."""
    config = dict(optim)
    frozen = dict(optim)

    def make_optimizer(params: Iterable[torch.Tensor]) -> Any:
        return build_optimizer(params, frozen)

    config["make_optimizer"] = make_optimizer
    return config


def state_shape(name: str, key: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape torch gives state ``key`` of a parameter of ``shape`` under optimizer ``name``: the
    parameter's own, Adafactor's factored row / column statistics, ``()`` for ``step``; None where it
    is not known (a user's optimizer: compared wherever the reference's has the same shape)."""
    if key == "step":
        return ()
    if name == "adafactor" and key == "row_var":
        return (*shape[:-1], 1)
    if name == "adafactor" and key == "col_var":
        return (*shape[:-2], 1, shape[-1])
    if name in STATE_NAMES:
        return tuple(shape)
    return None


def state_names(name: str) -> tuple[str, ...] | None:
    """The state names compared for optimizer ``name`` (None: a user's optimizer, every name)."""
    return STATE_NAMES.get(name)


def iter_phase_names(optimizers: str | Iterable[str]) -> Iterator[str]:
    """The names of a comma list (or a sequence), stripped."""
    items = optimizers.split(",") if isinstance(optimizers, str) else list(optimizers)
    for item in items:
        yield item.strip() if isinstance(item, str) else item
