"""Which function is a contract's check, and the one place a run's verdicts are made.

:func:`judges` marks the one public ``check_*`` function of :mod:`zerosim.checks` that decides a
contract, for every kind of observation the contract is judged on (the engine's runs on every backend,
a live trainer under ``zerosim verify``, a monitored run, a benchmark's plans). A contract's spec names
that function (``check`` in ``contracts/<id>.toml``), and the test suite holds every contract to
exactly one. :func:`judge` calls it: the simulator, ``zerosim verify`` and the monitor name the
contract and hand over their observations, and no other module of theirs calls a check.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ..values.verdict import Verdict

F = TypeVar("F", bound=Callable[..., Any])

#: the attribute :func:`judges` sets on a check
CONTRACT_ATTRIBUTE = "contract_id"


def judges(contract: str) -> Callable[[F], F]:
    """Mark the decorated function as ``contract``'s check (it keeps its signature and behaviour)."""

    def mark(fn: F) -> F:
        setattr(fn, CONTRACT_ATTRIBUTE, contract)
        return fn

    return mark


def contract_of(fn: Any) -> str | None:
    """The contract ``fn`` is the check of, or None for any other function."""
    value = getattr(fn, CONTRACT_ATTRIBUTE, None)
    return value if isinstance(value, str) else None


def judge(contract: str, *observations: Any, **options: Any) -> Verdict:
    """``contract``'s verdict (C-ZERO-001..008) on ``observations``: the one check :func:`judges` marks
    for it, called with ``observations`` and ``options`` (its signature says which it takes)."""
    check = _checks().get(contract)
    if check is None:
        raise ValueError(f"contract: {contract!r} is judged by no check of zerosim.checks")
    verdict: Verdict = check(*observations, **options)
    return verdict


@functools.cache
def _checks() -> dict[str, Callable[..., Any]]:
    """contract -> its check, from the modules of :mod:`zerosim.checks` (imported on the first call)."""
    package = importlib.import_module(__package__ or "zerosim.checks")
    found: dict[str, Callable[..., Any]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, fn in vars(module).items():
            contract = contract_of(fn)
            if contract is not None and name.startswith("check_") and fn.__module__ == module.__name__:
                found[contract] = fn
    return found
