"""A trainer-mutant module for ``zerosim mutants --trainers``: one broken trainer and the correct one.

The correct example must survive (nothing to catch), so the command exits 1: the matrix tells a
broken trainer from a working one.
"""

from examples.zero1_trainer import make_trainer as correct  # noqa: F401
from tests.verify_trainers.broken import summed_gradient  # noqa: F401

MUTANTS = {"summed_gradient": 2, "correct": 2}
