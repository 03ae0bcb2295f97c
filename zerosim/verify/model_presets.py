"""The names ``--model`` accepts and the built-in presets' sizes, without torch.

The launcher of ``zerosim verify`` (and of the benchmarks that train a preset) checks ``--model``
before any rank starts; these values are plain data, so that check costs no torch import.
:mod:`zerosim.verify.model` builds the torch GPT from a :class:`zerosim.values.presets.GPTConfig`;
:mod:`zerosim.verify.model_source` builds whatever ``--model`` names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zerosim.errors import ConfigError, install_hint
from zerosim.values.presets import GPTConfig

HF_MODEL = "hf-gpt2"
MOE_MODEL = "moe"  # the built-in mixture of experts (zerosim.verify.model_moe)
HF_INSTALL = install_hint("hf")


#: the verify GPTs, :class:`zerosim.values.presets.GPTConfig` values (the one model-shape type): a toy whose
#: every width is a different prime-ish size (a transposed or mis-sliced tensor cannot hide), with the
#: small tensors; the same tied; and a 50M-parameter model for the benchmarks
_GPT = GPTConfig(vocab_size=37, seq_len=7, d_model=25, n_head=5, mlp_width=47, n_layer=2,
                 tied_embeddings=False, batch=2, small_tensors=True)
PRESETS = {
    "gpt": _GPT,
    "gpt-tied": replace(_GPT, tied_embeddings=True),
    "gpt-50m": GPTConfig(vocab_size=24571, seq_len=65, d_model=511, n_head=7, mlp_width=2047, n_layer=8,
                         tied_embeddings=False, batch=2, small_tensors=False),
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
