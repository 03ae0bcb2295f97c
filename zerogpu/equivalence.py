"""``torchrun --nproc-per-node N -m zerogpu equivalence [options]``: every strategy, one launch, one table.

For each strategy of ``--strategies`` (comma list, or ``all``: no_shard, zero1, zero2, zero3,
hybrid_shard:k, hybrid_shard_zero2:k with k = 2 when N >= 4 is even, else k = N) every rank runs the
engine on the TorchCommunicator (NCCL on GPU, gloo on CPU); rank 0 evaluates C-ZERO-002..005,
reads C-ZERO-002's max error against the independent ground truth, runs the same configuration on
the in-process simulator and compares (:mod:`zerogpu.agreement`). Other options are those of
``zerosim simulate`` (``--model``, ``--steps``, ``--micro-batches``, ``--precision``, ``--seed``,
``--fault``...) and the torch ones of ``zerogpu simulate``; shard values are always observed in full.

Rank 0 prints a table (or ``--json``) and writes the JSON document to ``--out FILE`` if given (what
``python -m zerogpu report`` turns into a report). Exit status, the same on every rank: 0 every
contract held and every run agreed with the simulator, 1 otherwise, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from zerosim.checks.contracts import STEP_CONTRACTS
from zerosim.engine.run_file import RankRun
from zerosim.errors import ConfigError, ZeroSimError
from zerosim.files.outputs import write_text
from zerosim.values.observe import RankObservation


def default_strategies(world_size: int) -> list[str]:
    """Every strategy kind at this world size (hybrid groups of 2 where that leaves >= 2 replicas)."""
    k = 2 if world_size >= 4 and world_size % 2 == 0 else world_size
    return ["no_shard", "zero1", "zero2", "zero3", f"hybrid_shard:{k}", f"hybrid_shard_zero2:{k}"]


def parse_strategies(text: str, world_size: int) -> list[str]:
    if text.strip() == "all":
        return default_strategies(world_size)
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise ConfigError("strategies", text, "expected a comma-separated list of strategies or 'all'")
    return out


def environment(device: str, backend: str) -> dict[str, Any]:
    """What ran the job: versions, device name, NCCL version (where CUDA)."""
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
                           "dist_backend": backend, "host": platform.node()}
    if device.startswith("cuda"):
        env["cuda"] = torch.version.cuda
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
        env["tf32"] = {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        }
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational
            env["nccl"] = None
    return env


def _verdict_summary(v: Any) -> dict[str, Any]:
    first = v.violations[0] if v.violations else None
    return {"passed": v.passed, "checked": v.checked, "violations": len(v.violations),
            "skipped": v.details.get("skipped"), "first_violation": str(first) if first is not None else None}


def evaluate_entry(
    strategy: str, run: Any, observations: list[Any], xp: str, wall_s: float
) -> dict[str, Any]:
    """Rank 0: the contracts, the error against the ground truth and the agreement with the simulator."""
    from zerosim.engine.run_result import evaluate
    from zerosim.engine.spmd import simulate_observations

    from .agreement import compare_with_simulator

    result = evaluate(run, observations)
    gt = result.verdicts["C-ZERO-002"].details.get("ground_truth", {})
    errors = gt.get("max_abs_error", {}) or {}
    sim = simulate_observations(run.cfg.replace(xp="numpy"))
    agreement = compare_with_simulator(observations, sim, run=run, xp=xp)
    return {"strategy": strategy, "resolved": result.config["strategy"], "shard_group_size": run.k,
            "replicas": run.replicas, "passed": result.passed and agreement["agrees"],
            "contracts_passed": result.passed,
            "verdicts": {cid: _verdict_summary(v) for cid, v in result.verdicts.items()},
            "max_abs_error_vs_ground_truth": max(errors.values(), default=None),
            "max_abs_error_by_state": errors, "ground_truth_tolerance": gt.get("tolerance"),
            "vs_simulator": agreement, "final_loss": result.steps[-1]["loss"] if result.steps else None,
            "wall_s": wall_s}


def render_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    e = doc["environment"]
    console = Console()
    console.width = max(console.width, 112)  # one row per strategy, also when piped (rich assumes 80)
    console.print(
        f"[bold]zerogpu equivalence[/]: {doc['world_size']} rank(s), {e['dist_backend']} on {e['device']}"
        f"{' (' + e['device_name'] + ')' if e.get('device_name') else ''}, engine arrays: {doc['xp']}"
    )
    t = Table(title="C-ZERO-00x verdicts; max |error| vs the ground truth; agreement with the simulator")
    for col in ("strategy", *(c.removeprefix("C-ZERO-") for c in STEP_CONTRACTS[1:]), "err vs truth",
                "diff vs sim", "agreement"):
        t.add_column(col, no_wrap=True)
    for r in doc["runs"]:
        marks = ["[green]PASS[/]" if r["verdicts"][c]["passed"] else "[red]FAIL[/]"
                 for c in STEP_CONTRACTS[1:]]  # 001 judges the plan, shown elsewhere
        a = r["vs_simulator"]
        how = ("bitwise" if a["bitwise_equal"] else "within bound") if a["agrees"] else "[red]DIFFERS[/]"
        err = r["max_abs_error_vs_ground_truth"]
        t.add_row(
            r["strategy"], *marks, "-" if err is None else f"{err:.3g}", f"{a['max_abs_diff']:.3g}", how
        )
    console.print(t)
    for r in doc["runs"]:
        for cid, v in r["verdicts"].items():
            if not v["passed"]:
                console.print(
                    f"[red]{r['strategy']} {cid}[/] {v['first_violation']}", highlight=False, soft_wrap=True
                )
        for p in r["vs_simulator"]["problems"]:
            console.print(f"[red]{r['strategy']} vs simulator[/] {p}", highlight=False, soft_wrap=True)


def equivalence_rank(args: Any, load: Callable[[], RankRun]) -> NoReturn:
    """Run one rank of ``equivalence``: ``load()`` gives the base run and the torch settings, ``args``
    the command's own options (``strategies``, ``out``, ``json``, ``model``; parsed by
    :func:`zerosim.cli.gpu.equivalence_parser`). Bad input: rank 0 prints it, every rank exits 2."""
    from .rank import fail_on_bad_input, run_rank
    from .simulate import resolve_setup

    try:
        job = load()
        base, device, backend = resolve_setup(job)
        strategies = parse_strategies(args.strategies, base.world_size)
        runs = [base.replace(strategy=s, observe="full").validate() for s in strategies]
    except ZeroSimError as e:
        fail_on_bad_input(e)
    xp = base.xp

    def body() -> int:
        from .comm import init_distributed
        from .program import agree_on_exit, exact_float32_math, gather_observations, rank_program_on_device

        exact_float32_math(device)
        comm = init_distributed(backend, device, base.timeout_s, reduce_scatter=job.option("reduce_scatter"),
                                all_gather=job.option("all_gather"))
        collected = []
        for (
            run
        ) in runs:  # every run first: rank 0's evaluation must not keep its peers waiting in a collective
            t0 = time.perf_counter()
            observation = rank_program_on_device(comm, run)
            wall = time.perf_counter() - t0
            collected.append((gather_observations(comm, observation), wall))
        code = None
        if comm.rank == 0:
            entries = [
                evaluate_entry(strategy, run, _on_root(observations), xp, wall)
                for strategy, run, (observations, wall) in zip(strategies, runs, collected, strict=True)
            ]
            doc = {
                "world_size": comm.world_size,
                "xp": xp,
                "environment": environment(comm.device, backend),
                "config": {
                    "model": args.model,
                    "steps": base.steps,
                    "micro_batches": base.micro_batches,
                    "precision": base.precision,
                    "seed": base.seed,
                    "fault": base.fault,
                },
                "passed": all(e["passed"] for e in entries),
                "runs": entries,
            }
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                write_text(args.out, json.dumps(doc, indent=2, default=str))
            if args.json:
                json.dump(doc, sys.stdout, indent=2, default=str)
                print()
            else:
                render_table(doc)
            sys.stdout.flush()
            code = 0 if doc["passed"] else 1
        return agree_on_exit(comm, code)

    run_rank(body)


def _on_root(observations: list[RankObservation] | None) -> list[RankObservation]:
    """The gathered observations, which only rank 0 (the gather's root) holds."""
    if observations is None:
        raise RuntimeError("observations are gathered on rank 0 only")
    return observations
