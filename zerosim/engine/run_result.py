"""The result of one run and how it is judged: C-ZERO-001 on its plan, C-ZERO-002..005 on its observations.

:func:`plan_verdict` checks the partition the run trains with before any rank starts (a plan that
breaks C-ZERO-001 is never trained: :func:`plan_refused_result`). :func:`evaluate` ``(cfg,
observations) -> RunResult`` computes the unsharded references and runs the step checks on the
per-rank observations of a run from any backend (simulator, MPI, torch). It is pure with respect to
the backend: the observations are host numpy whichever backend produced them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checks.contracts import STEP_CONTRACTS
from ..checks.holdings import OwnershipExpectation
from ..checks.judges import judge
from ..checks.tolerance import equivalence_tolerance
from ..cost.comm_model import CommEstimate, comm_for_run
from ..errors import ConfigError
from ..values.observe import RankObservation
from ..values.verdict import Verdict
from .config import ResolvedRun, RunConfig

ProgressFn = Callable[[str, int, int], None]  # (phase, done, total)
#: the contracts a run is judged by, in order (the one list: :data:`zerosim.checks.contracts.STEP_CONTRACTS`)
CONTRACTS = STEP_CONTRACTS


def resolve_run(cfg: RunConfig | ResolvedRun) -> ResolvedRun:
    """``cfg`` validated and resolved (a ResolvedRun passes through unchanged)."""
    return cfg if isinstance(cfg, ResolvedRun) else cfg.resolve()


@dataclass
class RunResult:
    """Verdicts of every step contract plus per-step metrics of one run."""

    config: dict[str, Any]
    verdicts: dict[str, Verdict]
    steps: list[dict[str, Any]]
    comm: CommEstimate | None = None
    observations: list[RankObservation] = field(default_factory=list, repr=False)
    timings: dict[str, float] = field(default_factory=dict)
    #: the unsharded runs C-ZERO-002 compared against: "independent" (ground truth), "ordered" when bitwise
    references: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts.values())

    @property
    def outcome(self) -> str:
        """"fail" (a contract was violated), "diverged" (none was, but a reference went non-finite and
        the comparison stopped there: :attr:`Verdict.diverged_at`) or "pass"."""
        outcomes = {v.outcome for v in self.verdicts.values()}
        return "fail" if "fail" in outcomes else ("diverged" if "diverged" in outcomes else "pass")

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "passed": self.passed, "outcome": self.outcome,
                "verdicts": {k: v.to_json() for k, v in self.verdicts.items()},
                "steps": self.steps, "comm_model": self.comm.to_json(with_links=False) if self.comm else None,
                "timings": self.timings,
                "ranks": [o.to_json(with_steps=False) for o in self.observations]}


def plan_verdict(run: ResolvedRun) -> Verdict:
    """C-ZERO-001 on the partition the run trains with: one shard group's plan (every group has it); a
    matrix optimizer's whole-tensor layout also on the run's StatePlan, whose ``whole_tensor`` clause
    holds every tensor's optimizer state whole on one rank of each shard group."""
    context = {"partitioner": run.unit_plan.partitioner, "shard_group_size": run.k}
    verdict = judge("C-ZERO-001", run.unit_plan.shard_plan, context=context)
    if getattr(run, "matrix_layout", None) == "whole-tensor" and run.strategy.shards_optimizer:
        verdict.extend(judge("C-ZERO-001", run.state_plan))
    return verdict


def plan_refused_result(run: ResolvedRun, verdict: Verdict) -> RunResult:
    """The result of a run whose plan breaks C-ZERO-001: nothing was trained, the step contracts were
    not run (their verdicts say so)."""
    verdicts = {"C-ZERO-001": verdict}
    for contract in CONTRACTS[1:]:
        verdicts[contract] = Verdict.skipped(contract, "not trained: the plan breaks C-ZERO-001")
    return RunResult(run.describe(), verdicts, [])


