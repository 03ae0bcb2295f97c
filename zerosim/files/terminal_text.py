"""Text read from a file, made safe to print on a terminal.

Names in a checkpoint index (tensors, files, the optimizer) and in a monitor's trace (tensors, the
adapter) are data a user may not have written. A terminal executes the control characters in such
text (escape sequences clear the screen, move the cursor, rewrite a line), so anything printed from
a file goes through :func:`printable` first: every character Python does not call printable (C0/C1
controls, DEL, bidi overrides and other format characters, line and paragraph separators, unassigned
code points) is shown as its escape (``\\x1b``, ``\\u202e``), and a backslash as ``\\\\`` so an
escape cannot be forged. The CLI prints with plain ``print`` (no rich markup is interpreted in such
text); a violation's line (:class:`zerosim.values.verdict.Violation`) is escaped the same way wherever it is
printed or logged.
"""

from __future__ import annotations

from typing import Any


def printable(value: Any) -> str:
    """``str(value)`` with every non-printable character (and the backslash) escaped."""
    out = []
    for ch in str(value):
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(
                f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
            )
    return "".join(out)
