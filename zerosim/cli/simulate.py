"""``zerosim simulate``: train with the reference ZeRO engine on N simulated ranks, check C-ZERO-001..005.

With no arguments it runs a meaningful default in a second or two: the ``tiny`` model, 4 ranks,
FULL_SHARD (ZeRO-3), the ``fsdp`` partitioner, AdamW with clipping at 1.0, 3 steps. A rich progress
bar, then a table of contract verdicts (and the first violations, if any). Exit status: 0 every
contract holds, 1 a contract failed, 2 bad input (one line, before anything runs), 3 the run itself
failed (a non-finite gradient, a rank error, a collective timeout) or diverged (the unsharded
reference itself went non-finite: no contract can be judged after that step). A plan that breaks
C-ZERO-001 is never trained (exit 1).

The run options (:mod:`zerosim.engine.run_args`) and the printed result (:mod:`zerosim.engine.run_output`)
are shared with ``mpiexec -n N python -m zerosim.mpi simulate`` (``--backend mpi`` launches that) and
``torchrun --nproc-per-node N -m zerogpu simulate`` (``--backend torch`` launches that).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from ..engine.run_args import add_run_arguments, config_from_args
from ..engine.run_output import render
from ..errors import EXIT_RUN_FAILED, CollectiveError, ConfigError, NonFiniteGradientError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="train on N simulated ranks with the reference ZeRO engine and check C-ZERO-002..005",
        description="Train the simulator model with the reference ZeRO engine on N ranks (in this process, "
        "or under mpiexec with --backend mpi) and check the step contracts C-ZERO-002..005 "
        "against ground truth, the plan and the ring communication model.",
    )
    add_run_arguments(p)
    p.set_defaults(func=run)


#: ``--backend`` -> (the module whose ``launch_simulate(args)`` starts that launcher, the pip extra it needs)
LAUNCHERS = {"mpi": ("zerosim.mpi.launch", "mpi"), "torch": ("zerogpu.launch", "torch")}


def run(args: argparse.Namespace) -> int:
    backend = getattr(args, "backend", "sim")
    if backend in LAUNCHERS:
        module_name, extra = LAUNCHERS[backend]
        try:
            launcher = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError("backend", backend, f"the {backend} backend is not available here ({e}); "
                              f"pip install 'zerosim[{extra}]'") from None
        resolved = config_from_args(args).validate()  # bad input fails here, before the launcher starts
        from ..engine.run_result import plan_refused_result, plan_verdict

        plan = plan_verdict(resolved)
        if not plan.passed:  # a plan with gaps or overlaps is never launched
            return render(plan_refused_result(resolved, plan), args.json)
        return int(launcher.launch_simulate(args))
    from ..engine.spmd import run_simulated

    cfg = config_from_args(args)
    run_ = cfg.validate()
    try:
        if args.json or not sys.stderr.isatty():
            result = run_simulated(run_)
        else:
            result = _run_with_progress(run_)
    except (NonFiniteGradientError, CollectiveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return render(result, args.json)


def _run_with_progress(run_: Any) -> Any:
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

        return run_simulated(run_, progress=on_progress)
