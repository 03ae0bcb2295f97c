"""ParamLayout: from a config / preset, from a torch module on the meta device, from a list."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings

from zerosim import ConfigError, GPTConfig, ParamLayout, TensorSpec
from zerosim.numerics.model import SimModelConfig, sim_layout
from zerosim.testing.strategies import layouts
from zerosim.values.layout import infer_block
from zerosim.values.presets import PRESETS, simulator_presets


# Published parameter counts of the GPT-2 family (tied embeddings, biases): Hugging Face model cards.
@pytest.mark.parametrize("preset, expected", [
    ("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
])
def test_gpt2_presets_match_published_parameter_counts(preset, expected):
    assert ParamLayout.from_config(preset).total_numel == expected


def test_every_gpt2_preset_builds_with_blocks_embedding_norm_and_tied_head():
    for name, cfg in PRESETS.items():
        if cfg.structure != "gpt2":
            continue
        layout = ParamLayout.from_config(name)
        kinds = [b.kind for b in layout.blocks]
        assert kinds[0] == "embedding" and kinds[-1] == "final_norm", name
        assert layout.num_transformer_blocks == cfg.n_layer
        assert layout.aliases == {"lm_head.weight": "wte.weight"}
        assert layout.tensor_range("lm_head.weight") == layout.tensor_range("wte.weight")
        assert layout.total_bytes == 4 * layout.total_numel


def test_every_block_model_preset_is_the_simulators_model():
    block_presets = [name for name, cfg in PRESETS.items() if cfg.structure == "block"]
    assert {"tiny", "sim-10m"} <= set(block_presets)
    for name in block_presets:
        cfg = PRESETS[name]
        layout = ParamLayout.from_config(name)
        assert layout.tensors == sim_layout(SimModelConfig.from_preset(name)).tensors, name
        kinds = [b.kind for b in layout.blocks]
        assert kinds == ["embedding"] + ["block"] * cfg.n_layer + ["final_norm", "lm_head"]
        assert layout.aliases == {}  # the head is its own tensor
        d, v, f = cfg.d_model, cfg.vocab_size, cfg.mlp_ratio * cfg.d_model
        assert layout.total_numel == 2 * v * d + cfg.n_layer * (d + 2 * f * d) + d
        assert layout.total_bytes == 4 * layout.total_numel


def test_presets_have_a_known_structure_and_gpt2_layouts_are_not_simulated():
    assert set(simulator_presets()) == {n for n, c in PRESETS.items() if c.structure == "block"}
    gpt2_layouts = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt-7.5b", "gpt3-175b"}
    assert gpt2_layouts.isdisjoint(simulator_presets())
    with pytest.raises(ConfigError, match="structure"):
        GPTConfig(vocab_size=8, seq_len=4, n_layer=1, n_head=1, d_model=4, structure="llama")
    for name in set(PRESETS) - set(simulator_presets()):
        with pytest.raises(ConfigError, match="block models") as e:
            SimModelConfig.from_preset(name)
        assert e.value.field == "model"


def test_untied_head_is_counted_separately():
    tied = GPTConfig(vocab_size=100, seq_len=8, n_layer=2, n_head=2, d_model=16)
    untied = GPTConfig(vocab_size=100, seq_len=8, n_layer=2, n_head=2, d_model=16, tied_embeddings=False)
    a, b = ParamLayout.from_config(tied), ParamLayout.from_config(untied)
    assert b.total_numel - a.total_numel == 100 * 16
    assert [blk.kind for blk in b.blocks][-1] == "lm_head"


def test_offsets_are_contiguous_and_tensor_range_matches():
    layout = ParamLayout.from_config("tiny")
    end = 0
    for t, off in zip(layout.tensors, layout.offsets, strict=True):
        assert off == end
        assert layout.tensor_range(t.name) == (off, off + t.numel)
        end += t.numel
    assert end == layout.total_numel


def test_bytes_by_dtype_mixed():
    layout = ParamLayout.from_list([("a", (10, 3), "bf16"), ("b", (7,), "fp32"), ("c", (2, 2), "float16")])
    assert layout.bytes_by_dtype() == {"bfloat16": 60, "float32": 28, "float16": 8}
    assert layout.total_numel == 41
    assert layout.with_dtype("float64").bytes_by_dtype() == {"float64": 8 * 41}


def test_from_list_accepts_specs_dicts_and_tuples_and_infers_blocks():
    layout = ParamLayout.from_list([
        TensorSpec("tok_embeddings.weight", (5, 4), "float32", "embedding"),
        {"name": "layers.0.attn.wq", "shape": (4, 4)},
        ("layers.1.mlp.w1", 12),
        ("norm.weight", (4,), "bf16"),
        ("output.weight", (5, 4), None, "lm_head"),
    ])
    assert [b.name for b in layout.blocks] == ["embedding", "blocks.0", "blocks.1", "final_norm", "lm_head"]
    assert layout.tensors[2].shape == (12,)
    assert layout.total_numel == 20 + 16 + 12 + 4 + 20


@pytest.mark.parametrize("name, block", [
    ("transformer.h.3.attn.c_attn.weight", "blocks.3"), ("model.layers.11.mlp.up.weight", "blocks.11"),
    ("transformer.wte.weight", "embedding"), ("model.embed_tokens.weight", "embedding"),
    ("transformer.ln_f.weight", "final_norm"), ("lm_head.weight", "lm_head"), ("something.else", "other"),
])
def test_infer_block(name, block):
    assert infer_block(name) == block


@pytest.mark.parametrize("specs, field", [
    ([("a", (2,)), ("a", (3,))], "tensors"),
    ([("a", (-1, 2))], "a.shape"),
    ([("a", "xy")], "specs[0].shape"),
    ([("", (2,))], "specs[0].name"),
    ([42], "specs[0]"),
    ([("a", (2,), "complex7")], "a.dtype"),
])
def test_bad_lists_raise_config_error_naming_the_field(specs, field):
    with pytest.raises(ConfigError) as e:
        ParamLayout.from_list(specs)
    assert e.value.field == field


def test_alias_to_unknown_tensor_and_unknown_preset_and_unknown_tensor():
    with pytest.raises(ConfigError, match="aliases"):
        ParamLayout.from_list([("a", (2,))], aliases={"b": "nope"})
    with pytest.raises(ConfigError) as e:
        ParamLayout.from_config("gpt-9000")
    assert e.value.field == "model" and "gpt2-small" in str(e.value)
    with pytest.raises(ConfigError, match="tensor"):
        ParamLayout.from_config("tiny").tensor_range("no.such.weight")


def test_from_module_on_meta_device_counts_tied_weights_once_and_allocates_nothing():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    cfg = PRESETS["gpt2-small"]

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.ModuleDict({"c_attn": nn.Linear(d, 3 * d), "c_proj": nn.Linear(d, d)})
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.transformer = nn.ModuleDict(
                {
                    "wte": nn.Embedding(c.vocab_size, c.d_model),
                    "wpe": nn.Embedding(c.seq_len, c.d_model),
                    "h": nn.ModuleList(Block(c.d_model) for _ in range(c.n_layer)),
                    "ln_f": nn.LayerNorm(c.d_model),
                }
            )
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
            self.lm_head.weight = self.transformer["wte"].weight  # tied

    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    layout = ParamLayout.from_module(model, name="gpt2-meta")
    assert layout.total_numel == ParamLayout.from_config(cfg).total_numel == 124_439_808
    assert layout.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert layout.num_transformer_blocks == cfg.n_layer
    assert {b.kind for b in layout.blocks} == {"embedding", "block", "final_norm"}
    with torch.device("meta"):
        half = GPT(PRESETS["tiny"]).to(torch.bfloat16)
    assert list(ParamLayout.from_module(half).bytes_by_dtype()) == ["bfloat16"]


def test_from_module_rejects_non_modules():
    with pytest.raises(ConfigError) as e:
        ParamLayout.from_module(object())
    assert e.value.field == "module"


def test_importing_zerosim_does_not_import_torch_or_hypothesis():
    code = ("import sys, zerosim, zerosim.values.layout, zerosim.cli; "
            "print('torch' in sys.modules, 'hypothesis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_generated_layouts_are_consistent(layout):
    assert layout.total_numel == sum(layout.numels())
    assert sum(layout.bytes_by_dtype().values()) == layout.total_bytes
    assert sum(layout.block_numel(b) for b in layout.blocks) == layout.total_numel
    indices = sorted(i for b in layout.blocks for i in b.tensor_indices)
    assert indices == list(range(len(layout.tensors)))
    for alias, target in layout.aliases.items():
        assert layout.tensor_range(alias) == layout.tensor_range(target)
