"""A training loop with ``zerosim.monitor`` in it: the three lines a real run adds, on a small MLP.

Run it on the CPU (gloo) from the repository root, then judge what the monitor wrote offline::

    torchrun --nproc-per-node 2 examples/monitored_training.py                  # DDP: 0 violations
    torchrun --nproc-per-node 2 examples/monitored_training.py --fsdp2          # FSDP2, 1-D mesh
    torchrun --nproc-per-node 2 examples/monitored_training.py --corrupt-at 12  # a bit flips on rank 1
    torchrun --nproc-per-node 2 examples/monitored_training.py --fault grad-bitflip --replay-every 1
    zerosim check trace reports/monitor-example-<timestamp>                     # exit 0, or 1

The model trains with AdamW and ``clip_grad_norm_``; every ``--every`` steps the monitor checks that
every replica holds the same bytes (C-ZERO-003), that the owned ranges cover every parameter once
(C-ZERO-001), that the optimizer state is present and finite with equal step counters, and that the
logged gradient norm is the one recomputed from the gradient (C-ZERO-002). ``--corrupt-at STEP`` flips
one mantissa bit of one element of rank 1's copy of ``blocks.0.weight`` after that step (the value
moves by about 5e-4 of itself), as silent data corruption would: training goes on (the monitor logs
by default), and the first check at or after that step names the tensor and the range, as does
``zerosim check trace`` (at two ranks there is no majority, so it says ranks 0 and 1 disagree; from
three ranks on the majority names rank 1). Under FSDP2 on a 1-D mesh each shard has one copy
only, so a flipped bit has nothing to be compared with: the option needs DDP.

``--fault`` injects a fault every replica agrees on, which only the step checks see (DDP; at step
``--fault-at``, default 7): ``lr-spike`` (an AdamW whose step uses 3x the learning rate its param group
declares: the ``update`` check), ``grad-bitflip`` (an exponent bit of one element of rank 1's local
gradient flips inside backward, before the all-reduce: ``replay``, with ``--replay-every``, names it
``transient``), ``halve-head-grad`` (every rank halves ``head.weight``'s gradient after clipping: the
``grad_accounting`` check names the tensor). Each rank exits 0 once training ends, whatever
the monitor found (it stops a run only with ``on_violation="raise"``); the offline judge's exit status
is the verdict.
"""

from __future__ import annotations

import argparse
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from zerosim.monitor import Monitor

MAX_NORM = 1.0
FAULTS = ("lr-spike", "grad-bitflip", "halve-head-grad")
CORRUPTED = "blocks.0.weight"
FLIPPED_BIT = 12  # of a float32's 23 mantissa bits: a change training does not round away


class MLP(torch.nn.Module):
    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        self.embed = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 (default: DDP)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--every", type=int, default=5, help="steps between checks (default 5)")
    parser.add_argument("--out", help="the monitor's folder (default reports/monitor-example-<timestamp>)")
    parser.add_argument("--corrupt-at", type=int, metavar="STEP",
                        help=f"flip one bit of rank 1's {CORRUPTED} after STEP (DDP only)")
    parser.add_argument("--fault", choices=FAULTS, help="a fault every replica agrees on (DDP only)")
    parser.add_argument("--fault-at", type=int, default=7, metavar="STEP", help="its step (default 7)")
    parser.add_argument("--replay-every", type=int, metavar="N",
                        help="recompute each rank's local gradient every N steps (monitor.replay_check)")
    args = parser.parse_args()
    if args.corrupt_at is not None and args.fsdp2:
        parser.error("--corrupt-at needs DDP: a 1-D FSDP2 shard has no second copy to compare with")
    if args.fault is not None and args.fsdp2:
        parser.error("--fault needs DDP: FSDP2 reduces in its post-backward, where the step checks are off")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


def shared_out(out: str | None) -> str:
    """``out``, or a new folder named after rank 0's clock, the same on every rank."""
    if out is not None:
        return out
    stamp = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64)
    dist.broadcast(stamp, src=0)
    when = datetime.datetime.fromtimestamp(int(stamp) / 1000)
    return f"reports/monitor-example-{when:%Y%m%d-%H%M%S}-{int(stamp) % 1000:03d}"


def main() -> None:
    args = parse()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    mlp = MLP()
    model: torch.nn.Module = mlp
    if args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in mlp.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(mlp, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(mlp)
    spiked = [False]

    class SpikedAdamW(torch.optim.AdamW):
        """AdamW whose step at ``--fault-at`` uses 3x the learning rate its param groups declare."""

        def step(self, closure: Any = None) -> Any:
            if not spiked[0]:
                return super().step(closure)
            for group in self.param_groups:
                group["lr"] *= 3
            try:
                return super().step(closure)
            finally:
                for group in self.param_groups:
                    group["lr"] /= 3

    optimizer = SpikedAdamW(model.parameters(), lr=1e-2)
    out = shared_out(args.out)
    monitor = Monitor(model, optimizer, every=args.every, out=out, max_grad_norm=MAX_NORM,
                      replay_every=args.replay_every)
    plain = dict(mlp.named_parameters())  # the tensors DDP wraps (FSDP2's own, sharded)
    current = [-1]

    flipped = [False]

    def flip_local_gradient(grad: torch.Tensor) -> torch.Tensor:
        if args.fault != "grad-bitflip" or rank != 1 or current[0] != args.fault_at or flipped[0]:
            return grad
        flipped[0] = True  # transient: a recomputation of the same step computes it right
        grad = grad.clone()  # a compute fault: the exponent's bit of one element
        grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 27)
        return grad

    plain["blocks.0.weight"].register_hook(flip_local_gradient)

    data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    for step in range(args.steps):
        current[0] = step
        x, y = torch.randn(32, 16, generator=data), torch.randn(32, 4, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if hasattr(norm, "full_tensor"):  # FSDP2 returns the global norm as a DTensor
            norm = norm.full_tensor()
        head_grad = plain["head.weight"].grad
        if args.fault == "halve-head-grad" and step == args.fault_at and head_grad is not None:
            head_grad.mul_(0.5)

        def same_loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return torch.nn.functional.mse_loss(model(x), y)

        monitor.replay_check(step, same_loss)
        spiked[0] = args.fault == "lr-spike" and step == args.fault_at
        optimizer.step()
        if step == args.corrupt_at and rank == 1:
            with torch.no_grad():  # silent data corruption: one bit of one rank's copy
                weight = dict(model.named_parameters())[f"module.{CORRUPTED}"]
                weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << FLIPPED_BIT)
        monitor.after_step(step, loss=loss.detach(), grad_norm=norm)  # tensors: read on their device

    summary = monitor.close()  # judges the last check, writes OUT/summary.json on rank 0
    if rank == 0:
        print(f"{summary['checks']} checks, {summary['violation_count']} violation(s); "
              f"judge them again with: zerosim check trace {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
