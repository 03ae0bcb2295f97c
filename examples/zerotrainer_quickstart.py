"""README step 7 as a whole script: ``zerogpu.ZeroTrainer`` trains a small model under torchrun.

Run it on the CPU (gloo) from the repository root::

    torchrun --nproc-per-node 2 examples/zerotrainer_quickstart.py              # ZeRO-3, 8 steps
    torchrun --nproc-per-node 2 examples/zerotrainer_quickstart.py --strategy zero2 --steps 20

Each rank trains on its own batches; the trainer averages the gradients over the ranks, shards the
optimizer state (and under ZeRO-3 the parameters), and every rank ends with the same weights. Rank 0
prints the loss of each step. The script ends as every ZeroTrainer script should: ``trainer.close()``
then ``dist.destroy_process_group()``, so that no process group is left for the interpreter's
teardown and the process exits 0 (docs/zerogpu-trainer.md, "Ending a run").
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

import zerogpu
from zerogpu.trainer import STRATEGY_NAMES


class TinyMLP(torch.nn.Module):
    """An MLP whose forward returns the loss (what ZeroTrainer's default ``loss_fn`` calls)."""

    def __init__(self, width: int = 32, depth: int = 2):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="zero3", choices=STRATEGY_NAMES,
                        help="how ZeroTrainer shards (default zero3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


def main() -> None:
    args = parse()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyMLP()
    trainer = zerogpu.ZeroTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), args.strategy)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    for step in range(args.steps):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
        loss = trainer.step(x, y)
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
