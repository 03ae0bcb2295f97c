"""One launch of ``zerosim bench peers``'s ranks as one value: :class:`PeersRun`, frozen and JSON both ways.

``zerosim bench peers`` validates its options once, writes one :class:`PeersRun` per launch to a file in
its private temporary folder and starts ``torchrun ... -m zerosim.bench.peers_rank --config FILE``;
every rank loads the value (:func:`read_peers_run`) and checks it again as plain data (the same checks,
deterministic on every rank), nothing is turned back into command-line options. Under an external
launcher the command line builds the same value from the rank program's options
(``zerosim.cli.rank_commands.peers_rank_run``, reached through :mod:`zerosim.engine.run_file`'s
hand-over). A bad file is one line naming the field, exit 2 on every rank. The settings' defaults
and their checks live here, shared by the command, the launcher and the ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, require_non_negative_int, require_positive_int
from ..values.run_value import RunValue

PEERS_RUN_FORMAT = "zerosim-bench-peers-run/1"
DEFAULT_MODELS = ("gpt", "gpt-50m")
DEFAULT_STEPS = 3
DEFAULT_WARMUP = 1
DEFAULT_ROUNDS = 2
DEFAULT_MIN_TIME_S = 1.0
#: the most timed steps one adapter runs in one round, however short its step (``--min-time``)
MAX_TIMED_STEPS = 500
DEFAULT_TIMEOUT_S = 120.0
DTYPES = ("float32", "float64")
DEVICES = ("cpu", "cuda")
OPTIMIZERS = ("adamw", "sgd")


def parse_int(field: str, text: Any) -> int:
    """``text`` as an integer; ConfigError naming ``field`` otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(field, text, "must be an integer") from None


def _seconds_problem(value: Any, *, allow_zero: bool) -> str | None:
    """Why ``value`` is not a usable number of seconds (positive and finite, or 0 with ``allow_zero``);
    None when it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number of seconds"
    if not (0 <= value if allow_zero else 0 < value) or not value < math.inf:
        return f"must be a finite number of seconds, {'0 or more' if allow_zero else 'positive'}"
    return None


def parse_seconds(field: str, text: Any, *, allow_zero: bool = False) -> float:
    """``text`` as a finite number of seconds, positive (or 0 or more with ``allow_zero``);
    ConfigError naming ``field`` otherwise."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ConfigError(field, text, "must be a number of seconds") from None
    problem = _seconds_problem(value, allow_zero=allow_zero)
    if problem:
        raise ConfigError(field, text, problem)
    return value


def split_names(field: str, text: str | Sequence[str]) -> list[str]:
    """A comma-separated list (or a sequence) as names; ConfigError when empty or repeated."""
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else [str(n).strip() for n in text]
    if not names or any(not n for n in names):
        raise ConfigError(field, text if isinstance(text, str) else ",".join(names),
                          "give a comma-separated list of names")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(field, ",".join(names), f"{', '.join(repeated)} given twice")
    return names


def select_models(text: str | Sequence[str]) -> list[str]:
    from ..verify.model import require_model

    names = split_names("models", text)
    for name in names:
        require_model(name)
    return names


def select_adapters(text: str | Sequence[str] | None) -> list[str]:
    """The adapters to run: ``text`` validated (built-in names and named variants against the tables,
    ``MODULE:FACTORY`` by importing it), or every installed built-in adapter in table order followed by
    the ``-native`` variants of the installed zerogpu adapters."""
    from ..verify.adapters import ADAPTERS, VARIANTS, installed_adapters, missing_requirement
    from ..verify.targets import resolve_factory

    if text is None:
        names = installed_adapters()
        if not names:
            raise ConfigError("adapters", "", "no built-in adapter can run here (is torch installed?)")
        return names + [v for v in VARIANTS if v.removesuffix("-native") in names]
    names = split_names("adapters", text)
    for name in names:
        if name in ADAPTERS:
            reason = missing_requirement(name)
            if reason:
                raise ConfigError("adapters", name, reason)
        elif name in VARIANTS or ":" in name:
            resolve_factory(name)
        else:
            raise ConfigError("adapters", name, f"not a built-in adapter ({', '.join(ADAPTERS)}), "
                              f"not a variant ({', '.join(VARIANTS)}) and not MODULE:FACTORY")
    return names


