"""One ``zerosim verify`` run as one value: what the command parses once and every rank loads.

:class:`VerifyRun` is frozen and JSON-serialisable. ``zerosim verify`` (or :func:`zerosim.verify.verify`)
builds it from its options, validates it before any process starts, writes it to ``run.json`` in the
run's private folder and starts each rank with ``-m zerosim.verify --run-file <that file>``; a rank loads it
(:func:`read_verify_run`), checks it again against what the launcher really started, and never parses
options a second time. Ranks a user starts (``torchrun --nnodes N -m zerosim.verify TARGET [options]``)
build the same value from their own command line. The file is plain JSON, never unpickled; a field
that is missing, unknown or of the wrong kind is a :class:`~zerosim.errors.ConfigError` naming it.

The validation every launch shares (the launcher's and the ranks') lives here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerosim.errors import ConfigError, require_positive_int
from zerosim.json_value import read_json_file, require_known_fields

from .suite import OPTIMIZERS, build_phases

VERIFY_RUN_FORMAT = "zerosim-verify-run/1"
DEFAULT_TIMEOUT_S = 120.0  # a collective (or a trainer call between two of them) that takes longer: a hang
DTYPES = ("float64", "float32")
DEVICES = ("cpu", "cuda")
RESUME_STAGES = ("save", "load")
# micro-batches per optimizer step: every rank trains K micro-batches of the built-in model per step and
# rank 0 keeps nothing per micro-batch, but the reference replays K x world of them per step
MAX_GRAD_ACCUM = 64


@dataclass(frozen=True)
class VerifyRun:
    """Everything a rank of ``zerosim verify`` needs.

    ``world``: the ranks of this launch (None: whatever the launcher started). ``out``: the folder rank
    0 writes ``report.json`` / ``error.json`` / failure records into. ``json_output``: rank 0 prints
    the report as one JSON object; ``quiet``: it prints nothing (the launcher reads the files).
    ``resume_at`` / ``resume_dir`` / ``resume_stage``: one of the two launches of a resumed run.
    ``save_observations``: rank 0 also writes the observations to this path as plain data.
    ``grad_accum``: micro-batches per optimizer step (K > 1: ``step_accumulated`` is called with K).
    """

    target: str
    world: int | None = None
    steps: int | None = None
    dtype: str = "float64"
    device: str = "cpu"
    model: str = "gpt"
    optimizers: str = ",".join(OPTIMIZERS)
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    out: str | None = None
    json_output: bool = False
    quiet: bool = False
    resume_at: int | None = None
    resume_dir: str | None = None
    resume_stage: str | None = None
    save_observations: str | None = None
    grad_accum: int = 1

    def replace(self, **changes: Any) -> VerifyRun:
        return dataclasses.replace(self, **changes)

    def validate(self) -> VerifyRun:
        """This value, or ConfigError (one line naming the field and value) for the first bad field."""
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError("target", self.target, "give a built-in adapter name or MODULE:FACTORY")
        validate_options(world=1 if self.world is None else self.world, steps=self.steps, dtype=self.dtype,
                         device=self.device, model=self.model, optimizers=self.optimizers,
                         timeout_s=self.timeout_s, grad_accum=self.grad_accum)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("seed", self.seed, "must be a non-negative integer")
        if self.resume_stage is not None and self.resume_stage not in RESUME_STAGES:
            raise ConfigError("resume_stage", self.resume_stage, f"must be one of {', '.join(RESUME_STAGES)}")
        if self.resume_stage is not None or self.resume_at is not None:
            if self.resume_stage is None or self.resume_dir is None:
                raise ConfigError(
                    "resume_at", self.resume_at, "use zerosim verify --resume-at K (it starts both launches)"
                )
            validate_resume(self.resume_at, None, self.optimizers, self.steps, self.device)
        return self

    def to_json(self) -> dict[str, Any]:
        return {"format": VERIFY_RUN_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> VerifyRun:
        """The value ``data`` describes; ConfigError naming the first field that is not one."""
        names = [f.name for f in dataclasses.fields(cls)]
        data = require_known_fields(data, ["format", *names])
        if data.get("format") != VERIFY_RUN_FORMAT:
            raise ConfigError("format", data.get("format"), f"expected {VERIFY_RUN_FORMAT!r}")
        if "target" not in data:
            raise ConfigError("target", None, "the run file names no target")
        values = {k: v for k, v in data.items() if k != "format"}
        for name in ("json_output", "quiet"):
            if name in values and not isinstance(values[name], bool):
                raise ConfigError(name, values[name], "expected true/false")
        for name in ("target", "dtype", "device", "model", "optimizers", "out", "resume_dir",
                     "resume_stage", "save_observations"):
            if values.get(name) is not None and not isinstance(values[name], str):
                raise ConfigError(name, values[name], "expected a string")
        for name in ("world", "steps", "seed", "resume_at", "grad_accum"):
            value = values.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(name, value, "expected an integer")
        timeout = values.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigError("timeout_s", timeout, "expected a number of seconds")
        values["timeout_s"] = float(timeout)
        return cls(**values).validate()


def write_verify_run(run: VerifyRun, path: str | os.PathLike[str]) -> Path:
    """Write ``run`` to ``path`` as JSON; returns the path."""
    out = Path(path)
    out.write_text(json.dumps(run.to_json(), indent=1, sort_keys=True) + "\n")
    return out


def read_verify_run(path: str | os.PathLike[str]) -> VerifyRun:
    """The validated :class:`VerifyRun` in ``path``; ConfigError naming the field if it is not one."""
    return VerifyRun.from_json(read_json_file(path))


# ---- validation shared by the launcher and the ranks ---------------------------------------------------


def validate_options(
    *, world: Any, steps: Any, dtype: Any, device: Any, model: Any, optimizers: Any, timeout_s: Any,
    grad_accum: Any = 1,
) -> None:
    """ConfigError (one line naming the field and value) for any bad option; deterministic."""
    from .model_source import model_source

    require_positive_int("world", world)
    require_grad_accum(grad_accum)
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ConfigError("device", device, f"must be one of {', '.join(DEVICES)}")
    model_source(model)
    build_phases(optimizers, steps)
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s < float("inf")
    ):
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")


def require_grad_accum(value: Any) -> int:
    """``--grad-accum K``: an integer 1 <= K <= MAX_GRAD_ACCUM, or ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GRAD_ACCUM:
        raise ConfigError(
            "grad_accum", value,
            f"must be an integer from 1 to {MAX_GRAD_ACCUM} (micro-batches per optimizer step; the "
            f"reference replays K x world micro-batches per step)",
        )
    return value


