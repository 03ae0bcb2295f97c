"""Does a torchrun run agree with the in-process simulator? (same seed, model, strategy, world size).

:func:`compare_with_simulator` compares every rank's observations, step by step: the float32 master
shard, the reduced gradient shard, the optimizer state, the gathered working weights, loss / grad
norm / clip factor, and the traffic counters and holdings. Pure: numpy observations in, a JSON-able
summary out (a report can print it; a test can assert on it).

Documented agreement (``tests/test_zerogpu_torchrun.py`` holds us to it):

- **Bitwise** when the engine computes with numpy (``--xp numpy``) and every reduction that feeds
  the training state runs over at most :data:`BITWISE_MAX_GROUP` ranks: one IEEE addition is
  commutative, and the TorchCommunicator's ``avg`` is the simulator's sum-then-divide.
- Otherwise within :data:`AGREEMENT_TOLERANCE` for the run's precision, elementwise
  ``|got - sim| <= rtol * |sim| + atol_scale * max|sim|`` per state array: gloo / NCCL sum more than
  two ranks in their own order, and with ``--xp torch`` the model's matrix products run in torch's
  BLAS (CPU) or cuBLAS (GPU, TF32 off), whose blockings round differently from numpy's. In bf16 /
  fp16 such an fp32 difference can flip a rounding of the 16-bit activations, so the bound there is
  a couple of that format's ulps (observed bf16 on ``tiny``: 3e-5 on a gradient of scale ~1e-2).
- Traffic counters and holdings: always identical, call for call and byte for byte.

The contract verdicts (C-ZERO-002 against the independent ground truth with its own tolerance)
are the authority; this comparison says how close two backends come to each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zerosim.observe import RankObservation

BITWISE_MAX_GROUP = 2
# precision -> (rtol, atol_scale). fp32: torch (CPU BLAS) vs numpy on `tiny`, 2 AdamW steps, observed
# max abs diff 6e-8 on O(1) weights; Adam divides by sqrt(v), so O(eps) gradient differences show up
# amplified in the update: 1e-5 of the array's scale leaves room. bf16 / fp16: ~2.5 ulps of the format.
AGREEMENT_TOLERANCE: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-5),
    "bf16": (1e-2, 1e-2),
    "fp16": (2e-3, 2e-3),
}


def bitwise_expected(run: Any, xp: str) -> bool:
    """Bitwise agreement is promised: numpy arrays and every state reduction over at most two ranks."""
    return xp == "numpy" and max(run.k, run.replicas) <= BITWISE_MAX_GROUP


def state_arrays(step: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if step.master is not None:
        out["master"] = step.master.values
    if step.grads is not None:
        out["grads"] = step.grads.values
    for name, values in (step.optimizer or {}).items():
        out[f"optimizer.{name}"] = values.values
    if step.gathered is not None:
        out["gathered"] = step.gathered
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def compare_with_simulator(got: Sequence[RankObservation], sim: Sequence[RankObservation], *, bitwise: bool,
                           precision: str = "fp32") -> dict[str, Any]:
    """Summary: ``agrees`` plus what was compared and the worst difference (with where it is)."""
    rtol, atol_scale = AGREEMENT_TOLERANCE.get(precision, AGREEMENT_TOLERANCE["fp32"])
    problems: list[str] = []
    max_abs, worst_at, differing, compared = 0.0, "", 0, 0
    if [o.rank for o in got] != [o.rank for o in sim]:
        problems.append(f"ranks differ: {[o.rank for o in got]} vs {[o.rank for o in sim]}")
    for g, s in zip(got, sim, strict=False):
        if g.groups != s.groups:
            problems.append(f"rank {g.rank}: groups differ")
        if len(g.steps) != len(s.steps):
            problems.append(f"rank {g.rank}: {len(g.steps)} steps vs {len(s.steps)}")
        for gs, ss in zip(g.steps, s.steps, strict=False):
            where = f"rank {g.rank} step {gs.step}"
            if gs.traffic != ss.traffic:
                problems.append(f"{where}: traffic differs")
            if gs.holdings != ss.holdings:
                problems.append(f"{where}: holdings differ")
            scalars = np.array([gs.loss, gs.grad_norm, gs.clip_coef], np.float64)
            want = np.array([ss.loss, ss.grad_norm, ss.clip_coef], np.float64)
            if not np.allclose(scalars, want, rtol=rtol, atol=atol_scale, equal_nan=True):
                problems.append(f"{where}: loss/grad norm/clip {scalars.tolist()} vs {want.tolist()}")
            mine, theirs = state_arrays(gs), state_arrays(ss)
            if mine.keys() != theirs.keys():
                problems.append(f"{where}: observed states {sorted(mine)} vs {sorted(theirs)}")
            for name in sorted(mine.keys() & theirs.keys()):
                a, b = np.asarray(mine[name]), np.asarray(theirs[name])
                if a.dtype != b.dtype or a.shape != b.shape:
                    problems.append(f"{where} {name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
                    continue
                compared += a.size
                n_diff = int(np.count_nonzero(_bits(a) != _bits(b)))
                differing += n_diff
                if a.size == 0:
                    continue
                want_abs = np.abs(b.astype(np.float64))
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                i = int(np.argmax(diff))
                if diff[i] > max_abs:
                    max_abs, worst_at = float(diff[i]), f"{where} {name}[{i}]"
                if bitwise and n_diff:
                    problems.append(f"{where} {name}: {n_diff} of {a.size} elements differ in some bit "
                                    f"(bitwise agreement expected)")
                elif not bitwise and not np.all(diff <= rtol * want_abs + atol_scale * float(want_abs.max())):
                    problems.append(
                        f"{where} {name}: max |diff| {diff[i]:.3g} at [{i}] beyond "
                        f"rtol {rtol:g} x |sim| + {atol_scale:g} x max|sim| ({float(want_abs.max()):.3g})"
                    )
    return {
        "agrees": not problems,
        "bitwise_required": bitwise,
        "bitwise_equal": differing == 0 and compared > 0,
        "elements_compared": compared,
        "elements_differing": differing,
        "max_abs_diff": max_abs,
        "max_abs_diff_at": worst_at,
        "rtol": None if bitwise else rtol,
        "atol_scale": None if bitwise else atol_scale,
        "problems": problems[:8],
    }
