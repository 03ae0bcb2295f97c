"""Under torchrun (world 2, gloo): users' own DDP training loops with zerosim.monitor in them, for
tests/test_monitor_setups.py. One launch runs several setups one after the other.

argv: RESULTS OUT_ROOT --setup NAME[,NAME...] [--steps N] [--every K] [--flip-at STEP]

Setups (each a loop people run; the monitor must find nothing in them):

* ``plain``: a small MLP, AdamW, ``clip_grad_norm_``;
* ``frozen``: its first layer frozen (``requires_grad=False``: no gradient, no optimizer state), the
  optimizer given every parameter;
* ``lora``: a frozen base layer with a trainable low-rank pair beside it, the optimizer given only the
  trainable matrices;
* ``add-group``: the head trained from step ADD_AT on, as a parameter group added then
  (``optimizer.add_param_group``);
* ``unfreeze``: the first layer frozen until step ADD_AT, then unfrozen (DDP wrapped again, as DDP
  reduces only the parameters that needed a gradient when it was wrapped);
* ``tied``: a token embedding and an output layer sharing one weight;
* ``no-sync``: two micro-batches per step, the first under ``DDP.no_sync()``;
* ``eval``: dropout, and every EVAL_EVERY steps an evaluation pass in ``model.eval()`` under no_grad;
* ``autocast``: the forward pass under CPU bfloat16 autocast;
* ``skip-at-S``: ``plain`` whose rank 1 does not call ``after_step`` at step S (the last step: S =
  steps - 1);
* ``hook-error-S``: ``plain`` in which, from step S on, the monitor's gradient projection and update
  recompute raise on rank 1: inside its hooks, within ``loss.backward()`` and ``optimizer.step()``.

``--flip-at STEP`` flips one bit of rank 1's copy of the setup's :data:`FLIPPED` tensor after STEP
(``ZEROSIM_FAULT`` bitflip, :mod:`zerosim.monitor.faults`). Every rank appends one JSON line per setup to
``RESULTS.rankR``: its violations (step, contract, clause, ranks, tensor, text), its monitor's summary
a digest of its final parameters and the tensor flipped.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zerogpu.rank import leave_rank  # os._exit after the teardown: a gloo finalizer can abort at exit
from zerosim.monitor import Monitor
from zerosim.monitor.faults import LiveFault

MAX_NORM = 1.0
TIMEOUT_S = 120
ADD_AT = 60  #: the step from which ``add-group`` trains the head and ``unfreeze`` the first layer
EVAL_EVERY = 20
VOCAB, WIDTH = 16, 12
#: the tensor ``--flip-at`` flips in each setup: one both ranks hold (a frozen one where there is one)
FLIPPED = {"plain": "blocks.0.weight", "frozen": "embed.weight", "lora": "embed.base.weight",
           "add-group": "head.weight", "unfreeze": "embed.weight", "tied": "tokens.weight",
           "no-sync": "blocks.0.weight", "eval": "blocks.1.weight", "autocast": "head.bias"}


class Mlp(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, WIDTH)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)])
        self.head = torch.nn.Linear(WIDTH, 3)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = self.drop(torch.tanh(block(h)))
        return self.head(h)


class LowRank(torch.nn.Module):
    """A frozen base layer plus a trainable rank-2 update ``B @ A`` (what a LoRA adapter adds)."""

    def __init__(self, inner: int, outer: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(inner, outer)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(2, inner) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.zeros(outer, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class LoraMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = LowRank(6, WIDTH)
        self.head = LowRank(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


class TiedLm(torch.nn.Module):
    """A token embedding whose weight the output layer shares."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.tokens(ids))))


def build(setup: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)  # the same initial parameters on every rank
    if setup == "lora":
        model: torch.nn.Module = LoraMlp()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if setup == "tied":
        model = TiedLm()
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)
    model = Mlp(dropout=0.2 if setup == "eval" else 0.0)
    if setup in ("frozen", "unfreeze"):
        model.embed.requires_grad_(False)
    if setup == "add-group":
        trained = [p for n, p in model.named_parameters() if not n.startswith("head.")]
        return model, torch.optim.AdamW(trained, lr=0.01)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def batch(setup: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if setup == "tied":
        ids = torch.randint(0, VOCAB, (8,), generator=gen)
        return ids, torch.roll(ids, 1)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def loss_of(setup: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if setup == "tied":
        return torch.nn.functional.cross_entropy(model(x), y)
    if setup == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return torch.nn.functional.mse_loss(out.float(), y)
    return torch.nn.functional.mse_loss(model(x), y)


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(setup: str, steps: int, every: int, out: Path, flip_at: int | None) -> dict:
    rank = dist.get_rank()
    model, optimizer = build(setup)
    ddp = DistributedDataParallel(model)
    monitor = Monitor(ddp, optimizer, every=every, out=out, max_norm=MAX_NORM, log=lambda line: None)
    fault = None
    if flip_at is not None:
        fault = LiveFault.from_env(rank, f"bitflip:rank=1:step={flip_at}:tensor={FLIPPED[setup]}")
    skip_at = int(setup.removeprefix("skip-at-")) if setup.startswith("skip-at-") else None
    break_at = int(setup.removeprefix("hook-error-")) if setup.startswith("hook-error-") else None
    found = []
    for step in range(steps):
        if step == ADD_AT and setup == "add-group":
            optimizer.add_param_group({"params": list(model.head.parameters()), "lr": 0.005})
        if step == ADD_AT and setup == "unfreeze":
            model.embed.requires_grad_(True)
            ddp = DistributedDataParallel(model)  # DDP reduces what needed a gradient when wrapped
        if setup == "eval" and step % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                loss_of(setup, ddp, *batch(setup, rank, -step - 1))
            model.train()
        if rank == 1 and step == break_at:
            break_monitor_hooks()
        optimizer.zero_grad()
        if setup == "no-sync":
            with ddp.no_sync():
                loss_of(setup, ddp, *batch(setup, rank, 2 * step + 10_000)).backward()
        loss = loss_of(setup, ddp, *batch(setup, rank, step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        if fault is not None:
            fault.after_step(step, ddp, optimizer)
        if rank == 1 and step == skip_at:
            continue
        for v in monitor.after_step(step, loss=loss.detach(), grad_norm=norm):
            found.append({"step": v.step, "contract": v.contract, "clause": v.clause,
                          "ranks": list(v.ranks), "tensor": v.tensor, "text": str(v)})
    summary = monitor.close()
    return {"setup": setup, "rank": rank, "violations": found, "summary": summary,
            "params": params_digest(model), "flipped": None if flip_at is None else FLIPPED[setup]}


def break_monitor_hooks() -> None:
    """The monitor's own code made to fail inside the hooks it puts into the loop's backward and step."""
    from zerosim.monitor import step_probe, update_probe

    def fail(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a deliberately broken monitor")

    step_probe.StepProbe.project = fail  # type: ignore[method-assign,assignment]
    update_probe.recompute_update = fail  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("out_root")
    parser.add_argument("--setup", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--flip-at", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    for setup in args.setup.split(","):
        record = run(setup, args.steps, args.every, Path(args.out_root) / setup, args.flip_at)
        with open(f"{args.results}.rank{dist.get_rank()}", "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)


if __name__ == "__main__":
    main()
