"""How a torch ``nn.Module`` becomes the engine's flat layout: its parameters, grouped into units.

A *unit* is what ZeRO-3 gathers just before it runs and frees right after (FSDP's wrapped module).
By default every element of every ``nn.ModuleList`` is a unit (a transformer's blocks), and
everything else belongs to the root unit, which stays gathered for the whole forward and backward.
``units=`` names the submodules to use instead (``["encoder.layers.0", ...]``), or is a predicate
``fn(qualified_name, module) -> bool``; a chosen module nested in another chosen module is its own
unit, its parent keeps the rest.

A parameter belongs to the innermost unit that contains every module it is registered in. A
shared parameter (a tied embedding and output head) registered in two units therefore lands in
their common ancestor, the root at worst: it is gathered once and its gradient is the sum of both
uses, as FSDP requires of shared parameters.

The layout lists each parameter once, in ``named_parameters()`` order, under its canonical name
(the first name torch reports); its other names become aliases. Validation here is bad input
(:class:`~zerosim.errors.ConfigError`, one line naming the field): a module without parameters,
parameters on several devices or of several dtypes, a frozen parameter, an unknown unit name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerosim.errors import ConfigError
from zerosim.values.layout import ParamLayout, TensorSpec

ROOT_UNIT = "root"
UnitSpec = Sequence[str] | Callable[[str, nn.Module], bool] | None


@dataclass(frozen=True)
class ModuleUnits:
    """The layout of a module, its units in forward order (root first) and where each lives."""

    layout: ParamLayout
    parameters: dict[str, nn.Parameter]  # canonical name -> the module's parameter object
    unit_modules: dict[str, nn.Module]   # unit name -> module (the root unit's is the model)
    unit_of: dict[str, str]              # canonical parameter name -> unit name
    order: tuple[str, ...]               # unit names that hold parameters: root first, then module order
    device: torch.device
    dtype: torch.dtype

    def unit_parameters(self, unit: str) -> list[str]:
        """The canonical names of the parameters ``unit`` holds, in layout order."""
        return [t.name for t in self.layout.tensors if self.unit_of[t.name] == unit]


def _chosen_units(model: nn.Module, units: UnitSpec) -> dict[str, nn.Module]:
    """Qualified name -> module of every unit the user (or the default policy) chose, model order."""
    named = dict(model.named_modules())
    if units is None:
        out: dict[str, nn.Module] = {}
        for qual, module in named.items():
            if isinstance(module, nn.ModuleList):
                for i, child in enumerate(module):
                    out[f"{qual}.{i}" if qual else str(i)] = child
        return out
    if callable(units):
        return {q: m for q, m in named.items() if q and units(q, m)}
    if isinstance(units, (str, bytes)) or not isinstance(units, Sequence):
        raise ConfigError("units", units, "must be a list of submodule names or a predicate fn(name, module)")
    out = {}
    for q in units:
        if not isinstance(q, str) or not q or q not in named:
            raise ConfigError("units", q, "is not the qualified name of a submodule (model.named_modules())")
        out[q] = named[q]
    return {q: out[q] for q in named if q in out}  # model order, whatever order the user listed


def _common_unit(names: list[str], unit_names: list[str]) -> str:
    """The innermost unit whose subtree holds every module path in ``names`` (ROOT_UNIT if none)."""
    def owner(path: str) -> str:
        best = ROOT_UNIT
        for u in unit_names:
            if (path == u or path.startswith(u + ".")) and (best == ROOT_UNIT or len(u) > len(best)):
                best = u
        return best

    owners = {owner(n) for n in names}
    while len(owners) > 1:  # climb to the innermost unit containing all of them
        longest = max(owners, key=len)
        owners.discard(longest)
        parents = [u for u in unit_names if longest.startswith(u + ".")]
        owners.add(max(parents, key=len) if parents else ROOT_UNIT)
    return owners.pop()


def describe_module(model: Any, units: UnitSpec = None) -> ModuleUnits:
    """The :class:`ModuleUnits` of ``model``; ConfigError (one line) for anything ZeroTrainer cannot shard."""
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "must be a torch.nn.Module")
    registrations: dict[int, list[str]] = {}
    params: dict[int, tuple[str, nn.Parameter]] = {}
    for qual, p in model.named_parameters(remove_duplicate=False):
        registrations.setdefault(id(p), []).append(qual)
        params.setdefault(id(p), (qual, p))
    if not params:
        raise ConfigError("model", type(model).__name__, "has no parameters: there is nothing to shard")
    first_name, first = next(iter(params.values()))
    for name, p in params.values():
        if p.device != first.device:
            raise ConfigError("model", name, f"is on {p.device} but {first_name!r} is on {first.device}: "
                              "move the model to one device first (model.to(device))")
        if p.dtype != first.dtype:
            raise ConfigError("model", name, f"is {p.dtype} but {first_name!r} is {first.dtype}: every "
                              "parameter must have one dtype (model.to(dtype))")
        if not p.requires_grad:
            raise ConfigError("model", name, "has requires_grad=False: ZeroTrainer shards and steps every "
                              "parameter; register a frozen tensor as a buffer instead")
    if first.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError("model", str(first.dtype), "parameters must be floating point")
    chosen = _chosen_units(model, units)
    unit_names = list(chosen)
    tensors, aliases, unit_of, by_name = [], {}, {}, {}
    for key, (name, p) in params.items():
        module_paths = [q.rsplit(".", 1)[0] if "." in q else "" for q in registrations[key]]
        unit = _common_unit(module_paths, unit_names)
        for alias in registrations[key][1:]:
            aliases[alias] = name
        tensors.append(TensorSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), unit))
        unit_of[name] = unit
        by_name[name] = p
    layout = ParamLayout(tuple(tensors), aliases, type(model).__name__)
    present = set(unit_of.values())
    order = tuple(u for u in [ROOT_UNIT, *unit_names] if u in present)
    modules = {ROOT_UNIT: model, **{u: chosen[u] for u in unit_names if u in present}}
    return ModuleUnits(layout, by_name, modules, unit_of, order, first.device, first.dtype)
