"""What ``zerosim bench monitor`` measures: the adapters it can launch and the monitored variants.

Read by the command (:mod:`zerosim.bench.monitor`) and by every rank of its launch
(:mod:`zerosim.bench.monitor_rank`), so neither imports the other.
"""

from __future__ import annotations

#: the adapters a launch can train (DeepSpeed's only where it is installed: :data:`OPTIONAL`)
ADAPTERS = ("ddp", "zero-redundancy", "fsdp2", "zerogpu-zero3", "deepspeed-1", "deepspeed-2", "deepspeed-3")
OPTIONAL = ("deepspeed-1", "deepspeed-2", "deepspeed-3")
#: variant -> (every, step checks on) (None: no monitor); with the step checks, ``replay_every`` is
#: ``every``. ``off`` runs are always timed, between the monitored runs.
VARIANTS: dict[str, tuple[int, bool] | None] = {
    "off": None, "every=100": (100, False), "every=1": (1, False),
    "every=100+step-checks": (100, True), "every=1+step-checks": (1, True)}
