"""Running ``zerosim verify``: the launcher (:func:`verify`) and what every rank runs (:func:`rank_main`).

Launcher: validates the options, resolves TARGET (bad input fails here, before any process starts),
then starts ``torchrun --standalone --nproc-per-node N -m zerosim.verify TARGET ...``
(:func:`zerogpu.launch.run_torchrun`: a wall-clock timeout, never a process left behind) with the
current directory on every rank's ``PYTHONPATH``. Rank 0 writes ``report.json`` (or ``error.json``)
into the run directory; each failing rank writes ``failure-rank<R>.json`` naming the rank to blame.

Each rank: ``init_process_group`` (gloo on the CPU, NCCL with ``--device cuda``; every collective
bounded by ``--timeout``), then for each phase of the suite (:mod:`zerosim.verify.suite`): the same
seeded model, ``make_trainer(model, optim)``, and for each step ``step()`` on its own micro-batch,
``full_parameters()``, and the optional ``full_optimizer_state()`` / ``local_shards()``. Every rank's
observation goes to rank 0 each step; rank 0 validates them (a protocol breach: every rank exits 2
with the same one line), and at the end trains the reference, derives the bounds, runs the checks
and the diagnosis, and writes the report. Exit status, the same on every rank: 0 every contract
holds, 1 a contract failed, 2 bad input, 3 a rank failed or hung (:mod:`zerogpu.rank`).

With ``--resume-at K`` the launcher starts two launches in turn, each under the same wall-clock
bound: ``--world`` ranks that train and save (``--resume-stage save``), then ``--resume-world`` fresh
ranks that load, continue and report (``--resume-stage load``; :mod:`zerosim.verify.session`).

Under an external launcher (``torchrun --nnodes ... -m zerosim.verify TARGET``) the same program
runs; rank 0 prints the report (``--json``: one object) and writes it under ``--out`` if given.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from zerosim.errors import ConfigError, ZeroSimError, require_output_dir, require_positive_int

from .errors import RankFailure, TrainerError
from .outcome import VerifyReport
from .resume import SNAPSHOT_FILE
from .suite import OPTIMIZERS, build_phases

DEFAULT_TIMEOUT_S = 120.0  # a collective (or a trainer call between two of them) that takes longer: a hang
DTYPES = ("float64", "float32")
DEVICES = ("cpu", "cuda")
REPORT_FILE = "report.json"
ERROR_FILE = "error.json"
FAILURE_PREFIX = "failure-rank"


# ---- validation shared by the launcher and the ranks ---------------------------------------------------


def validate_options(
    *, world: Any, steps: Any, dtype: Any, device: Any, model: Any, optimizers: Any, timeout_s: Any
) -> None:
    """ConfigError (one line naming the field and value) for any bad option; deterministic."""
    from .model import require_model

    require_positive_int("world", world)
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ConfigError("device", device, f"must be one of {', '.join(DEVICES)}")
    require_model(model)
    build_phases(optimizers, steps)
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s < float("inf")
    ):
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")


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


# ---- the launcher ----------------------------------------------------------------------------------------


def verify(
    target: str,
    *,
    world: int = 4,
    steps: int | None = None,
    dtype: str = "float64",
    device: str = "cpu",
    model: str = "gpt",
    optimizers: Any = OPTIMIZERS,
    timeout_s: float | None = None,
    out: str | None = None,
    resume_at: int | None = None,
    resume_world: int | None = None,
) -> VerifyReport:
    """Train ``target`` on ``world`` ranks next to the unsharded reference and check C-ZERO-001..005.

    Raises ConfigError (bad option), TrainerError (the trainer breaks the protocol; exit 2) or
    RankFailure (a rank raised or hung; exit 3). ``timeout_s`` bounds every collective and every
    trainer call (default 120 s); ``out``: a directory that receives ``report.json``.

    ``resume_at=K``: each phase stops after its K-th step; every rank calls ``save_checkpoint``; those
    ranks end; ``resume_world`` ranks (default ``world``) start in a second launch, build a fresh
    trainer, call ``load_checkpoint`` and train the phase's remaining steps; C-ZERO-007 is checked
    besides the others (:mod:`zerosim.verify.resume`).
    """
    from zerogpu.launch import run_torchrun, torch_unavailable_reason

    from .targets import resolve_factory

    validate_options(
        world=world,
        steps=steps,
        dtype=dtype,
        device=device,
        model=model,
        optimizers=optimizers,
        timeout_s=timeout_s,
    )
    if resume_world is not None and resume_at is None:
        raise ConfigError("resume_world", resume_world, "needs --resume-at K (the phase step to resume at)")
    if resume_at is not None:
        resume_world = world if resume_world is None else resume_world
        validate_resume(resume_at, resume_world, optimizers, steps, device)
    reason = torch_unavailable_reason()
    if reason:
        raise ConfigError("backend", "torch", reason)
    require_startable(world, device)
    if out:
        require_output_dir(out)
    resolve_factory(target)
    collective_s = float(timeout_s or DEFAULT_TIMEOUT_S)
    names = optimizers if isinstance(optimizers, str) else ",".join(optimizers)
    with tempfile.TemporaryDirectory(prefix="zerosim-verify-") as tmp:
        run_dir = Path(out) if out else Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in [run_dir / REPORT_FILE, run_dir / ERROR_FILE, *run_dir.glob(FAILURE_PREFIX + "*")]:
            stale.unlink(missing_ok=True)
        argv = [
            "-m",
            "zerosim.verify",
            target,
            "--dtype",
            dtype,
            "--device",
            device,
            "--model",
            model,
            "--optimizers",
            names,
            "--timeout",
            repr(collective_s),
            "--out",
            str(run_dir),
            "--quiet",
        ]
        if steps is not None:
            argv += ["--steps", str(steps)]
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        launch_s = 4 * collective_s + 300.0
        if resume_at is None:
            result = run_torchrun(world, argv, launch_s, env={"PYTHONPATH": path}, capture=True)
            return _collect(result, run_dir, world, launch_s)
        assert resume_world is not None
        resume_dir = run_dir / "resume"
        shutil.rmtree(resume_dir, ignore_errors=True)
        resume_dir.mkdir(parents=True)
        common = ["--resume-at", str(resume_at), "--resume-dir", str(resume_dir)]
        env = {"PYTHONPATH": path}
        save_argv = argv + common + ["--resume-stage", "save"]
        first = run_torchrun(world, save_argv, launch_s, env=env, capture=True)
        if first.returncode != 0 or not (resume_dir / SNAPSHOT_FILE).exists():
            _collect(first, run_dir, world, launch_s)  # raises the first launch's error
            raise RankFailure(-1, f"the first launch ended with status {first.returncode} without saving")
        second = run_torchrun(
            resume_world,
            argv + common + ["--resume-stage", "load"],
            launch_s,
            env=env,
            capture=True,
        )
        report = _collect(second, run_dir, resume_world, launch_s)
        report.extra["wall_s"] = round(first.elapsed_s + second.elapsed_s, 2)
        return report


def _collect(result: Any, run_dir: Path, world: int, launch_s: float) -> VerifyReport:
    """The report of a finished launch, or the error it ended with."""
    code = result.returncode
    if code in (0, 1) and (run_dir / REPORT_FILE).exists():
        report = VerifyReport.from_json(json.loads((run_dir / REPORT_FILE).read_text()))
        report.extra["wall_s"] = round(result.elapsed_s, 2)
        return report
    if (run_dir / ERROR_FILE).exists():
        err = json.loads((run_dir / ERROR_FILE).read_text())
        if err.get("kind") == "config" and "field" in err:
            raise ConfigError(err["field"], err["value"], err["reason"])
        raise TrainerError(err["message"])
    failure = _blamed_failure(run_dir)
    if failure is not None:
        raise RankFailure(failure["rank"], failure["message"])
    stderr = (result.stderr or "").strip().splitlines()
    for line in stderr:
        if line.startswith("rank ") and " failed: " in line:
            rank = line.split()[1]
            raise RankFailure(int(rank) if rank.isdigit() else -1, line.split(" failed: ", 1)[1])
    if result.timed_out:
        raise RankFailure(-1, f"the run did not finish within {launch_s:g}s; killed every rank")
    tail = " | ".join(stderr[-3:]) if stderr else "no output"
    raise RankFailure(-1, f"the ranks ended with status {code} without a report ({tail})")


def _blamed_failure(run_dir: Path) -> dict[str, Any] | None:
    """The most telling failure record: a rank that raised itself beats ranks that saw a peer fail or hang."""
    records = []
    for p in sorted(run_dir.glob(FAILURE_PREFIX + "*.json")):
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    order = {"raised": 0, "hang": 1, "peer": 2}
    return min(records, key=lambda r: (order.get(r.get("kind"), 3), r.get("time", 0.0)))


# ---- every rank -------------------------------------------------------------------------------------------


def rank_main(args: Any) -> NoReturn:
    """One rank of ``zerosim verify``: ``args`` are the rank's options
    (:func:`zerosim.cli.rank_commands.verify_rank_parser`); bad input: one line, every rank exits 2."""
    from zerogpu.rank import fail_on_bad_input, run_rank

    try:
        world = int(os.environ.get("WORLD_SIZE", "0")) or None
        if world is None:
            raise ConfigError(
                "launcher",
                "no WORLD_SIZE",
                "run under torchrun (torchrun --nproc-per-node N "
                "-m zerosim.verify TARGET), or use zerosim verify",
            )
        validate_options(
            world=world,
            steps=args.steps,
            dtype=args.dtype,
            device=args.device,
            model=args.model,
            optimizers=args.optimizers,
            timeout_s=args.timeout,
        )
        if args.resume_stage is not None or args.resume_at is not None:
            if args.resume_stage is None or args.resume_dir is None:
                raise ConfigError(
                    "resume_at", args.resume_at, "use zerosim verify --resume-at K (it starts both launches)"
                )
            validate_resume(args.resume_at, None, args.optimizers, args.steps, args.device)
    except ZeroSimError as e:
        _write_error(args.out, e)
        fail_on_bad_input(e)
    run_rank(lambda: _rank_body(args))


def _rank_body(args: Any) -> int:
    import torch

    from zerogpu.comm import init_distributed
    from zerogpu.program import agree_on_exit, exact_float32_math

    from .session import RankSession

    torch.set_num_threads(1)
    device = "cpu" if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    exact_float32_math(device)
    comm = init_distributed("gloo" if device == "cpu" else "nccl", device, args.timeout)
    session = None
    try:
        session = RankSession(comm, args, device)
        code = session.run()
    except TrainerError as e:  # every rank raised the same agreed error (see RankSession.agree)
        if comm.rank == 0:
            _write_error(args.out, e)
            if not args.quiet:
                print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except BaseException as e:
        if session is not None:
            session.record_failure(e)
        raise
    return agree_on_exit(comm, code)


def _write_error(out: str | None, error: ZeroSimError) -> None:
    if not out or int(os.environ.get("RANK", "0")) != 0:
        return
    kind = "trainer" if isinstance(error, TrainerError) else "config"
    Path(out).mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"kind": kind, "message": str(error), "time": time.time()}
    if isinstance(error, ConfigError):
        plain = isinstance(error.value, (str, int, float, bool, type(None)))
        value = error.value if plain else repr(error.value)
        record.update(field=error.field, value=value, reason=error.reason)
    (Path(out) / ERROR_FILE).write_text(json.dumps(record))
