"""The monitor's own process group, its two collectives on it, and the row each rank contributes.

* :func:`monitor_group`: a process group of every rank made for the monitor alone (``new_group``, at
  ``Monitor()``), with the monitor's own timeout: its collectives are ordered among themselves only,
  never among the training's, so a rank that calls the monitor on other steps than the rest cannot
  put the training's collectives out of order.
* :func:`exchange_keys`: every rank's layout keys (JSON bytes, never pickle), gathered at ``Monitor()``
  and again whenever a rank's layout fingerprint changes: two all-gathers (lengths, then the padded
  bytes).
* :func:`start_gather`: one all-gather of a small int64 row per rank at every check, posted without
  waiting so that it can complete while training goes on: two digest lanes per held piece and a fixed
  summary (:data:`SUMMARY`; ``step`` and ``phase`` say which check, or that the rank is closing or
  off), floats carried as their float64 bits. :meth:`Gather.wait` waits for it at most a given time.

Both run on the device the backend communicates from (the current CUDA device under NCCL, the CPU
otherwise).
"""

from __future__ import annotations

import datetime
import json
import struct
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

#: the summary fields after the digest lanes, in order
SUMMARY = ("fingerprint", "n_held", "step", "phase", "missing", "missing_idx", "nonfinite", "nonfinite_idx",
           "has_counters", "step_min", "step_max", "step_min_idx", "has_grad", "grad_sq", "grad_numel",
           "has_norm", "grad_norm", "has_loss", "loss")
FLOAT_FIELDS = ("grad_sq", "grad_norm", "loss")
#: where the layout fingerprint sits in the summary
FINGERPRINT = SUMMARY.index("fingerprint")
STEP = SUMMARY.index("step")
PHASE = SUMMARY.index("phase")
#: ``phase`` values: a check's row; a rank closing the monitor; a rank whose monitor turned itself off
CHECK, CLOSING, OFF = 0, 1, 2


class ExchangeFailed(RuntimeError):
    """One of the monitor's collectives failed: the other ranks did not contribute within the monitor's
    timeout, or the collective itself raised."""


def monitor_group(timeout_s: float) -> Any:
    """A new process group of every rank, on the default group's backend, for the monitor's collectives
    only, whose collectives give up after ``timeout_s`` seconds. Collective over the default group."""
    return dist.new_group(backend=str(dist.get_backend()),
                          timeout=datetime.timedelta(seconds=timeout_s))


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


def exchange_keys(keys: dict[str, Any], device: torch.device, group: Any = None,
                  timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Every rank's ``keys`` (JSON-serialisable), in rank order, gathered over ``group``; each of the two
    all-gathers waited for at most ``timeout_s`` seconds (:class:`ExchangeFailed`)."""
    world = dist.get_world_size()
    data = json.dumps(keys, separators=(",", ":")).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.zeros(world, 1, dtype=torch.int64, device=device)
    _wait(dist.all_gather(list(lengths.unbind(0)), length, group=group, async_op=True), timeout_s)
    sizes = lengths.reshape(-1).tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = torch.zeros(world, longest, dtype=torch.uint8, device=device)
    _wait(dist.all_gather(list(gathered.unbind(0)), mine, group=group, async_op=True), timeout_s)
    table = gathered.cpu()
    return [json.loads(bytes(table[r, :n].tolist()).decode()) for r, n in enumerate(sizes)]


def _wait(work: Any, timeout_s: float | None) -> None:
    """Wait for ``work`` (a posted collective) at most ``timeout_s`` seconds (None: without bound)."""
    if timeout_s is not None and not _poll(work.is_completed, timeout_s):
        raise ExchangeFailed(f"the other ranks did not join the monitor's exchange within {timeout_s:g} s")
    try:
        work.wait()
    except Exception as err:  # noqa: BLE001 - the backend's own error, as the monitor's
        raise ExchangeFailed(f"the monitor's exchange failed: {err}") from None


def _poll(done: Any, timeout_s: float) -> bool:
    """Whether ``done()`` turns true within ``timeout_s`` seconds, asked at growing intervals (50 us to
    10 ms): what a completed collective costs is one call."""
    if done():
        return True
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while time.monotonic() < deadline:
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        if done():
            return True
        pause = min(pause * 2, 0.01)
    return bool(done())


#: per device: the side stream a gathered table is copied to the host on (the training's stream never
#: waits for the monitor's collective)
_SIDE: dict[int, Any] = {}


class Gather:
    """One all-gather of every rank's row over the monitor's group, posted without waiting
    (``async_op``): :meth:`wait` gives the host table, one row per rank in rank order. The i-th gather
    a rank posts is matched with the i-th of every other rank, whatever step each was posted at (the
    row's ``step`` and ``phase`` say which).

    On an accelerator the table is copied into page-locked host memory behind the gather on a side
    stream, and an event is recorded after the copy: the training's stream never waits for the
    monitor's collective, and :meth:`wait` waits for that event only."""

    def __init__(self, row: torch.Tensor, group: Any = None):
        self.row = row  # kept alive (and unchanged) until the gather is complete
        self.out = torch.empty(dist.get_world_size(), row.numel(), dtype=row.dtype, device=row.device)
        self.work = dist.all_gather(list(self.out.unbind(0)), row, group=group, async_op=True)
        self.host: torch.Tensor | None = None
        self.done: Any = None
        if row.device.type == "cuda":
            index = row.device.index if row.device.index is not None else torch.cuda.current_device()
            side = _SIDE.get(index)
            if side is None:
                side = _SIDE[index] = torch.cuda.Stream(device=row.device)
            with torch.cuda.stream(side):
                self.work.wait()  # the side stream waits for the gather; neither the host nor training
                self.host = torch.empty(self.out.shape, dtype=self.out.dtype, pin_memory=True)
                self.host.copy_(self.out, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record(side)

    def is_done(self) -> bool:
        """Whether the table has arrived (the gather is complete, and copied to the host)."""
        if self.host is not None:
            return bool(self.work.is_completed()) and bool(self.done.query())
        return bool(self.work.is_completed())

    def wait(self, timeout_s: float | None = None) -> np.ndarray | None:
        """The gathered table; None when it has not arrived within ``timeout_s`` seconds (None: wait
        without bound other than the group's own timeout)."""
        if timeout_s is not None and not _poll(self.is_done, timeout_s):
            return None
        try:
            self.work.wait()  # raises the collective's own error, if it failed
            if self.host is not None:
                self.done.synchronize()
                return self.host.numpy()
        except Exception as err:  # noqa: BLE001 - the backend's own error, as the monitor's
            raise ExchangeFailed(f"the monitor's exchange failed: {err}") from None
        return self.out.cpu().numpy()


def start_gather(row: torch.Tensor, group: Any = None) -> Gather:
    """Post the all-gather of ``row`` (the same length on every rank) over ``group``;
    :meth:`Gather.wait` completes it."""
    return Gather(row, group)


def summary_values(row: Any, width: int) -> dict[str, Any]:
    """The summary fields of a gathered row (a numpy or torch int64 vector) whose digest part is
    ``width`` lanes long."""
    values = row[width: width + len(SUMMARY)].tolist()
    out: dict[str, Any] = dict(zip(SUMMARY, values, strict=True))
    for key in FLOAT_FIELDS:
        out[key] = bits_float(out[key])
    return out
