"""A user's own DDP loop (gloo, a check at every step) whose optimizer steps whole matrices, for
tests/test_monitor_matrix_update.py: ``OPTIMIZER FAULT OUT STEPS``. OPTIMIZER: ``Muon`` or ``Adafactor``
(torch.optim's). Faults: ``none``; ``lr3``: a subclass whose 9th step uses 3x its learning rate on
every rank; ``lr3-rank0`` / ``lr3-rank2``: on that rank only. Rank 0 prints each violation as
``VIOL <violation>`` and the summary as ``SUMMARY <checks> <violations> <step_checks_off>``."""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zerosim.monitor import Monitor


class MLP(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.embed = torch.nn.Linear(16, 48, bias=False)
        s.blocks = torch.nn.ModuleList([torch.nn.Linear(48, 48, bias=False) for _ in range(2)])
        s.head = torch.nn.Linear(48, 4, bias=False)

    def forward(s, x):
        h = torch.tanh(s.embed(x))
        for b in s.blocks:
            h = torch.tanh(b(h))
        return s.head(h)


def main():
    kind, fault, out = sys.argv[1], sys.argv[2], sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 14
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)
    base = getattr(torch.optim, kind)
    faulty = fault == "lr3" or fault == f"lr3-rank{rank}"

    class Odd(base):
        n = 0

        def step(self, closure=None):
            Odd.n += 1
            if Odd.n == 9 and faulty:
                for g in self.param_groups:
                    g["lr"] *= 3
                r = super().step(closure)
                for g in self.param_groups:
                    g["lr"] /= 3
                return r
            return super().step(closure)

    opt = Odd(model.parameters(), lr=0.02) if kind == "Muon" else Odd(model.parameters(), lr=0.01,
                                                                      weight_decay=0.01)
    mon = Monitor(ddp, opt, every=1, out=out)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(steps):
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        for v in mon.after_step(step, loss=loss.detach()):
            if rank == 0:
                print("VIOL", v, flush=True)
    s = mon.close()
    if rank == 0:
        print("SUMMARY", s["checks"], s["violation_count"], s["step_checks_off"], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
