"""One exception family for everything zerosim rejects.

Every error raised at a boundary (CLI option, public function argument, user implementation,
collective) is a :class:`ZeroSimError`, so callers can catch one type and the CLI can turn it into
a one-line message and exit status 2 instead of a traceback from deep inside.

The exit statuses every command and every backend launcher ends with are defined here, once.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0                #: every contract holds
EXIT_CONTRACT_FAILED = 1   #: a contract failed (the run itself completed)
EXIT_CHECKPOINT_CORRUPT = 1  #: checkpoint inspect: the index is valid, a file it names is not
EXIT_BAD_INPUT = 2         #: a ZeroSimError before anything ran: one line naming the field and value
EXIT_RUN_FAILED = 3        #: the run failed: a rank raised, a collective timed out, a non-finite gradient,
#: or the run diverged (the unsharded reference itself went non-finite)
EXIT_LAUNCH_TIMEOUT = 124  #: a launched job outlived its wall-clock limit (like coreutils' timeout(1))
EXIT_INTERRUPTED = 130     #: Ctrl-C
EXIT_BROKEN_PIPE = 141     #: stdout closed by its reader (`| head`): 128 + SIGPIPE, as a shell tool exits


def install_hint(extra: str) -> str:
    """How to install the optional extra ``extra``, in the README's words (an editable install from the
    checkout); DeepSpeed's with ``DS_BUILD_OPS=0`` (no C++/CUDA ops compiled at install)."""
    prefix = "DS_BUILD_OPS=0 " if extra == "deepspeed" else ""
    return f'{prefix}pip install -e ".[{extra}]" in the zerosim checkout'


class ZeroSimError(Exception):
    """Base class of every error zerosim raises on purpose."""


class ConfigError(ZeroSimError, ValueError):
    """A user-supplied value is invalid. Names the offending field and the value it had."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {field}={value!r}: {reason}")


class ImplementationError(ZeroSimError):
    """A user's implementation (``--impl``) could not be imported, raised, or returned the wrong type."""


class CollectiveError(ZeroSimError):
    """A collective failed: a rank raised, or a rank never arrived before the timeout."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete in time. Names the collective and the ranks that never arrived."""

    def __init__(self, collective: str, missing_ranks: list[int], timeout_s: float, group: str = "world"):
        self.collective = collective
        self.missing_ranks = list(missing_ranks)
        self.timeout_s = timeout_s
        self.group = group
        super().__init__(
            f"{collective} on group {group} timed out after {timeout_s:g}s; "
            f"ranks that never arrived: {self.missing_ranks}"
        )


class NonFiniteGradientError(ZeroSimError):
    """A gradient holds NaN or Inf. Names the rank and the tensor, so it is never silently averaged."""

    def __init__(self, rank: int, tensor: str, step: int | None = None, detail: str = ""):
        self.rank = rank
        self.tensor = tensor
        self.step = step
        where = f" at step {step}" if step is not None else ""
        super().__init__(
            f"non-finite gradient on rank {rank}, tensor {tensor!r}{where}{': ' + detail if detail else ''}"
        )


def require_positive_int(field: str, value: Any) -> int:
    """Validate that ``value`` is an int > 0 (bool excluded); return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, value, "must be a positive integer")
    if value <= 0:
        raise ConfigError(field, value, "must be a positive integer")
    return value


def require_non_negative_int(field: str, value: Any) -> int:
    """Validate that ``value`` is an int >= 0 (bool excluded); return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, value, "must be a non-negative integer")
    if value < 0:
        raise ConfigError(field, value, "must be a non-negative integer")
    return value


def require_rank(rank: Any, world_size: int, field: str = "rank") -> int:
    """Validate that ``rank`` is an int in ``[0, world_size)``; return it."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ConfigError(field, rank, "must be an integer")
    if not 0 <= rank < world_size:
        raise ConfigError(field, rank, f"must be in [0, {world_size}) for world_size={world_size}")
    return rank
