"""zerogpu: the torch.distributed backend (NCCL on GPU, gloo on CPU) of the zerosim engine and contracts.

- :class:`zerogpu.ZeroTrainer` (:mod:`zerogpu.trainer`): the engine around any torch ``nn.Module``
  (ZeRO-1/2/3, hybrid), :mod:`zerogpu.module_units` (which submodules are gathered together),
  :mod:`zerogpu.module_engine` (autograd meets the engine), :class:`zerogpu.OffloadConfig` /
  :mod:`zerogpu.offload` (ZeRO-3 parameter shards on a host tier, fetched within a device budget).
- :mod:`zerogpu.comm`: the TorchCommunicator (the engine's collectives, timeouts, traffic accounting).
- :mod:`zerogpu.simulate`, :mod:`zerogpu.equivalence`, :mod:`zerogpu.selftest`: what runs on each
  torchrun rank (``torchrun --nproc-per-node N -m zerogpu <command>``); :mod:`zerogpu.rank`: the
  failure policy every rank follows; :mod:`zerogpu.program`: the per-rank program on the device.
- :mod:`zerogpu.launch`: starting torchrun (``zerosim simulate --backend torch``);
  :mod:`zerogpu.gpu_report`: ``python -m zerogpu report`` (JSON + markdown, needs CUDA or ``--cpu``).
- :mod:`zerogpu.agreement`: how closely a torchrun run matches the in-process simulator.

``ZeroTrainer`` and ``OffloadConfig`` are imported on first use, so ``import zerogpu`` needs no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OffloadConfig", "ZeroTrainer"]

#: What every rank of ``python -m zerogpu simulate|equivalence|selftest-comm`` imports whatever its
#: options (:mod:`zerogpu.rank_zygote` imports them once before forking the ranks; none starts a
#: thread or touches a device at import). ``selftest-comm`` needs only the first two.
RANK_IMPORTS = ("zerogpu.comm", "zerogpu.rank", "zerogpu.program", "zerosim.engine.run_file")


def __getattr__(name: str) -> Any:
    if name == "ZeroTrainer":
        from .trainer import ZeroTrainer

        return ZeroTrainer
    if name == "OffloadConfig":
        from .offload import OffloadConfig

        return OffloadConfig
    raise AttributeError(f"module 'zerogpu' has no attribute {name!r}")
