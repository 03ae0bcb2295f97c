"""Host-device copy rates (pinned and pageable) and torch's fused CPU AdamW on this machine's cores:
what ZeRO-Offload's host tier has to work with. Run on a machine with one CUDA device:
``python3 host_link_probe.py``."""

import time

import torch


def median_seconds(run, repeats: int = 5) -> float:
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    n = 1 << 26
    device = torch.empty(n, device="cuda")
    pinned = torch.empty(n, pin_memory=True)
    pageable = torch.empty(n)
    gb = 4 * n / 1e9
    print(f"h2d pinned {gb / median_seconds(lambda: device.copy_(pinned, non_blocking=True)):.1f} GB/s")
    print(f"d2h pinned {gb / median_seconds(lambda: pinned.copy_(device, non_blocking=True)):.1f} GB/s")
    print(f"h2d pageable {gb / median_seconds(lambda: device.copy_(pageable)):.1f} GB/s")
    print("cpu threads", torch.get_num_threads())
    param = torch.zeros(n)
    param.grad = torch.randn(n)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()
    t0 = time.perf_counter()
    opt.step()
    seconds = time.perf_counter() - t0
    print(f"cpu fused adamw 2^26: {seconds * 1e3:.1f} ms, {28 * n / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
