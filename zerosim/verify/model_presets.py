"""The names ``--model`` accepts and the built-in presets' sizes, without torch.

The launcher of ``zerosim verify`` (and of the benchmarks that train a preset) checks ``--model``
before any rank starts; these values are plain data, so that check costs no torch import.
:mod:`zerosim.verify.model` builds the torch GPT from a :class:`GPTConfig`;
:mod:`zerosim.verify.model_source` builds whatever ``--model`` names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerosim.errors import ConfigError, install_hint

HF_MODEL = "hf-gpt2"
MOE_MODEL = "moe"  # the built-in mixture of experts (zerosim.verify.model_moe)
HF_INSTALL = install_hint("hf")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 37
    block: int = 7
    d_model: int = 25
    n_head: int = 5
    d_mlp: int = 47
    n_layer: int = 2
    tied: bool = False
    batch: int = 2  # sequences per rank per step
    small_tensors: bool = True  # small.bias (3 elements) and small.gain (1): see zerosim.verify.model

    @property
    def widest(self) -> int:
        """The longest dot product in one layer (for :mod:`zerosim.checks.tolerance`'s rounding model)."""
        return max(self.d_model, self.d_mlp, self.vocab, self.block)


PRESETS = {
    "gpt": GPTConfig(),
    "gpt-tied": GPTConfig(tied=True),
    "gpt-50m": GPTConfig(vocab=24571, block=65, d_model=511, n_head=7, d_mlp=2047, n_layer=8, batch=2,
                         small_tensors=False),
}
BUILT_IN_MODELS = (*PRESETS, MOE_MODEL, HF_MODEL)


def require_model(name: str) -> GPTConfig:
    """The preset called ``name``; ConfigError (field ``model``) listing the presets otherwise."""
    if name not in PRESETS:
        raise ConfigError("model", name, f"known models: {', '.join(PRESETS)}")
    return PRESETS[name]


def require_model_name(name: Any) -> str:
    """``name`` when ``--model`` may name it: a built-in model or ``MODULE:FACTORY``; ConfigError
    (field ``model``) otherwise, and for ``hf-gpt2`` without transformers. Imports nothing the name
    points at: :meth:`zerosim.verify.model_source.ModelSource.validate` imports and calls a factory."""
    import importlib.util

    if not isinstance(name, str) or not name:
        raise ConfigError("model", name,
                          f"give a built-in model ({', '.join(BUILT_IN_MODELS)}) or MODULE:FACTORY")
    if name == HF_MODEL and importlib.util.find_spec("transformers") is None:
        raise ConfigError("model", name, f"needs transformers, which is not installed: {HF_INSTALL}")
    if name not in BUILT_IN_MODELS and (":" not in name or name.startswith(":") or name.endswith(":")):
        raise ConfigError("model", name, f"known models: {', '.join(BUILT_IN_MODELS)}, or MODULE:FACTORY")
    return name


def is_preset(name: Any) -> bool:
    """Whether ``name`` is a built-in preset: a model that needs no factory validated before launch."""
    return isinstance(name, str) and name in PRESETS
