"""The hooks the monitor puts into a training loop (autograd's gradient hooks, the optimizer's step
pre/post hooks) never raise into it.

A hook runs inside ``loss.backward()`` or ``optimizer.step()``, where an exception of the monitor's
would end the user's step. :class:`HookGuard` wraps each hook: the first error is kept, every guarded
hook is a no-op from then on (a hook cannot be removed while torch iterates over its hooks), and the
probe that owns the guard hands the error to the monitor at its next check (:meth:`HookGuard.reraise`),
where the monitor's own failures turn it off and training goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HookFailed(RuntimeError):
    """A guarded hook raised: the monitor's own failure, reported at its next check."""


class HookGuard:
    """Wraps hooks so that none raises; keeps the first error (:attr:`error`)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.where = ""

    def wrap(self, hook: Callable[..., Any], where: str) -> Callable[..., None]:
        """``hook`` made safe: runs while no guarded hook has failed, returns None (so it never changes
        a gradient or a step's arguments), and keeps its exception instead of raising it."""

        def guarded(*args: Any, **kwargs: Any) -> None:
            if self.error is not None:
                return
            try:
                hook(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - kept, reported at the monitor's next check
                self.error, self.where = err, where

        return guarded

    def reraise(self) -> None:
        """Raise :class:`HookFailed` naming the hook and its error, if one failed."""
        if self.error is not None:
            raise HookFailed(f"the {self.where} hook failed: {type(self.error).__name__}: "
                             f"{self.error}") from self.error
