"""What ``zerosim report`` builds: the large modelled configuration and the small measured one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..values.run_value import RunValue

DEFAULT_DP_DEGREES = tuple(2**i for i in range(11))  # 1 .. 1024
#: The measured runs train every strategy at every listed world size in this process: at most 32
#: ranks per world size and 64 ranks over all of them (the default 1, 2, 4, 8 takes 15-30 s on two
#: cores; 32 ranks alone take about a minute).
MAX_MEASURED_WORLD_SIZE = 32
MAX_MEASURED_RANKS = 64


def check_measured_world_sizes(world_sizes: tuple[int, ...], field: str = "world_sizes") -> None:
    """ConfigError unless each world size is at most MAX_MEASURED_WORLD_SIZE and they sum to at most
    MAX_MEASURED_RANKS."""
    why = ("every strategy is trained at every measured world size, about a minute at 32 ranks on "
           "two cores")
    for w in world_sizes:
        if w > MAX_MEASURED_WORLD_SIZE:
            raise ConfigError(field, w,
                              f"at most {MAX_MEASURED_WORLD_SIZE} ranks per measured world size: {why}")
    if sum(world_sizes) > MAX_MEASURED_RANKS:
        raise ConfigError(field, ",".join(map(str, world_sizes)),
                          f"at most {MAX_MEASURED_RANKS} ranks over all measured world sizes: {why}")


@dataclass(frozen=True)
class ReportConfig(RunValue):
    """Defaults: the ZeRO paper's 7.5B at N_d = 64 (modelled) and the ``tiny`` simulator model at
    world sizes 1, 2, 4, 8 (measured by the simulator, and at 2 ranks by MPI when mpi4py works and by
    torch.distributed (gloo) when torch and zerogpu work)."""

    # modelled, large
    large_params: int = 7_500_000_000
    large_model: str = "gpt-7.5b"             # a preset for the comm figure and the DeepSpeed table
    large_world_size: int = 64
    large_ranks_per_node: int = 8
    dp_degrees: tuple[int, ...] = DEFAULT_DP_DEGREES
    # measured, small (the simulator's model)
    sim_model: str = "tiny"
    world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    ranks_per_node: int = 2                   # hybrid strategies and the intra/inter split of the small runs
    steps: int = 3
    precision: str = "fp32"                   # the engine's precision for the measured runs
    optimizer: str = "adamw"
    partitioner: str = "fsdp"                 # the engine's default partitioner
    offload_world_size: int = 4
    mpi: bool = True                          # also measure under mpiexec (2 ranks) when mpi4py works
    mpi_world_size: int = 2
    torch: bool = True                        # also measure under torchrun (gloo, CPU) when zerogpu works
    torch_world_size: int = 2
    deepspeed: bool = True                    # call the real DeepSpeed estimator when installed
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require_positive_int("large_params", self.large_params)
        require_positive_int("large_world_size", self.large_world_size)
        require_positive_int("large_ranks_per_node", self.large_ranks_per_node)
        require_positive_int("steps", self.steps)
        require_positive_int("ranks_per_node", self.ranks_per_node)
        require_positive_int("offload_world_size", self.offload_world_size)
        require_positive_int("mpi_world_size", self.mpi_world_size)
        require_positive_int("torch_world_size", self.torch_world_size)
        if not self.world_sizes:
            raise ConfigError("world_sizes", self.world_sizes, "must list at least one world size")
        for w in self.world_sizes:
            require_positive_int("world_sizes", w)
        check_measured_world_sizes(tuple(self.world_sizes))
        for w in self.dp_degrees:
            require_positive_int("dp_degrees", w)
        if self.large_world_size % self.large_ranks_per_node:
            raise ConfigError("large_ranks_per_node", self.large_ranks_per_node,
                              f"must divide large_world_size={self.large_world_size}")

    @property
    def measured_world_size(self) -> int:
        """The world size of the side-by-side (stacked bar, traffic) panels: the largest measured one."""
        return max(self.world_sizes)

    WHAT = "report config"

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> ReportConfig:
        """The config of these JSON fields: the world-size lists back to tuples, every value then checked
        by the constructor (ConfigError naming the field)."""
        for key in ("dp_degrees", "world_sizes"):
            value = values.get(key)
            if value is not None:
                if not isinstance(value, list):
                    raise ConfigError(key, value, "expected a list of world sizes")
                values[key] = tuple(value)
        extra = values.get("extra", {})
        if not isinstance(extra, dict):
            raise ConfigError("extra", extra, "expected a JSON object")
        return cls(**values)
