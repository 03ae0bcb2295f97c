"""One rank of a ``zerosim verify`` run: build the trainer per phase, step it, ship observations to rank 0.

Every decision that can end the run early (a phase skipped because ``make_trainer`` raised
``NotImplementedError``, a protocol breach on any rank) is taken by rank 0 from every rank's report
and broadcast (:meth:`RankSession.agree`), so all ranks leave together with the same status and the
same one line. A rank that raises inside the trainer, or a collective that times out, ends the run
with exit 3; the rank to blame is written to ``failure-rank<R>.json`` (:meth:`RankSession.record_failure`):
the rank itself when it raised, else the rank that entered the fewest collectives
(:mod:`zerosim.verify.arrival`).

A resumed run (``--resume-stage``) is two launches of this program. ``save``: each phase runs its
first ``--resume-at`` steps, every rank calls ``save_checkpoint``, and rank 0 leaves the phases and
the observations so far in the resume directory. ``load``: rank 0 reads them back, each phase builds
a fresh trainer, calls ``load_checkpoint``, reports its state right after loading, trains the
remaining steps, and rank 0 evaluates the whole run (:mod:`zerosim.verify.resume`).

Why one module of this length: a rank's life in a run (trainer per phase, steps, observations,
failure records) is one sequence whose early exits must agree with each other.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.errors import ConfigError
from zerosim.files import datafile
from zerosim.files.outputs import OutputError, write_text
from zerosim.values.observe import TrainerObservation

from .errors import TrainerError
from .mixed_precision import policy
from .model_source import model_source, to_device
from .optimizers import describe_user_optimizer, is_user_optimizer, trainer_config
from .protocol import (
    close_trainer,
    finite_loss,
    logged_norm,
    missing_resume_method,
    require_trainer_object,
    to_numpy,
    validate_local_shards,
    validate_optimizer_state,
    validate_parameters,
)
from .resume import SNAPSHOT_FILE, ResumeRun, read_first_run
from .run_value import VerifyRun
from .suite import Phase, build_phases

NOT_RULED_OUT = {
    "sgd": "a gradient summed instead of averaged (AdamW normalises the scale away) and momentum-buffer bugs",
    "adamw": "a clip norm over the wrong set of elements and Adam state bugs (step count, bias correction, "
    "decoupled weight decay)",
}


class RankSession:
    """The per-rank program (see the module docstring). Rank 0 keeps every observation and evaluates."""

    def __init__(self, comm: Any, settings: VerifyRun, device: str):
        from .arrival import ArrivalCounter
        from .targets import resolve_factory

        self.comm = comm
        self.settings = settings
        self.device = device
        self.rank = comm.rank
        self.world = comm.world_size
        self.phases = build_phases(settings.optimizers, settings.steps)
        self.arrivals = ArrivalCounter(comm)
        self.where = "start"
        self.factory = self.agree(self._local(resolve_factory, settings.target))
        for phase in self.phases:  # a user's optimizer: its defaults (lr, weight_decay, ...) beside its name
            if is_user_optimizer(phase.name):
                self.where = f"importing the optimizer {phase.name}"
                defaults = self.agree(self._local(describe_user_optimizer, phase.name))
                phase.optim.update({k: v for k, v in defaults.items() if k not in phase.optim})
        self.observations: dict[int, list[TrainerObservation]] = {}
        self.started = time.monotonic()

    # -- agreement ---------------------------------------------------------------------------------------
    def _local(self, fn: Any, *args: Any) -> Any:
        """(value, None) or (None, the error's message) for a local call that may break the protocol
        or refuse its input (a malformed TARGET under torchrun)."""
        try:
            return fn(*args), None
        except (TrainerError, ConfigError) as e:
            return None, str(e)

    def agree(self, outcome: tuple[Any, str | None]) -> Any:
        """Every rank learns whether any rank hit a protocol error; all raise the lowest rank's."""
        value, error = outcome
        first = self.first_of_any(error)
        if first:
            raise TrainerError(first)
        return value

    def first_of_any(self, value: Any) -> Any:
        """The lowest rank's non-None ``value`` on every rank (None if every rank had None)."""
        values = self.comm.gather_object(value, root=0)
        first = next((v for v in values if v is not None), None) if values is not None else None
        return self.comm.broadcast_object(first, root=0)

    # -- the run -----------------------------------------------------------------------------------------
    def run(self) -> int:
        import torch

        from .reference import choose_clip
        from .resources import PhaseResources, ResourceProbe, resource_outcomes

        spec = self.settings.target
        source = model_source(self.settings.model, self.settings.seed)
        self.where = "checking the model factory"
        self.agree(self._local(source.validate, self.world, self.settings.grad_accum))
        base = source.build(self.settings.dtype)
        expected = {
            n: (tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in base.named_parameters()
        }
        numels = {n: int(p.numel()) for n, p in base.named_parameters()}
        phase_info: list[dict[str, Any]] = []
        phase_resources: list[Any] = []
        stage = getattr(self.settings, "resume_stage", None)
        resume_at = getattr(self.settings, "resume_at", None)
        first_info: dict[str, dict[str, Any]] = {}
        resume: ResumeRun | None = None
        if stage == "load":
            resume, first_info = self._load_first_run()
        for phase in self.phases:
            if stage == "load" and first_info.get(phase.name, {}).get("status") != "ran":
                phase_info.append(first_info.get(phase.name) or self._phase_json(phase, "skipped", ""))
                continue
            if phase.name == "adamw" and stage != "load":  # the resumed run keeps the first run's clip
                clip = None
                if self.rank == 0:
                    clip = choose_clip(
                        base,
                        phase.optim,
                        self.world,
                        phase.first_step,
                        phase.steps,
                        model_name=self.settings.model,
                        seed=self.settings.seed,
                        grad_accum=self.settings.grad_accum,
                        source=source,
                    )
                threshold, binds_at, offset = self.comm.broadcast_object(clip, root=0)
                phase.optim["max_grad_norm"] = threshold
                phase.data_offset = offset
                phase.extra["clip_first_binds_at_phase_step"] = binds_at
                phase.extra["data_offset"] = offset
            model = source.build(self.settings.dtype).to(self.device)
            self.where = f"make_trainer for the {phase.name} phase"
            trainer, skipped = self.agree(self._local(self._make, model, phase))
            skipped = self.first_of_any(skipped)  # a phase one rank cannot run is skipped on every rank
            if skipped is not None:
                phase_info.append(self._phase_json(phase, "skipped", skipped))
                continue
            if stage is not None:
                self.where = f"{phase.name} phase: checking the trainer for save/load"
                self._require_resumable(trainer)
            steps = phase.step_numbers
            if stage == "save":
                steps = steps[:resume_at]
            elif stage == "load":
                assert resume is not None
                steps = steps[resume_at:]
                reason = self._resume_phase(trainer, phase, resume, expected, numels)
                if reason is not None:
                    phase_info.append(self._phase_json(phase, "skipped", reason))
                    self._close(trainer, phase)
                    del trainer
                    continue
            k = self.settings.grad_accum
            if k > 1:
                self.where = f"{phase.name} phase: checking the trainer for step_accumulated"
                self._require_accumulating(trainer)
            probe = ResourceProbe(trainer)
            for step in steps:
                batches = [
                    to_device(source.batch(self.rank, step + phase.data_offset, m, self.world), self.device)
                    for m in range(k)
                ]
                if k == 1:
                    self.where = f"step {step} ({phase.name}): step()"
                    self.arrivals.mark(self.where)
                    with probe.counting():
                        loss = trainer.step(*batches[0])
                else:
                    self.where = f"step {step} ({phase.name}): step_accumulated()"
                    self.arrivals.mark(self.where)
                    with probe.counting():
                        loss = trainer.step_accumulated(batches)
                obs = self.agree(
                    self._local(self._observe, trainer, phase, step, loss, expected, numels, True))
                obs.resources = probe.take()
                gathered = self.comm.gather_object(obs, root=0)
                if self.rank == 0:
                    self.observations[step] = list(gathered)
            if stage == "save":
                self.where = f"{phase.name} phase: save_checkpoint()"
                self.arrivals.mark(self.where)
                trainer.save_checkpoint(str(self._resume_dir() / phase.name))
            phase_info.append(self._phase_json(phase, "ran", ""))
            if self.rank == 0 and stage != "save":
                phase_resources.append(
                    PhaseResources(
                        phase.name,
                        dict(phase.optim),
                        steps[0],
                        {**probe.info, "micro_batches": k},
                        [[o.resources for o in self.observations[s]] for s in steps],
                    )
                )
            self._close(trainer, phase)
            del trainer, probe
            if torch.cuda.is_available() and self.device.startswith("cuda"):
                torch.cuda.synchronize(self.device)
        if stage == "save":
            self.where = "writing the first run's observations"
            if self.rank == 0:
                self._save_first_run(phase_info)
            self.comm.barrier()
            return 0
        self.where = "evaluation on rank 0"
        code = 0
        if self.rank == 0:
            from .evaluate import evaluate, save_observations
            from .render import render_text

            mixed = policy(self.settings.precision, self.settings.reduce_dtype)
            overflowed = (self._skipped_steps(base) if mixed is not None and mixed.get("loss_scale")
                          else frozenset())
            resources = (
                resource_outcomes(phase_resources, base, base_dtype_bytes(base), self.world, mixed,
                                  overflowed)
                if phase_resources
                else None
            )
            run: dict[str, Any] = dict(
                target=spec,
                world=resume.world_before if resume is not None else self.world,
                dtype=self.settings.dtype,
                device=self.settings.device,
                model_name=self.settings.model,
                seed=self.settings.seed,
                phases=self.phases,
                phase_info=phase_info,
                observations=self.observations,
                numels=numels,
                resources=resources,
                mesh=self.settings.mesh,
                strict=self.settings.strict,
                grad_accum=self.settings.grad_accum,
                precision=self.settings.precision,
                reduce_dtype=self.settings.reduce_dtype,
            )
            if self.settings.save_observations:
                save_observations(self.settings.save_observations, run)
            started = time.monotonic()
            report = evaluate(base=base, resume=resume, **run)
            report.extra["evaluation_s"] = round(time.monotonic() - started, 2)
            report.extra["training_s"] = round(started - self.started, 2)
            if self.settings.out:
                Path(self.settings.out).mkdir(parents=True, exist_ok=True)
                write_text(Path(self.settings.out) / "report.json", json.dumps(report.to_json(), indent=1))
            if not self.settings.quiet:
                text = json.dumps(report.to_json()) if self.settings.json_output else render_text(report)
                print(text, flush=True)
            code = report.exit_code
        return code

    def _skipped_steps(self, base: Any) -> frozenset[int]:
        """Rank 0: the steps of every phase whose masters did not change (a loss-scaling trainer skipped
        them), from the phase's initial model on."""
        from .resources import skipped_steps

        initial = {n: p.detach().cpu().float().numpy() for n, p in base.named_parameters()}
        masters = {s: seen[0].params for s, seen in self.observations.items() if seen}
        out: set[int] = set()
        for phase in self.phases:
            out |= skipped_steps(phase.step_numbers, masters, initial)
        return frozenset(out)

    def _close(self, trainer: Any, phase: Phase) -> None:
        """The trainer's optional ``close()`` once its phase is over, on every rank."""
        self.where = f"{phase.name} phase: close()"
        close_trainer(trainer)

    # -- resuming ----------------------------------------------------------------------------------------
    def _require_resumable(self, trainer: Any) -> None:
        """Every rank agrees on a TrainerError (bad input) when the trainer cannot save or load."""
        missing = missing_resume_method(trainer)
        error = None
        if missing is not None:
            error = (
                f"{self.settings.target}: the trainer has no {missing}() method; --resume-at needs "
                "save_checkpoint(directory) and load_checkpoint(directory)"
            )
        self.agree((None, error))

    def _require_accumulating(self, trainer: Any) -> None:
        """Every rank agrees on a TrainerError (bad input) when ``--grad-accum K > 1`` meets a trainer
        without ``step_accumulated``."""
        error = None
        if not callable(getattr(trainer, "step_accumulated", None)):
            error = (
                f"{self.settings.target}: the trainer has no step_accumulated(micro_batches) method; "
                f"--grad-accum {self.settings.grad_accum} needs it (or use --grad-accum 1)"
            )
        self.agree((None, error))

    def _save_first_run(self, phase_info: list[dict[str, Any]]) -> None:
        """Rank 0 of the first world: the phases (with the chosen clip) and every observation so far."""
        snapshot = {
            "world": self.world,
            "phases": self.phases,
            "phase_info": phase_info,
            "observations": self.observations,
        }
        datafile.save(self._resume_dir() / SNAPSHOT_FILE, snapshot)

    def _resume_dir(self) -> Path:
        """The folder the first launch of a resumed run saves into (the run value always names it)."""
        if self.settings.resume_dir is None:
            raise ConfigError("resume_dir", None, "a resumed run needs the folder of its first launch")
        return Path(self.settings.resume_dir)

    def _load_first_run(self) -> tuple[ResumeRun, dict[str, dict[str, Any]]]:
        """Rank 0 reads what the first world left (plain data in the run's private folder: a file
        replaced there can hold wrong values but cannot run code) and sends every rank the phases;
        rank 0 keeps the observations."""
        first = None
        if self.rank == 0:
            first = read_first_run(self._resume_dir() / SNAPSHOT_FILE)
        plan = self.comm.broadcast_object(
            None if first is None else (first["world"], first["phases"], first["phase_info"]), root=0
        )
        world_before, self.phases, info = plan
        if first is not None:
            self.observations = dict(first["observations"])
        resume = ResumeRun(int(self.settings.resume_at or 0), int(world_before), self.world)
        return resume, {p["name"]: p for p in info}

    def _resume_phase(
        self, trainer: Any, phase: Phase, resume: ResumeRun, expected: dict[str, Any], numels: dict[str, int]
    ) -> str | None:
        """``load_checkpoint`` on every rank, then every rank's state right after it to rank 0. The reason
        the phase cannot resume (the trainer raised NotImplementedError on some rank), or None."""
        last = resume.last_step_before(phase.first_step)
        self.where = f"{phase.name} phase: load_checkpoint()"
        self.arrivals.mark(self.where)
        reason = None
        try:
            trainer.load_checkpoint(str(self._resume_dir() / phase.name))
        except NotImplementedError as e:
            reason = f"load_checkpoint raised NotImplementedError ({e or 'no reason given'})"
        reason = self.first_of_any(reason)
        if reason is not None:
            return f"resume from world {resume.world_before} to {resume.world_after}: {reason}"
        obs = self.agree(self._local(self._observe, trainer, phase, last, 0.0, expected, numels))
        gathered = self.comm.gather_object(obs, root=0)
        if self.rank == 0:
            resume.after_load[phase.name] = list(gathered)
            resume.before_save[phase.name] = self.observations[last][0]
        return None

    def _make(self, model: Any, phase: Phase) -> tuple[Any, str | None]:
        name = self.settings.target
        try:
            optim = trainer_config(phase.optim)
            if self.settings.mesh is not None:
                optim["mesh"] = tuple(self.settings.mesh)
            mixed = policy(self.settings.precision, self.settings.reduce_dtype)
            if mixed is not None:
                optim["mixed_precision"] = mixed
            trainer = self.factory(model, optim)
        except NotImplementedError as e:
            return (
                None,
                f"make_trainer raised NotImplementedError ({e or 'no reason given'}) for {phase.name}",
            )
        except TrainerError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's constructor raised: bad input, named
            raise TrainerError(
                f"{name}: make_trainer raised on rank {self.rank} ({phase.name} phase): "
                f"{type(e).__name__}: {e}"
            ) from e
        require_trainer_object(trainer, name, self.rank)
        return trainer, None

    def _observe(
        self,
        trainer: Any,
        phase: Phase,
        step: int,
        loss: Any,
        expected: dict[str, Any],
        numels: dict[str, int],
        stepped: bool = False,
    ) -> TrainerObservation:
        # a non-finite value (finite=False) is data, not a protocol breach: C-ZERO-002 judges it against the
        # reference and the diagnosis non-finite-weights names it; names, shapes and dtypes are protocol
        loss_value = finite_loss(loss, self.rank, step, finite=False)
        grad_norm = None
        if stepped and callable(getattr(trainer, "last_grad_norm", None)):
            self.where = f"step {step} ({phase.name}): last_grad_norm()"
            grad_norm = logged_norm(trainer.last_grad_norm(), self.rank, step, finite=False)
        self.where = f"step {step} ({phase.name}): full_parameters()"
        self.arrivals.mark(self.where)
        raw = trainer.full_parameters()
        params = _as_arrays(raw, "full_parameters", self.rank)
        validate_parameters(params, expected, self.rank, finite=False)
        state = None
        if callable(getattr(trainer, "full_optimizer_state", None)):
            self.where = f"step {step} ({phase.name}): full_optimizer_state()"
            self.arrivals.mark(self.where)
            raw_state = trainer.full_optimizer_state()
            if not isinstance(raw_state, dict):
                raise TrainerError(
                    f"full_optimizer_state() on rank {self.rank} returned "
                    f"{type(raw_state).__name__}, expected a dict"
                )
            state = {
                n: _as_arrays(e, f"full_optimizer_state()[{n!r}]", self.rank) if isinstance(e, dict) else e
                for n, e in raw_state.items()
            }
            validate_optimizer_state(state, expected, phase.name, self.rank, finite=False)
        shards = None
        if callable(getattr(trainer, "local_shards", None)):
            self.where = f"step {step} ({phase.name}): local_shards()"
            shards = validate_local_shards(trainer.local_shards(), numels, self.rank)
        self.where = f"step {step} ({phase.name}): sending observations to rank 0"
        return TrainerObservation(phase.name, step, self.rank, loss_value, params, state, shards,
                                  grad_norm=grad_norm)

    def _phase_json(self, phase: Phase, status: str, reason: str) -> dict[str, Any]:
        info = {
            "name": phase.name,
            "first_step": phase.first_step,
            "last_step": phase.first_step + phase.steps - 1,
            "status": status,
            "optim": {k: (list(v) if isinstance(v, tuple) else v) for k, v in phase.optim.items()},
            **phase.extra,
        }
        if status == "skipped":
            info["reason"] = reason
            info["not_ruled_out"] = NOT_RULED_OUT.get(phase.name, "")
        return info

    # -- failure -----------------------------------------------------------------------------------------
    def record_failure(self, error: BaseException) -> None:
        """Write ``failure-rank<R>.json`` naming the rank to blame and what this rank saw
        (:func:`zerosim.verify.blame.failure_record`; see the module docstring)."""
        from .blame import failure_record

        out = self.settings.out
        if not out:
            return
        record = failure_record(error, self.rank, self.where, self.arrivals)
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            write_text(Path(out) / f"failure-rank{self.rank}.json", json.dumps(record))
        except (OSError, OutputError):
            print(f"rank {self.rank}: could not write the failure record to {out}", file=sys.stderr)


def base_dtype_bytes(model: Any) -> int:
    return int(next(model.parameters()).element_size())


def _as_arrays(values: Any, method: str, rank: int) -> Any:
    if not isinstance(values, dict):
        return values
    out = {}
    for name, v in values.items():
        try:
            out[name] = np.array(to_numpy(v), copy=True)
        except (TypeError, RuntimeError) as e:
            raise TrainerError(
                f"{method} on rank {rank}: {name!r} cannot be read as an array ({type(v).__name__}: {e})"
            ) from None
    return out
