"""A trainer module whose own import fails on a missing dependency whose name is a prefix of the
module's (as ``torch`` is of ``torch_trainer``): verify must blame the dependency, not the module."""

import tests.verify_trainers.needs  # noqa: F401  (no such module)


def make_trainer(model, optim):  # pragma: no cover - never reached
    raise AssertionError("unreachable")
