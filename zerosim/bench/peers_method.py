"""How ``zerosim bench peers`` measures: each adapter's ZeRO stage and whether it is a peer, the
order of the rounds, how many steps a round times, and the settings every adapter is given (the
optimizer with its clip, the model presets, the machine recorded beside them).

The launcher (:mod:`zerosim.bench.peers`), the ranks (:mod:`zerosim.bench.peers_rank`) and the report
(:mod:`zerosim.bench.peers_report`) all read these rules from here, so the report states the method
the runner used.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from .peers_run import MAX_TIMED_STEPS

MAX_GRAD_NORM = 1.0
OURS_PREFIX = "zerogpu-"  # built-in adapters whose name starts so are ours; the other built-ins are peers

#: ZeRO stage of every known adapter: 0 (replicated, DDP), 1, 2, 3, or "hybrid" (sharded within a group,
#: replicated across groups). A trainer's ``declared_strategy`` takes precedence at run time.
STAGES: dict[str, int | str] = {
    "ddp": 0,
    "torch-zero": 1,
    "deepspeed-1": 1,
    "zerogpu-1": 1,
    "fsdp2-grad-op": 2,
    "deepspeed-2": 2,
    "zerogpu-2": 2,
    "fsdp2": 3,
    "deepspeed-3": 3,
    "zerogpu-3": 3,
    "zerogpu-3-offload": 3,
    "fsdp2-hybrid": "hybrid",
    "zerogpu-hybrid": "hybrid",
    "zerogpu-1-native": 1,
    "zerogpu-2-native": 2,
    "zerogpu-3-native": 3,
    "zerogpu-3-offload-native": 3,
    "zerogpu-hybrid-native": "hybrid",
}
STAGE_ORDER: dict[int | str | None, int] = {0: 0, 1: 1, 2: 2, 3: 3, "hybrid": 4, None: 5}




# ---- stages and peers -----------------------------------------------------------------------------------


def stage_from_strategy(declared: Any) -> int | str | None:
    """The stage a ``declared_strategy`` names (``ddp`` 0, ``zeroK`` K, ``hybrid[:k]``), or None."""
    if not isinstance(declared, str):
        return None
    text = declared.strip().lower()
    if text in ("ddp", "no_shard", "zero0"):
        return 0
    if text in ("zero1", "zero2", "zero3"):
        return int(text[-1])
    if text.startswith("hybrid"):
        return "hybrid"
    return None


def stage_of(adapter: str, declared: Any = None) -> tuple[int | str | None, str]:
    """(stage, where it came from: ``"declared"`` or ``"table"``; ``"unknown"`` when neither says)."""
    stage = stage_from_strategy(declared)
    if stage is not None:
        return stage, "declared"
    if adapter in STAGES:
        return STAGES[adapter], "table"
    return None, "unknown"


def is_peer(adapter: str) -> bool:
    """Whether ``adapter`` is a peer: a built-in adapter not named ``zerogpu-*`` (a ``MODULE:FACTORY``
    target is the user's own trainer, never a peer)."""
    from ..verify.adapters import ADAPTERS

    return adapter in ADAPTERS and not adapter.startswith(OURS_PREFIX)


# ---- rounds ------------------------------------------------------------------------------------------------


def sequence(adapters: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, adapter)`` in the order they run: the list forwards in even rounds, backwards in odd
    ones (A B C, C B A, A B C, ...). Load that drifts during a run then falls on every adapter alike
    on average, instead of on whichever ran last."""
    out: list[tuple[int, str]] = []
    for r in range(rounds):
        out += [(r, a) for a in (adapters if r % 2 == 0 else list(reversed(adapters)))]
    return out


def timed_steps(steps: int, min_time_s: float, first: Sequence[float]) -> int:
    """How many steps one rank wants timed in a round: at least ``steps``, and enough that they add up
    to about ``min_time_s`` at the median of the ``first`` ``steps`` samples, at most
    :data:`MAX_TIMED_STEPS`. The ranks run the largest of their wishes: a millisecond step then gets
    hundreds of samples and a second-long one the ``steps`` asked for."""
    if not first or min_time_s <= 0:
        return steps
    median = statistics.median(first)
    wanted = math.ceil(min_time_s / median) if median > 0 else MAX_TIMED_STEPS
    return max(steps, min(MAX_TIMED_STEPS, wanted))


def merge_rounds(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, adapter) from its rows of every round: samples (and each rank's) joined in
    round order, ``steps_per_round`` and ``round_indices`` kept; an adapter that failed in any round
    is its error row."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["adapter"]), []).append(row)
    merged: list[dict[str, Any]] = []
    for group in groups.values():
        failed = [r for r in group if r.get("status") != "ok"]
        if failed:
            merged.append(failed[0])
            continue
        group.sort(key=lambda r: r.get("round", 0))
        row = dict(group[-1])
        row["samples"] = [x for r in group for x in r["samples"]]
        row["warmup_samples"] = [x for r in group for x in r.get("warmup_samples", [])]
        ranks = len(group[0].get("rank_samples") or [])
        row["rank_samples"] = [[x for r in group for x in r["rank_samples"][k]] for k in range(ranks)]
        row["steps_per_round"] = [len(r["samples"]) for r in group]
        row["round_indices"] = [r.get("round", 0) for r in group]
        row["init_s"] = max(r.get("init_s", 0.0) for r in group)
        row["rounds"] = len(group)
        row.pop("round", None)
        row.pop("position", None)
        merged.append(row)
    return merged


# ---- options ----------------------------------------------------------------------------------------------


def optim_config(optimizer: str) -> dict[str, Any]:
    """The protocol's optim dict for ``optimizer``: verify's phase settings with a clip at 1.0."""
    from ..verify.suite import PHASE_CONFIGS

    return {**PHASE_CONFIGS[optimizer], "max_grad_norm": MAX_GRAD_NORM}


def default_world(device: str) -> int:
    """2 ranks on the CPU; on CUDA one rank per GPU (0 when there is none: refused later)."""
    if device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def model_info(name: str) -> dict[str, Any]:
    """A preset's parameter count and sizes (counted on the meta device: nothing is allocated)."""
    import dataclasses

    import torch

    from ..verify.model import GPT, require_model

    cfg = require_model(name)
    with torch.device("meta"):
        model = GPT(cfg)
    return {"params": sum(p.numel() for p in model.parameters()), "config": dataclasses.asdict(cfg)}


def environment(device: str) -> dict[str, Any]:
    """Machine and library versions for the report."""
    import importlib.metadata as md

    env: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    for package in ("torch", "deepspeed"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
            env["cuda"] = torch.version.cuda
    return env
