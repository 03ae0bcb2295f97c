"""One judge: every contract is decided by one public function of zerosim.checks, whatever produced the
observations (the simulator, mpi, torch, ``zerosim verify``, the monitor, the benchmarks), and nothing
outside zerosim.checks builds a contract's violations.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import zerosim.checks
from zerosim.checks.contracts import load_contracts
from zerosim.checks.judges import contract_of

ROOT = Path(__file__).resolve().parents[1]
CHECKS_DIR = ROOT / "zerosim" / "checks"
#: what only zerosim.checks may call: building a violation, a collector of them, or adding a built one
VIOLATION_BUILDERS = ("Violation", "ViolationCollector", "add_violation")


def public_checks() -> dict[str, list[str]]:
    """Every public ``check_*`` function defined in a module of zerosim.checks -> the contract it
    declares (None where it declares none), as ``module:function`` by contract."""
    found: dict[str, list[str]] = {}
    for info in pkgutil.iter_modules(zerosim.checks.__path__):
        module = importlib.import_module(f"zerosim.checks.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("check_") and fn.__module__ == module.__name__:
                found.setdefault(str(contract_of(fn)), []).append(f"{module.__name__}:{name}")
    return found


def test_every_contract_has_exactly_one_public_check_and_its_spec_names_it() -> None:
    specs = load_contracts()
    checks = public_checks()
    undeclared = checks.pop("None", [])
    assert not undeclared, f"public check_* functions of zerosim.checks that judge no contract: {undeclared}"
    assert set(checks) == set(specs), "contracts without a check, or checks of an unknown contract"
    for cid, spec in specs.items():
        assert checks[cid] == [spec.check], f"{cid}: one check, the one its spec names; found {checks[cid]}"
        assert contract_of(spec.resolve_check()) == cid


def _builds_violations(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line name`` of every call in ``path`` that builds a violation or relabels one with another
    contract (``replace(v, contract=...)``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        relabels = name == "replace" and any(k.arg == "contract" for k in node.keywords)
        if name in VIOLATION_BUILDERS or relabels:
            found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_nothing_outside_zerosim_checks_builds_a_contracts_violations() -> None:
    outside = [p for package in ("zerosim", "zerogpu") for p in sorted((ROOT / package).rglob("*.py"))
               if CHECKS_DIR not in p.parents]
    assert outside, "no source files found"
    offenders = [hit for p in outside for hit in _builds_violations(p)]
    assert not offenders, f"violations built outside zerosim.checks: {offenders}"


def test_the_rule_finds_a_violation_built_outside_the_checks(tmp_path: Path) -> None:
    # a deliberately wrong module: a verdict's violation built by hand, and one relabelled as another contract
    rogue = tmp_path / "rogue.py"
    rogue.write_text("from dataclasses import replace\nfrom zerosim.values.verdict import Violation\n"
                     "v = Violation('C-ZERO-004', 'bytes', 'made up here')\n"
                     "w = replace(v, contract='C-ZERO-005')\n", encoding="utf-8")
    assert _builds_violations(rogue, tmp_path) == ["rogue.py:3 Violation", "rogue.py:4 replace"]


#: the modules that judge a whole run: the simulator's result, zerosim verify's report (its values, its
#: resources, its resumed state), the monitor's verdicts and a user's partition function's cases
RUN_JUDGES = ("zerosim/engine/run_result.py", "zerosim/verify/evaluate.py", "zerosim/verify/resources.py",
              "zerosim/verify/resume.py", "zerosim/monitor/judge.py", "zerosim/monitor/monitor.py",
              "zerosim/testing/check_impl.py", "zerosim/testing/state_dict_runs.py", "zerosim/cli/check.py",
              "zerosim/cli/plan.py", "zerosim/bench/check.py")


def _checks_imported(path: Path) -> list[str]:
    """The contracts' checks (functions marked by ``judges``) that ``path`` imports by name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and "checks" in node.module:
            module = importlib.import_module(node.module if node.level == 0 else
                                             "zerosim.checks." + node.module.split(".")[-1])
            found += [a.name for a in node.names if contract_of(getattr(module, a.name, None))]
    return found


def test_runs_are_judged_through_the_one_entry_point() -> None:
    """Every run's verdicts come from checks.judges.judge: none of the modules that judge a run imports
    a check itself."""
    offenders = {path: hits for path in RUN_JUDGES if (hits := _checks_imported(ROOT / path))}
    assert not offenders, offenders
    assert all("judge(" in (ROOT / path).read_text(encoding="utf-8")
               or "judge_contract(" in (ROOT / path).read_text(encoding="utf-8") for path in RUN_JUDGES)


def test_no_module_outside_the_checks_imports_a_contracts_check() -> None:
    """Beyond the run judges: every module of zerosim and zerogpu outside zerosim.checks reaches a
    contract's check through judge() only."""
    modules = [p for p in sorted((ROOT / "zerosim").rglob("*.py")) + sorted((ROOT / "zerogpu").rglob("*.py"))
               if CHECKS_DIR not in p.parents]
    offenders = {str(p.relative_to(ROOT)): hits for p in modules if (hits := _checks_imported(p))}
    assert not offenders, offenders


def test_the_rule_sees_a_check_imported_directly(tmp_path: Path) -> None:
    rogue = tmp_path / "rogue.py"
    rogue.write_text("from zerosim.checks.identity import check_replica_identity\n"
                     "from zerosim.checks.judges import judge\n", encoding="utf-8")
    assert _checks_imported(rogue) == ["check_replica_identity"]


def test_judge_calls_the_contracts_one_check() -> None:
    """judge(contract, ...) is the contract's check on the same observations: the same verdict for a correct
    plan and for a broken one (a partitioner that drops the remainder)."""
    from zerosim.checks.judges import judge
    from zerosim.engine.config import RunConfig

    check = load_contracts()["C-ZERO-001"].resolve_check()
    for fault in (None, "dropped-remainder"):
        run = RunConfig(model="tiny", strategy="zero3", world_size=5, fault=fault).resolve()
        plan = run.unit_plan.shard_plan
        verdict = judge("C-ZERO-001", plan)
        assert verdict.to_json() == check(plan).to_json()
        assert verdict.passed == (fault is None)
    with pytest.raises(ValueError, match="C-ZERO-999"):
        judge("C-ZERO-999")
