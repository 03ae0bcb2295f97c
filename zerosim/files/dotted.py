"""Importing a callable named by a string: ``package.module:function`` or ``path/to/file.py:function``.

The one importer behind every name a user or a contract file gives: contract checks
(``check = "zerosim.checks.partition:check_partition_plan"``) and user partitioners
(``zerosim check --impl my_rule.py:split``). Every failure is a ZeroSimError naming the field and
what failed (the module that cannot be imported, the attribute that is missing, the object that is
not callable), never a traceback from inside importlib.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ImplementationError


def import_dotted(spec: Any, field: str, *, allow_files: bool = False) -> Callable[..., Any]:
    """The callable ``spec`` names. ``allow_files`` also accepts ``path/to/file.py:function`` and makes
    the working directory importable (user code next to the command); ConfigError for a malformed
    ``spec``, ImplementationError when the import or the lookup fails."""
    shape = "'package.module:function'" + (" or 'file.py:function'" if allow_files else "")
    if not isinstance(spec, str):
        raise ConfigError(field, spec, f"must look like {shape}")
    module_name, _, attr = spec.rpartition(":") if allow_files else spec.partition(":")
    if not module_name or not attr or ":" not in spec:
        raise ConfigError(field, spec, f"must look like {shape}")
    module = _import_module(module_name, spec, field, allow_files)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImplementationError(
                f"{field}={spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise ImplementationError(f"{field}={spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def _import_module(module_name: str, spec: str, field: str, allow_files: bool) -> Any:
    try:
        if allow_files and module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ImplementationError(f"{field}={spec!r}: no such file {module_name!r}")
            file_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            return module
        if allow_files and os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(module_name)
    except ImplementationError:
        raise
    except (Exception, SystemExit) as e:  # ImportError, SyntaxError, anything raised on import, sys.exit
        raise ImplementationError(
            f"{field}={spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}"
        ) from e
