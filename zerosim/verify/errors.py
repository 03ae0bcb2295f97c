"""The errors ``zerosim verify`` raises besides :class:`zerosim.errors.ConfigError`.

* :class:`TrainerError`: the trainer under test is bad input (its factory cannot be found, is not
  callable, raises on construction, returns an object without the protocol's methods, or returns
  values that break the protocol: a missing or extra name, a wrong shape or dtype, NaN). Exit 2.
* :class:`RankFailure`: a rank raised or hung while training. Names the rank. Exit 3.
"""

from __future__ import annotations

from zerosim.errors import ImplementationError, ZeroSimError


class TrainerError(ImplementationError):
    """The trainer under test broke the protocol (exit 2). The message is one line naming what and where."""


class RankFailure(ZeroSimError):
    """A rank raised or hung during ``zerosim verify`` (exit 3). ``rank`` is the rank to look at."""

    def __init__(self, rank: int, message: str):
        self.rank = int(rank)  # -1: no rank could be named (the launch itself failed or timed out)
        self.message = message
        super().__init__(
            f"rank {self.rank} failed: {message}" if self.rank >= 0 else f"the run failed: {message}"
        )
