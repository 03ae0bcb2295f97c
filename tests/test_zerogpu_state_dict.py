"""zerogpu.state_dict: rank-0 load of a full torch state dict into a ZeroTrainer (C-ZERO-006).

* One rank, in this process: ``.pt`` and ``.safetensors`` files of the tied GPT (the tied weight under
  either name) load into every strategy; the module's parameters stay the same objects and the next
  step is bitwise plain torch's SGD on the loaded weights; a bfloat16 model loads a bfloat16 file;
  buffers load; bad input names the tensor, with nothing applied.
* Two ranks under torchrun (gloo): every strategy, both formats, bucketed or not; each rank's master
  shard and working parameters are checked with C-ZERO-006 against the file's full state dict; only
  rank 0 opens the file (the others are given a path that does not exist); a strict load of a file
  that lacks a tensor raises the same one-line error on both ranks with nothing changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from zerogpu.launch import run_ranks, torch_unavailable_reason  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402

PROBE = Path(__file__).parent / "zerogpu_programs" / "state_dict_probe.py"



def _gpt(dtype: str = "float32", shift: float = 0.0):
    from zerosim.verify.model import build_model

    model = build_model("gpt-tied", "float32").to(getattr(torch, dtype))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(shift * (i + 1))
    return model


def _save(model, directory: Path) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    state = model.state_dict()
    torch.save(state, directory / "model.pt")
    # safetensors refuses shared storage: the tied weight goes under its other name only
    save_file({k: v.contiguous() for k, v in state.items() if k != "wte.weight"},
              str(directory / "model.safetensors"))
    return directory / "model.pt", directory / "model.safetensors"


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_one_rank_loads_both_formats_in_place_and_trains_on(world_of_one, tmp_path: Path,
                                                            strategy: str) -> None:
    from zerogpu.state_dict import DistModule, load_state_dict
    from zerogpu.trainer import ZeroTrainer
    from zerosim.verify.model import micro_batch

    src = _gpt(shift=0.5)
    files = _save(src, tmp_path)
    model = _gpt()
    trainer = ZeroTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    params = dict(model.named_parameters())
    for path in files:
        result = load_state_dict(trainer, path, bucket_bytes=1 << 12)
        assert result.missing_keys == [] == result.unexpected_keys and result.files_opened == 1
        full = DistModule(trainer).state_dict()
        for name, p in src.named_parameters():
            assert torch.equal(full[name], p.detach()), (path.name, name)
    assert all(params[n] is p for n, p in model.named_parameters())
    x, y = micro_batch(0, 1, model="gpt-tied")
    loss = trainer.step(x, y)
    opt = torch.optim.SGD(src.parameters(), lr=0.1)
    want = src(x, y)
    want.backward()
    opt.step()
    assert loss == float(want.detach())
    after = trainer.full_parameters()
    for name, p in src.named_parameters():
        assert torch.equal(after[name], p.detach()), name


def test_bf16_model_loads_a_bf16_file(world_of_one, tmp_path: Path) -> None:
    from zerogpu.state_dict import load_state_dict
    from zerogpu.trainer import ZeroTrainer
    from zerosim.engine.observation import full_params_view

    src = _gpt("bfloat16", shift=0.25)
    _, path = _save(src, tmp_path)
    model = _gpt("bfloat16")
    trainer = ZeroTrainer(model, {"name": "adamw", "lr": 1e-3}, "zero3")
    load_state_dict(trainer, path)
    work = full_params_view(trainer.state)  # ml_dtypes bfloat16, flat in layout order
    assert work.dtype.name == "bfloat16"
    want = torch.cat([src.get_parameter(t.name).detach().reshape(-1) for t in trainer.state.layout.tensors])
    assert np.array_equal(work.astype(np.float32), want.float().numpy())


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x, y):
        return ((self.lin(x) * self.scale - y) ** 2).mean()


def test_persistent_buffers_load_and_non_strict_reports(world_of_one) -> None:
    from zerogpu.state_dict import load_state_dict
    from zerogpu.trainer import ZeroTrainer

    model = _WithBuffer()
    trainer = ZeroTrainer(model, {"name": "sgd", "lr": 0.1}, "zero2")
    state = {"lin.weight": torch.full((2, 3), 2.0), "scale": torch.tensor([3.0, 4.0]),
             "other": torch.zeros(1)}
    result = load_state_dict(trainer, state, strict=False)
    assert result.missing_keys == ["lin.bias"] and result.unexpected_keys == ["other"]
    assert torch.equal(model.scale, torch.tensor([3.0, 4.0]))
    assert torch.equal(trainer.full_parameters()["lin.weight"], torch.full((2, 3), 2.0))


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.pop("blocks.0.ln1.weight"), "invalid state_dict='blocks.0.ln1.weight': missing from"),
    (lambda s: s.__setitem__("blocks.0.ln1.weight", torch.zeros(2)), "has shape (2,), the model"),
    (lambda s: s.__setitem__("blocks.0.ln1.weight", s["blocks.0.ln1.weight"].double()),
     "has dtype float64, the model float32"),
    (lambda s: s.__setitem__("nope", torch.zeros(1)), "invalid state_dict='nope': unexpected key"),
])
def test_bad_state_dicts_change_nothing(world_of_one, mutate, match: str) -> None:
    from zerogpu.state_dict import load_state_dict
    from zerogpu.trainer import ZeroTrainer

    model = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = ZeroTrainer(model, {"name": "sgd", "lr": 0.1}, "zero1")
    state = dict(_gpt(shift=1.0).state_dict())
    mutate(state)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        load_state_dict(trainer, state)
    assert "\n" not in str(e.value)
    full = trainer.full_parameters()
    assert all(torch.equal(full[n], before[n]) for n in before)


def test_a_trainer_is_required() -> None:
    from zerogpu.state_dict import DistModule, load_state_dict

    with pytest.raises(ConfigError, match="trainer"):
        load_state_dict(object(), None)
    with pytest.raises(ConfigError, match="trainer"):
        DistModule(object())


@pytest.mark.torchdist
@pytest.mark.slow
def test_two_ranks_keep_exactly_their_shards_and_only_rank_0_opens_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from zerogpu.module_units import describe_module
    from zerogpu.trainer import resolve_strategy
    from zerosim.checks.state_dict import check_broadcast_shard
    from zerosim.partition import get_partitioner
    from zerosim.values.flat_buffers import build_unit_plan
    from zerosim.values.observe import ShardValues

    if torch_unavailable_reason():
        pytest.skip(torch_unavailable_reason())
    src = _gpt(shift=0.5)
    _save(src, tmp_path)
    short = {k: v.contiguous() for k, v in src.state_dict().items() if k not in ("wte.weight", "wpe.weight")}
    save_file(short, str(tmp_path / "short.safetensors"))
    result = run_ranks(2, [str(PROBE), str(tmp_path)], timeout_s=300)
    assert result.returncode == 0, (result.stderr or "")[-2000:]
    rows = [json.loads(line) for r in (0, 1)
            for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
    layout = describe_module(src, None).layout
    full = np.concatenate([src.get_parameter(t.name).detach().reshape(-1).numpy() for t in layout.tensors])
    cases = sorted({r["case"] for r in rows if r["case"] != "strict"})
    assert len(cases) == 6
    for case in cases:
        got = {r["rank"]: r for r in rows if r["case"] == case}
        assert sorted(got) == [0, 1]
        strategy = resolve_strategy(got[0]["strategy"], None, 2)
        plan = build_unit_plan(layout, strategy, get_partitioner("fsdp"), 2)
        k = strategy.shard_group_size(2)
        pieces = {r: tuple(plan.owned_global(r % k)) if strategy.shards_optimizer else ((0, full.size, 0),)
                  for r in (0, 1)}
        shards = {r: ShardValues(tuple(tuple(p) for p in got[r]["pieces"]),
                                 np.asarray(got[r]["master"], np.float32)) for r in (0, 1)}
        params = {r: np.asarray(got[r]["params"], np.float32) for r in (0, 1)}
        v = check_broadcast_shard(full, layout, shards, pieces, params, {"case": case})
        assert v.passed, [str(x) for x in v.violations]
        assert [got[r]["files_opened"] for r in (0, 1)] == [1, 0]
        assert got[1]["bytes_read"] == 0 and got[0]["bytes_read"] >= full.size * 4
        assert got[1]["largest_buffer_bytes"] <= max(int(case.split(":")[-1]),
                                                     max(t.numel for t in layout.tensors) * 4)
    strict = [r for r in rows if r["case"] == "strict"]
    assert len(strict) == 2 and strict[0]["error"] == strict[1]["error"]
    assert strict[0]["error"].startswith("invalid state_dict='wpe.weight': missing from")
    assert all(r["unchanged"] for r in strict)
