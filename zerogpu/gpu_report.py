"""``python -m zerogpu report [--out reports/gpu] [--world-size N]``: the GPU equivalence report.

From an ordinary shell on a CUDA machine: starts ``torchrun --nproc-per-node N -m zerogpu
equivalence --device cuda`` (NCCL, one GPU per rank, engine arrays on the GPU, TF32 off) for every
strategy, then writes ``<out>/equivalence.json`` (the full document: environment, per strategy the
C-ZERO-002..005 verdicts, max |error| against the independent ground truth per state, agreement
with the in-process simulator) and ``<out>/equivalence.md`` (the same as a table, in words).

``--world-size`` defaults to the number of visible GPUs. NCCL needs a distinct GPU per rank, so on a
one-GPU machine the run is a world of 1: the engine on CUDA against the ground truth, but no
cross-GPU collective; ``--world-size 2`` or more needs as many GPUs.

Without CUDA it stops with exit 2 and says so, unless ``--cpu`` is given: then the same report is
made with gloo on the CPU (what CI can check). Exit status: 0 every contract held and every run
agreed with the simulator, 1 otherwise, 2 bad input / no CUDA, 3 a rank failed, 124 launch timeout.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from zerosim.checks.contracts import STEP_CONTRACTS
from zerosim.errors import EXIT_BAD_INPUT, ConfigError, ZeroSimError, require_positive_int
from zerosim.files.outputs import write_text


def resolve_world(args: Any) -> tuple[int, str]:
    """(world size, device) or ConfigError (no CUDA without --cpu, more ranks than GPUs)."""
    import torch

    if args.cpu:
        return require_positive_int("world_size", 2 if args.world_size is None else args.world_size), "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(
            "device",
            "cuda",
            f"the GPU report needs CUDA, and this machine has none (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda}); run it on a GPU machine, or "
            "pass --cpu for the same report with gloo on the CPU",
        )
    gpus = torch.cuda.device_count()
    n = require_positive_int("world_size", gpus if args.world_size is None else args.world_size)
    if n > gpus:
        raise ConfigError("world_size", n, f"NCCL needs one GPU per rank and {gpus} are visible")
    return n, "cuda"


def markdown(doc: dict[str, Any]) -> str:
    """The report in words and one table."""
    e, c = doc["environment"], doc["config"]
    where = f"{e['dist_backend']} on {e['device']}"
    if e.get("device_name"):
        where += f" ({e['device_name']}, CUDA {e.get('cuda')}, NCCL {e.get('nccl')}, TF32 off)"
    lines = [
        "# zerogpu equivalence report",
        "",
        f"- Ran: {doc['world_size']} rank(s) under torchrun, {where}; torch {e['torch']}; engine arrays: "
        f"{doc['xp']}.",
        f"- Model `{c['model']}`, {c['steps']} step(s) x {c['micro_batches']} micro-batch(es), "
        f"{c['precision']}, "
        f"seed {c['seed']}.",
        f"- Overall: **{'PASS' if doc['passed'] else 'FAIL'}** (every contract, and agreement with the "
        "in-process "
        "simulator).",
        "",
        "C-ZERO-002: every rank's master / optimizer shard equals the independent ground truth within the "
        "contract's tolerance. C-ZERO-003: gathered weights bitwise identical on every rank. C-ZERO-004: "
        'holdings equal the plan. C-ZERO-005: traffic equals the ring model exactly. "vs simulator": the '
        "same run on the in-process numpy simulator (bitwise where promised, else within tolerance; see "
        "`zerogpu/agreement.py`).",
        "",
        "| strategy | shard group x replicas | C-ZERO-002 | C-ZERO-003 | C-ZERO-004 | C-ZERO-005 "
        "| max abs error vs ground truth | max abs diff vs simulator | agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        a = r["vs_simulator"]
        marks = ["PASS" if r["verdicts"][cid]["passed"] else "**FAIL**"
                 for cid in STEP_CONTRACTS[1:]]
        err = r["max_abs_error_vs_ground_truth"]
        how = ("bitwise" if a["bitwise_equal"] else "within bound") if a["agrees"] else "**differs**"
        lines.append(f"| {r['strategy']} | {r['shard_group_size']} x {r['replicas']} | {' | '.join(marks)} | "
                     f"{'-' if err is None else f'{err:.3g}'} | {a['max_abs_diff']:.3g} | {how} |")
    failures = [
        (r["strategy"], cid, v["first_violation"])
        for r in doc["runs"]
        for cid, v in r["verdicts"].items()
        if not v["passed"]
    ]
    failures += [
        (r["strategy"], "vs simulator", p) for r in doc["runs"] for p in r["vs_simulator"]["problems"]
    ]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {s} {what}: {msg}" for s, what, msg in failures]
    return "\n".join(lines) + "\n"


def report(args: Any) -> int:
    """``python -m zerogpu report`` for its parsed options (:func:`zerosim.cli.gpu.report_parser`):
    launches the equivalence ranks, writes JSON and markdown; returns the exit status."""
    from .launch import run_ranks

    try:
        n, device = resolve_world(args)
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with tempfile.TemporaryDirectory(prefix="zerogpu-report-") as tmp:
        raw = Path(tmp) / "equivalence.json"
        forwarded = [
            "-m",
            "zerogpu",
            "equivalence",
            "--device",
            device,
            "--strategies",
            args.strategies,
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--micro-batches",
            str(args.micro_batches),
            "--precision",
            args.precision,
            "--xp",
            args.xp,
            "--timeout",
            str(args.timeout),
            "--json",
            "--out",
            str(raw),
        ]
        print(
            f"running {n} ranks of -m zerogpu equivalence on {device} ...", file=sys.stderr
        )
        result = run_ranks(n, forwarded, args.launch_timeout)
        if not raw.exists():
            tail = "\n".join((result.stderr or "").strip().splitlines()[-15:])
            why = "launch timeout" if result.timed_out else f"exit {result.returncode}"
            print(f"error: the equivalence run produced no result ({why}):\n{tail}", file=sys.stderr)
            return result.returncode or 3
        doc = json.loads(raw.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "equivalence.json", json.dumps(doc, indent=2))
    write_text(args.out / "equivalence.md", markdown(doc))
    print(markdown(doc))
    print(f"wrote {args.out / 'equivalence.json'} and {args.out / 'equivalence.md'}", file=sys.stderr)
    return 0 if doc["passed"] else 1
