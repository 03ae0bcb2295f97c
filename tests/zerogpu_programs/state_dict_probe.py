"""Under torchrun: rank 0 loads a full state dict file into a ZeroTrainer; every rank reports its shard.

``state_dict_probe.py DIR``: ``DIR/model.safetensors`` and ``DIR/model.pt`` hold the same full state
dict of the tied GPT (written by the test), ``DIR/short.safetensors`` one tensor fewer. For every
strategy the trainer is built on the seed's weights and loads a file; only rank 0 is given its path
(the others pass ``DIR/absent.safetensors``, which does not exist: a rank that tried to open it
would fail). Each rank writes JSON lines to ``DIR/rank<r>.jsonl``: per case the pieces and values of
its master shard, its full working parameters and what the load did; then one after a strict load
of the short file (the error every rank raised).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zerogpu.state_dict import DistModule, load_state_dict
from zerogpu.trainer import ZeroTrainer
from zerosim.engine.observation import full_params_view
from zerosim.errors import ConfigError
from zerosim.verify.model import build_model

CASES = (("ddp", "model.safetensors", 0), ("zero1", "model.pt", 0), ("zero2", "model.safetensors", 4096),
         ("zero3", "model.safetensors", 0), ("zero3", "model.pt", 1 << 20),
         ("hybrid", "model.safetensors", 0))


def main() -> int:
    directory = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = (directory / f"rank{rank}.jsonl").open("w")
    for strategy, file, bucket in CASES:
        model = build_model("gpt-tied", "float32")
        trainer = ZeroTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        source = directory / (file if rank == 0 else "absent.safetensors")
        result = load_state_dict(trainer, source, bucket_bytes=bucket)
        e = trainer.state
        print(json.dumps({
            "case": f"{strategy}:{file}:{bucket}", "strategy": strategy, "rank": rank,
            "pieces": [list(p) for p in e.owned_pieces], "master": e.xp.to_numpy(e.master).tolist(),
            "params": full_params_view(e).tolist(), "files_opened": result.files_opened,
            "bytes_read": result.bytes_read, "broadcasts": result.broadcasts,
            "largest_buffer_bytes": result.largest_buffer_bytes, "missing": result.missing_keys,
            "unexpected": result.unexpected_keys,
        }), file=out, flush=True)
        trainer.schedule.remove_hooks()
    model = build_model("gpt-tied", "float32")
    trainer = ZeroTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero3")
    before = trainer.state.xp.to_numpy(trainer.state.master, copy=True)
    try:
        DistModule(trainer).load_state_dict(directory / "short.safetensors" if rank == 0 else None)
        error = ""
    except ConfigError as err:
        error = str(err)
    unchanged = bool((trainer.state.xp.to_numpy(trainer.state.master) == before).all())
    print(json.dumps({"case": "strict", "rank": rank, "error": error, "unchanged": unchanged}), file=out,
          flush=True)
    out.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from zerogpu.rank import leave_rank

    leave_rank(main())
