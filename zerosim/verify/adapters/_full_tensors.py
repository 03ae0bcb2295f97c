"""Full values of many dim-0-sharded DTensors with one all-gather, for the observations a rank sends.

``DTensor.full_tensor()`` is one collective per tensor, each a synchronisation point of every rank;
an FSDP2 model's parameters and optimizer states are dozens of tensors, so a step's observation
(C-ZERO-002's parameters and optimizer state, C-ZERO-003's replicas) would cost dozens of rounds.
:func:`full_tensors` concatenates this rank's local shards into one flat buffer, all-gathers that
over the shard dimension of the mesh (one round per dtype), and cuts every full tensor out of the
result. An all-gather copies bytes, so each result equals what ``full_tensor()`` returns bit for bit.

Handled: DTensors whose placements are ``Shard(0)`` on one mesh dimension and ``Replicate()`` on the
others (FSDP2's and HSDP's), split as ``torch.chunk`` splits dim 0. Anything else (another placement,
a plain tensor) gets ``full_tensor()`` or a detached copy, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


def _shard_dim(value: DTensor) -> int | None:
    """The mesh dimension ``value`` is split over on tensor dim 0 (replicated over every other one), or
    None for any other layout."""
    shard = [i for i, p in enumerate(value.placements) if isinstance(p, Shard) and p.dim == 0]
    rest = [p for i, p in enumerate(value.placements) if i not in shard]
    if len(shard) != 1 or not all(isinstance(p, Replicate) for p in rest) or value.dim() == 0:
        return None
    return shard[0]


def _chunk_numels(value: DTensor, chunks: int) -> list[int]:
    """Elements of ``value``'s local shard on each of the ``chunks`` ranks of its shard group."""
    rows = int(value.shape[0])
    row = value.numel() // rows if rows else 0
    return [int(Shard.local_shard_size_and_offset(rows, chunks, j)[0]) * row for j in range(chunks)]


def full_tensors(values: list[Any]) -> list[torch.Tensor]:
    """Detached full copies of ``values`` (DTensors or plain tensors), in order; every rank of the mesh
    must call it with the same tensors (it is a collective, as ``full_tensor()`` is)."""
    out: list[torch.Tensor | None] = [None] * len(values)
    batches: dict[tuple[Any, ...], list[int]] = {}
    for i, value in enumerate(values):
        dim = _shard_dim(value) if isinstance(value, DTensor) else None
        if dim is None:
            out[i] = value.full_tensor().detach() if isinstance(value, DTensor) else value.detach().clone()
            continue
        key = (id(value.device_mesh), dim, value.dtype, value.to_local().device)
        batches.setdefault(key, []).append(i)
    for indices in batches.values():
        for i, full in zip(indices, _gather_batch([values[i] for i in indices]), strict=True):
            out[i] = full
    assert all(t is not None for t in out)
    return [t for t in out if t is not None]


def _gather_batch(values: list[DTensor]) -> list[torch.Tensor]:
    """One all-gather of the flat concatenation of ``values``' local shards (same mesh, shard dimension,
    dtype and device) over the shard group, padded to the longest rank's total."""
    mesh = values[0].device_mesh
    dim = _shard_dim(values[0])
    assert dim is not None
    chunks = mesh.size(dim)
    me = mesh.get_local_rank(dim)
    numels = [_chunk_numels(v, chunks) for v in values]
    locals_ = [v.to_local().detach().reshape(-1) for v in values]
    if any(local.numel() != n[me] for local, n in zip(locals_, numels, strict=True)):
        return [v.full_tensor().detach() for v in values]  # not torch.chunk's split: the general path
    totals = [sum(n[j] for n in numels) for j in range(chunks)]
    width = max(totals)
    send = torch.zeros(width, dtype=values[0].dtype, device=locals_[0].device)
    if totals[me]:
        send[: totals[me]].copy_(torch.cat(locals_))
    received = torch.empty(chunks * width, dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(received, send, group=mesh.get_group(dim))
    starts = [j * width for j in range(chunks)]
    fulls = []
    for value, n in zip(values, numels, strict=True):
        pieces = []
        for j in range(chunks):
            pieces.append(received[starts[j] : starts[j] + n[j]])
            starts[j] += n[j]
        fulls.append(torch.cat(pieces).reshape(value.shape))
    return fulls
