"""A low-precision compute copy of a float32 model under DDP, for the replicated adapters' mixed precision.

The float32 model the trainer was given holds the masters (its optimizer steps them). A deep copy cast
to ``param_dtype`` runs forward and backward under DistributedDataParallel, whose comm hook
(:meth:`ComputeCopy.reduce_hook`) takes each bucket's ``param_dtype`` gradients, upcasts them to
float32, adds what earlier micro-batches left on the masters, casts the sum to ``reduce_dtype``,
divides it by the world size and all-reduces it (through ``torch.distributed.all_reduce``, so the
traffic records carry the real dtype), and writes the result, in float32, to the masters' ``.grad``.
The copy's own gradients are left as DDP computed them and never stepped.

Under gradient accumulation DDP's ``no_sync()`` accumulates the copy's gradients in ``param_dtype``;
:meth:`ComputeCopy.hold_local` moves them after each micro-batch but the last onto the masters' ``.grad``
in float32 instead (local, unreduced), so accumulation happens in float32 and one all-reduce per
optimizer step moves the sum. After each optimizer step :meth:`ComputeCopy.refresh` casts the masters
into the copy (round to nearest even): the next forward computes with them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._mixed_precision import MixedPolicy


class ComputeCopy:
    """``param_dtype`` forward and backward of a float32 master model, float32 gradients on the masters."""

    def __init__(self, master: torch.nn.Module, policy: MixedPolicy):
        self.master = master
        self.policy = policy
        self.module = copy.deepcopy(master).to(policy.param_dtype)
        pairs = list(zip(self.module.parameters(), master.parameters(), strict=True))
        self._master_of = {id(c): m for c, m in pairs}
        self.world = dist.get_world_size()
        device = next(master.parameters()).device
        self.ddp = DistributedDataParallel(
            self.module, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        # DDP checks a hook's annotations against the classes themselves; the lambda has none
        self.ddp.register_comm_hook(None, lambda _state, bucket: self.reduce_hook(bucket))

    def reduce_hook(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """DDP comm hook: the bucket's gradients (plus held float32 ones), averaged in ``reduce_dtype``
        over the world, onto the masters' ``.grad`` in float32 (see the module docstring)."""
        pieces = []
        masters = []
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            m = self._master_of[id(p)]
            piece = g.detach().reshape(-1).to(torch.float32)
            if m.grad is not None:
                piece = piece + m.grad.reshape(-1)
            pieces.append(piece)
            masters.append(m)
        flat = torch.cat(pieces).to(self.policy.reduce_dtype)
        flat.div_(self.world)
        dist.all_reduce(flat)
        offset = 0
        for m in masters:
            n = m.numel()
            m.grad = flat[offset:offset + n].to(torch.float32).view_as(m).clone()
            offset += n
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    @torch.no_grad()
    def hold_local(self) -> None:
        """After a ``no_sync`` backward: the copy's gradients, upcast, added onto the masters' ``.grad``
        (local sums, not yet reduced); the copy's gradients are zeroed."""
        for c in self.module.parameters():
            if c.grad is None:
                continue
            m = self._master_of[id(c)]
            g = c.grad.to(torch.float32)
            m.grad = g.clone() if m.grad is None else m.grad.add_(g)
            c.grad.zero_()

    def zero_grad(self) -> None:
        """No gradient on the copy (DDP's bucket views are reused) nor on the masters."""
        for c in self.module.parameters():
            if c.grad is not None:
                c.grad.zero_()
        for m in self.master.parameters():
            m.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The masters cast into the copy: what the next forward computes with."""
        for c in self.module.parameters():
            c.copy_(self._master_of[id(c)])
