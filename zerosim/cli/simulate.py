"""``zerosim simulate``: train with the reference ZeRO engine on N simulated ranks, check C-ZERO-002..005.

With no arguments it runs a meaningful default in a second or two: the ``tiny`` model, 4 ranks,
FULL_SHARD (ZeRO-3), the ``fsdp`` partitioner, AdamW with clipping at 1.0, 3 steps. A rich progress
bar, then a table of contract verdicts (and the first violations, if any). Exit status: 0 every
contract holds, 1 a contract failed, 2 bad input (one line, before anything runs), 3 the run itself
failed (a non-finite gradient, a rank error, a collective timeout).

``add_run_arguments``, ``config_from_args`` and ``render`` are shared with
``mpiexec -n N python -m zerosim.mpi simulate`` (``--backend mpi`` launches that) and
``torchrun --nproc-per-node N -m zerogpu simulate`` (``--backend torch`` launches that).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from ..engine.faults import FAULTS
from ..errors import CollectiveError, ConfigError, NonFiniteGradientError
from ..presets import PRESETS

STRATEGY_HELP = ("no_shard|ddp|zero1|zero2|zero3|full_shard|shard_grad_op|hybrid_shard[:K]|"
                 "hybrid_shard_zero2[:K] (default full_shard)")
EXIT_RUN_FAILED = 3


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate", help="train on N simulated ranks with the reference ZeRO engine and check C-ZERO-002..005",
        description="Train the simulator model with the reference ZeRO engine on N ranks (in this process, "
                    "or under mpiexec with --backend mpi) and check the step contracts C-ZERO-002..005 "
                    "against ground truth, the plan and the ring communication model.")
    add_run_arguments(p)
    p.set_defaults(func=run)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by ``zerosim simulate`` and ``python -m zerosim.mpi simulate``."""
    g = p.add_argument_group("run")
    g.add_argument("--model", default="tiny", metavar="PRESET", help=f"model preset (default tiny): {', '.join(PRESETS)}")
    g.add_argument("--world-size", type=int, default=4, metavar="N", help="number of ranks (default 4)")
    g.add_argument("--strategy", default="full_shard", metavar="S", help=STRATEGY_HELP)
    g.add_argument("--partitioner", default="fsdp", metavar="P",
                   help="how shards are cut (default fsdp): fsdp, deepspeed, deepspeed-zero3, seed, "
                        "zero-redundancy, round-robin, contiguous")
    g.add_argument("--optimizer", default="adamw", metavar="O", help="sgd (momentum 0.9) | adam | adamw (default)")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3)")
    g.add_argument("--max-grad-norm", default="1.0", metavar="X",
                   help="global-norm clipping threshold, or 'none' (default 1.0)")
    g.add_argument("--steps", type=int, default=3, metavar="K", help="optimizer steps (default 3)")
    g.add_argument("--micro-batches", type=int, default=1, metavar="M", help="gradient accumulation steps (default 1)")
    g.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="default fp32")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="ranks per node (topology; the hybrid shard group size by default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch per rank (default 2)")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    g.add_argument("--prefetch", type=int, default=0, help="ZeRO-3: blocks gathered ahead of use (default 0)")
    g.add_argument("--offload", action="store_true", help="ZeRO-3: keep master + optimizer state on the host")
    g.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="collective timeout: a rank that never arrives fails the run (default 60)")
    g.add_argument("--schedule", default="serial", choices=("serial", "parallel"),
                   help="simulator: one rank at a time (default) or all threads at once")
    g.add_argument("--observe", default="auto", choices=("auto", "full", "digest"),
                   help="keep shard values for C-ZERO-002 (full), digests only, or full when small (auto)")
    g.add_argument("--fault", default=None, metavar="NAME",
                   help="run a deliberately broken engine variant (shows what the contracts catch): "
                        + ", ".join(sorted(FAULTS)))
    g.add_argument("--inject-nan", default=None, metavar="RANK:STEP:TENSOR",
                   help="test hook: a NaN in TENSOR's gradient on RANK at STEP (e.g. 1:0:blocks.0.mlp.w_in)")
    g.add_argument("--zero1-reduce", default="all_reduce", metavar="{all_reduce,reduce_scatter}",
                   help="ZeRO-1 gradient averaging: all_reduce of the full gradient (torch ZeroRedundancyOptimizer, "
                        "default) or reduce_scatter into the rank's shard (DeepSpeed stage 1, the paper's "
                        "2(N-1)/N Psi); other strategies ignore it")
    g.add_argument("--backend", default="sim", choices=("sim", "mpi", "torch"),
                   help="sim: N threads in this process (default); mpi: mpiexec -n N processes; "
                        "torch: torchrun --nproc-per-node N processes (gloo on CPU, NCCL on GPU)")
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def _parse_max_norm(text: Any) -> float | None:
    if text is None or str(text).strip().lower() in ("none", "off", "0"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise ConfigError("max_grad_norm", text, "must be a positive number or 'none'") from None
    if not v > 0:
        raise ConfigError("max_grad_norm", text, "must be a positive number or 'none'")
    return v


def _parse_injection(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    parts = str(text).split(":", 2)
    if len(parts) != 3:
        raise ConfigError("inject_nan", text, "expected RANK:STEP:TENSOR, e.g. 1:0:blocks.0.mlp.w_in")
    try:
        return {"rank": int(parts[0]), "step": int(parts[1]), "tensor": parts[2]}
    except ValueError:
        raise ConfigError("inject_nan", text, "RANK and STEP must be integers") from None


def config_from_args(args: argparse.Namespace) -> Any:
    """The RunConfig the options describe (validate() it before running)."""
    from ..engine.spmd import RunConfig

    return RunConfig(
        model=args.model, world_size=args.world_size, strategy=args.strategy, partitioner=args.partitioner,
        optimizer=args.optimizer, precision=args.precision, steps=args.steps, micro_batches=args.micro_batches,
        seed=args.seed, ranks_per_node=args.ranks_per_node, lr=args.lr,
        max_grad_norm=_parse_max_norm(args.max_grad_norm), batch_size=args.batch_size, seq_len=args.seq_len,
        offload=bool(args.offload), prefetch=args.prefetch, timeout_s=args.timeout, schedule=args.schedule,
        observe=args.observe, inject_nan=_parse_injection(args.inject_nan), fault=args.fault,
        zero1_grad_reduce=getattr(args, "zero1_reduce", "all_reduce"),
    )


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
        config_from_args(args).validate()  # bad input fails here, before the launcher starts
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


# ---- rendering ----------------------------------------------------------------------------------------

def _titles() -> dict[str, str]:
    try:
        from ..contracts import load_contracts

        return {k: v.title for k, v in load_contracts().items()}
    except Exception:  # noqa: BLE001 - titles are decoration; a missing contracts/ dir must not break a run
        return {}


def _summary(contract: str, v: Any) -> str:
    d = v.details
    if d.get("skipped"):
        return str(d["skipped"])
    if contract == "C-ZERO-002":
        gt = d.get("ground_truth", {})
        errs = gt.get("max_abs_error", {})
        worst = max(errs.values(), default=0.0)
        tol = gt.get("tolerance") or {}
        bit = "bitwise equal to the same-order reference; " if d.get("bitwise_required") else ""
        return f"{bit}max |err| vs ground truth {worst:.2g} (tolerance {tol.get('atol_scale', '?')} x scale)"
    if contract == "C-ZERO-003":
        return f"{d.get('ranks', '?')} ranks x {d.get('steps', '?')} steps bitwise identical to each other and to the master"
    if contract == "C-ZERO-004":
        peaks = d.get("peaks", {})
        mx = max((max(p) for p in peaks.values() if p), default=0)
        return f"holdings == plan; peak live params {mx / 1e6:.3g} MB"
    if contract == "C-ZERO-005":
        return (f"{d.get('model_bytes_sent_per_rank', 0) / 1e6:.4g} MB sent per rank per step "
                f"(paper: {d.get('paper_elements_per_rank', 0):,.0f} elements, padding {d.get('padding_elements', 0)})")
    return ""


def render(result: Any, as_json: bool) -> int:
    """Print the verdicts (table or JSON); return the exit status (0 pass, 1 a contract failed)."""
    code = 0 if result.passed else 1
    if as_json:
        try:
            json.dump(result.to_json(), sys.stdout, indent=2)
            print()
        except BrokenPipeError:  # `zerosim simulate --json | head`: the reader left; keep the exit status
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - interpreter shutdown flushes stdout again
        return code
    from rich.console import Console
    from rich.table import Table

    from .tables import print_table

    console = Console()
    c = result.config
    console.print(f"[bold]zerosim simulate[/]: {c['strategy']} on {c['world_size']} ranks "
                  f"(shard group {c['shard_group_size']}, {c['replicas']} replica(s)), model {c['model'].get('vocab_size')}"
                  f"x{c['model'].get('d_model')} x {c['model'].get('n_layer')} layers = {c['num_params']:,} params, "
                  f"partitioner {c['partitioner']}, {c['optimizer']['name']}, {c['precision']}, "
                  f"{c['steps']} step(s) x {c['micro_batches']} micro-batch(es)")
    steps = Table(title="steps")
    for col in ("step", "loss", "ground truth loss", "grad norm", "clip", "MB sent / rank", "wall (s)"):
        steps.add_column(col, justify="right")
    for m in result.steps:
        steps.add_row(str(m["step"]), f"{m['loss']:.6f}", f"{m.get('reference_loss', float('nan')):.6f}",
                      f"{m['grad_norm']:.4g}", f"{m['clip_coef']:.4g}", f"{m['bytes_sent_rank0'] / 1e6:.4g}",
                      f"{m['wall_s']:.3f}")
    print_table(steps, console)
    titles = _titles()
    table = Table(title="contracts")
    for col in ("contract", "title", "verdict", "checked", "summary"):
        table.add_column(col)
    for cid, v in result.verdicts.items():
        skipped = bool(v.details.get("skipped"))
        verdict = "[yellow]SKIP[/]" if skipped else ("[green]PASS[/]" if v.passed else "[red]FAIL[/]")
        summary = _summary(cid, v) if v.passed else f"{len(v.violations)} violation(s)"
        table.add_row(cid, titles.get(cid, ""), verdict, str(v.checked), summary)
    print_table(table, console)
    shown = 0
    for v in result.verdicts.values():
        for viol in v.violations[:4]:
            console.print(str(viol), style="red", markup=False, highlight=False, soft_wrap=True)
            shown += 1
    if shown:
        console.print("(more detail: --json)")
    return code
