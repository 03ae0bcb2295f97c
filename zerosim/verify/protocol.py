"""The trainer protocol that ``zerosim verify`` drives, and the validation of what a trainer returns.

A user's trainer is built by ``make_trainer(model, optim) -> Trainer`` on every rank after
``torch.distributed`` is initialised. ``model`` is the built-in GPT, identical on every rank and
already in the run's dtype; ``optim`` is an :class:`OptimConfig`. Raising ``NotImplementedError``
from ``make_trainer`` marks that optimizer phase "skipped".

Required: ``step(inputs, targets) -> float`` (one optimizer step on this rank's micro-batch; the
global gradient is the mean over ranks) and ``full_parameters() -> dict[str, Tensor]`` (every
parameter, full and unsharded, keyed by its name in ``model.named_parameters()``; collective).
Optional: ``full_optimizer_state() -> dict[str, dict[str, Tensor]]`` (torch.optim's state names
``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``step``; Adafactor's ``row_var``, ``col_var``,
``variance``) and ``local_shards() -> dict[str,
list[tuple[int, int]]]`` (half-open ranges of each flattened parameter whose optimizer state this
rank owns; C-ZERO-001 is checked from them).

Optional, for ``--grad-accum K`` (K > 1): ``step_accumulated(micro_batches) -> float``, where
``micro_batches`` is a list of K ``(inputs, targets)`` pairs for this rank, all of the same shape: one
optimizer step on the mean gradient over all K x world micro-batches; returns the mean local loss.

Optional: ``last_grad_norm() -> float``: the total gradient norm before clipping of the last step, as
the trainer would log it (C-ZERO-008 checks it every step against the reference's norm).

Optional: ``close()``, called once after a trainer's last step (by verify between phases, by
``zerosim bench peers`` between adapters): release what the trainer registered outside itself
(hooks on the model, an engine's global state), so that the next trainer built in the same process
starts clean and the memory of this one can be freed.

Optional, for ``--resume-at``: ``save_checkpoint(directory)`` and ``load_checkpoint(directory)``, both
collective (every rank calls them, between steps, with the same directory, on a shared filesystem).
``save_checkpoint`` writes everything the trainer needs to continue: parameters, optimizer state and
step counters. ``load_checkpoint`` is called on a freshly built trainer (the same factory, a fresh
model of the same seed) at possibly another world size, and must leave it exactly where the saved
trainer was: its ``full_parameters()`` and ``full_optimizer_state()`` bitwise equal to the saved
trainer's, and its next steps those the saved trainer would have taken on the new world's batches.

The validators here turn a protocol breach into a one-line :class:`~zerosim.verify.errors.TrainerError`
naming the method, the parameter and the rank (bad input, exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypedDict, runtime_checkable

import numpy as np

from .errors import TrainerError
from .optimizers import STATE_NAMES as STATE_NAMES
from .optimizers import state_names, state_shape

REQUIRED_METHODS = ("step", "full_parameters")
OPTIONAL_METHODS = ("full_optimizer_state", "local_shards", "save_checkpoint", "load_checkpoint", "close",
                    "step_accumulated", "last_grad_norm")
RESUME_METHODS = ("save_checkpoint", "load_checkpoint")


class OptimConfig(TypedDict, total=False):
    """What ``make_trainer`` receives as ``optim``. ``name``: sgd, adam, adamw, adafactor, muon or a
    user's ``MODULE:FACTORY``; each optimizer's own hyper-parameters beside it (``momentum`` for sgd;
    ``betas`` and ``eps`` for adam / adamw; muon's AdamW ones as ``adamw_*``; a user's optimizer: its
    ``defaults``). ``make_optimizer(params)``: the phase's optimizer over exactly those tensors, treating
    them as the reference treats the whole model's (:mod:`zerosim.verify.optimizers`). ``max_grad_norm``:
    None or clip with ``torch.nn.utils.clip_grad_norm_`` on the full averaged gradient."""

    name: str
    lr: float
    momentum: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float | None
    make_optimizer: Callable[[Iterable[Any]], Any]


@runtime_checkable
class Trainer(Protocol):
    """A sharded data-parallel trainer under test (C-ZERO-001..003 are checked on what it returns)."""

    def step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step on this rank's micro-batch; returns this rank's local loss."""
        ...

    def full_parameters(self) -> dict[str, Any]:
        """Every parameter, full and unsharded, as this rank holds it after the step (collective)."""
        ...


