"""Load a full torch state dict into a :class:`~zerogpu.trainer.ZeroTrainer` from rank 0.

::

    trainer = ZeroTrainer(model, optim, "zero3")
    result = load_state_dict(trainer, "model.safetensors")      # collective; rank 0 reads the file
    result.missing_keys, result.unexpected_keys

    module = DistModule(trainer)                                 # the same, as methods
    module.load_state_dict("model.pt", strict=False)
    weights = module.state_dict()                                # collective: full tensors on every rank

Only rank 0 opens the file (``.safetensors``, or a torch ``.pt`` / ``.pth`` / ``.bin`` loaded with
``weights_only=True``); the tensors are broadcast one at a time (or in buckets of at most
``bucket_bytes``) and every rank keeps only its shard of the master
(:func:`zerosim.checkpoint.broadcast.broadcast_and_shard_state_dict`). Names are the module's
``named_parameters()`` names; a tied weight may appear under any of its names, as in
``module.state_dict()``. The module's persistent buffers (``named_buffers()``) are loaded too, whole
on every rank. Everything is validated on rank 0 before anything changes: a missing or unexpected
key (strict, or reported when ``strict=False``), a shape or dtype that differs from the module's
(no silent casts) is one ConfigError naming the tensor, raised on every rank.

After the master shards are in place the working parameters are rebuilt in place: under ZeRO-1/2
and DDP the parameters stay views into the engine's flat parameters (refilled by the engine's
all-gather or cast); under ZeRO-3 the next forward gathers the units from the new shards. The
optimizer state is untouched, as with torch's ``Module.load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerosim.checkpoint.broadcast import BroadcastLoadResult, broadcast_and_shard_state_dict
from zerosim.engine.rank_state import RankState
from zerosim.errors import ConfigError

StateDictSource = str | Path | Mapping[str, Any]


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` would contain (non-persistent ones excluded)."""
    keys = set(module.state_dict(keep_vars=True))
    return {name: b for name, b in module.named_buffers() if name in keys}


def load_state_dict(
    trainer: Any, source: StateDictSource | None, strict: bool = True, *, bucket_bytes: int = 0
) -> BroadcastLoadResult:
    """Load a full state dict into ``trainer`` (a ZeroTrainer; collective: every rank calls it between
    steps). ``source`` is read on rank 0 only: a file path or an in-memory mapping of tensors; other
    ranks may pass None. Returns this rank's result (``missing_keys``, ``unexpected_keys``, files
    opened, bytes read, broadcasts)."""
    state = getattr(trainer, "state", None)
    module = getattr(trainer, "model", None)
    if not isinstance(state, RankState) or not isinstance(module, torch.nn.Module):
        raise ConfigError("trainer", type(trainer).__name__, "must be a zerogpu.ZeroTrainer")
    buffers = _persistent_buffers(module)
    spec = {name: (tuple(b.shape), str(b.dtype).removeprefix("torch.")) for name, b in buffers.items()}
    with torch.no_grad():
        result = broadcast_and_shard_state_dict(state, source, strict=strict, bucket_bytes=bucket_bytes,
                                                replicated=spec)
        for name, value in result.replicated.items():
            target = buffers[name]
            target.copy_(_to_torch(value).to(target.device).view(target.shape))
    trainer.schedule.params_refreshed()  # the offload tier's copy of the shards follows the load
    return result


def _to_torch(value: np.ndarray) -> torch.Tensor:
    if value.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: reinterpret the bits
        return torch.from_numpy(np.ascontiguousarray(value).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(value))


class DistModule:
    """A module trained by a :class:`~zerogpu.trainer.ZeroTrainer`, with torch's state-dict methods in
    their distributed form (``load_state_dict`` from rank 0, ``state_dict`` gathered). Calling it runs
    the module's forward."""

    def __init__(self, trainer: Any):
        if not isinstance(getattr(trainer, "model", None), torch.nn.Module):
            raise ConfigError("trainer", type(trainer).__name__, "must be a zerogpu.ZeroTrainer")
        self.trainer = trainer
        self.module: torch.nn.Module = trainer.model

    def load_state_dict(
        self, source: StateDictSource | None, strict: bool = True, *, bucket_bytes: int = 0
    ) -> BroadcastLoadResult:
        """See :func:`load_state_dict` (collective)."""
        return load_state_dict(self.trainer, source, strict, bucket_bytes=bucket_bytes)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer, full, on every rank (collective under ZeRO-3)."""
        out: dict[str, torch.Tensor] = dict(self.trainer.full_parameters())
        out.update({name: b.detach().clone() for name, b in _persistent_buffers(self.module).items()})
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
