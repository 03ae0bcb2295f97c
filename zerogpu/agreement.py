"""Does a torchrun run agree with the in-process simulator? (same seed, model, strategy, world size).

:func:`compare_with_simulator` compares every rank's observations, step by step: the float32 master
shard, the reduced gradient shard, the optimizer state, the gathered working weights, loss / grad
norm / clip factor, and the traffic counters and holdings. A JSON-able summary out (a report can
print it; a test can assert on it).

The agreement it requires is derived, not observed (:mod:`zerosim.checks.agreement`, tests in
``tests/test_backend_agreement.py``):

- **Bitwise** when the engine computes with numpy (``--xp numpy``) and every reduction that feeds
  the training state runs over at most :data:`~zerosim.checks.agreement.BITWISE_MAX_GROUP` ranks:
  one IEEE addition is commutative, and the TorchCommunicator's ``avg`` is the simulator's
  sum-then-divide.
- Otherwise each element within its bound: gloo / NCCL sum more than two ranks in their own order,
  and with ``--xp torch`` the model's matrix products run in torch's BLAS (CPU) or cuBLAS (GPU, TF32
  off), whose blockings add in another order than numpy's. The summation error bound of the additions
  that may be ordered apart, propagated through clipping and the optimizer by the rounding model
  C-ZERO-002 uses (:func:`zerosim.engine.backend_agreement.agreement_bounds`).
- Traffic counters and holdings: always identical, call for call and byte for byte.

The contract verdicts (C-ZERO-002 against the independent ground truth with its own bound) are the
authority; this comparison says how close two backends come to each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerosim.checks import agreement
from zerosim.engine.backend_agreement import agreement_bounds
from zerosim.values.observe import RankObservation


def bitwise_expected(run: Any, xp: str) -> bool:
    """Bitwise agreement is promised: numpy arrays and every state reduction over at most two ranks."""
    return agreement.bitwise_expected(run.k, run.replicas, same_local_arithmetic=xp == "numpy")


def compare_with_simulator(got: Sequence[RankObservation], sim: Sequence[RankObservation], *, run: Any,
                           xp: str = "numpy", bitwise: bool | None = None) -> dict[str, Any]:
    """Summary: ``agrees`` plus what was compared and the worst difference (with where it is).
    ``run``: the resolved run both backends ran; ``xp``: the array library ``got`` computed with;
    ``bitwise``: require every bit (default: :func:`bitwise_expected`)."""
    if bitwise is None:
        bitwise = bitwise_expected(run, xp)
    bounds = None if bitwise else agreement_bounds(run, same_local_arithmetic=xp == "numpy")
    if not bitwise and bounds is None:
        return {"agrees": False, "bitwise_required": False, "bitwise_equal": False, "elements_compared": 0,
                "elements_differing": 0, "max_abs_diff": 0.0, "max_abs_diff_at": "", "bound": None,
                "max_diff_over_bound": None,
                "problems": [f"no derived agreement bound for optimizer {run.spec.name} (not elementwise)"]}
    return agreement.compare_backends(got, sim, bitwise=bitwise, bounds=bounds)
