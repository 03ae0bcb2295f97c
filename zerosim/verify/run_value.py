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

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerosim.errors import ConfigError, require_positive_int
from zerosim.values.run_value import RunValue

from .mixed_precision import DEFAULT_REDUCE_DTYPE, FULL, require_precision
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
class VerifyRun(RunValue):
    """Everything a rank of ``zerosim verify`` needs.

    ``world``: the ranks of this launch (None: whatever the launcher started). ``out``: the folder rank
    0 writes ``report.json`` / ``error.json`` / failure records into. ``json_output``: rank 0 prints
    the report as one JSON object; ``quiet``: it prints nothing (the launcher reads the files).
    ``resume_at`` / ``resume_dir`` / ``resume_stage``: one of the two launches of a resumed run.
    ``save_observations``: rank 0 also writes the observations to this path as plain data.
    ``allow_world_1``: run on one rank although it cannot show a sharding bug. ``mesh``: (replicas,
    shard group size) handed to the trainer as ``optim["mesh"]`` and used by the checks. ``strict``:
    findings (traffic or memory off the declared strategy's model while every value is right) fail.
    ``grad_accum``: micro-batches per optimizer step (K > 1: ``step_accumulated`` is called with K).
    ``precision``: "full" (everything in ``dtype``), "bf16" or "fp16" (compute in that dtype, float32
    masters: ``dtype`` must be float32); ``reduce_dtype``: the dtype gradients are reduced in under
    bf16/fp16 (:mod:`zerosim.verify.mixed_precision`; the trainer gets ``optim["mixed_precision"]``).
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
    allow_world_1: bool = False
    mesh: tuple[int, int] | None = None
    strict: bool = False
    grad_accum: int = 1
    precision: str = FULL
    reduce_dtype: str = DEFAULT_REDUCE_DTYPE

    FORMAT = VERIFY_RUN_FORMAT

    def validate(self) -> VerifyRun:
        """This value, or ConfigError (one line naming the field and value) for the first bad field."""
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError("target", self.target, "give a built-in adapter name or MODULE:FACTORY")
        validate_options(world=1 if self.world is None else self.world, steps=self.steps, dtype=self.dtype,
                         device=self.device, model=self.model, optimizers=self.optimizers,
                         timeout_s=self.timeout_s, grad_accum=self.grad_accum)
        require_precision(self.precision, self.reduce_dtype, self.dtype, self.device)
        if self.world is not None and self.resume_stage != "load":  # a resumed run may continue on one rank
            require_world(self.world, self.allow_world_1)
            if self.mesh is not None:
                require_mesh(self.mesh, self.world)
        if self.mesh is not None:
            require_mesh_target(self.target, self.mesh)
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

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> VerifyRun:
        """The value of the run file's fields, validated; ConfigError naming the first that is not one."""
        if "target" not in values:
            raise ConfigError("target", None, "the run file names no target")
        for name in ("json_output", "quiet", "allow_world_1", "strict"):
            if name in values and not isinstance(values[name], bool):
                raise ConfigError(name, values[name], "expected true/false")
        for name in ("target", "dtype", "device", "model", "optimizers", "out", "resume_dir",
                     "resume_stage", "save_observations", "precision", "reduce_dtype"):
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
        mesh = values.get("mesh")
        if mesh is not None:
            if not isinstance(mesh, list) or len(mesh) != 2 or any(
                isinstance(v, bool) or not isinstance(v, int) for v in mesh
            ):
                raise ConfigError("mesh", mesh, "expected [replicas, shard group size]")
            values["mesh"] = (mesh[0], mesh[1])
        return cls(**values).validate()


def write_verify_run(run: VerifyRun, path: str | os.PathLike[str]) -> Path:
    """Write ``run`` to ``path`` as JSON; returns the path."""
    return run.write(path)


def read_verify_run(path: str | os.PathLike[str]) -> VerifyRun:
    """The validated :class:`VerifyRun` in ``path``; ConfigError naming the field if it is not one."""
    return VerifyRun.read(path)


# ---- validation shared by the launcher and the ranks ---------------------------------------------------


def validate_options(
    *, world: Any, steps: Any, dtype: Any, device: Any, model: Any, optimizers: Any, timeout_s: Any,
    grad_accum: Any = 1,
) -> None:
    """ConfigError (one line naming the field and value) for any bad option; deterministic."""
    from .model_presets import require_model_name

    require_positive_int("world", world)
    require_grad_accum(grad_accum)
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ConfigError("device", device, f"must be one of {', '.join(DEVICES)}")
    require_model_name(model)
    build_phases(optimizers, steps)
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s < float("inf")
    ):
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")


def require_world(world: int, allow_world_1: bool) -> None:
    """ConfigError for one rank unless the user asked for it: nothing is sharded, reduced or gathered
    on one rank, so no sharding bug can show and a pass would say nothing."""
    if world == 1 and not allow_world_1:
        raise ConfigError(
            "world", world, "one rank cannot show a sharding bug (nothing is sharded, reduced or gathered); "
            "use --world 2 or more, or --allow-world-1 to run it anyway"
        )


def parse_mesh(text: Any) -> tuple[int, int]:
    """``"RxS"`` -> (R, S): R replicas of S shard ranks; ConfigError naming the field and value."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if match is None:
        raise ConfigError("mesh", text, "expected RxS: R replicas of S shard ranks, e.g. 2x2")
    mesh = (int(match.group(1)), int(match.group(2)))
    if min(mesh) < 1:
        raise ConfigError("mesh", text, "R and S must be at least 1")
    return mesh


def require_mesh(mesh: Any, world: int) -> None:
    """ConfigError unless ``mesh`` = (R, S) are positive integers with R x S = ``world``."""
    if (not isinstance(mesh, tuple) or len(mesh) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in mesh)):
        raise ConfigError("mesh", mesh, "expected (replicas, shard group size), both positive integers")
    if mesh[0] * mesh[1] != world:
        raise ConfigError(
            "mesh", f"{mesh[0]}x{mesh[1]}",
            f"{mesh[0]} x {mesh[1]} = {mesh[0] * mesh[1]} ranks, but the run has {world}",
        )


def require_mesh_target(target: str, mesh: tuple[int, int]) -> None:
    """ConfigError when a built-in adapter with a fixed layout is given a mesh; a hybrid adapter and a
    user's MODULE:FACTORY get ``optim["mesh"]`` (verify cannot know whether a user's trainer is hybrid:
    it hands the mesh over and judges the ranges against it)."""
    from .adapters import ADAPTERS, HYBRID_ADAPTERS, VARIANTS

    if (target in ADAPTERS or target in VARIANTS) and target not in HYBRID_ADAPTERS:
        raise ConfigError(
            "mesh", f"{mesh[0]}x{mesh[1]}",
            f"{target} has a fixed layout; --mesh applies to {', '.join(HYBRID_ADAPTERS[:2])} and to "
            "your own MODULE:FACTORY",
        )


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
