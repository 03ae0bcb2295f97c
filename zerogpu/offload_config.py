"""The offload configuration (what the tiers may hold, how far ahead to copy) and its budget error.

:class:`OffloadConfig` is what ``ZeroTrainer(offload=...)`` takes and :class:`zerogpu.offload.OffloadManager`
obeys; every field is validated when it is created. :class:`OffloadBudgetError` is the refusal of a
budget that cannot hold what the registered units need, naming the unit, its bytes and the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerosim.errors import ConfigError, require_non_negative_int, require_positive_int

DEVICE_BUDGET_FIELD = "offload.device_budget_bytes"
HOST_BUDGET_FIELD = "offload.host_budget_bytes"


class OffloadBudgetError(ConfigError):
    """A budget cannot hold what the registered units need. Names the unit, its bytes and the budget."""

    def __init__(self, field: str, value: Any, reason: str, *, unit: str | None = None,
                 needed_bytes: int | None = None):
        self.unit = unit
        self.needed_bytes = needed_bytes
        super().__init__(field, value, reason)


@dataclass(frozen=True)
class OffloadConfig:
    """What the offload manager may hold and how far ahead it copies; every field validated on creation.

    ``device_budget_bytes`` is C-ZERO-004's bound for the device tier; ``host_budget_bytes`` (None:
    unlimited) bounds the host tier; ``prefetch_depth`` units are copied ahead of the one in use;
    ``async_prefetch`` issues prefetch copies on a side CUDA stream (bookkeeping only on CPU);
    ``pin_memory`` pins host shards when the device is CUDA (ignored on CPU).
    """

    device_budget_bytes: int
    host_budget_bytes: int | None = None
    prefetch_depth: int = 1
    async_prefetch: bool = True
    pin_memory: bool = True

    def __post_init__(self) -> None:
        require_positive_int(DEVICE_BUDGET_FIELD, self.device_budget_bytes)
        if self.host_budget_bytes is not None:
            if isinstance(self.host_budget_bytes, bool) or not isinstance(self.host_budget_bytes, int) \
                    or self.host_budget_bytes <= 0:
                raise ConfigError(HOST_BUDGET_FIELD, self.host_budget_bytes,
                                  "must be a positive integer or None (unlimited)")
        require_non_negative_int("offload.prefetch_depth", self.prefetch_depth)
        for field in ("async_prefetch", "pin_memory"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ConfigError(f"offload.{field}", value, "must be True or False")
