"""The built-in adapters under the protocol's mixed-precision policy (``optim["mixed_precision"]``).

Pure tests: the loss-scale rule, the policy's parsing, DeepSpeed's config mapping and its refusals.
Live: one launch at world 2 (tests/verify_programs/mixed_precision_rank.py) trains torch-zero, fsdp2,
zerogpu-3 and (when installed) deepspeed-2 in full precision, bf16 and fp16, and shows per run the dtype
the model computed in, the dtypes the traffic records give the gradient reductions, the dtype of the
returned masters and whether they are float32 values (not bfloat16-rounded), a checkpoint round trip,
and whether two identical micro-batches accumulate to exactly one step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from zerogpu.launch import run_ranks, torch_unavailable_reason  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402
from zerosim.files import datafile  # noqa: E402
from zerosim.verify.adapters._mixed_precision import (  # noqa: E402
    DynamicLossScale,
    mixed_policy,
    without_policy,
)
from zerosim.verify.adapters.deepspeed_zero import mixed_precision_config  # noqa: E402

PROGRAM = Path(__file__).parent / "verify_programs" / "mixed_precision_rank.py"
WORLD = 2
SCALE = {"init": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1000}
BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
FP16 = {"param_dtype": "float16", "reduce_dtype": "float32", "loss_scale": SCALE}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
ADAPTERS = ("torch-zero", "fsdp2", "zerogpu-3", *(("deepspeed-2",) if HAS_DEEPSPEED else ()))
#: the adapters that run float16 on any processor; DeepSpeed's is asked (:func:`fp16_supported`)
FP16_SUPPORTED = ("torch-zero", "fsdp2")


def fp16_supported(name: str) -> bool:
    """Whether ``name`` runs float16 here. DeepSpeed answers for itself: its CPU accelerator says yes
    on processors with AVX512-FP16 and no elsewhere (``ZEROSIM_DEEPSPEED_FP16`` tells it what to say),
    so the expected verdict follows the framework's answer, not the machine's model."""
    if name.startswith("deepspeed"):
        from zerosim.verify.adapters.deepspeed_zero import deepspeed_fp16_supported

        return deepspeed_fp16_supported()
    return name in FP16_SUPPORTED


# ---- pure ---------------------------------------------------------------------------------------------


def test_loss_scale_backs_off_on_overflow_and_grows_after_the_interval() -> None:
    scale = DynamicLossScale({**SCALE, "growth_interval": 3})
    scale.update(False)
    assert scale.scale == 32768.0 and scale.skipped_steps == 1
    for _ in range(2):
        scale.update(True)
    assert scale.scale == 32768.0 and scale.growth_tracker == 2
    scale.update(True)
    assert scale.scale == 65536.0 and scale.growth_tracker == 0
    scale.update(True)
    scale.update(False)  # an overflow resets the run of finite steps
    assert scale.scale == 32768.0 and scale.growth_tracker == 0
    again = DynamicLossScale(SCALE)
    again.load_state_dict(scale.state_dict())
    assert again.state_dict() == scale.state_dict()


def test_the_policy_is_absent_in_full_precision_and_names_a_bad_dtype() -> None:
    assert mixed_policy({"name": "sgd", "lr": 0.1}) is None
    policy = mixed_policy({"name": "sgd", "mixed_precision": FP16})
    assert policy is not None
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)
    assert policy.loss_scale == SCALE
    assert without_policy({"name": "sgd", "mixed_precision": FP16}) == {"name": "sgd"}
    with pytest.raises(ConfigError, match="mixed_precision.param_dtype.*fp8"):
        mixed_policy({"mixed_precision": {"param_dtype": "fp8", "reduce_dtype": "float32"}})


def test_deepspeed_config_follows_the_policy_and_refuses_what_deepspeed_cannot_scale() -> None:
    bf16 = mixed_policy({"mixed_precision": BF16})
    assert bf16 is not None
    assert mixed_precision_config(bf16) == {"communication_data_type": "fp32", "bf16": {"enabled": True}}
    fp16 = mixed_policy({"mixed_precision": FP16})
    assert fp16 is not None
    config = mixed_precision_config(fp16)
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                              "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
    bf16_wire = mixed_policy({"mixed_precision": {**BF16, "reduce_dtype": "bfloat16"}})
    assert bf16_wire is not None and mixed_precision_config(bf16_wire)["communication_data_type"] == "bf16"
    for bad, reason in (({"growth_factor": 3.0}, "grows by 2"), ({"init": 1000.0}, "power of two")):
        odd = mixed_policy({"mixed_precision": {**FP16, "loss_scale": {**SCALE, **bad}}})
        assert odd is not None
        with pytest.raises(NotImplementedError, match=reason):
            mixed_precision_config(odd)


# ---- live: one launch at world 2 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> dict:
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("mixed")
    out = folder / "runs.safetensors"
    argv = [str(PROGRAM), str(out), str(folder / "checkpoints"), ",".join(ADAPTERS)]
    result = run_ranks(WORLD, argv, 600.0)
    assert result.returncode == 0, (result.stderr or "")[-3000:]
    return datafile.load(out)


def _run(live: dict, name: str, precision: str) -> dict:
    ranks = live[f"{name}/{precision}"]
    assert all(r == ranks[0] for r in ranks[1:]), ranks  # every rank saw and returned the same
    return ranks[0]


@pytest.mark.parametrize("name", ADAPTERS)
def test_full_precision_computes_and_reduces_in_float32_with_no_loss_scale(live: dict, name: str) -> None:
    run = _run(live, name, "full")
    assert run["compute"] == ["float32"] and run["reduce"] == ["float32"]
    assert run["params"] == ["float32"] and run["scale"] is None


@pytest.mark.parametrize("name", ADAPTERS)
def test_bf16_computes_in_bf16_reduces_in_float32_and_returns_float32_masters(live: dict, name: str) -> None:
    run = _run(live, name, "bf16")
    assert run["compute"] == ["bfloat16"], run
    assert run["reduce"] == ["float32"], f"{name} reduced in {run['reduce']} under reduce_dtype float32"
    assert run["params"] == ["float32"] and run["state"] == ["float32"]
    assert run["starts_from_model"], f"{name}'s masters do not start from the float32 model it received"
    # a trainer without a float32 master returns bfloat16 values: every element would be representable
    assert run["not_bf16"] > run["numel"] // 2, run
    assert run["resumed_bitwise"]
    assert run["accumulation_bitwise"], f"{name}: step_accumulated([b, b]) differs from step(b)"


@pytest.mark.parametrize("name", FP16_SUPPORTED)
def test_fp16_skips_overflowing_steps_backs_off_and_resumes_with_its_scale(live: dict, name: str) -> None:
    run = _run(live, name, "fp16")
    assert run["compute"] == ["float16"] and run["reduce"] == ["float32"] and run["params"] == ["float32"]
    scale = run["scale"]
    skipped, taken = int(scale["skipped_steps"]), int(scale["growth_tracker"])
    assert skipped >= 1 and taken >= 1, scale  # 65536 overflows this model's float16 gradients at first
    assert skipped + taken == 5  # the program's fp16 steps; the growth interval (1000) is not reached
    assert scale["scale"] == SCALE["init"] * SCALE["backoff_factor"] ** skipped
    assert run["norm"] < float("inf")  # the last step was taken: its unscaled norm
    assert run["resumed_scale"] == scale and run["resumed_bitwise"]


@pytest.mark.parametrize("name", [n for n in ADAPTERS if n not in FP16_SUPPORTED])
def test_fp16_is_unsupported_with_the_reason_exactly_where_the_framework_says_it_cannot(live: dict,
                                                                                      name: str) -> None:
    run = _run(live, name, "fp16")
    if not fp16_supported(name):
        assert "float16" in run["unsupported"]
        return
    # DeepSpeed where its accelerator runs float16: its own loss scaler, float32 masters and reduction
    assert "unsupported" not in run, run["unsupported"]
    assert run["compute"] == ["float16"] and run["reduce"] == ["float32"] and run["params"] == ["float32"]
    assert run["norm"] < float("inf")  # the last step was taken: its unscaled norm
    assert run["resumed_bitwise"]
