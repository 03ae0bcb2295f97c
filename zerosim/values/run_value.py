"""The family of run values: one frozen dataclass base, one JSON round trip, one file format.

A launcher validates its options once into a run value, writes it (:meth:`RunValue.write`) and every
rank reads it back (:meth:`RunValue.read`); nothing is turned back into command-line options. Each run
type (:class:`~zerosim.engine.config.RunConfig`, :class:`~zerosim.engine.run_file.RankRun`,
:class:`~zerosim.verify.run_value.VerifyRun`, :class:`~zerosim.bench.peers_run.PeersRun`,
:class:`~zerosim.bench.mpi.MpiBenchRun`, :class:`~zerosim.report.config.ReportConfig`) derives from
:class:`RunValue` and says only what is its own: its fields, its ``FORMAT`` (the ``format`` key of a
value stored on its own; None for one only ever nested in another) and how its fields are checked
and converted from JSON (:meth:`RunValue.from_fields`). The JSON is plain (tuples become lists,
nested values their own JSON), never unpickled; a value that is not one is a
:class:`~zerosim.errors.ConfigError` naming the field (one line, exit 2 on every rank).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ..errors import ConfigError
from ..files.json_file import check_fields, read_settings, write_settings

#: the run type a class method of :class:`RunValue` builds
R = TypeVar("R", bound="RunValue")


@dataclasses.dataclass(frozen=True)
class RunValue:
    """Base of every run value (the launch side of C-ZERO-001..008: a rank runs what its launcher
    validated, nothing re-parsed). Subclasses are frozen dataclasses."""

    #: the ``format`` key the value's JSON carries; None: the value is only nested in another
    FORMAT: ClassVar[str | None] = None
    #: what the value is called in an error about its JSON or its file
    WHAT: ClassVar[str] = "run file"

    def replace(self: R, **changes: Any) -> R:
        """A copy with ``changes`` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The value as JSON-native data: every field, tuples as lists, nested run values as their JSON,
        and ``format`` first when the type has one; :meth:`from_json` reads it back."""
        data = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return data if self.FORMAT is None else {"format": self.FORMAT, **data}

    @classmethod
    def from_json(cls: type[R], data: Any) -> R:
        """The value ``data`` describes: a JSON object with no unknown key and the type's ``format``,
        its fields checked and converted by :meth:`from_fields` (ConfigError naming the first bad one)."""
        names = tuple(f.name for f in dataclasses.fields(cls))
        if cls.FORMAT is not None:
            values = dict(check_fields(data, ("format", *names), cls.FORMAT, cls.WHAT))
            values.pop("format", None)
            return cls.from_fields(values)
        if not isinstance(data, dict):
            raise ConfigError(cls.WHAT, type(data).__name__,
                              f"expected a JSON object of {cls.__name__} fields")
        for key, value in data.items():
            if key not in names:
                raise ConfigError(f"{cls.WHAT} field {key!r}", value, f"unknown; known: {', '.join(names)}")
        return cls.from_fields(dict(data))

    @classmethod
    def from_fields(cls: type[R], values: dict[str, Any]) -> R:
        """The value of these JSON fields (known names, ``format`` removed). A run type overrides it to
        check each field's JSON type and convert lists and objects back (ConfigError naming the field)."""
        return cls(**values)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the value's JSON to ``path`` (renamed into place); returns the path."""
        return write_settings(self.to_json(), path)

    @classmethod
    def read(cls: type[R], path: str | os.PathLike[str]) -> R:
        """The value in the file ``path``; ConfigError naming the file (missing, oversized, not JSON) or
        the field."""
        return cls.from_json(read_settings(path, cls.WHAT))


def plain(value: Any) -> Any:
    """``value`` as JSON-native data: a run value's JSON, a dataclass's fields, tuples and lists as
    lists, mappings as dicts; anything else as it is."""
    if isinstance(value, RunValue):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value