def require_trainer_object(obj: Any, factory: str, rank: int) -> None:
    """TrainerError unless ``obj`` has callable ``step`` and ``full_parameters``."""
    for name in REQUIRED_METHODS:
        if not callable(getattr(obj, name, None)):
            raise TrainerError(
                f"{factory} returned {type(obj).__name__!s} on rank {rank}, which has no "
                f"callable {name}(); a trainer needs step(inputs, targets) and full_parameters()"
            )
    for name in OPTIONAL_METHODS:
        attr = getattr(obj, name, None)
        if attr is not None and not callable(attr):
            raise TrainerError(f"{factory}: {name} on rank {rank} is {type(attr).__name__}, not a method")


def missing_resume_method(obj: Any) -> str | None:
    """The first of ``save_checkpoint`` / ``load_checkpoint`` that ``obj`` lacks (None: it has both)."""
    for name in RESUME_METHODS:
        if not callable(getattr(obj, name, None)):
            return name
    return None


def to_numpy(value: Any) -> np.ndarray:
    """A tensor (any device) or array as a host numpy array (no copy when already one)."""
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if detach is not None:
        return detach().cpu().numpy()
    return np.asarray(value)


def validate_parameters(
    params: Any,
    expected: Mapping[str, tuple[tuple[int, ...], str]],
    rank: int,
    method: str = "full_parameters",
    finite: bool = True,
) -> None:
    """TrainerError (one line) unless ``params`` maps exactly the expected names to arrays of the expected
    shape and dtype with finite values. ``expected``: name -> (shape, numpy dtype name). ``finite``
    False (mixed precision): a non-finite value is left to C-ZERO-002 (an fp16 overflow step that was
    taken instead of skipped is a contract failure, not a protocol breach)."""
    if not isinstance(params, Mapping):
        raise TrainerError(
            f"{method}() on rank {rank} returned {type(params).__name__}, expected a dict name -> tensor"
        )
    missing = [n for n in expected if n not in params]
    if missing:
        raise TrainerError(
            f"{method}() on rank {rank} is missing parameter {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    extra = [n for n in params if n not in expected]
    if extra:
        raise TrainerError(
            f"{method}() on rank {rank} returned unknown name {extra[0]!r} (not in model.named_parameters())"
        )
    for name, (shape, dtype) in expected.items():
        arr = params[name]
        if not isinstance(arr, np.ndarray):
            raise TrainerError(f"{method}() on rank {rank}: {name!r} is {type(arr).__name__}, not a tensor")
        if tuple(arr.shape) != tuple(shape):
            raise TrainerError(
                f"{method}() on rank {rank}: {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}"
            )
        if str(arr.dtype) != dtype:
            raise TrainerError(f"{method}() on rank {rank}: {name!r} has dtype {arr.dtype}, expected {dtype}")
        if finite and not np.isfinite(arr).all():
            bad = int(np.flatnonzero(~np.isfinite(arr.reshape(-1)))[0])
            raise TrainerError(
                f"{method}() on rank {rank}: {name!r} holds a non-finite value "
                f"({arr.reshape(-1)[bad]}) at flat element {bad}"
            )


def validate_optimizer_state(
    state: Any, expected: Mapping[str, tuple[tuple[int, ...], str]], optim: str, rank: int,
    finite: bool = True,
) -> None:
    """TrainerError unless ``state`` maps parameter names to dicts of torch.optim state arrays of the
    shape torch gives them (:func:`zerosim.verify.optimizers.state_shape`: the parameter's, Adafactor's
    row and column statistics; ``step``: a scalar). Names a trainer does not expose are allowed to be
    absent; a user's optimizer's entries are checked for finiteness only."""
    if not isinstance(state, Mapping):
        raise TrainerError(
            f"full_optimizer_state() on rank {rank} returned {type(state).__name__}, "
            "expected a dict name -> {state name: tensor}"
        )
    for name, entry in state.items():
        if name not in expected:
            raise TrainerError(f"full_optimizer_state() on rank {rank} returned unknown name {name!r}")
        if not isinstance(entry, Mapping):
            raise TrainerError(
                f"full_optimizer_state() on rank {rank}: {name!r} is {type(entry).__name__}, "
                "expected a dict of state tensors"
            )
        shape, dtype = expected[name]
        names = state_names(optim)
        for key, arr in entry.items():
            if names is not None and key not in names:
                continue  # a peer's extra bookkeeping; only torch.optim's names are compared
            if not isinstance(arr, np.ndarray):
                raise TrainerError(f"full_optimizer_state() on rank {rank}: {name!r}[{key!r}] is "
                                   f"{type(arr).__name__}, not a tensor")
            if key == "step":
                if arr.size != 1 or not np.isfinite(arr).all():
                    raise TrainerError(
                        f"full_optimizer_state() on rank {rank}: {name!r}['step'] must be "
                        f"one finite number, got shape {tuple(arr.shape)}"
                    )
                continue
            want = state_shape(optim, key, tuple(shape))
            if want is not None and tuple(arr.shape) != want:
                raise TrainerError(
                    f"full_optimizer_state() on rank {rank}: {name!r}[{key!r}] has shape "
                    f"{tuple(arr.shape)}, expected {want}"
                )
            if finite and not np.isfinite(arr).all():
                raise TrainerError(
                    f"full_optimizer_state() on rank {rank}: {name!r}[{key!r}] holds a non-finite value"
                )


def validate_local_shards(
    shards: Any, numels: Mapping[str, int], rank: int
) -> dict[str, list[tuple[int, int]]]:
    """``local_shards()`` as plain ``{name: [(start, stop), ...]}``; TrainerError on a name that is not a
    parameter, a range that is not two integers, or one outside ``[0, numel]`` / with start > stop."""
    if not isinstance(shards, Mapping):
        raise TrainerError(
            f"local_shards() on rank {rank} returned {type(shards).__name__}, expected a dict "
            "name -> [(start, stop), ...]"
        )
    out: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in shards.items():
        if name not in numels:
            raise TrainerError(f"local_shards() on rank {rank} returned unknown name {name!r}")
        clean: list[tuple[int, int]] = []
        try:
            items = list(ranges)
        except TypeError:
            raise TrainerError(
                f"local_shards() on rank {rank}: {name!r} is {type(ranges).__name__}, expected "
                "a list of (start, stop)"
            ) from None
        for item in items:
            pair = tuple(item) if isinstance(item, (tuple, list)) else (item,)
            if len(pair) != 2 or not all(_is_int(x) for x in pair):
                raise TrainerError(
                    f"local_shards() on rank {rank}: {name!r} has range {item!r}; ranges are "
                    "(start, stop) integer pairs"
                )
            start, stop = int(pair[0]), int(pair[1])
            if not 0 <= start <= stop <= numels[name]:
                raise TrainerError(
                    f"local_shards() on rank {rank}: {name!r} range ({start}, {stop}) is out of "
                    f"bounds for its {numels[name]} elements"
                )
            if stop > start:
                clean.append((start, stop))
        out[name] = clean
    return out


def _is_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    item = getattr(x, "item", None)  # a 0-d integer tensor
    if (
        item is not None
        and getattr(x, "dtype", None) is not None
        and not getattr(x, "is_floating_point", lambda: True)()
    ):
        return isinstance(item(), int)
    return False


def finite_loss(value: Any, rank: int, step: int, finite: bool = True) -> float:
    """``step()``'s return value as a float; TrainerError if it is not a finite number (``finite`` False,
    mixed precision: a non-finite loss is allowed, the masters are judged)."""
    try:
        loss = float(value)
    except (TypeError, ValueError):
        raise TrainerError(
            f"step() on rank {rank} at step {step} returned {type(value).__name__}, expected "
            "the loss as a float"
        ) from None
    if finite and not math.isfinite(loss):
        raise TrainerError(f"step() on rank {rank} at step {step} returned a non-finite loss ({loss})")
    return loss


def logged_norm(value: Any, rank: int, step: int, finite: bool = True) -> float:
    """``last_grad_norm()``'s return value as a float; TrainerError unless it is a finite number >= 0
    (``finite`` False, mixed precision: an fp16 overflow step's norm may be inf; C-ZERO-008 judges it)."""
    try:
        norm = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TrainerError(
            f"last_grad_norm() on rank {rank} at step {step} returned {type(value).__name__}, expected "
            "the total gradient norm as a float"
        ) from None
    if (finite and not math.isfinite(norm)) or norm < 0:
        raise TrainerError(
            f"last_grad_norm() on rank {rank} at step {step} returned {norm}, expected a finite norm >= 0"
        )
    return norm


def close_trainer(trainer: Any) -> None:
    """Call the trainer's optional ``close()`` (see the module docstring); nothing when it has none."""
    close = getattr(trainer, "close", None)
    if callable(close):
        close()
