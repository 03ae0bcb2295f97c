"""The step path's shape: schedules call down into the state's functions, never the other way round,
and one table alone moves a unit between its states."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "zerosim" / "engine"
#: the engine modules that build and run a schedule: the block model's schedule itself, and the rank
#: program that drives it; every other engine module is the state and the functions over it
SCHEDULE_DRIVERS = {"block_schedule.py", "spmd.py"}
#: the offload tier keeps its own state per unit for the host and device copies of a shard
#: (zerogpu.offload's manager), apart from the engine's unit table
OWN_UNIT_TABLES = {"zerogpu/offload.py"}
UNIT_STATE_MEMBERS = {"OFFLOADED", "IN_FLIGHT", "SHARDED", "IN_USE", "GATHERED"}


def calls_back(source: str) -> list[str]:
    """What in ``source`` reaches a schedule or the torch backend: an import of zerogpu or of a
    schedule module, a string naming zerogpu (an importlib target), or a method called on anything
    named ``schedule`` (``schedule.m()``, ``x.schedule.m()``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "zerogpu"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] == "zerogpu" or module.endswith(("block_schedule", "module_engine")):
                found.append(module)
        elif isinstance(node, ast.Constant) and str(node.value).startswith("zerogpu"):
            found.append(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if name == "schedule":
                found.append(f"line {node.lineno}: schedule.{node.func.attr}()")
    return found


def unit_state_writes(source: str) -> list[int]:
    """Lines of ``source`` that produce a ``UnitState`` member other than to compare with it."""
    tree = ast.parse(source)
    compared = {id(n) for c in ast.walk(tree) if isinstance(c, ast.Compare) for n in ast.walk(c)}
    return sorted(n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr in UNIT_STATE_MEMBERS
                  and isinstance(n.value, ast.Name) and n.value.id == "UnitState" and id(n) not in compared)


def test_nothing_in_the_engine_calls_a_schedule_back_or_imports_zerogpu():
    offenders = {p.name: calls_back(p.read_text()) for p in sorted(ENGINE.glob("*.py"))
                 if p.name not in SCHEDULE_DRIVERS}
    assert len(offenders) > 10  # the scan read the engine's modules
    assert not {k: v for k, v in offenders.items() if v}
    drivers = {p.name: calls_back(p.read_text()) for p in ENGINE.glob("*.py") if p.name in SCHEDULE_DRIVERS}
    assert not [m for found in drivers.values() for m in found if "zerogpu" in m]
    # the scan sees each way of reaching back
    assert calls_back("import zerogpu.comm\n") == ["zerogpu.comm"]
    assert calls_back("from .block_schedule import BlockSchedule\n") == ["block_schedule"]
    assert calls_back("importlib.import_module('zerogpu.spawn')\n") == ["zerogpu.spawn"]
    assert calls_back("def f(s):\n    s.schedule.settle(0)\n") == ["line 2: schedule.settle()"]
    assert calls_back("def f(schedule):\n    return schedule.step(0)\n") == ["line 2: schedule.step()"]


def test_the_rank_state_holds_no_schedule_and_no_reference_back():
    """A schedule holds its state; the state holds nothing of the schedule (no field, no weak
    reference), so the step functions cannot call it."""
    import weakref

    from zerosim.comm.sim import run_spmd
    from zerosim.engine.block_schedule import BlockSchedule, block_rank_state
    from zerosim.engine.config import RunConfig
    from zerosim.numerics.xp import numpy_namespace

    run = RunConfig(strategy="zero3", world_size=2, steps=1).resolve()

    def rank(comm):
        state = block_rank_state(comm, run, numpy_namespace())
        schedule = BlockSchedule(state)
        schedule.step(0)
        held = list(vars(state).values())
        return schedule.state is state, [type(v).__name__ for v in held
                                         if isinstance(v, (BlockSchedule, weakref.ref)) or callable(v)
                                         and getattr(v, "__self__", None) is schedule]

    for holds, back in run_spmd(2, rank, timeout_s=60):
        assert holds and back == []


def test_only_the_unit_table_writes_a_unit_state():
    sources = sorted([*(ROOT / "zerosim").rglob("*.py"), *(ROOT / "zerogpu").rglob("*.py")])
    writes = {}
    for p in sources:
        rel = str(p.relative_to(ROOT))
        if rel in OWN_UNIT_TABLES or rel == "zerosim/engine/unit_table.py":
            continue
        lines = unit_state_writes(p.read_text())
        if lines:
            writes[rel] = lines
    assert not writes, writes
    assert unit_state_writes((ENGINE / "unit_table.py").read_text())  # the table itself writes them
    # the scan tells a write from a comparison
    assert unit_state_writes("t[n] = UnitState.SHARDED\n") == [1]
    assert unit_state_writes("ok = t[n] is UnitState.GATHERED or t[n] in (UnitState.IN_FLIGHT,)\n") == []
