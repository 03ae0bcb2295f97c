"""Where the monitor makes the host wait on a GPU: every synchronising op's stack, zerosim frames only."""
import collections, sys, tempfile, traceback, warnings
import torch, torch.distributed as dist
from zerosim.monitor import Monitor

seen = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message).lower():
        return
    frames = [f for f in traceback.extract_stack()[:-1] if "zerosim" in f.filename]
    seen[" <- ".join(f"{f.filename.split('zerosim/')[-1]}:{f.lineno}:{f.name}" for f in frames[::-1][:6])] += 1
warnings.showwarning = show
d = tempfile.mkdtemp()
dist.init_process_group("nccl", init_method=f"file://{d}/store", rank=0, world_size=1, device_id=torch.device("cuda", 0))
for fused in (True, False):
  for kw in ({}, {"max_grad_norm": 1.0}):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    mon = Monitor(ddp, opt, every=1, log=lambda line: None, **({"max_norm": 1.0} if not kw else kw))
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    seen.clear()
    for step in range(8):
        opt.zero_grad()
        if step >= 3:
            torch.cuda.synchronize(); torch.cuda.set_sync_debug_mode("warn"); warnings.simplefilter("always")
        loss = torch.nn.functional.mse_loss(ddp(x), y); loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
        mon.after_step(step, loss=loss.detach(), grad_norm=norm)
        torch.cuda.set_sync_debug_mode("default")
    print(f"== fused={fused} {kw}: {sum(seen.values())} syncs in 5 steps"); 
    for k, v in seen.most_common(): print(v, k)
    print(mon.close())
dist.destroy_process_group()
