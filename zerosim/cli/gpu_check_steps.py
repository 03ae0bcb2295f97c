"""``python -m zerosim.cli.gpu_check_steps STEP [options]``: the command lines of the ``zerosim
gpu-check`` steps that run in a process of their own (each step its own process group with its own
time limit, :mod:`zerosim.bench.gpu_check`).

- ``trainer_devices``: ZeroTrainer on a device against the same run on the CPU
  (:mod:`zerosim.bench.trainer_devices`);
- ``optimizer_bandwidth``: the AdamW update's throughput against the device's copy bandwidth
  (:mod:`zerosim.bench.optimizer_bandwidth`);
- ``verify_devices``: ``zerosim verify`` on the device, the built-in peers at world 1
  (:mod:`zerosim.bench.verify_devices`).

Exit status: the step's own (0 pass, 1 a comparison failed, 2 bad input).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..bench import optimizer_bandwidth, trainer_devices, verify_devices
from ..errors import EXIT_BAD_INPUT


def trainer_devices_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerosim.cli.gpu_check_steps trainer_devices",
                                description="ZeroTrainer on a device against the same run on the CPU.")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--model", default="gpt", help="a zerosim verify model preset (default gpt)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    p.add_argument("--strategies", default=",".join(trainer_devices.STRATEGIES),
                   help="comma-separated (default: all)")
    p.add_argument("--perturb", action="store_true", help="move one device parameter past its bound")
    p.add_argument("--out", type=Path, required=True, help="the JSON document to write")
    return p


def optimizer_bandwidth_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerosim.cli.gpu_check_steps optimizer_bandwidth",
                                description="AdamW update throughput against the device's copy bandwidth.")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--elements", type=int, default=1 << 26, help="shard length (default 2^26)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per kernel (default 10)")
    p.add_argument("--perturb", action="store_true", help="move one device result past its bound")
    p.add_argument("--out", type=Path, required=True, help="the JSON document to write")
    return p


def verify_devices_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerosim.cli.gpu_check_steps verify_devices",
                                description="zerosim verify on the device: the built-in peers at world 1.")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    p.add_argument("--out", type=Path, required=True, help="the JSON document to write")
    return p


STEPS = {
    "trainer_devices": (trainer_devices_parser, trainer_devices.main),
    "optimizer_bandwidth": (optimizer_bandwidth_parser, optimizer_bandwidth.main),
    "verify_devices": (verify_devices_parser, verify_devices.main),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in STEPS:
        names = ",".join(STEPS)
        print(f"usage: python -m zerosim.cli.gpu_check_steps {{{names}}} [options]", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser, step = STEPS[argv[0]]
    return int(step(parser().parse_args(argv[1:])))


if __name__ == "__main__":
    sys.exit(main())
