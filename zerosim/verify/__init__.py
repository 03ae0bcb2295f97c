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

__all__ = ["ContractOutcome", "Diagnosis", "OptimConfig", "RankFailure", "Trainer", "TrainerError",
           "VerifyReport", "verify"]
