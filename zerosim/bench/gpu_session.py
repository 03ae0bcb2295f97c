"""What every step of ``zerosim gpu-check`` run in its own process shares: a one-rank process group on
the device, full-precision float32 on the GPU (TF32 off), the device's description, and JSON that
stays JSON (non-finite numbers written as strings, so a reader never meets ``NaN`` or ``Infinity``).
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def full_precision_float32() -> None:
    """Matrix products and convolutions in true float32 on CUDA: TF32 would round the inputs to 10 bits
    of mantissa and put the device run outside any float32 rounding bound."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@contextmanager
def world_of_one(device: str, scratch: Path) -> Iterator[None]:
    """A one-rank gloo process group for ZeroTrainer in this process, destroyed on the way out (as
    ``zerosim bench offload`` makes one: at world 1 no collective moves data, so CUDA tensors need no
    NCCL; the tests and the report step exercise NCCL); ``scratch`` holds its file store."""
    import torch.distributed as dist

    full_precision_float32()
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def require_device(text: Any, *, present: bool = False) -> str:
    """A ``--device`` value: ``cpu`` or ``cuda``; with ``present``, ``cuda`` only where torch sees a GPU."""
    if text not in ("cpu", "cuda"):
        raise ConfigError("device", text, "must be cpu or cuda")
    if present and text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device", text, "CUDA is not available here; use --device cpu")
    return str(text)


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: str) -> dict[str, Any]:
    """The device's name (``torch.cuda.get_device_name``, or the host's processor for the CPU) and the
    versions a result depends on: torch, its CUDA, cuDNN and NCCL."""
    import torch

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = None
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "device_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (``"inf"``, ``"nan"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, doc: Any) -> None:
    """``doc`` as indented, strictly valid JSON (see :func:`json_safe`)."""
    path.write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")
