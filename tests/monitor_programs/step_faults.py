"""A user's own DDP loop (gloo, AdamW, clip 1.0, a check at every step) with one step fault, for
tests/test_monitor_step_checks.py: ``FAULT OUT STEPS [replay]``. Faults: ``none``; ``lr3``: an AdamW
subclass whose 9th step uses 3x its learning rate on every rank (``lr3-rank0``: on rank 0 only);
``gradflip``: an exponent bit of one element of rank 1's local gradient flipped inside backward at step
11; ``halve``: every rank halves head.weight's gradient after clipping at step 7; ``corrupt0``: rank 0's
weights changed outside the step at step 5. Rank 0 prints each violation as ``VIOL <violation>``."""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zerosim.monitor import Monitor


class MLP(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.embed = torch.nn.Linear(16, 64)
        s.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
        s.head = torch.nn.Linear(64, 4)

    def forward(s, x):
        h = torch.tanh(s.embed(x))
        for b in s.blocks:
            h = torch.tanh(b(h))
        return s.head(h)


def main():
    fault = sys.argv[1]
    out = sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)

    class Odd(torch.optim.AdamW):
        n = 0

        def step(self, closure=None):
            Odd.n += 1
            if Odd.n == 9 and (fault == "lr3" or (fault == "lr3-rank0" and rank == 0)):
                for g in self.param_groups:
                    g["lr"] *= 3
                r = super().step(closure)
                for g in self.param_groups:
                    g["lr"] /= 3
                return r
            return super().step(closure)

    opt = Odd(model.parameters(), lr=1e-2)
    mon = Monitor(
        ddp, opt, every=1, out=out, max_grad_norm=1.0, replay_every=1 if "replay" in sys.argv else None
    )
    flipped = [False]

    def flip(g):
        if fault == "gradflip" and rank == 1 and cur[0] == 11 and not flipped[0]:
            flipped[0] = True
            g = g.clone()
            g.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 27)
            return g
        return g

    model.blocks[0].weight.register_hook(flip)
    cur = [0]
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(steps):
        cur[0] = step
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if fault == "halve" and step == 7:
            model.head.weight.grad.mul_(0.5)
        mon.replay_check(step, lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
        opt.step()
        if fault == "corrupt0" and step == 5 and rank == 0:
            with torch.no_grad():
                model.blocks[1].weight.view(-1)[:1].mul_(1.5)
        for v in mon.after_step(step, loss=loss.detach(), grad_norm=norm):
            if rank == 0:
                print("VIOL", v, flush=True)
    s = mon.close()
    if rank == 0:
        print("SUMMARY", s["checks"], s["violation_count"], s["notes"], s["off_reason"], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
