"""Whole-state checkpoints for the replicated adapters (``ddp``, ``torch-zero``): one torch file.

Rank 0 writes the model's ``state_dict()`` and a full optimizer state dict with ``torch.save`` (to a
temporary name, then renamed, so a save killed midway leaves no half-written file under the final
name); every rank then waits at a barrier. Loading reads the file on every rank with
``weights_only=True`` (tensors and plain containers only, never pickled code), so any world size can
load what any other saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FILE_NAME = "trainer.pt"


def save_full(directory: Any, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None,
              loss_scale: dict[str, float] | None = None) -> None:
    """Rank 0 writes ``{"model": ..., "optimizer": ...}`` (and ``"loss_scale"``, the dynamic loss scale's
    state, when given) under ``directory``; collective (barrier)."""
    if dist.get_rank() == 0:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (FILE_NAME + ".tmp")
        with open(tmp, "wb") as f:
            saved = {"model": model_state, "optimizer": optimizer_state}
            if loss_scale is not None:
                saved["loss_scale"] = loss_scale
            torch.save(saved, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / FILE_NAME)
    dist.barrier()


def load_full(directory: Any) -> dict[str, Any]:
    """The dict :func:`save_full` wrote, read on this rank to the CPU."""
    return dict(torch.load(Path(directory) / FILE_NAME, map_location="cpu", weights_only=True))