def validate_resume(at: Any, world: Any, optimizers: Any, steps: Any, device: str) -> None:
    """ConfigError (one line naming the field and value) unless every phase can be interrupted after
    its ``at``-th step (1 <= at < the shortest phase) and ``world`` ranks (when given) can start."""
    require_positive_int("resume_at", at)
    phases = build_phases(optimizers, steps)
    shortest = min(phases, key=lambda p: p.steps)
    if at >= shortest.steps:
        raise ConfigError(
            "resume_at",
            at,
            f"must be below {shortest.steps}: every phase resumes after its K-th step and the "
            f"{shortest.name} phase has {shortest.steps} steps (--steps gives more)",
        )
    if world is not None:
        require_positive_int("resume_world", world)
        require_startable(world, device)


def require_startable(world: int, device: str) -> None:
    """ConfigError unless this machine can start ``world`` ranks on ``device``."""
    if device == "cpu":
        limit = 4 * (os.cpu_count() or 1)
        if world > limit:
            raise ConfigError(
                "world",
                world,
                f"this machine can start at most {limit} CPU ranks (4 x {os.cpu_count()} cores)",
            )
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise ConfigError("device", device, "CUDA is not available here; use --device cpu")
    if world > gpus:
        raise ConfigError(
            "world",
            world,
            f"--device cuda runs one rank per GPU (NCCL) and this machine has "
            f"{gpus}; use --world {gpus} or less, or --device cpu",
        )
