"""``zerosim verify``: train a live sharded trainer next to an unsharded reference and check the contracts.

Public API::

    from zerosim.verify import verify
    report = verify("ddp", world=4)            # or "package.module:make_trainer"
    report.verdict, report.contracts["C-ZERO-002"].details["max_error"], report.diagnosis

The trainer protocol (:class:`Trainer`, :class:`OptimConfig`) is in :mod:`zerosim.verify.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import RankFailure, TrainerError
from .outcome import ContractOutcome, Diagnosis, VerifyReport
from .protocol import OptimConfig, Trainer
from .runner import verify

#: What every rank of ``python -m zerosim.verify`` imports whatever the target: its entry, the session,
#: the torch communicator and per-rank program, and ``torch._dynamo``, which torch imports on the first
#: ``torch.optim`` optimizer (the reference's and the built-in trainers'). :mod:`zerogpu.rank_zygote`
#: imports them once before forking the ranks; none starts a thread or touches a device at import.
RANK_IMPORTS = (
    "array_api_compat.torch",
    "torch._dynamo",
    "zerogpu.comm",
    "zerogpu.program",
    "zerogpu.rank",
    "zerosim.processes.rank_logs",
    "zerosim.verify.adapters",
    "zerosim.verify.arrival",
    "zerosim.verify.resources",
    "zerosim.verify.run_value",
    "zerosim.verify.session",
    "zerosim.verify.targets",
)


def launch_imports(args: Sequence[str]) -> tuple[str, ...]:
    """The modules every rank of ``python -m zerosim.verify --run-file FILE`` imports for the target and
    device that FILE names, beyond :data:`RANK_IMPORTS`
    (:data:`~zerosim.verify.adapters.CPU_RANK_IMPORTS`), for :mod:`zerogpu.rank_zygote` to import
    once before the fork; nothing for any other arguments or a file it cannot read."""
    from ..engine.run_file import config_path_argument
    from ..errors import ConfigError
    from ..files.json_file import read_settings
    from .adapters import CPU_RANK_IMPORTS

    path = config_path_argument(list(args))  # --run FILE, or --run-file FILE as zerosim verify writes it
    if path is None:
        return ()
    try:
        run = read_settings(path)
    except ConfigError:
        return ()
    target = run.get("target") if isinstance(run, dict) and run.get("device", "cpu") == "cpu" else None
    return CPU_RANK_IMPORTS.get(target, ()) if isinstance(target, str) else ()


__all__ = ["ContractOutcome", "Diagnosis", "OptimConfig", "RankFailure", "Trainer", "TrainerError",
           "VerifyReport", "verify"]
