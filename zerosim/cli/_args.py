"""What every command that prints to a pipe shares: :func:`pipe_safe`. (Integers written as text are
parsed by :mod:`zerosim.files.int_text`.)"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import EXIT_BROKEN_PIPE


def pipe_safe(func: Callable[..., int]) -> Callable[..., int]:
    """Let ``zerosim plan ... | head`` end quietly with 141 (128 + SIGPIPE), the status every command
    ends with when its reader goes away: a closed stdout is not an error worth a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            return func(*args, **kwargs)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # Python's documented recipe for SIGPIPE
            os.close(devnull)
            return EXIT_BROKEN_PIPE

    return wrapper
