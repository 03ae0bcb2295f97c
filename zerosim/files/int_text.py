"""Integers written as text, as a command line or a settings file gives them: one integer as an
exact expression (``1000``, ``10**12``, ``1e12``, ``2**61-1``, ``1_000_003``) and lists of them with
inclusive ranges (``1..64,1024``). Only integer arithmetic is evaluated; anything else is a
ConfigError naming the field.
"""

from __future__ import annotations

import ast
import operator

from ..errors import ConfigError

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow}


def parse_int_expr(text: str, field: str) -> int:
    """An integer written as ``1000``, ``10**12``, ``1e12``, ``2**61-1`` or ``1_000_003``."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        return _eval(node)
    except (SyntaxError, ValueError, TypeError, OverflowError):
        raise ConfigError(field, text, "must be an integer (e.g. 1000, 10**12, 1e12, 2**61-1)") from None


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        if node.value.is_integer() and abs(node.value) < 2**53:
            return int(node.value)
        raise ValueError("not an exact integer")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and not 0 <= right <= 4096:
            raise ValueError("exponent out of range")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError("unsupported expression")


def parse_int_list(text: str, field: str) -> list[int]:
    """Comma-separated integers and inclusive ranges: ``1..64,1024`` or ``0,1,7,1e12``."""
    out: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        if ".." in item:
            lo_text, _, hi_text = item.partition("..")
            lo, hi = parse_int_expr(lo_text, field), parse_int_expr(hi_text, field)
            if hi < lo or hi - lo > 1_000_000:
                raise ConfigError(field, item, "a range 'a..b' needs a <= b and at most 10^6 values")
            out.extend(range(lo, hi + 1))
        else:
            out.append(parse_int_expr(item, field))
    if not out:
        raise ConfigError(field, text, "must list at least one integer")
    return out
