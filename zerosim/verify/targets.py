"""TARGET resolution for ``zerosim verify``: a built-in adapter name or ``MODULE:FACTORY``.

A built-in name maps to its ``module:factory`` through :data:`zerosim.verify.adapters.ADAPTERS` (or
:data:`~zerosim.verify.adapters.VARIANTS`, the named variants such as ``zerogpu-3-native``).
``MODULE:FACTORY`` is imported with the current directory first on ``sys.path`` (the launcher also
puts it on every rank's ``PYTHONPATH``). Anything that cannot give a callable factory is a
:class:`~zerosim.verify.errors.TrainerError`: one line naming the target and what failed (exit 2).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from zerosim.errors import ConfigError

from .errors import TrainerError


def factory_spec(target: str) -> str:
    """``module:factory`` for TARGET (an adapter name is looked up; ``MODULE:FACTORY`` returned as is)."""
    from .adapters import ADAPTERS, VARIANTS, missing_requirement

    if not isinstance(target, str) or not target.strip():
        raise ConfigError("target", target, "give a built-in adapter name or MODULE:FACTORY")
    if target in ADAPTERS:
        reason = missing_requirement(target)
        if reason:
            raise ConfigError("target", target, reason)
        return ADAPTERS[target]
    if target in VARIANTS:
        return VARIANTS[target]
    if ":" not in target:
        raise ConfigError(
            "target", target, f"not a built-in adapter ({', '.join(ADAPTERS)}) and not MODULE:FACTORY"
        )
    return target


def is_built_in(target: str) -> bool:
    """True for a built-in adapter or variant name (its module ships with zerosim)."""
    from .adapters import ADAPTERS, VARIANTS

    return target in ADAPTERS or target in VARIANTS


def target_parts(target: str) -> tuple[str, str]:
    """(module, factory) of TARGET's ``module:factory`` (:func:`factory_spec`), checked without importing
    anything: ConfigError unless both parts are there."""
    module_name, _, attr = factory_spec(target).partition(":")
    if not module_name or not attr:
        raise ConfigError(
            "target", target, "MODULE:FACTORY needs both parts, e.g. examples.zero1_trainer:make_trainer"
        )
    return module_name, attr


def resolve_factory(target: str) -> Callable[..., Any]:
    """The ``make_trainer`` callable TARGET names. TrainerError if its module or attribute is missing, the
    module raises on import, or the attribute is not callable."""
    module_name, attr = target_parts(target)
    return import_callable(module_name, attr, f"target {target!r}")


def import_callable(module_name: str, attr: str, what: str) -> Callable[..., Any]:
    """``module_name``'s (dotted) attribute ``attr``, imported with the current directory first on
    ``sys.path``; TrainerError, one line starting with ``what``, if the module is missing or raises on
    import, or the attribute is missing or not callable."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise TrainerError(
                f"{what}: module {module_name!r} not found (looked in the current "
                "directory and PYTHONPATH)"
            ) from None
        raise TrainerError(
            f"{what}: importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise TrainerError(
            f"{what}: importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TrainerError(f"{what}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TrainerError(f"{what}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj
