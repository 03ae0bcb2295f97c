"""``zerosim simulate``: train with the reference ZeRO engine on N simulated ranks, check C-ZERO-001..005.

With no arguments it runs a meaningful default in a second or two: the ``tiny`` model, 4 ranks,
FULL_SHARD (ZeRO-3), the ``fsdp`` partitioner, AdamW with clipping at 1.0, 3 steps. A rich progress
bar, then a table of contract verdicts (and the first violations, if any). Exit status: 0 every
contract holds, 1 a contract failed, 2 bad input (one line, before anything runs), 3 the run itself
failed (a non-finite gradient, a rank error, a collective timeout) or diverged (the unsharded
reference itself went non-finite: no contract can be judged after that step). A plan that breaks
C-ZERO-001 is never trained (exit 1).

The run options (:mod:`zerosim.cli.run_options`) and the printed result (:mod:`zerosim.engine.run_output`)
are shared with ``mpiexec -n N python -m zerosim.mpi simulate`` (``--backend mpi`` launches that) and
``torchrun --nproc-per-node N -m zerogpu simulate`` (``--backend torch`` launches that). The options
are parsed here once: a launched run travels to its ranks as one run file
(:mod:`zerosim.engine.run_file`), and ``--write-config FILE`` writes that file for ranks a user starts
(across nodes: ``mpiexec -f hosts ... simulate --config FILE``, ``torchrun --nnodes ... --config FILE``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from ..engine.run_file import RankRun, write_rank_run
from ..engine.run_output import render
from ..errors import EXIT_RUN_FAILED, CollectiveError, ConfigError, NonFiniteGradientError, install_hint
from .run_options import add_run_arguments, config_from_args


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="train on N simulated ranks with the reference ZeRO engine and check C-ZERO-001..005",
        description="Train the simulator model with the reference ZeRO engine on N ranks (in this process, "
        "or under mpiexec with --backend mpi) and check the plan (C-ZERO-001), then the step contracts "
        "C-ZERO-002..005 against ground truth, the plan and the ring communication model. "
        "--optimizer muon|adafactor (not elementwise) steps each tensor whole on one owner rank.",
    )
    add_run_arguments(p)
    p.add_argument("--write-config", default=None, metavar="FILE",
                   help="with --backend mpi|torch: validate the run, write it to FILE (JSON) and exit, "
                        "for ranks started by hand (python -m zerosim.mpi simulate --config FILE, "
                        "torchrun ... -m zerogpu simulate --config FILE)")
    p.add_argument("--save-checkpoint", default=None, metavar="DIR",
                   help="after the last step the ranks save their state (master weights, optimizer state, "
                        "step) to DIR as a sharded checkpoint, for zerosim checkpoint inspect|reshard; DIR "
                        "must be new or empty (simulated ranks only)")
    p.set_defaults(func=run)


#: ``--backend`` -> (the module whose ``launch_simulate(args)`` starts that launcher, the pip extra it needs)
LAUNCHERS = {"mpi": ("zerosim.mpi.launch", "mpi"), "torch": ("zerogpu.launch", "torch")}


def run(args: argparse.Namespace) -> int:
    backend = getattr(args, "backend", "sim")
    save_to = getattr(args, "save_checkpoint", None)
    if save_to is not None:
        require_new_checkpoint_dir(save_to, backend)
    if backend in LAUNCHERS:
        module_name, extra = LAUNCHERS[backend]
        try:
            launcher = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError("backend", backend, f"the {backend} backend is not available here ({e}); "
                              f"{install_hint(extra)}") from None
        job = rank_run(args)
        resolved = job.run.validate()  # bad input fails here, before the launcher starts
        if args.write_config is not None:
            return _write_config(job, args.write_config)
        from ..engine.run_result import plan_refused_result, plan_verdict

        plan = plan_verdict(resolved)
        if not plan.passed:  # a plan with gaps or overlaps is never launched
            return render(plan_refused_result(resolved, plan), args.json)
        return int(launcher.launch_simulate(job))
    if getattr(args, "write_config", None) is not None:
        raise ConfigError("write_config", args.write_config,
                          "a run file is for ranks started apart from this process: add --backend mpi|torch")
    from ..engine.spmd import run_simulated

    cfg = config_from_args(args)
    run_: Any = cfg.validate()  # a ResolvedRun: run_simulated takes it as it is
    try:
        if args.json or not sys.stderr.isatty():
            result = run_simulated(run_, save_to=save_to)
        else:
            result = _run_with_progress(run_, save_to)
    except (NonFiniteGradientError, CollectiveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    code = render(result, args.json)
    if save_to is not None:
        where = sys.stderr if args.json else sys.stdout  # --json: stdout holds the one JSON document
        print(f"checkpoint after step {run_.steps} saved in {save_to} ({run_.world_size} ranks); read it "
              f"with zerosim checkpoint inspect {save_to}", file=where)
    return code


def require_new_checkpoint_dir(path: str, backend: str) -> None:
    """ConfigError unless ``--save-checkpoint`` names a directory that does not exist yet or is empty (a
    checkpoint never lands among other files), on the simulated ranks (the backend this process runs)."""
    if backend != "sim":
        raise ConfigError("save_checkpoint", path, f"is saved by simulated ranks; --backend {backend} "
                          "launches ranks that do not save (drop --backend or --save-checkpoint)")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError("save_checkpoint", path, "exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        raise ConfigError("save_checkpoint", path, "exists and is not empty: give a new or empty directory")


def rank_run(args: argparse.Namespace) -> RankRun:
    """The value a launched run ships to its ranks: the run the options describe, how rank 0 reports it,
    the backend's default settings (the torch ranks compute with torch arrays, as ``zerogpu simulate``)."""
    cfg = config_from_args(args)
    if args.backend == "torch":
        cfg = cfg.replace(xp="torch")
    return RankRun(cfg, args.backend, bool(args.json))


def _write_config(job: RankRun, path: str) -> int:
    """``--write-config FILE``: the run file for ranks a user starts; the command to start them."""
    try:
        write_rank_run(job, path)
    except OSError as e:
        raise ConfigError("write_config", path, e.strerror or "cannot be written") from None
    start = (f"mpiexec -n {job.run.world_size} {sys.executable} -m zerosim.mpi" if job.backend == "mpi"
             else f"torchrun --nproc-per-node {job.run.world_size} -m zerogpu")
    print(f"wrote {path}; start the ranks with: {start} simulate --config {path}")
    return 0


def _run_with_progress(run_: Any, save_to: str | None = None) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..engine.spmd import run_simulated

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        train = progress.add_task(f"training on {run_.world_size} simulated ranks", total=run_.steps)
        check = progress.add_task("checking contracts", total=4, visible=False)

        def on_progress(phase: str, done: int, total: int) -> None:
            if phase == "train":
                progress.update(train, completed=done)
            else:
                progress.update(check, completed=done, visible=True,
                                description=f"checking {phase}" if phase != "done" else "checked")

        return run_simulated(run_, progress=on_progress, save_to=save_to)
