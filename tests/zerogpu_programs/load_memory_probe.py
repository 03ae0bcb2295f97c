"""Peak memory of a rank-0 load of a ~1 GB state dict into ZeroTrainer (ZeRO-3), per rank.

Not a test (it moves a gigabyte); run by hand::

    python tests/zerogpu_programs/load_memory_probe.py make DIR            # DIR/big.safetensors, 1.0 GB
    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/zerogpu_programs/load_memory_probe.py load DIR

The model is ten bias-free 5000 x 5000 float32 Linear layers (250,000,000 parameters). Its
parameters are allocated on the meta device and moved to empty host storage, so building it touches
no memory; the trainer's set-up then runs before the measurement starts. Each rank returns freed heap
to the system, records ``ru_maxrss`` and its current RSS, resets the kernel's peak (``clear_refs``
5; VmHWM), loads (only rank 0 is given the path), and prints one JSON line: the RSS peak during the
load above the RSS before it, against the largest tensor and the rank's master shard.
"""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import sys
import time
from pathlib import Path

LAYERS, WIDTH = 10, 5000


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def make(directory: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    state = {f"layers.{i}.weight": rng.standard_normal((WIDTH, WIDTH), dtype=np.float32)
             for i in range(LAYERS)}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "big.safetensors"))


def load(directory: Path) -> None:
    import torch
    import torch.distributed as dist

    from zerogpu.state_dict import load_state_dict
    from zerogpu.trainer import ZeroTrainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with torch.device("meta"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))
    model = model.to_empty(device="cpu")
    trainer = ZeroTrainer(model, {"name": "sgd", "lr": 0.1}, "zero3")
    e = trainer.state
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    t0 = time.perf_counter()
    result = load_state_dict(trainer, directory / "big.safetensors" if rank == 0 else None)
    seconds = time.perf_counter() - t0
    hwm_after = _status_kib("VmHWM")
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    largest = max(t.nbytes for t in e.layout.tensors)
    shard = e.xp.nbytes(e.master)
    peak_delta = (hwm_after - rss_before) * 1024
    print(json.dumps({
        "rank": rank, "seconds": round(seconds, 2), "files_opened": result.files_opened,
        "bytes_read": result.bytes_read, "broadcasts": result.broadcasts,
        "largest_tensor_bytes": largest, "shard_bytes": shard,
        "rss_before_bytes": rss_before * 1024, "peak_delta_bytes": peak_delta,
        "ru_maxrss_before_kib": ru_before, "ru_maxrss_after_kib": ru_after,
        "ratio_to_largest_plus_shard": round(peak_delta / (largest + shard), 3),
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    what, where = sys.argv[1], Path(sys.argv[2])
    make(where) if what == "make" else load(where)
    from zerogpu.rank import leave_rank

    leave_rank(0)
