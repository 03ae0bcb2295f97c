"""The run file: one launched run as one JSON value, written by the command, loaded by every rank.

``zerosim simulate --backend mpi|torch`` validates its options once, writes a :class:`RankRun` (the
:class:`~zerosim.engine.config.RunConfig` plus how rank 0 reports and the backend's own settings) to
``run.json`` in a private temporary folder, and starts the ranks with ``simulate --config <that file>``.
Each rank loads the value (:func:`read_rank_run`); nothing is turned back into command-line options
and parsed again. ``zerosim simulate ... --write-config PATH`` writes the same file for ranks a user
starts (``mpiexec -f hosts``, ``torchrun --nnodes``). The file is plain JSON, never unpickled; a
missing, malformed or tampered file is a :class:`~zerosim.errors.ConfigError` naming the field and
the value (one line, exit 2 on every rank).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ..errors import ConfigError
from ..values.run_value import RunValue
from .config import RunConfig

RUN_FILE_FORMAT = "zerosim-run/1"
RUN_FILE_NAME = "run.json"
#: backend -> its rank settings and each one's allowed values (None: any string, checked by the rank)
BACKEND_OPTIONS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "mpi": {"timeout_mode": ("abort", "raise")},
    "torch": {"device": None, "dist_backend": ("auto", "gloo", "nccl"),
              "reduce_scatter": ("auto", "native", "reduce", "all_reduce"),
              "all_gather": ("auto", "native", "broadcast")},
}
#: the settings a backend's ranks use when the file leaves them out (the MPI timeout mode: the rank's
#: ``$ZEROSIM_MPI_TIMEOUT_MODE``, else abort)
BACKEND_DEFAULTS: dict[str, dict[str, str]] = {
    "mpi": {},
    "torch": {"device": "auto", "dist_backend": "auto", "reduce_scatter": "auto", "all_gather": "auto"},
}


@dataclass(frozen=True)
class RankRun(RunValue):
    """What every rank of a launched ``simulate`` needs: the run, how rank 0 reports it (``json_output``:
    JSON instead of tables; ``save_observations``: a path rank 0 writes the observations to, as plain
    data) and the backend's settings (``options``, see :data:`BACKEND_OPTIONS`)."""

    run: RunConfig
    backend: str
    json_output: bool = False
    save_observations: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)

    FORMAT = RUN_FILE_FORMAT

    def option(self, name: str, default: str = "") -> str:
        """The backend setting ``name``: the file's value, else the backend's default, else ``default``."""
        return self.options.get(name, BACKEND_DEFAULTS[self.backend].get(name, default))

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> RankRun:
        """The value of the run file's fields, every one checked (ConfigError naming the field)."""
        backend = data.get("backend")
        if backend not in BACKEND_OPTIONS:
            raise ConfigError("backend", backend, f"known: {', '.join(BACKEND_OPTIONS)}")
        json_output = data.get("json_output", False)
        if not isinstance(json_output, bool):
            raise ConfigError("json_output", json_output, "expected true/false")
        save = data.get("save_observations")
        if save is not None and (not isinstance(save, str) or not save):
            raise ConfigError("save_observations", save, "expected a file path or null")
        options = data.get("options", {})
        if not isinstance(options, dict):
            raise ConfigError("options", options, "expected a JSON object")
        allowed = BACKEND_OPTIONS[backend]
        for name, value in options.items():
            if name not in allowed:
                raise ConfigError(f"options.{name}", value,
                                  f"not a {backend} setting; known: {', '.join(allowed)}")
            choices = allowed[name]
            if not isinstance(value, str) or (choices is not None and value not in choices):
                raise ConfigError(f"options.{name}", value,
                                  f"known: {', '.join(choices)}" if choices else "expected a string")
        if "run" not in data:
            raise ConfigError("run", None, "the run file has no run config")
        return cls(RunConfig.from_json(data["run"]), backend, json_output, save, dict(options))


def write_rank_run(job: RankRun, path: str | os.PathLike[str]) -> Path:
    """Write ``job`` to ``path`` (JSON); returns the path."""
    return job.write(path)


def read_rank_run(path: str | os.PathLike[str], backend: str) -> RankRun:
    """The :class:`RankRun` in ``path`` for ``backend``'s ranks; ConfigError naming the field if bad."""
    job = RankRun.read(path)
    if job.backend != backend:
        raise ConfigError("backend", job.backend, f"this run file is for the {job.backend} backend, "
                          f"these ranks run {backend}")
    return job


#: the command line of hand-started ranks (:mod:`zerosim.cli.ranks`): a rank entry point given options
#: instead of a run file replaces itself with it (started by name, never imported: it sits above the ranks)
RANK_COMMAND_LINE = "zerosim.cli.ranks"
#: the spellings of the one argument a rank entry point takes: ``--run FILE`` (``--config`` and
#: ``--run-file``, what the launchers have written, are the same argument)
RUN_FILE_OPTIONS = ("--run", "--config", "--run-file")


def config_path_argument(argv: list[str]) -> str | None:
    """``PATH`` when ``argv`` is exactly ``--run PATH`` (or ``--config PATH``, ``--run-file PATH``, or
    ``--run=PATH`` ...), else None. The rank entry points take this one argument and nothing else."""
    if len(argv) == 2 and argv[0] in RUN_FILE_OPTIONS:
        return argv[1]
    if len(argv) == 1 and "=" in argv[0] and argv[0].split("=", 1)[0] in RUN_FILE_OPTIONS:
        return argv[0].split("=", 1)[1]
    return None


def rank_run_path(argv: list[str], command: str) -> str:
    """The run file a rank entry point was given (``--run FILE``). Given anything else (the options of a
    rank a user starts by hand), this process becomes ``python -m zerosim.cli.ranks COMMAND ARGV``: the
    command line parses them once into the same run value and runs the rank on it (C-ZERO-001..005 are
    checked by the run either way); the interpreter's own options and the environment are kept."""
    path = config_path_argument(argv)
    if path is not None:
        return path
    hand_to_command_line(command, argv)


def hand_to_command_line(command: str, argv: list[str]) -> NoReturn:
    """Replace this process with ``python -m zerosim.cli.ranks COMMAND ARGV`` (same pid: a launcher that
    started it still waits on it)."""
    import sys

    orig = list(getattr(sys, "orig_argv", [sys.executable]))
    interpreter = orig[1:orig.index("-m")] if "-m" in orig else []
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, *interpreter, "-m", RANK_COMMAND_LINE, command, *argv])
