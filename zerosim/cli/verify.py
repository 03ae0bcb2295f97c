"""``zerosim verify TARGET``: train a live sharded trainer beside an unsharded reference; check the contracts.

TARGET is a built-in adapter (ddp, torch-zero, fsdp2, fsdp2-grad-op, fsdp2-hybrid, deepspeed-1|2|3) or
MODULE:FACTORY (``make_trainer(model, optim) -> Trainer``; the current directory and PYTHONPATH are
importable on every rank). Starts the ranks itself (torch.distributed: gloo on the CPU, NCCL with
``--device cuda``). Exit status: 0 every contract holds, 1 a contract failed, 2 bad input, 3 a rank
failed or hung. ``--all``: every installed adapter x {sgd, adamw} x world {2, 4}, plus resumes
2 -> 3 and 4 -> 2 (:mod:`zerosim.verify.matrix` says what it writes where). ``--resume-at K
--resume-world M``: save after step K of each phase, resume on M fresh ranks, check C-ZERO-007.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ZeroSimError

if TYPE_CHECKING:
    from ..verify.run_value import VerifyRun

EXIT_RANK_FAILED = 3


def add_run_arguments(p: Any) -> None:
    """The options of one verify run, declared once: ``zerosim verify`` and its ranks started by hand
    (``torchrun ... -m zerosim.verify``, :func:`zerosim.cli.rank_commands.verify_rank_parser`) both take
    them, and :func:`verify_run` turns them into the one :class:`~zerosim.verify.run_value.VerifyRun`
    (C-ZERO-001..005, 007 and 008 are judged on it). Values stay text here; :func:`verify_run`
    converts them, so a bad one is one line naming the field."""
    p.add_argument("target", nargs="?", default=None, help="built-in adapter name or MODULE:FACTORY")
    p.add_argument(
        "--allow-world-1", action="store_true",
        help="run on one rank anyway (refused otherwise: one rank cannot show a sharding bug)",
    )
    p.add_argument(
        "--mesh", default=None, metavar="RxS",
        help="R replicas of S shard ranks (R x S = world; rank r in shard group r // S, replica group "
        "r %% S), given to the trainer as optim['mesh'] = (R, S) and judged by the checks; default: "
        "the target's own",
    )
    p.add_argument(
        "--strict", action="store_true",
        help="findings fail the run (traffic or memory off the declared strategy's model while every "
        "value is right; without --strict such a run passes and lists them)",
    )
    p.add_argument(
        "--steps", default=None, help="optimizer steps over both phases (default 24: 12 SGD + 12 AdamW)"
    )
    p.add_argument("--dtype", default=None,
                   help="float64 / fp64 (default) or float32 / fp32; under --precision bf16|fp16 the master "
                   "dtype, float32")
    p.add_argument(
        "--precision", default=None, metavar="bf16|fp16|fp32|fp64",
        help="bf16 / bfloat16 or fp16 / float16: mixed precision, the trainer computes in that dtype with "
        "float32 master weights and optimizer state (optim['mixed_precision']; fp16 adds dynamic loss "
        "scaling); fp32 / float32 or fp64 / float64: everything in that dtype (as --dtype); default: "
        "everything in --dtype",
    )
    p.add_argument(
        "--reduce-dtype", default=None, metavar="float32|bfloat16|float16",
        help="under --precision bf16|fp16: the dtype gradients are reduced in (default float32; fp32, bf16 "
        "and fp16 also spell them); a reduction in another dtype fails C-ZERO-005",
    )
    p.add_argument("--device", default="cpu", help="cpu (gloo, default) or cuda (NCCL, one rank per GPU)")
    p.add_argument(
        "--model",
        default="gpt",
        help="gpt (default), gpt-tied, moe (top-2 of 7 routed experts), hf-gpt2 (transformers' GPT-2, random "
        "weights; the [hf] extra), or "
        "MODULE:FACTORY: factory(seed) -> (model, make_batch), make_batch(step, rank, world, micro) -> "
        "(inputs, targets), model(inputs, targets) -> scalar loss",
    )
    p.add_argument("--optimizers", default="sgd,adamw", help="phases to run (default sgd,adamw)")
    p.add_argument(
        "--grad-accum",
        default=None,
        metavar="K",
        help="micro-batches per optimizer step (default 1): verify calls trainer.step_accumulated with K "
        "(inputs, targets) pairs; the reference takes the mean gradient of all K x world micro-batches",
    )
    p.add_argument(
        "--timeout", default=None, help="seconds a collective or trainer call may take (default 120)"
    )
    p.add_argument(
        "--resume-at",
        default=None,
        metavar="K",
        help="stop each phase after its K-th step, save_checkpoint on every rank, start --resume-world "
        "fresh ranks that load_checkpoint and continue; checks C-ZERO-007",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", default=None, help="directory that receives report.json")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check a live sharded trainer (FSDP2, ZeroRedundancyOptimizer, DeepSpeed, "
        "yours) against C-ZERO-001..005 and 008 (007 with --resume-at)",
        description=__doc__.split("\n\n")[0],
    )
    add_run_arguments(p)
    p.add_argument(
        "--world", "--world-size", dest="world", default=None,
        help="ranks to start (default 4; under torchrun: the ranks it started)",
    )
    p.add_argument(
        "--resume-world", default=None, metavar="M", help="ranks of the resumed run (default: --world)"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every installed adapter x {sgd, adamw} x world {2, 4}, plus the resume, mesh, accumulation "
        "and bf16/fp16 columns: verify-matrix.md, .json and .png in --out DIR or a new "
        "reports/verify-matrix-<timestamp>/",
    )
    p.add_argument(
        "--resume-matrix",
        action="store_true",
        help="only the resume column of --all: every installed adapter saved at world 2 and 4, resumed "
        "at 3 and 2: verify-resume-matrix.md and .json in --out DIR or a new "
        "reports/verify-resume-matrix-<timestamp>/",
    )
    p.set_defaults(func=run)


def verify_run(args: Any, world: int | None) -> VerifyRun:
    """The :class:`~zerosim.verify.run_value.VerifyRun` the options of :func:`add_run_arguments` (and a
    rank's own: ``seed``, ``quiet``, ``resume_dir``, ``resume_stage``, ``save_observations``, when the
    parser has them) describe, precision resolved here and only here; not yet validated (the launcher
    and the ranks call ``validate``). ConfigError naming the first option that is not a value."""
    from ..verify.run_value import DEFAULT_TIMEOUT_S, VerifyRun

    precision, reduce_dtype, dtype = precision_options(args)
    timeout = _seconds(args.timeout)
    return VerifyRun(
        args.target, world=world, steps=_int("steps", args.steps), dtype=dtype, device=args.device,
        model=args.model, optimizers=args.optimizers, seed=_int("seed", getattr(args, "seed", 0)) or 0,
        timeout_s=DEFAULT_TIMEOUT_S if timeout is None else timeout, out=args.out,
        json_output=bool(args.json), quiet=bool(getattr(args, "quiet", False)),
        resume_at=_int("resume_at", args.resume_at), resume_dir=getattr(args, "resume_dir", None),
        resume_stage=getattr(args, "resume_stage", None),
        save_observations=getattr(args, "save_observations", None), allow_world_1=bool(args.allow_world_1),
        mesh=_mesh(args.mesh), strict=bool(args.strict), grad_accum=_grad_accum(args), precision=precision,
        reduce_dtype=reduce_dtype,
    )


def _int(field: str, text: Any) -> int | None:
    if text is None:
        return None
    try:
        return int(str(text))
    except ValueError:
        raise ConfigError(field, text, "must be an integer") from None


def _seconds(text: Any) -> float | None:
    if text is None:
        return None
    try:
        value = float(str(text))
    except ValueError:
        raise ConfigError("timeout", text, "must be a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ConfigError("timeout", text, "must be a positive number of seconds")
    return value


def run(args: Any) -> int:
    from ..verify.errors import RankFailure

    if args.all or args.resume_matrix:
        from ..verify import matrix

        try:
            args.dtype = dtype_option(args)  # fp32 / fp64 as float32 / float64, like a single run
            return int(matrix.run_cli(args, _seconds(args.timeout)))
        except ZeroSimError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if not args.target:
        print(
            "error: zerosim verify: give TARGET (a built-in adapter name or MODULE:FACTORY) or --all",
            file=sys.stderr,
        )
        return 2
    if under_launcher():
        _run_as_rank(args)
    try:
        report = _verify(args)
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        from ..verify.render import render_text

        print(render_text(report))
    return report.exit_code


def under_launcher() -> bool:
    """Started by torchrun (or another launcher that sets the torch.distributed environment)?"""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _run_as_rank(args: Any) -> None:
    """``torchrun ... zerosim verify TARGET``: this process is one rank (no second launch)."""
    from ..verify.runner import rank_main

    if args.resume_at is not None or args.resume_world is not None:
        raise ConfigError(
            "resume_at",
            args.resume_at,
            "resuming needs two launches; run zerosim verify --resume-at K without torchrun",
        )
    rank_main(verify_run(args, _int("world", args.world)))


def _verify(args: Any) -> Any:
    """Start the ranks of the run the options describe (two launches with ``--resume-at``), collect."""
    from ..verify.runner import launch_verify

    world = _int("world", args.world)
    run = verify_run(args, 4 if world is None else world)
    return launch_verify(run.replace(resume_at=None), out=args.out, resume_at=run.resume_at,
                         resume_world=_int("resume_world", args.resume_world))


def _mesh(text: Any) -> tuple[int, int] | None:
    from ..verify.run_value import parse_mesh

    return None if text is None else parse_mesh(text)


def precision_options(args: Any) -> tuple[str, str, str]:
    """(precision, reduce_dtype, dtype) from ``--precision``, ``--reduce-dtype`` and ``--dtype``
    (:func:`zerosim.verify.mixed_precision.resolve_precision`, the one resolution)."""
    from ..verify.mixed_precision import resolve_precision

    return resolve_precision(getattr(args, "precision", None), getattr(args, "reduce_dtype", None),
                             dtype_option(args))


def dtype_option(args: Any) -> str | None:
    """``--dtype`` in either spelling (float32 or fp32, float64 or fp64), canonical; None when not given."""
    from ..values.dtypes import canonical_dtype
    from ..verify.run_value import DTYPES

    text = getattr(args, "dtype", None)
    return None if text is None else canonical_dtype(text, "dtype", allowed=DTYPES)


def _grad_accum(args: Any) -> int:
    value = _int("grad_accum", getattr(args, "grad_accum", None))
    return 1 if value is None else value
