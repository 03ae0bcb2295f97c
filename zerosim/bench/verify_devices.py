"""``zerosim verify`` on a device: the built-in peers' trainers trained beside the reference on the GPU.

``python -m zerosim.cli.gpu_check_steps verify_devices --device cuda --out FILE``: each case is one
:func:`zerosim.verify.verify` run at world 1 (one rank, NCCL on the GPU; ``--device cpu``: gloo), its
contracts judged as ``zerosim verify TARGET --device cuda --world 1 --allow-world-1`` judges them. On a
GPU the cases are the torch peers (DDP, ZeroRedundancyOptimizer, FSDP2), zerogpu's ZeRO-3, mixed
precision (bf16) and gradient accumulation over three micro-batches (a mean that divides by 3 on the
device); on the CPU one case, so the step's code runs in CI at a size that takes seconds.

One rank cannot show a sharding bug; what a device run shows is the device's arithmetic (cuBLAS,
torch's CUDA optimizer kernels, NCCL, bf16 on the GPU) within the bounds the CPU runs are judged by.

Writes ``{"step": "verify", "device", "steps", "runs": [{"case", "target", "options", "verdict",
"seconds", "contracts": {id: outcome}, "error"}], "passed"}``. Exit 0 every case passed, 1 one failed
or could not run (its error named), 2 bad input.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..errors import EXIT_BAD_INPUT, ZeroSimError, require_positive_int
from .gpu_session import require_device, write_json

#: (case name, target, verify options) per device
CASES: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "cuda": [
        ("ddp", "ddp", {}),
        ("torch-zero", "torch-zero", {}),
        ("fsdp2", "fsdp2", {}),
        ("zerogpu-3", "zerogpu-3", {}),
        ("fsdp2-bf16", "fsdp2", {"precision": "bf16"}),
        ("zerogpu-2-bf16", "zerogpu-2", {"precision": "bf16"}),
        ("fsdp2-accum3", "fsdp2", {"grad_accum": 3}),
    ],
    "cpu": [("fsdp2", "fsdp2", {})],
}


def run_case(target: str, options: dict[str, Any], device: str, steps: int) -> dict[str, Any]:
    """One verify run at world 1 on ``device``; any error it raises is the case's result."""
    from ..verify import verify

    started = time.monotonic()
    try:
        report = verify(target, world=1, allow_world_1=True, steps=steps, device=device, **options)
    except (ZeroSimError, RuntimeError) as e:
        return {"verdict": "error", "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                "seconds": time.monotonic() - started, "contracts": {}}
    contracts = {cid: outcome.status for cid, outcome in report.contracts.items()}
    return {"verdict": report.verdict, "error": None, "seconds": time.monotonic() - started,
            "contracts": contracts}


def main(args: Any) -> int:
    """The step, its options parsed by :func:`zerosim.cli.gpu_check_steps.verify_devices_parser`."""
    try:
        require_positive_int("steps", args.steps)
        require_device(args.device)
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    runs = []
    for case, target, options in CASES[args.device]:
        result = run_case(target, options, args.device, args.steps)
        runs.append({"case": case, "target": target, "options": options, **result})
        why = f" ({result['error']})" if result["error"] else ""
        print(f"{case:>16}: {result['verdict']} in {result['seconds']:.1f} s{why}")
    passed = all(r["verdict"] == "pass" for r in runs)
    write_json(args.out, {"step": "verify", "device": args.device, "steps": args.steps, "runs": runs,
                          "passed": passed})
    return 0 if passed else 1
