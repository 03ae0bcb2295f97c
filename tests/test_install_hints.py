"""Every hint about a missing optional extra says what the README says: an editable install from the
checkout (``pip install -e ".[hf]"``, DeepSpeed's with ``DS_BUILD_OPS=0``), never an install by package
name that the README does not use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerosim.errors import install_hint
from zerosim.verify.adapters import REQUIRES
from zerosim.verify.model_presets import HF_INSTALL

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("extra", ["hf", "deepspeed", "mpi", "torch"])
def test_the_hint_is_the_readme_install_command(extra: str) -> None:
    hint = install_hint(extra)
    command = hint.removesuffix(" in the zerosim checkout")
    assert command.endswith(f'pip install -e ".[{extra}]"'), hint
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[all]"' in readme  # the README's form, with the extras it installs
    if extra == "deepspeed":
        assert command == 'DS_BUILD_OPS=0 pip install -e ".[deepspeed]"' and command in readme


def test_the_verify_hints_use_it() -> None:
    assert HF_INSTALL == install_hint("hf")
    deepspeed = [hint for package, hint in REQUIRES.values() if package == "deepspeed"]
    assert deepspeed and all(hint == install_hint("deepspeed") for hint in deepspeed)


def test_no_module_spells_an_install_by_package_name() -> None:
    """``pip install 'zerosim[x]'`` or ``pip install deepspeed`` in a message would contradict the README."""
    pattern = re.compile(r"pip install ['\"]?zerosim\[|pip install deepspeed")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for package in ("zerosim", "zerogpu")
                 for path in sorted((ROOT / package).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
