import time, torch
n = 1 << 26
d = torch.empty(n, device="cuda"); h = torch.empty(n, pin_memory=True); u = torch.empty(n)
def t(f, r=5):
    f(); torch.cuda.synchronize(); ts=[]
    for _ in range(r):
        a=time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]
b = 4*n/1e9
print(f"h2d pinned {b/t(lambda: d.copy_(h, non_blocking=True)):.1f} GB/s")
print(f"d2h pinned {b/t(lambda: h.copy_(d, non_blocking=True)):.1f} GB/s")
print(f"h2d pageable {b/t(lambda: d.copy_(u)):.1f} GB/s")
print("cpu threads", torch.get_num_threads())
p=torch.zeros(n); g=torch.randn(n); opt=torch.optim.AdamW([p], lr=1e-3, fused=True); p.grad=g
opt.step()
a=time.perf_counter(); opt.step(); s=time.perf_counter()-a
print(f"cpu fused adamw 2^26: {s*1e3:.1f} ms, {28*n/s/1e9:.1f} GB/s")