def validate_run(*, steps: Any, warmup: Any, dtype: Any, device: Any, optimizer: Any, timeout_s: Any,
                 rounds: Any = 1, min_time_s: Any = 0.0) -> None:
    """ConfigError for a bad option the launcher and every rank check alike (deterministic)."""
    require_positive_int("steps", steps)
    if steps > MAX_TIMED_STEPS:
        raise ConfigError("steps", steps, f"at most {MAX_TIMED_STEPS} timed steps per adapter and round")
    require_non_negative_int("warmup", warmup)
    require_positive_int("rounds", rounds)
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ConfigError("device", device, f"must be one of {', '.join(DEVICES)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", optimizer, f"must be one of {', '.join(OPTIMIZERS)}")
    for field, value, allow_zero in (("min_time", min_time_s, True), ("timeout", timeout_s, False)):
        problem = _seconds_problem(value, allow_zero=allow_zero)
        if problem:
            raise ConfigError(field, value, problem)


@dataclass(frozen=True)
class PeersRun(RunValue):
    """What every rank of one ``bench peers`` launch needs: the models and adapters in order, the
    timing settings, where to start in the (round, adapter) order and which adapters to leave out (they
    failed in an earlier launch), and where rank 0 writes (``results``: one JSON line per adapter for
    the launcher; else a report under ``out``)."""

    models: tuple[str, ...]
    adapters: tuple[str, ...]
    steps: int = DEFAULT_STEPS
    warmup: int = DEFAULT_WARMUP
    rounds: int = DEFAULT_ROUNDS
    min_time_s: float = DEFAULT_MIN_TIME_S
    dtype: str = "float32"
    device: str = "cpu"
    optimizer: str = "adamw"
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    from_position: int = 0
    skip: tuple[str, ...] = ()
    out: str | None = None
    results: str | None = None

    FORMAT = PEERS_RUN_FORMAT
    WHAT = "bench peers run file"

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> PeersRun:
        """The value of the file's fields, every one checked (ConfigError naming the first bad one)."""
        for key in ("models", "adapters"):
            if key not in fields:
                raise ConfigError(key, None, "the run file names none")
        for key in ("models", "adapters", "skip"):
            value = fields.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(key, value, "expected a list of names")
        for key in ("out", "results"):
            value = fields.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(key, value, "expected a path or null")
        for key in ("dtype", "device", "optimizer"):
            if key in fields and not isinstance(fields[key], str):
                raise ConfigError(key, fields[key], "expected a string")
        run = cls(**{**fields, "models": tuple(fields["models"]), "adapters": tuple(fields["adapters"]),
                     "skip": tuple(fields.get("skip", ()))})
        run.validate()
        return run

    def validate(self) -> None:
        """ConfigError for the first setting a rank cannot run with (the launcher's checks, repeated)."""
        validate_run(steps=self.steps, warmup=self.warmup, dtype=self.dtype, device=self.device,
                           optimizer=self.optimizer, timeout_s=self.timeout_s, rounds=self.rounds,
                           min_time_s=self.min_time_s)
        require_non_negative_int("from_position", self.from_position)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", self.seed, "must be an integer")
        select_models(list(self.models))
        select_adapters(list(self.adapters))

    def settings(self, world: int) -> dict[str, Any]:
        """The settings a report states (:func:`zerosim.bench.peers_report.build_report`)."""
        return {"device": self.device, "world": world, "dtype": self.dtype, "optimizer": self.optimizer,
                "steps": self.steps, "warmup": self.warmup, "rounds": self.rounds,
                "min_time_s": self.min_time_s, "timeout_s": self.timeout_s}


def write_peers_run(run: PeersRun, path: str | os.PathLike[str]) -> Path:
    """``run`` as JSON in ``path`` (renamed into place)."""
    return run.write(path)


def read_peers_run(path: str | os.PathLike[str]) -> PeersRun:
    """The :class:`PeersRun` in ``path``; ConfigError naming the file or the field if it is not one."""
    return PeersRun.read(path)
