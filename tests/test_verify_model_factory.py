"""``zerosim verify --model MODULE:FACTORY`` and ``--model hf-gpt2``: a user's model beside the built-in one.

Pure tests: the model source checks what the factory returns (each wrong factory of
``tests/verify_trainers/models.py`` is one ConfigError naming what is wrong), and the sizes it derives
for the rounding model. Launches (world 2, 4 steps): a correct model passes under a built-in adapter
with accumulation, a wrong factory ends the command in one line with exit 2, and the built-in GPT-2
from transformers passes where the ``[hf]`` extra is installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from zerosim.errors import ConfigError  # noqa: E402
from zerosim.verify.model_source import model_sizes_of, model_source  # noqa: E402

M = "tests.verify_trainers.models"


@pytest.mark.parametrize(("factory", "words"), [
    ("raises", "the factory raised RuntimeError: no weights here"),
    ("not_a_pair", "the factory returned Regressor; expected a pair (model, make_batch)"),
    ("model_not_a_module", "the factory returned dict as the model; expected a torch.nn.Module"),
    ("batch_not_callable", "as make_batch; expected a callable"),
    ("rank_dependent_shapes", "for rank 1, micro-batch 0 but"),
    ("vector_loss", "expected the loss as a scalar float tensor"),
    ("no_such_factory", "has no attribute 'no_such_factory'"),
])
def test_a_wrong_factory_is_one_config_error_naming_what_is_wrong(factory: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        model_source(f"{M}:{factory}").validate(world=2, grad_accum=2)
    assert e.value.field == "model" and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["nope", ":f", "mod:", "", 3])
def test_a_model_name_that_is_neither_built_in_nor_module_factory_is_refused(name: object) -> None:
    with pytest.raises(ConfigError, match="model"):
        model_source(name)


def test_a_correct_factory_builds_the_same_model_and_batches_every_time() -> None:
    source = model_source(f"{M}:regressor", seed=3)
    source.validate(world=2, grad_accum=3)
    a, b = source.build("float64"), source.build("float64")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert source.build("float32").layers[0].weight.dtype == torch.float32
    x1, x2 = source.batch(1, 2, 1, 2), source.batch(1, 2, 1, 2)
    assert torch.equal(x1[0], x2[0]) and not torch.equal(x1[0], source.batch(0, 2, 1, 2)[0])
    sizes = source.sizes()
    assert (sizes.batch, sizes.block, sizes.n_layer, sizes.widest) == (4, 5, 2, 7)


def test_sizes_of_the_built_in_model_are_its_preset() -> None:
    from zerosim.verify.model import PRESETS

    assert model_source("gpt").sizes() is PRESETS["gpt"]
    model, _ = __import__(M, fromlist=["regressor"]).regressor(0)
    assert model_sizes_of(model, torch.zeros(6, 5)).batch == 6


def test_cli_refuses_a_raising_factory_in_one_line_before_starting_ranks() -> None:
    p = subprocess.run([sys.executable, "-m", "zerosim", "verify", "ddp", "--world", "2",
                        "--model", f"{M}:raises"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "model" in lines[0] and "RuntimeError" in lines[0], p.stderr


@pytest.mark.torchdist
def test_a_users_model_passes_under_fsdp2_with_accumulation() -> None:
    from zerosim.verify import verify

    report = verify("fsdp2", world=2, steps=4, model=f"{M}:regressor", grad_accum=2, timeout_s=300)
    failed = {cid: o.reason for cid, o in report.contracts.items() if o.status == "fail"}
    assert not failed, failed
    for cid in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-008"):
        assert report.contracts[cid].status == "pass", cid
    assert report.model == f"{M}:regressor"


@pytest.mark.torchdist
def test_a_broken_trainer_on_a_users_model_still_fails() -> None:
    from zerosim.verify import verify

    report = verify("tests.verify_trainers.broken:summed_gradient", world=2, steps=4,
                    model=f"{M}:regressor", timeout_s=300)
    assert report.verdict == "fail" and report.contracts["C-ZERO-002"].status == "fail"
    assert "gradient-scale" in [d.bug_class for d in report.diagnosis]


@pytest.mark.torchdist
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="the [hf] extra is not installed")
def test_the_built_in_hf_gpt2_passes_under_ddp() -> None:
    from zerosim.verify import verify

    report = verify("ddp", world=2, steps=4, model="hf-gpt2", timeout_s=300)
    failed = {cid: o.reason for cid, o in report.contracts.items() if o.status == "fail"}
    assert not failed, failed
    assert report.contracts["C-ZERO-002"].status == "pass"
