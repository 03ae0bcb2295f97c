"""Trainers that break the verify protocol or the run itself: bad input (exit 2) or a failing rank (exit 3).

Each factory is one way a user's ``MODULE:FACTORY`` goes wrong; ``tests/test_verify_bad_input.py``
runs each through ``zerosim verify`` and expects one clear line, no traceback and no hang.
"""

from __future__ import annotations

import time

import torch

from examples.zero1_trainer import Zero1Trainer

MISBEHAVING_RANK = 1
FAILING_STEP = 2  # the step (within the first phase) at which the mid-run failures happen
RAISED_MESSAGE = "optimizer shard lost its state: exp_avg is None"
HANG_SECONDS = 600.0  # far longer than the collective timeout the test gives; the launcher kills us

NOT_CALLABLE = {"name": "a dict where a factory should be"}


def raises_on_construction(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    raise RuntimeError("cannot shard a model with 0 parameters")


class _NoStep:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class _NoFullParameters:
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return 0.0


def without_step(model: torch.nn.Module, optim: dict) -> _NoStep:
    return _NoStep(model)


def without_full_parameters(model: torch.nn.Module, optim: dict) -> _NoFullParameters:
    return _NoFullParameters()


def _first_name(params: dict[str, torch.Tensor]) -> str:
    return next(iter(params))


class MissingName(Zero1Trainer):
    def full_parameters(self) -> dict[str, torch.Tensor]:
        params = super().full_parameters()
        del params[_first_name(params)]
        return params


class ExtraName(Zero1Trainer):
    def full_parameters(self) -> dict[str, torch.Tensor]:
        params = super().full_parameters()
        params["module.extra_bias"] = torch.zeros(3, dtype=self.params[0].dtype)
        return params


class WrongShape(Zero1Trainer):
    def full_parameters(self) -> dict[str, torch.Tensor]:
        params = super().full_parameters()
        name = _first_name(params)
        params[name] = params[name].reshape(-1)[:-1]
        return params


class WrongDtype(Zero1Trainer):
    def full_parameters(self) -> dict[str, torch.Tensor]:
        params = super().full_parameters()
        name = _first_name(params)
        params[name] = params[name].to(torch.float16)
        return params


class NanParameters(Zero1Trainer):
    """Returns NaN in one element: no protocol breach, a C-ZERO-002 failure (the reference is finite)."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        params = super().full_parameters()
        params[_first_name(params)].reshape(-1)[0] = float("nan")
        return params


class ShardsOutOfBounds(Zero1Trainer):
    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        shards = super().local_shards()
        name = self.names[0]
        shards[name] = [(0, self.params[0].numel() + 5)]
        return shards


class ShardsNotIntegers(Zero1Trainer):
    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        shards: dict = super().local_shards()
        shards[self.names[0]] = [(0.0, 2.5)]
        return shards


class RankRaisesMidRun(Zero1Trainer):
    """Rank 1 raises inside ``step`` at step 2 while the others wait for it in the all-gather."""

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.rank == MISBEHAVING_RANK and self.steps_taken == FAILING_STEP:
            raise RuntimeError(RAISED_MESSAGE)
        super().update(param, grad)


class RankHangs(Zero1Trainer):
    """Rank 1 stops answering at step 2 (a deadlock outside the collectives); its peers wait for it in
    the all-gather until the collective timeout."""

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.rank == MISBEHAVING_RANK and self.steps_taken == FAILING_STEP:
            time.sleep(HANG_SECONDS)
        super().update(param, grad)


def missing_name(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return MissingName(model, optim)


def extra_name(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return ExtraName(model, optim)


def wrong_shape(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return WrongShape(model, optim)


def wrong_dtype(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return WrongDtype(model, optim)


def nan_parameters(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return NanParameters(model, optim)


def shards_out_of_bounds(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return ShardsOutOfBounds(model, optim)


def shards_not_integers(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return ShardsNotIntegers(model, optim)


def rank_raises_mid_run(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return RankRaisesMidRun(model, optim)


def rank_hangs(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return RankHangs(model, optim)
