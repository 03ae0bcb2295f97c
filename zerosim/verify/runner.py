"""Running ``zerosim verify``: the launcher (:func:`verify`) and what every rank runs (:func:`rank_main`).

Launcher: validates the options, resolves TARGET (bad input fails here, before any process starts),
then starts N ranks of ``python -m zerosim.verify TARGET ...`` as ``torchrun --standalone`` would
(:func:`zerogpu.launch.run_ranks`: a wall-clock timeout, never a process left behind) with the
current directory on every rank's ``PYTHONPATH``. Rank 0 writes ``report.json`` (or ``error.json``)
into the run directory; each failing rank writes ``failure-rank<R>.json`` naming the rank to blame.
Each rank's own output goes to ``rank<R>.log`` in ``--out``'s ``logs/`` (a temporary folder without
``--out``, kept when a rank failed), never through the launcher (:mod:`zerosim.processes.rank_logs`); the
failure line (:mod:`zerosim.verify.blame`) names the folder.

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

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from zerosim.errors import ConfigError, ZeroSimError
from zerosim.files.outputs import publish_files, require_output_dir, write_text

from .blame import blame_rank
from .errors import RankFailure, TrainerError
from .mixed_precision import DEFAULT_REDUCE_DTYPE, FULL, resolve_precision
from .outcome import VerifyReport
from .run_value import (
    DEFAULT_TIMEOUT_S,
    DEVICES,
    DTYPES,
    VerifyRun,
    read_verify_run,
    require_startable,
    validate_options,
    validate_resume,
    write_verify_run,
)
from .suite import OPTIMIZERS

__all__ = ["DEFAULT_TIMEOUT_S", "DEVICES", "DTYPES", "OPTIMIZERS", "VerifyRun", "launch_verify", "rank_main",
           "read_verify_run", "require_startable", "validate_options", "validate_resume", "verify"]

REPORT_FILE = "report.json"
ERROR_FILE = "error.json"
FAILURE_PREFIX = "failure-rank"
RUN_FILE = "run.json"  # the VerifyRun every rank of a launch loads (in the private folder)
LOG_FOLDER = "logs"  # under --out: each rank's own output, rank<R>.log (resume: save/ and load/)


# ---- the launcher ----------------------------------------------------------------------------------------


def verify(
    target: str,
    *,
    world: int = 4,
    steps: int | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    model: str = "gpt",
    optimizers: Any = OPTIMIZERS,
    timeout_s: float | None = None,
    out: str | None = None,
    resume_at: int | None = None,
    resume_world: int | None = None,
    allow_world_1: bool = False,
    mesh: tuple[int, int] | None = None,
    strict: bool = False,
    grad_accum: int = 1,
    precision: str = FULL,
    reduce_dtype: str | None = None,
) -> VerifyReport:
    """Train ``target`` on ``world`` ranks next to the unsharded reference and check C-ZERO-001..005.

    Raises ConfigError (bad option), TrainerError (the trainer breaks the protocol; exit 2) or
    RankFailure (a rank raised or hung; exit 3). ``timeout_s`` bounds every collective and every
    trainer call (default 120 s); ``out``: a directory that receives ``report.json``.

    With ``resume_at`` (checks C-ZERO-007 too): ``world`` ranks train each phase up to its
    ``resume_at``-th step, call ``save_checkpoint`` into a temporary directory of this run, and the
    ranks end; ``resume_world`` ranks (default ``world``) start in a second launch, build a fresh
    trainer, call ``load_checkpoint`` and train the phase's remaining steps; C-ZERO-007 is checked
    besides the others (:mod:`zerosim.verify.resume`).

    ``world`` 1 is refused unless ``allow_world_1`` (one rank cannot show a sharding bug). ``mesh`` =
    (R, S): the trainer gets ``optim["mesh"]`` and the checks judge R replicas of S shard ranks (rank r
    in shard group r // S, replica group r % S). ``strict``: findings (traffic or memory off the
    declared strategy's model while every value is right) fail the run.
    ``grad_accum`` K > 1: every optimizer step is ``trainer.step_accumulated`` on K micro-batches per
    rank, judged against the mean gradient of all K x world micro-batches.
    ``precision`` "bf16" / "fp16": the trainer gets ``optim["mixed_precision"]`` (compute dtype,
    ``reduce_dtype``, fp16's loss scale; :mod:`zerosim.verify.mixed_precision`) and a float32 model;
    ``dtype`` then defaults to float32, the master dtype.
    """
    # float32 is every run's default reduce dtype; another one needs a mixed-precision policy
    precision, reduce_dtype, dtype = resolve_precision(
        precision, None if reduce_dtype == DEFAULT_REDUCE_DTYPE else reduce_dtype, dtype)
    validate_options(world=world, steps=steps, dtype=dtype, device=device, model=model,
                     optimizers=optimizers, timeout_s=timeout_s, grad_accum=grad_accum)
    names = optimizers if isinstance(optimizers, str) else ",".join(optimizers)
    run = VerifyRun(target, world=world, steps=steps, dtype=dtype, device=device, model=model,
                    optimizers=names, timeout_s=float(timeout_s or DEFAULT_TIMEOUT_S),
                    allow_world_1=allow_world_1, mesh=mesh, strict=strict, grad_accum=grad_accum,
                    precision=precision, reduce_dtype=reduce_dtype)
    return launch_verify(run, out=out, resume_at=resume_at, resume_world=resume_world)


def launch_verify(run: VerifyRun, *, out: str | None = None, resume_at: int | None = None,
                  resume_world: int | None = None) -> VerifyReport:
    """:func:`verify` for a run already built as one value: validate it, start its ranks, collect."""
    from zerogpu.launch import torch_missing_reason

    from .targets import target_parts

    world = run.world if run.world is not None else 4
    run = run.replace(world=world).validate()
    if resume_world is not None and resume_at is None:
        raise ConfigError("resume_world", resume_world, "needs --resume-at K (the phase step to resume at)")
    if resume_at is not None and run.mesh is not None:
        raise ConfigError("mesh", f"{run.mesh[0]}x{run.mesh[1]}",
                          "cannot be combined with --resume-at (the resumed world has its own shape)")
    if resume_at is not None:
        resume_world = world if resume_world is None else resume_world
        validate_resume(resume_at, resume_world, run.optimizers, run.steps, run.device)
    reason = torch_missing_reason()  # whether torch.distributed works: checked before the ranks start
    if reason:
        raise ConfigError("backend", "torch", reason)
    require_startable(world, run.device)
    if out:
        require_output_dir(out)
    # TARGET's form and a built-in adapter's requirements are checked here, without importing torch; a
    # user's MODULE:FACTORY (and model factory) is imported by the ranks, which agree on its errors
    # before any of them trains (RankSession), so bad input there ends the run the same way: one line,
    # exit 2. The launcher then imports no torch, whatever the target.
    target_parts(run.target)
    # each rank's own output goes to a log file: under --out (kept), or in a folder of this run that is
    # kept only when a rank failure names it
    own_logs = None if out else tempfile.mkdtemp(prefix="zerosim-verify-logs-")
    log_dir = Path(out) / LOG_FOLDER if out else Path(str(own_logs))
    try:
        report = _launch(run.replace(world=world), out, log_dir, resume_at, resume_world)
    except RankFailure:
        raise  # its message names the rank logs: they stay
    except BaseException:
        if own_logs:
            shutil.rmtree(own_logs, ignore_errors=True)
        raise
    if own_logs:
        shutil.rmtree(own_logs, ignore_errors=True)
    return report


def _launch(run: VerifyRun, out: str | None, log_dir: Path, resume_at: int | None,
            resume_world: int | None) -> VerifyReport:
    """The launch (two with ``resume_at``) of :func:`launch_verify`, the run already validated.

    The ranks write into a private folder of this run (mkdtemp: mode 0700), never into --out: what
    they leave there (report, error, failure records) is copied into --out when the run ends, and
    nothing already in --out is read, replaced by anything but these names, or deleted."""
    with tempfile.TemporaryDirectory(prefix="zerosim-verify-") as private:
        run_dir = Path(private) / "run"
        run_dir.mkdir()
        ranks_run = run.replace(out=str(run_dir), quiet=True, json_output=False)
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        launch = _Launch(ranks_run, Path(private), {"PYTHONPATH": path}, 4 * run.timeout_s + 300.0, log_dir)
        try:
            if resume_at is None:
                report = launch.once()
            else:
                assert resume_world is not None
                report = launch.resumed(resume_world, resume_at, Path(private) / "resume")
        except BaseException:
            if out:
                with contextlib.suppress(OSError, ZeroSimError):  # the run's own error is the one to report
                    publish_files(run_dir, Path(out))
            raise
        if out:
            publish_files(run_dir, Path(out))
        return report


class _Launch:
    """The launches of one ``verify`` call: each ships its :class:`VerifyRun` to the ranks as one file
    in the run's private folder; every rank writes into ``run.out`` and its own output into ``log_dir``."""

    def __init__(self, run: VerifyRun, private: Path, env: dict[str, str], launch_s: float, log_dir: Path):
        assert run.out is not None and run.world is not None
        self.run, self.private, self.env, self.launch_s, self.log_dir = run, private, env, launch_s, log_dir
        self.run_dir = Path(run.out)

    def _start(self, run: VerifyRun, name: str, log_dir: Path) -> Any:
        from zerogpu.launch import run_ranks

        assert run.world is not None
        run_file = write_verify_run(run, self.private / name)
        return run_ranks(run.world, ["-m", "zerosim.verify", "--run-file", str(run_file)], self.launch_s,
                         env=self.env, capture=True, rank_log_dir=log_dir)

    def once(self) -> VerifyReport:
        result = self._start(self.run, RUN_FILE, self.log_dir)
        return _collect(result, self.run_dir, self.run.world or 0, self.launch_s, self.log_dir)

    def resumed(self, resume_world: int, at: int, resume_dir: Path) -> VerifyReport:
        """``run.world`` ranks train and save into ``resume_dir`` (inside this run's private folder), then
        ``resume_world`` fresh ranks load from it, continue and report."""
        resume_dir.mkdir(mode=0o700)
        resumed = self.run.replace(resume_at=at, resume_dir=str(resume_dir))
        save_logs, load_logs = self.log_dir / "save", self.log_dir / "load"
        world = self.run.world or 0
        first = self._start(resumed.replace(resume_stage="save"), "run-save.json", save_logs)
        from .resume import SNAPSHOT_FILE

        if first.returncode != 0 or not (resume_dir / SNAPSHOT_FILE).exists():
            _collect(first, self.run_dir, world, self.launch_s, save_logs)  # raises the first launch's error
            raise RankFailure(-1, f"the first launch ended with status {first.returncode} without saving "
                                  f"(rank output: {save_logs})")
        second = self._start(resumed.replace(resume_stage="load", world=resume_world), "run-load.json",
                             load_logs)
        report = _collect(second, self.run_dir, resume_world, self.launch_s, load_logs)
        report.extra["wall_s"] = round(first.elapsed_s + second.elapsed_s, 2)
        return report


def _collect(result: Any, run_dir: Path, world: int, launch_s: float, log_dir: Path) -> VerifyReport:
    """The report of a finished launch, or the error it ended with (a RankFailure names the rank's log
    and, when no rank said why, ends with the last lines of it)."""
    code = result.returncode
    if code in (0, 1, 2) and (run_dir / REPORT_FILE).exists():  # 2 with a report: verdict "unsupported"
        report = VerifyReport.from_json(json.loads((run_dir / REPORT_FILE).read_text()))
        report.extra["wall_s"] = round(result.elapsed_s, 2)
        return report
    if (run_dir / ERROR_FILE).exists():
        err = json.loads((run_dir / ERROR_FILE).read_text())
        if err.get("kind") == "config" and "field" in err:
            raise ConfigError(err["field"], err["value"], err["reason"])
        raise TrainerError(err["message"])
    blame = blame_rank(result, world, log_dir, _failure_records(run_dir), launch_s)
    raise RankFailure(blame.rank, blame.message)


def _failure_records(run_dir: Path) -> list[dict[str, Any]]:
    records = []
    for p in sorted(run_dir.glob(FAILURE_PREFIX + "*.json")):
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return records


# ---- every rank -------------------------------------------------------------------------------------------


def rank_main(run: VerifyRun) -> NoReturn:
    """One rank of ``zerosim verify`` running ``run`` (loaded from the launcher's run file, or built
    from this rank's own command line under an external launcher); bad input: one line, every rank
    exits 2."""
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
        if run.world is not None and run.world != world:
            raise ConfigError("world", run.world, f"the launcher started {world} rank(s); drop --world or "
                                                  "start that many")
        run.replace(world=world).validate()
    except ZeroSimError as e:
        _write_error(run.out, e)
        fail_on_bad_input(e)
    run_rank(lambda: _rank_body(run))


def _rank_body(run: VerifyRun) -> int:
    import torch

    from zerogpu.comm import init_distributed
    from zerogpu.program import agree_on_exit, exact_float32_math

    from .session import RankSession

    torch.set_num_threads(1)
    device = "cpu" if run.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    exact_float32_math(device)
    comm = init_distributed("gloo" if device == "cpu" else "nccl", device, run.timeout_s)
    session = None
    try:
        session = RankSession(comm, run, device)
        code = session.run()
    except TrainerError as e:  # every rank raised the same agreed error (see RankSession.agree)
        if comm.rank == 0:
            _write_error(run.out, e)
            if not run.quiet:
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
    record: dict[str, Any] = {"kind": kind, "message": str(error), "time": time.time()}
    if isinstance(error, ConfigError):
        plain = isinstance(error.value, (str, int, float, bool, type(None)))
        value = error.value if plain else repr(error.value)
        record.update(field=error.field, value=value, reason=error.reason)
    with contextlib.suppress(OSError, ZeroSimError):  # the one line on stderr says it all the same
        Path(out).mkdir(parents=True, exist_ok=True)
        write_text(Path(out) / ERROR_FILE, json.dumps(record))
