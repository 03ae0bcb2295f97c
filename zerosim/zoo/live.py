"""The zoo's live variant: each mechanism inside a monitored training loop, judged by ``zerosim.monitor``.

Every rank runs ``python -m zerosim.zoo.live RESULTS OUT MECHANISM [MECHANISM...]`` under torchrun (gloo
on the CPU; :func:`zerogpu.launch.run_ranks` in the runner). For each mechanism it trains a small
float64 MLP twice, with the bug and as the fixed twin, in the loop a hand-written data-parallel job
has: local backward per micro-batch, the gradient averaged over ranks, accumulated, clipped by its
norm, AdamW (the Muon entry: Muon on the matrices, AdamW on the rest, the Monitor given the Muon
optimizer), with :class:`zerosim.monitor.Monitor` checking every step (``every=1``) into
``OUT/<mechanism>/<broken|fixed>/``. Rank 0 appends one JSON line per run to RESULTS: the mechanism,
whether the bug was on, the monitor's checks and violations (contract, clause, step, ranks). The
offline judge (``zerosim check trace``) reads the same folders afterwards (:mod:`zerosim.zoo.runner`).

The mechanisms mirror :mod:`zerosim.zoo.bugs` on this model: ``blocks.1`` plays the experts, ``norm``
the router and the replicated layer norm; a "shard" of the replicated model is every other parameter.
The two mixture-of-experts mechanisms (:data:`MOE`) train verify's MoE model (``--model moe``) instead,
its experts run through an expert-parallel exchange (:mod:`zerosim.zoo.moe_bugs`): each expert runs on
its owner rank only, reached by the all-to-all (or the token all-gather), while every rank keeps a
copy of every expert's weights, so that the monitor sees replicas. An expert's local gradient is then
the sum over every rank's tokens on its owner and zeros elsewhere, and the all-reduce divided by the
world size gives the mean, as for every other tensor.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .bugs import BROKEN_RANK, FAULT_STEP, FLIPPED_GRAD_BIT, FLIPPED_WEIGHT_BIT, NARROW

STEPS = 6  #: optimizer steps per run, each checked by the monitor
MAX_NORM = 0.5  #: the clip threshold (binds on this model's first steps)
ACCUMULATING = {"last_micro_batch_only", "unscaled_accumulation", "double_scaled_accumulation",
                "partial_sums_in_reduce_dtype", "muon_per_micro_batch"}
MUON = "muon_per_micro_batch"  #: the mechanism that trains with the Muon recipe
EXPERTS, ROUTER = "blocks.1.", "norm."
#: the MoE mechanisms -> the class of :mod:`zerosim.zoo.moe_bugs` whose expert dispatch the loop runs
MOE = {"expert_divide_factor_skipped": "ExpertDivideFactorSkipped",
       "token_gather_without_reduce_scatter": "TokenGatherWithoutReduceScatter"}
MOE_EXPERTS = "moe.experts."
VIOLATION_FIELDS = ("contract", "clause", "step", "ranks", "tensor")
Grads = dict[str, torch.Tensor]


class LiveModel(torch.nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.norm = torch.nn.LayerNorm(width)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(2)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.embed(x)))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


class Loop:
    """One monitored run of ``mechanism`` (``bug``: on, else its fixed twin)."""

    def __init__(self, mechanism: str, bug: bool):
        self.mechanism, self.bug = mechanism, bug
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        self.model: torch.nn.Module = LiveModel().double()
        self.make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = self._mlp_batch
        if mechanism in MOE:
            from ..verify.model_moe import moe_factory
            from . import moe_bugs

            self.model, make_batch = moe_factory(0)
            self.make_batch = lambda step, index: make_batch(step, self.rank, self.world, index)
            # the expert dispatch only: the experts' gradients are reduced and stepped by this loop
            moe_bugs.runner_only(getattr(moe_bugs, MOE[mechanism]), self.model,
                                 self.on("token_gather_without_reduce_scatter"))
        self.data = torch.Generator().manual_seed(1 + self.rank)
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.muon: torch.optim.Optimizer | None = None
        self.matrices = [n for n, p in self.params.items() if p.ndim == 2]
        if mechanism == MUON:  # the Muon recipe: Muon on the matrices, AdamW on the rest
            self.muon = torch.optim.Muon([self.params[n] for n in self.matrices], lr=1e-2)
            self.optimizer = torch.optim.AdamW([p for n, p in self.params.items() if p.ndim != 2], lr=1e-2)
        self.step_index = 0
        self.previous: Grads | None = None

    def on(self, name: str) -> bool:
        return self.bug and self.mechanism == name

    # ---- the step's parts, each with the mechanisms that change it --------------------------------
    def loss_factor(self, count: int) -> float:
        if self.on("unscaled_accumulation"):
            return 1.0
        if self.on("double_scaled_accumulation"):
            return 1.0 / count**2
        return 1.0 / count

    def _mlp_batch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=self.data, dtype=torch.float64)
        return x, torch.randn(16, 3, generator=self.data, dtype=torch.float64)

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.mechanism in MOE:
            return self.model(x, y)
        return torch.nn.functional.mse_loss(self.model(x), y)

    def local_gradient(self) -> Grads:
        # an expert that runs on another rank has no gradient here: it contributes zeros
        grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in self.params.items()}
        if self.on("gradient_bit_flip") and self.rank == BROKEN_RANK and self.step_index == FAULT_STEP:
            grads["blocks.0.weight"].view(-1)[:1].view(torch.int64).bitwise_xor_(1 << FLIPPED_GRAD_BIT)
        if self.on("stale_gather_in_grad_buffer") and self.step_index > 1:
            grads = {n: g + self.params[n].detach() for n, g in grads.items()}
        return grads

    def reduce(self, grads: Grads) -> Grads:
        out: Grads = {}
        for name, g in grads.items():
            local = g.clone()
            if self.on("reduces_in_narrow_dtype"):
                narrow = g.to(NARROW)
                dist.all_reduce(narrow)
                mean = narrow.to(g.dtype) / self.world
            else:
                dist.all_reduce(g)
                mean = g / self.world
            if self.on("replicas_not_reduced") or (self.on("router_not_reduced") and name.startswith(ROUTER)):
                mean = local
            if (self.on("expert_gradients_summed") and name.startswith(EXPERTS)) or \
                    (self.on("expert_divide_factor_skipped") and name.startswith(MOE_EXPERTS)):
                mean = mean * self.world  # the sum over the ranks, not divided
            if self.on("layer_norm_replica_drift") and self.rank == BROKEN_RANK and name.startswith(ROUTER):
                mean = mean.to(torch.float32).to(mean.dtype)
            out[name] = mean
        return out

    def accumulate(self, total: Grads | None, reduced: Grads) -> Grads:
        if total is None or self.on("last_micro_batch_only"):
            return {n: g.clone() for n, g in reduced.items()}
        if self.on("partial_sums_in_reduce_dtype"):
            return {n: (total[n].to(NARROW) + g.to(NARROW)).to(g.dtype) for n, g in reduced.items()}
        return {n: total[n] + g for n, g in reduced.items()}

    def norms(self, grads: Grads) -> tuple[float, float]:
        """(the norm the clip uses, the norm the loop logs)."""
        names = list(grads)
        if self.on("local_clip_norm"):
            names = names[self.rank::self.world]  # this rank's shard of the parameters
        if self.on("experts_out_of_norm"):
            names = [n for n in names if not n.startswith(EXPERTS)]
        squares = sum(float((grads[n] * grads[n]).sum()) for n in names)
        norm = math.sqrt(squares)
        if self.on("logged_norm_over_shards"):
            return norm, norm / self.world
        if self.on("logged_norm_squares_averaged"):
            return norm, math.sqrt(squares / self.world)
        return norm, norm

    def after_update(self) -> None:
        with torch.no_grad():
            if self.on("weights_in_narrow_dtype"):
                for p in self.params.values():
                    p.copy_(p.to(NARROW).to(p.dtype))
            if self.on("optimizer_state_in_narrow_dtype"):
                for state in self.optimizer.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key].copy_(state[key].to(NARROW).to(state[key].dtype))
            if self.on("weight_bit_flip") and self.rank == BROKEN_RANK and self.step_index == FAULT_STEP:
                word = self.params["blocks.0.weight"].view(-1)[:1].view(torch.int64)
                word.bitwise_xor_(1 << FLIPPED_WEIGHT_BIT)

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, out: Path) -> dict:
        from ..monitor import Monitor

        monitor = Monitor(self.model, self.muon or self.optimizer, every=1, out=str(out), max_norm=MAX_NORM,
                          max_grad_norm=MAX_NORM, replay_every=1)
        count = 2 if self.mechanism in ACCUMULATING else 1
        for step in range(STEPS):
            self.step_index = step + 1
            current = {n: p.detach().clone() for n, p in self.params.items()}
            stale = self.previous if self.on("forward_on_previous_weights") else None
            total: Grads | None = None
            shares: list[Grads] = []
            loss = torch.zeros((), dtype=torch.float64)
            for index in range(count):
                x, y = self.make_batch(step, index)
                if stale is not None:
                    self._load(stale)
                self.model.zero_grad(set_to_none=True)
                loss = self.loss_of(x, y)
                (loss * self.loss_factor(count)).backward()
                if stale is not None:
                    self._load(current)
                if index == count - 1:  # the step's last micro-batch, backward again on the same data
                    monitor.replay_check(step, self._replay(x, y, count))
                shares.append(self.reduce(self.local_gradient()))
                total = self.accumulate(total, shares[-1])
            assert total is not None
            clip_norm, logged = self.norms(total)
            coefficient = min(MAX_NORM / (clip_norm + 1e-6), 1.0)
            self.step_optimizers(total, shares, coefficient)
            self.previous = current
            self.after_update()
            monitor.after_step(step, loss=loss.detach(), grad_norm=logged)
        return monitor.close()

    def step_optimizers(self, total: Grads, shares: list[Grads], coefficient: float) -> None:
        """The clipped step. The Muon recipe steps Muon on the matrices once on the step's gradient; with
        the bug once per micro-batch on that micro-batch's share, all at the same weights (momentum
        advances K times, Newton-Schulz orthogonalises each partial gradient)."""
        for name, p in self.params.items():
            p.grad = total[name] * coefficient
        if self.muon is not None:
            for part in shares if self.on(MUON) else [total]:
                for name in self.matrices:
                    self.params[name].grad = part[name] * coefficient
                self.muon.step()
        self.optimizer.step()

    def _replay(self, x: torch.Tensor, y: torch.Tensor, count: int) -> Callable[[], torch.Tensor]:
        """The loss of micro-batch (x, y) as the loop backpropagated it, for the monitor's replay."""

        def loss() -> torch.Tensor:
            return self.loss_of(x, y) * self.loss_factor(count)

        return loss

    def _load(self, values: Grads) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(values[name])


def main(argv: list[str]) -> int:
    results, out, mechanisms = Path(argv[0]), Path(argv[1]), argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    for mechanism in mechanisms:
        for bug in (True, False):
            folder = out / mechanism / ("broken" if bug else "fixed")
            summary = Loop(mechanism, bug).run(folder)
            if rank == 0:
                record = {"mechanism": mechanism, "bug": bug, "folder": str(folder),
                          "checks": summary["checks"], "violation_count": summary["violation_count"],
                          "violations": [{k: v.get(k) for k in VIOLATION_FIELDS}
                                         for v in summary["violations"]]}
                with results.open("a") as fh:
                    fh.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
