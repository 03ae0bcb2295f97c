"""``zerosim verify``: train a live sharded trainer next to an unsharded reference and check the contracts.

Public API::

    from zerosim.verify import verify
    report = verify("ddp", world=4)            # or "package.module:make_trainer"
    report.verdict, report.contracts["C-ZERO-002"].details["max_error"], report.diagnosis

The trainer protocol (:class:`Trainer`, :class:`OptimConfig`) is in :mod:`zerosim.verify.protocol`.
"""

from __future__ import annotations

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
    "zerosim.cli.rank_commands",
    "zerosim.rank_logs",
    "zerosim.verify.adapters",
    "zerosim.verify.arrival",
    "zerosim.verify.resources",
    "zerosim.verify.session",
    "zerosim.verify.targets",
)

__all__ = ["ContractOutcome", "Diagnosis", "OptimConfig", "RankFailure", "Trainer", "TrainerError",
           "VerifyReport", "verify"]
