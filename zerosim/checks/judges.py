"""Which function is a contract's check: :func:`judges` marks the one public ``check_*`` function of
:mod:`zerosim.checks` that decides a contract, for every kind of observation the contract is judged on
(the engine's runs on every backend, a live trainer under ``zerosim verify``, a monitored run, a
benchmark's plans). A contract's spec names that function (``check`` in ``contracts/<id>.toml``), and
the test suite holds every contract to exactly one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

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
