"""Test helpers for users of zerosim.

* :func:`assert_trainer_verifies` (``zerosim.testing.verify``): run ``zerosim verify`` on your own
  sharded trainer from your test suite; raises AssertionError with the diagnostic on failure. Needs
  torch only when called.
* hypothesis strategies (``zerosim.testing.strategies``): importing them needs hypothesis
  (``pip install -e ".[test]"`` in the checkout); importing ``zerosim`` itself never does.
"""

from .verify import assert_trainer_verifies

__all__ = ["assert_trainer_verifies"]
