"""Typed reading of an observation's JSON fields: each value checked for its type and range before a
check sees it, every refusal a ConfigError naming the field (its path in the record) and the value.

A monitor's trace (:meth:`zerosim.values.observe.MonitorObservation.from_json`) is input a user may have
copied, cut or edited, and the checks it feeds do integer arithmetic in int64 and floating-point
arithmetic that a negative sum of squares or a huge integer would break. So:

* an integer field is a JSON integer (never a float such as ``0.9`` or ``Infinity``, never ``true``),
  within the bounds its meaning gives (a rank below the world size, a count never negative, an element
  index within a signed 64-bit integer, :data:`INT64_LIMIT`);
* a number field is a JSON number (an integer or a float; ``NaN`` and ``Infinity`` where the writer
  can legitimately write them, as a non-finite gradient does), within its sign;
* a string field is a string, a range a pair of integers, a map of ranges an object of such lists.

Shown values are cut to :data:`SHOWN_CHARS` characters of their ``repr`` (which escapes control and
bidi characters), so an error line stays one short line whatever the record holds.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

INT64_LIMIT = 1 << 63  #: element indices, counts and steps lie in (-2**63, 2**63): numpy's int64
MAX_WORLD = 1 << 20  #: the most ranks a run may have (a world size above it is not a real run's)
SHOWN_CHARS = 60  #: characters of a refused value shown in the error line


class Shown:
    """A value as an error line shows it: its ``repr``, cut to SHOWN_CHARS characters."""

    def __init__(self, value: Any):
        text = repr(value)
        self.text = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."

    def __repr__(self) -> str:
        return self.text


def key_path(parent: str, key: Any) -> str:
    """``parent[key]`` with the key shown as :class:`Shown` shows it (escaped and cut)."""
    return f"{parent}[{Shown(key)!r}]"


def fail(path: str, value: Any, reason: str) -> ConfigError:
    return ConfigError(path, Shown(value), reason)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def need_int(value: Any, path: str, lo: int = -INT64_LIMIT + 1, hi: int = INT64_LIMIT - 1) -> int:
    """``value`` as an integer in ``[lo, hi]``."""
    if not is_int(value):
        raise fail(path, value, "must be an integer")
    if not lo <= value <= hi:
        raise fail(path, value, f"must be an integer in [{lo}, {hi}]")
    return int(value)


def need_count(value: Any, path: str) -> int:
    """``value`` as a non-negative integer below 2**63."""
    return need_int(value, path, 0, INT64_LIMIT - 1)


def need_number(value: Any, path: str, *, non_negative: bool = False, nan: bool = True,
                positive: bool = False) -> float:
    """``value`` (a JSON integer or float) as a float; ``non_negative``: refuses values below 0
    (``-Infinity`` included); ``positive``: refuses 0 too; ``nan``: whether NaN is allowed."""
    if not (is_int(value) or isinstance(value, float)):
        raise fail(path, value, "must be a number")
    number = float(value)
    if math.isnan(number):
        if not nan:
            raise fail(path, value, "must be a number, not NaN")
        return number
    if positive and not number > 0:
        raise fail(path, value, "must be a positive number")
    if non_negative and number < 0:
        raise fail(path, value, "must not be negative")
    return number


def need_optional_number(value: Any, path: str, **kwargs: bool) -> float | None:
    return None if value is None else need_number(value, path, **kwargs)


def need_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise fail(path, value, "must be a string")
    return value


def need_optional_str(value: Any, path: str) -> str | None:
    return None if value is None else need_str(value, path)


def need_list(value: Any, path: str, length: int | None = None) -> list[Any]:
    """``value`` as a JSON array (of exactly ``length`` items, where given)."""
    if not isinstance(value, list):
        raise fail(path, value, "must be a list")
    if length is not None and len(value) != length:
        raise fail(path, value, f"must be a list of {length} items")
    return value


def need_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(path, value, "must be an object")
    return value


def need_key(data: dict[str, Any], key: str) -> Any:
    """``data[key]``; a missing key is a ConfigError naming it."""
    if key not in data:
        raise ConfigError(key, None, "is missing")
    return data[key]


def need_ranges(value: Any, path: str) -> dict[str, list[tuple[int, int]]]:
    """A map of tensor name -> list of ``[start, stop)`` element ranges (integer pairs in int64's range;
    their order and bounds are C-ZERO-001's to judge)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in need_object(value, path).items():
        where = key_path(path, name)
        pairs = []
        for i, pair in enumerate(need_list(ranges, where)):
            a, b = need_list(pair, f"{where}[{i}]", 2)
            pairs.append((need_int(a, f"{where}[{i}][0]"), need_int(b, f"{where}[{i}][1]")))
        out[name] = pairs
    return out


#: the step checks' fields of a monitor's trace line and the field names their findings carry
UPDATE_NUMBERS = ("expected", "got", "bound")
#: the optimizers whose update formula a trace may name (zerosim.checks.update_formula.FORMULAS)
UPDATE_FORMULAS = ("SGD", "Adam", "AdamW", "Adafactor", "Muon")
REPLAY_NUMBERS = ("contributed", "first", "second", "bound")


def _finite(value: Any, path: str) -> float:
    number = need_number(value, path, nan=False)
    if not math.isfinite(number):
        raise fail(path, value, "must be a finite number")
    return number


def _numbers(value: Any, path: str) -> list[float]:
    return [need_number(v, f"{path}[{i}]") for i, v in enumerate(need_list(value, path))]


def _accounting(value: Any) -> dict[str, Any]:
    data = need_object(value, "accounting")
    tensors = [need_str(n, f"accounting.tensors[{i}]")
               for i, n in enumerate(need_list(need_key(data, "tensors"), "accounting.tensors"))]
    rows = {}
    for key in ("local", "consumed"):
        table = need_list(need_key(data, key), f"accounting.{key}", len(tensors))
        rows[key] = [_numbers(row, f"accounting.{key}[{i}]") for i, row in enumerate(table)]
        if any(len(row) < 3 or len(row) != len(rows[key][0]) for row in rows[key]):
            raise fail(f"accounting.{key}", table, "must hold rows of one length, at least 3 numbers")
        for i, row in enumerate(rows[key]):  # an L1 norm, then a count or a sum of squares (NaN: none)
            if any(v < 0 for v in row[-2:]):
                raise fail(f"accounting.{key}[{i}]", row[-2:], "must end in two non-negative numbers")
    if rows["local"] and len(rows["local"][0]) != len(rows["consumed"][0]):
        raise fail("accounting.consumed", data["consumed"], "must have rows as long as accounting.local's")
    return {"tensors": tensors, **rows, "dtype": need_str(need_key(data, "dtype"), "accounting.dtype"),
            "max_grad_norm": need_optional_number(need_key(data, "max_grad_norm"), "accounting.max_grad_norm",
                                                  positive=True, nan=False)}


def _finding(value: Any, path: str, numbers: tuple[str, ...], counts: tuple[str, ...]) -> dict[str, Any]:
    data = need_object(value, path)
    out: dict[str, Any] = dict(data)
    for key in counts:
        out[key] = need_count(need_key(data, key), f"{path}.{key}")
    out["tensor"] = need_optional_str(need_key(data, "tensor"), f"{path}.tensor")
    for key in numbers:
        out[key] = need_optional_number(data.get(key), f"{path}.{key}")
    for key in set(data) - set(counts) - set(numbers) - {"tensor"}:  # names, flags, ratios: one value each
        if not (data[key] is None or isinstance(data[key], (str, bool, int, float))):
            raise fail(f"{path}.{key}", data[key], "must be a string or a number")
    if "dtype" in data:
        out["dtype"] = need_str(data["dtype"], f"{path}.dtype")
    return out


#: the formulas whose samples are whole tensors, and each one's hyperparameters that are not numbers
_WHOLE = ("Adafactor", "Muon")


def _hyper(hp: dict[str, Any], where: str, optimizer: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in hp.items():
        path = f"{where}.hp.{key}"
        if key == "betas":  # each in [0, 1): a bias correction 1 - beta**t stays positive
            need_list(v, path, 2)
            out[key] = [_finite(b, f"{path}[{j}]") for j, b in enumerate(v)]
            if not all(0 <= b < 1 for b in out[key]):
                raise fail(path, v, "must be two numbers in [0, 1)")
        elif key == "eps" and isinstance(v, list):  # Adafactor's (eps1 or null, eps2)
            need_list(v, path, 2)
            out[key] = [None if e is None and j == 0 else _finite(e, f"{path}[{j}]") for j, e in enumerate(v)]
            if any(e is not None and e < 0 for e in out[key]):
                raise fail(path, v, "must hold numbers that are not negative")
        elif key == "ns_coefficients":
            need_list(v, path, 3)
            out[key] = [_finite(c, f"{path}[{j}]") for j, c in enumerate(v)]
        elif key == "adjust_lr_fn":
            out[key] = None if v is None else need_str(v, path)
        elif isinstance(v, bool):
            out[key] = v
        else:
            out[key] = _finite(v, path)
    need_key(out, "lr")
    if optimizer in ("Adam", "AdamW"):  # the Adam family's formula needs both
        for key in ("eps", "betas"):
            if key not in out:
                raise fail(f"{where}.hp.{key}", None, "is missing")
    if isinstance(out.get("eps"), float) and not out["eps"] > 0:
        raise fail(f"{where}.hp.eps", out["eps"], "must be a positive number")
    if optimizer == "Adafactor":
        if not out.get("d", 1.0) >= 1:
            raise fail(f"{where}.hp.d", out["d"], "must be at least 1")
        if not out.get("beta2_decay", -0.8) <= 0:
            raise fail(f"{where}.hp.beta2_decay", out["beta2_decay"], "must be at most 0")
    steps = out.get("ns_steps", 5)
    if optimizer == "Muon" and not (0 <= steps < 100 and float(steps).is_integer()):
        raise fail(f"{where}.hp.ns_steps", out["ns_steps"], "must be a whole number below 100")
    return out


def _sizes(shape: list[int], optimizer: str) -> dict[str, int]:
    """How many values each entry of a whole-tensor sample of ``shape`` holds."""
    n = math.prod(shape)
    if optimizer == "Adafactor" and len(shape) >= 2:
        return {"row_var": n // shape[-1], "col_var": n // shape[-2]}
    return {}


def _update_samples(value: Any, optimizer: str) -> list[dict[str, Any]]:
    """The update samples of a trace line, each field checked: finite numbers, betas in [0, 1) (a bias
    correction stays positive), the Adam family's eps positive and present with its betas; a whole-tensor
    sample (Adafactor, Muon) with a ``shape`` of positive sizes whose entries hold as many values as it
    gives (Adafactor's ``row_var`` / ``col_var`` one per row / column), Adafactor's ``d`` at least 1 and
    ``beta2_decay`` at most 0, Muon's matrix 2-D and its ``ns_steps`` a count below 100 (as torch
    requires), its twins' ``ns_spread`` a non-negative number."""
    samples = []
    for i, s in enumerate(need_list(value, "update_samples")):
        where = f"update_samples[{i}]"
        s = need_object(s, where)
        grad = _numbers(need_key(s, "grad"), f"{where}.grad")
        out: dict[str, Any] = {}
        sizes: dict[str, int] = {}
        if optimizer in _WHOLE:
            shape = need_list(need_key(s, "shape"), f"{where}.shape")
            if (not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
                    or math.prod(shape) != len(grad) or (optimizer == "Muon" and len(shape) != 2)):
                count = "two" if optimizer == "Muon" else "any number of"
                raise fail(f"{where}.shape", shape, f"must be {count} positive sizes whose product is grad's "
                           f"length ({len(grad)})")
            out["shape"] = list(shape)
            sizes = _sizes(shape, optimizer)
            if s.get("ns_spread") is not None:
                out["ns_spread"] = _finite(s["ns_spread"], f"{where}.ns_spread")
                if out["ns_spread"] < 0:
                    raise fail(f"{where}.ns_spread", s["ns_spread"], "must not be negative")
        parts = {}
        for key in ("pre", "post"):
            entries = need_object(need_key(s, key), f"{where}.{key}")
            # the monitor writes every entry it has as a list (an entry it lacks is left out)
            parts[key] = {e: _numbers(v, f"{where}.{key}.{e}") for e, v in entries.items()}
            for e, v in parts[key].items():
                want = sizes.get(e, len(grad))
                if len(v) != want:
                    raise fail(f"{where}.{key}.{e}", entries[e], f"must hold {want} values (as many as grad, "
                               "or one per row / column of the tensor)")
        if "param" not in parts["pre"] or "param" not in parts["post"]:
            raise fail(where, s, "must hold the parameter before and after the step")
        hp = _hyper(need_object(need_key(s, "hp"), f"{where}.hp"), where, optimizer)
        step = need_number(need_key(s, "step"), f"{where}.step", non_negative=True, nan=False)
        if not step < 2**53:  # a count of steps: a whole number a float holds exactly
            raise fail(f"{where}.step", step, "must be below 2**53")
        samples.append({"tensor": need_str(need_key(s, "tensor"), f"{where}.tensor"), "hp": hp,
                        "step": step, "grad": grad, **parts, **out})
    return samples


def step_check_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The step checks' fields of a trace line (absent: None), each checked for its type."""
    out: dict[str, Any] = {}
    if record.get("accounting") is not None:
        out["accounting"] = _accounting(record["accounting"])
    if record.get("update") is not None:
        update = _finding(record["update"], "update", UPDATE_NUMBERS, ("checked", "bad"))
        update["optimizer"] = need_str(need_key(update, "optimizer"), "update.optimizer")
        if update["optimizer"] not in UPDATE_FORMULAS:
            raise fail("update.optimizer", update["optimizer"],
                       f"must be one of {', '.join(UPDATE_FORMULAS)}")
        update["worst_ratio"] = need_number(need_key(update, "worst_ratio"), "update.worst_ratio",
                                            non_negative=True)
        out["update"] = update
    if record.get("update_samples") is not None:
        optimizer = out.get("update", {}).get("optimizer", "SGD")
        out["update_samples"] = _update_samples(record["update_samples"], optimizer)
    if record.get("replay") is not None:
        replay = _finding(record["replay"], "replay", REPLAY_NUMBERS, ("checked", "step"))
        out["replay"] = replay
    if record.get("step_checks_off") is not None:
        out["step_checks_off"] = need_str(record["step_checks_off"], "step_checks_off")
    return out


def monitor_observation_fields(data: Any) -> dict[str, Any]:
    """The fields of a :class:`~zerosim.values.observe.MonitorObservation` read from one JSON record, each
    checked for its type and range; a ConfigError naming the first field that is not. Keys it does not
    know (``monitor_s``) are left alone."""
    record = need_object(data, "record")
    rank = need_int(need_key(record, "rank"), "rank", 0, MAX_WORLD - 1)
    world = need_int(need_key(record, "world_size"), "world_size", 1, MAX_WORLD)
    if rank >= world:
        raise ConfigError("rank", rank, f"must be below the world size ({world})")
    held = []
    for i, piece in enumerate(need_list(need_key(record, "held"), "held")):
        name, a, b, dig = need_list(piece, f"held[{i}]", 4)
        held.append((need_str(name, f"held[{i}][0]"), need_int(a, f"held[{i}][1]"),
                     need_int(b, f"held[{i}][2]"), need_str(dig, f"held[{i}][3]")))
    numels = {name: need_count(n, key_path("numels", name))
              for name, n in need_object(need_key(record, "numels"), "numels").items()}
    if sum(numels.values()) >= INT64_LIMIT:
        raise ConfigError("numels", Shown(sum(numels.values())), "the tensors' elements must total "
                          "less than 2**63")
    return dict(
        rank=rank, world_size=world, step=need_count(need_key(record, "step"), "step"),
        adapter=need_str(need_key(record, "adapter"), "adapter"), held=held,
        owned=need_ranges(need_key(record, "owned"), "owned"), numels=numels,
        state_missing=_count_and_name(need_key(record, "state_missing"), "state_missing"),
        state_nonfinite=_count_and_name(need_key(record, "state_nonfinite"), "state_nonfinite"),
        step_counters=_counters(need_key(record, "step_counters")),
        grad_sq=need_optional_number(need_key(record, "grad_sq"), "grad_sq", non_negative=True),
        grad_ranges=None if record.get("grad_ranges") is None else
        need_ranges(record["grad_ranges"], "grad_ranges"),
        grad_numel=need_count(need_key(record, "grad_numel"), "grad_numel"),
        grad_norm=need_optional_number(need_key(record, "grad_norm"), "grad_norm", non_negative=True),
        grad_dtype=need_str(need_key(record, "grad_dtype"), "grad_dtype"),
        max_norm=need_optional_number(need_key(record, "max_norm"), "max_norm", positive=True, nan=False),
        loss=need_optional_number(need_key(record, "loss"), "loss"),
        **step_check_fields(record),
    )


def _count_and_name(value: Any, path: str) -> tuple[int, str | None]:
    count, name = need_list(value, path, 2)
    return need_count(count, f"{path}[0]"), need_optional_str(name, f"{path}[1]")


def _counters(value: Any) -> tuple[int, int, str | None] | None:
    if value is None:
        return None
    least, most, name = need_list(value, "step_counters", 3)
    return (need_int(least, "step_counters[0]"), need_int(most, "step_counters[1]"),
            need_optional_str(name, "step_counters[2]"))
