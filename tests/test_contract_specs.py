"""Contracts as data: every spec in contracts/ is valid and names a check that resolves to a callable."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from zerosim.checks.contracts import default_contracts_dir, get_contract, load_contract, load_contracts
from zerosim.errors import ConfigError, ZeroSimError

SPEC_FILES = sorted(default_contracts_dir().glob("*.toml"))

GOOD = '''id = "C-TEST-001"
title = "A test contract"
statement = "Something holds."
applies_to = ["plan"]
check = "zerosim.checks.partition:check_partition_plan"
[tolerance]
kind = "exact"
rationale = "integers"
'''


def test_contracts_directory_holds_c_zero_001():
    specs = load_contracts()
    assert "C-ZERO-001" in specs
    assert len(specs) == len(SPEC_FILES)


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_every_spec_is_valid_and_its_check_resolves_to_a_callable(path):
    spec = load_contract(path)
    assert spec.id == path.stem
    assert spec.title and spec.statement and spec.applies_to
    assert spec.tolerance["kind"] and spec.tolerance["rationale"]
    fn = spec.resolve_check()
    assert callable(fn)
    assert inspect.signature(fn).parameters, f"{spec.id}: a check takes observations"


def test_c_zero_001_spec_names_its_clauses_and_check():
    spec = get_contract("C-ZERO-001")
    from zerosim.checks.partition import CLAUSES, check_partition_plan

    assert spec.resolve_check() is check_partition_plan
    assert set(spec.clauses) == set(CLAUSES)
    assert spec.tolerance["kind"] == "exact"
    for clause in CLAUSES:
        assert f"({clause})" in spec.statement


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_loader_accepts_a_good_spec_from_another_directory(tmp_path):
    write(tmp_path, "C-TEST-001.toml", GOOD)
    specs = load_contracts(tmp_path)
    assert list(specs) == ["C-TEST-001"] and callable(specs["C-TEST-001"].resolve_check())


def test_loader_honours_the_environment_variable(tmp_path, monkeypatch):
    write(tmp_path, "C-TEST-001.toml", GOOD)
    monkeypatch.setenv("ZEROSIM_CONTRACTS_DIR", str(tmp_path))
    assert list(load_contracts()) == ["C-TEST-001"]


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t.replace('id = "C-TEST-001"', 'id = "C-OTHER-001"'), "C-TEST-001.toml:id"),
    (lambda t: t.replace('title = "A test contract"\n', ""), "C-TEST-001.toml"),
    (lambda t: t.replace('applies_to = ["plan"]', "applies_to = []"), "C-TEST-001.toml:applies_to"),
    (lambda t: t.replace('rationale = "integers"', ""), "C-TEST-001.toml:tolerance"),
    (lambda t: t.replace('kind = "exact"', 'kind = "allclose"'), "C-TEST-001.toml:tolerance.rtol"),
    (lambda t: t.replace("[tolerance]", "[tolerance"), "contract file"),
    (lambda t: t.replace('check = "zerosim', 'check = 42 #'), "C-TEST-001.toml:check"),
])
def test_loader_rejects_malformed_specs_naming_the_field(tmp_path, mutate, field):
    write(tmp_path, "C-TEST-001.toml", mutate(GOOD))
    with pytest.raises(ConfigError) as e:
        load_contracts(tmp_path)
    assert e.value.field == field


@pytest.mark.parametrize("check, message", [
    ("no_colon_here", "must look like"),
    ("zerosim_missing_module:fn", "cannot import"),
    ("zerosim.checks.partition:no_such_fn", "no attribute"),
    ("zerosim.checks.partition:CONTRACT", "not callable"),
])
def test_unresolvable_checks_are_clear_errors(tmp_path, check, message):
    write(tmp_path, "C-TEST-001.toml", GOOD.replace("zerosim.checks.partition:check_partition_plan", check))
    spec = load_contracts(tmp_path)["C-TEST-001"]
    with pytest.raises(ZeroSimError, match=message):
        spec.resolve_check()


def test_unknown_contract_and_missing_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        get_contract("C-NOPE-999")
    assert e.value.field == "contract"
    with pytest.raises(ConfigError):
        load_contracts(tmp_path / "absent")
