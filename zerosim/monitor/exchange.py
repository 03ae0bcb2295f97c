"""The monitor's two collectives over the default process group, and the row each rank contributes.

* :func:`exchange_keys`: every rank's layout keys (JSON bytes, never pickle), gathered once and again
  whenever a rank's layout fingerprint changes: two all-gathers (lengths, then the padded bytes).
* :func:`start_gather`: one all-gather of a small int64 row per
  rank at every check, posted without waiting so that it can complete while training goes on: two
  digest lanes per held piece and a fixed summary (:data:`SUMMARY`), floats carried as their float64
  bits.

Both run on the device the backend communicates from (the current CUDA device under NCCL, the CPU
otherwise) and are bounded by the process group's own timeout.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

#: the summary fields after the digest lanes, in order
SUMMARY = ("fingerprint", "n_held", "step", "missing", "missing_idx", "nonfinite", "nonfinite_idx",
           "has_counters", "step_min", "step_max", "step_min_idx", "has_grad", "grad_sq", "grad_numel",
           "has_norm", "grad_norm", "has_loss", "loss")
FLOAT_FIELDS = ("grad_sq", "grad_norm", "loss")
#: where the layout fingerprint sits in the summary
FINGERPRINT = SUMMARY.index("fingerprint")


def comm_device() -> torch.device:
    """Where the default group's tensors must live."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def float_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(value)))[0])


def bits_float(value: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(value)))[0])


def exchange_keys(keys: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Every rank's ``keys`` (JSON-serialisable), in rank order."""
    world = dist.get_world_size()
    data = json.dumps(keys, separators=(",", ":")).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = max(int(t.item()) for t in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [json.loads(bytes(t.cpu()[: int(n.item())].tolist()).decode())
            for t, n in zip(out, lengths, strict=True)]


class Gather:
    """One all-gather of every rank's row, posted without waiting (``async_op``): :meth:`wait` gives the
    host table, one row per rank in rank order. Posted at the same point of every rank's sequence of
    collectives on the default group, it is matched with the other ranks' in that order, whatever
    training collectives are posted after it.

    On an accelerator the table is copied into page-locked host memory behind the gather, on the
    current stream, and an event is recorded after the copy: :meth:`wait` waits for that event only,
    not for the work queued after it (the next step's kernels), so a check completed one step later
    finds the table there and the host does not give up its lead over the device."""

    def __init__(self, row: torch.Tensor):
        self.row = row  # kept alive (and unchanged) until the gather is complete
        self.out = torch.empty(dist.get_world_size(), row.numel(), dtype=row.dtype, device=row.device)
        self.work = dist.all_gather(list(self.out.unbind(0)), row, async_op=True)
        self.host: torch.Tensor | None = None
        self.done: Any = None
        if row.device.type == "cuda":
            self.work.wait()  # the current stream waits for the gather; the host does not
            self.host = torch.empty(self.out.shape, dtype=self.out.dtype, pin_memory=True)
            self.host.copy_(self.out, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> np.ndarray:
        if self.host is not None:
            self.done.synchronize()
            return self.host.numpy()
        self.work.wait()
        return self.out.cpu().numpy()


def start_gather(row: torch.Tensor) -> Gather:
    """Post the all-gather of ``row`` (the same length on every rank); :meth:`Gather.wait` completes it."""
    return Gather(row)


def summary_values(row: Any, width: int) -> dict[str, Any]:
    """The summary fields of a gathered row (a numpy or torch int64 vector) whose digest part is
    ``width`` lanes long."""
    values = row[width:].tolist()
    out: dict[str, Any] = dict(zip(SUMMARY, values, strict=True))
    for key in FLOAT_FIELDS:
        out[key] = bits_float(out[key])
    return out
