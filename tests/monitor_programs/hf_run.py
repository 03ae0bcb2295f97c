"""Under torchrun: a tiny Hugging Face ``Trainer`` run on the CPU (DDP over gloo) with
zerosim.monitor.hf.ZeroMonitorCallback, for tests/test_monitor_frameworks.py.

argv: RESULT_JSON OUT_DIR STEPS EVERY. Rank 0 writes the callback's summary.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import Trainer, TrainingArguments

from zerosim.monitor.hf import ZeroMonitorCallback


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(6, 10)
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), labels)}


def main() -> None:
    result, out, steps, every = sys.argv[1:]
    gen = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(6, generator=gen), "labels": torch.randn(3, generator=gen)} for _ in range(64)]
    args = TrainingArguments(output_dir=out + "/trainer", per_device_train_batch_size=2, max_steps=int(steps),
                             logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
                             ddp_backend="gloo", disable_tqdm=True, learning_rate=1e-2, max_grad_norm=1.0)
    callback = ZeroMonitorCallback(every=int(every), out=out + "/monitor", log=lambda line: None)
    Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[callback]).train()
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(callback.summary, f)
    dist.barrier()
    dist.destroy_process_group()
    from zerogpu.rank import leave_rank  # os._exit after the teardown: a gloo finalizer can abort at exit

    leave_rank(0)


if __name__ == "__main__":
    main()