def ownership_expectation(run: ResolvedRun) -> OwnershipExpectation:
    """The plan and the byte rules the engine follows (what C-ZERO-004 holds it to)."""
    s, units, n = run.strategy, run.unit_plan, run.world_size
    pad = [units.padding(r % run.k) for r in range(n)]
    zero = [0] * n
    padding = {"params": pad if s.shards_params else zero, "grads": pad if s.shards_grads else zero,
               "optimizer": pad if s.shards_optimizer else zero}
    master_separate = (
        run.precision.is_mixed or (s.shards_optimizer and not s.shards_params) or run.cfg.offload
    )
    states = len(run.spec.state_names) + (1 if master_separate else 0)
    pb = run.precision.param_bytes
    bpe = {"params": pb, "grads": 4, "optimizer": 4 * states}
    bound = None
    if s.shards_params:
        biggest = max((u.packed_numel + (0 if u.is_identity else u.numel) for u in units.units), default=0)
        bound = [units.shard_numel * pb + (1 + run.prefetch) * biggest * pb] * n
    return OwnershipExpectation(run.state_plan, padding, bpe, bound, run.prefetch)


_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class ReferenceJob:
    """The unsharded references of a run, computed in a child process while the run trains.

    The references depend on the configuration only, never on the observations, so the simulator
    starts them before its ranks train: they run on a core the serially scheduled ranks leave
    idle. :meth:`get` waits for them; if the child cannot deliver (it could not start, it died),
    the caller computes them itself, as it would have without a job. A child's ZeroSimError
    (bad input) is raised as it is."""

    def __init__(self, run: ResolvedRun, ordered: bool):
        import multiprocessing

        self.ordered = ordered
        self._result: tuple[dict[str, Any], dict[str, float]] | None = None
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: safe beside the rank threads
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_reference_job, args=(run.cfg, ordered, child), daemon=True,
                                 name="zerosim-references")
        # the child computes on the one core the training leaves idle: one BLAS thread, so it never
        # takes the training's core (the variables are read when the child starts its BLAS library)
        saved = {k: os.environ.get(k) for k in _ONE_THREAD}
        os.environ.update(dict.fromkeys(_ONE_THREAD, "1"))
        try:
            self._proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()

    @staticmethod
    def worth_it(run: ResolvedRun) -> bool:
        """Whether a child process pays for itself: many local passes (a fresh interpreter costs about
        a second of a core) and small results (the references cross a pipe)."""
        return (run.world_size * run.micro_batches >= 128
                and run.layout.total_numel * run.steps <= 1 << 22 and run.cfg.xp == "numpy")

    def get(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        """(references by name, their timings), or None where the child delivered nothing."""
        if self._result is None:
            try:
                status, payload = self._conn.recv()
            except (EOFError, OSError):
                status, payload = "lost", None
            finally:
                self._conn.close()
                self._proc.join(timeout=5)
            if status == "error":
                raise payload
            if status != "ok":
                return None
            self._result = payload
        return self._result

    def cancel(self) -> None:
        """Stop the child (the run failed before its references were needed)."""
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(timeout=5)
        self._conn.close()


def _reference_job(cfg: RunConfig, ordered: bool, conn: Any) -> None:
    """The child's work: the references of ``cfg`` and their timings, sent back over ``conn``."""
    from ..errors import ZeroSimError
    from .reference import independent_reference, ordered_reference

    try:
        run = cfg.resolve()
        refs: dict[str, Any] = {}
        timings: dict[str, float] = {}
        t = time.perf_counter()
        refs["independent"] = independent_reference(run)
        timings["ground_truth_s"] = time.perf_counter() - t
        if ordered:
            t = time.perf_counter()
            refs["ordered"] = ordered_reference(run)
            timings["ordered_reference_s"] = time.perf_counter() - t
        conn.send(("ok", (refs, timings)))
    except ZeroSimError as e:
        conn.send(("error", e))
    except Exception:  # noqa: BLE001 - the parent computes the references itself
        conn.send(("failed", None))
    finally:
        conn.close()


def evaluate(cfg: RunConfig | ResolvedRun, observations: Sequence[RankObservation], *,
             bitwise: bool | None = None, progress: ProgressFn | None = None,
             references: ReferenceJob | None = None) -> RunResult:
    """Run every step contract on the observations of a run of ``cfg`` (from any backend).

    ``bitwise`` (default: every rank ran on the simulator with numpy) also demands bit-identical
    agreement with the same-reduction-order reference; other backends reduce in their own order.
    ``references``: a :class:`ReferenceJob` started for this run; what it delivers is used instead
    of computing the same references here.
    """
    from .reference import independent_reference, ordered_reference

    run = resolve_run(cfg)
    obs = list(observations)
    if len(obs) != run.world_size:
        raise ConfigError("observations", len(obs), f"expected one per rank ({run.world_size})")
    if bitwise is None:
        bitwise = all(o.backend == "sim" for o in obs) and run.cfg.xp == "numpy"
    timings: dict[str, float] = {}
    layout = run.layout
    full = all(s.master is not None for o in obs for s in o.steps)
    verdicts: dict[str, Verdict] = {"C-ZERO-001": plan_verdict(run)}

    def phase(name: str, i: int) -> None:
        if progress is not None:
            progress(name, i, 4)

    phase("C-ZERO-002", 0)
    done: dict[str, Any] = {}
    if references is not None:
        t = time.perf_counter()
        got = references.get()
        if got is not None:
            done = dict(got[0])
            timings.update(got[1])
            timings["references_wait_s"] = time.perf_counter() - t
    if "independent" not in done:
        t = time.perf_counter()
        done["independent"] = independent_reference(run)
        timings["ground_truth_s"] = time.perf_counter() - t
    independent = done["independent"]
    references_used: dict[str, Any] = {"independent": independent}
    if full:
        tol = equivalence_tolerance(run.precision.name)
        v2 = judge("C-ZERO-002", obs, independent, layout=layout, tolerance=tol)
        v2.details = {"ground_truth": dict(v2.details)}
        if bitwise:
            if "ordered" not in done:
                t = time.perf_counter()
                done["ordered"] = ordered_reference(run)
                timings["ordered_reference_s"] = time.perf_counter() - t
            ordered = references_used["ordered"] = done["ordered"]
            vb = judge("C-ZERO-002", obs, ordered, layout=layout, bitwise=True)
            v2.extend(vb)
            v2.details["ordered_reference"] = dict(vb.details)
        v2.details["bitwise_required"] = bitwise
    else:
        v2 = Verdict("C-ZERO-002", details={"skipped": "observations hold digests only (observe='digest'); "
                                            "run with observe='full' to compare shard values"})
    verdicts["C-ZERO-002"] = v2
    phase("C-ZERO-003", 1)
    verdicts["C-ZERO-003"] = judge("C-ZERO-003", obs, layout=layout)
    phase("C-ZERO-004", 2)
    verdicts["C-ZERO-004"] = judge("C-ZERO-004", obs, ownership_expectation(run), layout=layout)
    phase("C-ZERO-005", 3)
    estimate = comm_for_run(run)
    verdicts["C-ZERO-005"] = judge("C-ZERO-005", obs, estimate, reduce_dtype=run.precision.master_dtype)
    phase("done", 4)
    return RunResult(
        run.describe(), verdicts, step_metrics(obs, independent), estimate, obs, timings, references_used
    )


def step_metrics(obs: Sequence[RankObservation], reference: Any | None = None) -> list[dict[str, Any]]:
    """Per step: loss (and the ground truth's), grad norm, wall time, rank-0 traffic, peak memory."""
    out = []
    steps = sorted({s.step for o in obs for s in o.steps})
    for step in steps:
        rows = [next(s for s in o.steps if s.step == step) for o in obs]
        r0 = rows[0]
        data, control = float(r0.bytes_sent("data")), float(r0.bytes_sent("control"))
        peaks = [s.memory.peak_by_location.get("device", 0) for s in rows if s.memory]
        m: dict[str, Any] = {
            "step": step,
            "loss": r0.loss,
            "grad_norm": r0.grad_norm,
            "clip_coef": r0.clip_coef,
            "wall_s": max(s.t_end for s in rows) - min(s.t_start for s in rows),
            "bytes_sent_rank0": data,
            "control_bytes_sent_rank0": control,
            "peak_device_bytes_max_rank": max(peaks, default=0),
        }
        if reference is not None and step < len(reference.steps):
            m["reference_loss"] = reference.steps[step].loss
        out.append(m)
    return out
