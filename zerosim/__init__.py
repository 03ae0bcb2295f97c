"""zerosim: verify and measure ZeRO-style sharded data-parallel training."""

from .errors import ConfigError, ZeroSimError
from .values.layout import ParamLayout, TensorSpec
from .values.plan import StatePlan, build_plan
from .values.presets import PRESETS, GPTConfig
from .values.strategy import ShardingStrategy, StrategyKind, Topology

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "GPTConfig", "PRESETS", "ParamLayout", "ShardingStrategy", "StatePlan",
    "StrategyKind", "TensorSpec", "Topology", "ZeroSimError", "build_plan",
]

# The seed partitioner's API (OptimizerShard, ZeroShardMap) and the user-facing partition checker.
from .partition.seed import OptimizerShard, ZeroShardMap  # noqa: E402
from .testing.check_impl import PartitionReport, check_partition  # noqa: E402

__all__ += ["OptimizerShard", "PartitionReport", "ZeroShardMap", "check_partition"]


# ---- moved modules: the old import paths the docs showed still import the moved modules ----
import importlib  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from importlib.machinery import ModuleSpec  # noqa: E402
from types import ModuleType  # noqa: E402

#: old name -> where the module is now: ``from zerosim.<old name> import ...``, as the docs once wrote
#: it, imports the moved module itself (one module object under both names, loaded on first use)
_MOVED_MODULES = {"groundtruth": "numerics.groundtruth", "model": "numerics.model", "optim": "numerics.optim"}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module by its old name (first on ``sys.meta_path``: the old name is always the moved
    module, even beside an older copy of the package that still has a file by that name)."""

    def __init__(self) -> None:
        self._specs: dict[str, ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{_MOVED_MODULES[spec.name.rpartition('.')[2]]}")
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)  # its own, not the old name's


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())
# ---- end of moved modules ----
