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
from typing import Any

from ..errors import ConfigError
from ..json_file import check_fields, read_settings, write_settings
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
class RankRun:
    """What every rank of a launched ``simulate`` needs: the run, how rank 0 reports it (``json_output``:
    JSON instead of tables; ``save_observations``: a path rank 0 writes the observations to, as plain
    data) and the backend's settings (``options``, see :data:`BACKEND_OPTIONS`)."""

    run: RunConfig
    backend: str
    json_output: bool = False
    save_observations: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)

    def option(self, name: str, default: str = "") -> str:
        """The backend setting ``name``: the file's value, else the backend's default, else ``default``."""
        return self.options.get(name, BACKEND_DEFAULTS[self.backend].get(name, default))

    def to_json(self) -> dict[str, Any]:
        return {"format": RUN_FILE_FORMAT, "backend": self.backend, "run": self.run.to_json(),
                "json_output": self.json_output, "save_observations": self.save_observations,
                "options": dict(self.options)}

    @classmethod
    def from_json(cls, data: Any) -> RankRun:
        """The value ``data`` describes, every field checked (ConfigError naming the field)."""
        data = check_fields(data, ("format", "backend", "run", "json_output", "save_observations", "options"),
                            RUN_FILE_FORMAT, "run file")
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
    return write_settings(job.to_json(), path)


def read_rank_run(path: str | os.PathLike[str], backend: str) -> RankRun:
    """The :class:`RankRun` in ``path`` for ``backend``'s ranks; ConfigError naming the field if bad."""
    job = RankRun.from_json(read_settings(path))
    if job.backend != backend:
        raise ConfigError("backend", job.backend, f"this run file is for the {job.backend} backend, "
                          f"these ranks run {backend}")
    return job


def config_path_argument(argv: list[str]) -> str | None:
    """``PATH`` when ``argv`` is exactly ``--config PATH`` (or ``--config=PATH``), else None. The rank
    entry points take this one argument; anything else is the command line's own options."""
    if len(argv) == 2 and argv[0] == "--config":
        return argv[1]
    if len(argv) == 1 and argv[0].startswith("--config="):
        return argv[0].split("=", 1)[1]
    return None
