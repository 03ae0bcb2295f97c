"""Where a monitored DDP loop on a GPU makes the host wait: every synchronising CUDA operation of 5 steps
(after 3 warm-up steps), counted by the stack of zerosim frames that asked for it.

Run from a checkout with the project importable, on one CUDA device: ``python3 monitor_syncs.py``."""

import collections
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist

from zerosim.monitor import Monitor

seen: collections.Counter[str] = collections.Counter()


def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message).lower():
        return
    frames = [f for f in traceback.extract_stack()[:-1] if "zerosim" in f.filename]
    where = [f"{f.filename.split('zerosim/')[-1]}:{f.lineno}:{f.name}" for f in frames[::-1][:6]]
    seen[" <- ".join(where)] += 1


def main() -> None:
    warnings.showwarning = show
    store = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    for fused in (True, False):
        for clip in ({"max_norm": 1.0}, {"max_grad_norm": 1.0}):
            torch.manual_seed(0)
            layers = (torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
            model = torch.nn.Sequential(*layers).cuda()
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
            monitor = Monitor(ddp, opt, every=1, log=lambda line: None, **clip)
            x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
            seen.clear()
            for step in range(8):
                opt.zero_grad()
                if step >= 3:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                    warnings.simplefilter("always")
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                monitor.after_step(step, loss=loss.detach(), grad_norm=norm)
                torch.cuda.set_sync_debug_mode("default")
            print(f"== fused={fused} {clip}: {sum(seen.values())} syncs in 5 steps")
            for where, count in seen.most_common():
                print(count, where)
            print(monitor.close())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
