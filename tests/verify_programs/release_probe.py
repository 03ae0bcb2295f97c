"""Under torchrun: every adapter named is built, stepped twice and dropped, twice over; each rank
reports whether the trainer, its model and its engine state (ZeroTrainer) or engine (DeepSpeed) were
collected.

``release_probe.py MODE ADAPTER[,ADAPTER...]``: MODE ``close`` calls the trainer's optional
``close()`` first (what ``zerosim verify`` and ``zerosim bench peers`` do), ``drop`` only deletes it.
One JSON line per rank and build: ``{"adapter", "mode", "alive": [names still reachable], "hooks":
hooks left on the model}``.
"""

from __future__ import annotations

import gc
import json
import sys
import weakref

import torch.distributed as dist

from zerogpu.trainer import ZeroTrainer
from zerosim.bench.peers_method import optim_config
from zerosim.verify.model import build_model, micro_batch
from zerosim.verify.protocol import close_trainer
from zerosim.verify.targets import resolve_factory


def hooks_left(model) -> int:
    """Forward hooks on every submodule plus post-accumulate-grad hooks on every parameter."""
    count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return count + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def main() -> int:
    mode, adapters = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for adapter in adapters:
        for build in range(2):
            model = build_model("gpt", "float32")
            trainer = resolve_factory(adapter)(model, optim_config("adamw"))
            for step in (1, 2):
                trainer.step(*micro_batch(rank, step))
            refs = {"trainer": weakref.ref(trainer), "model": weakref.ref(model)}
            if isinstance(trainer, ZeroTrainer):
                refs["state"] = weakref.ref(trainer.state)
            elif getattr(trainer, "engine", None) is not None:  # a DeepSpeed adapter's engine
                refs["engine"] = weakref.ref(trainer.engine)
            if mode == "close":
                close_trainer(trainer)
                hooks = hooks_left(model)
            del trainer
            if mode == "drop":
                gc.collect()
                hooks = hooks_left(model)
            del model
            gc.collect()
            alive = sorted(name for name, ref in refs.items() if ref() is not None)
            print(json.dumps({"rank": rank, "adapter": adapter, "mode": mode, "build": build,
                              "alive": alive, "hooks": hooks}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
