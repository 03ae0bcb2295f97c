"""Built-in GPT-style model configurations (the shapes, never the weights)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2-style decoder: token + position embedding, ``n_layer`` pre-norm blocks, final norm, lm head."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    mlp_ratio: int = 4
    bias: bool = True
    tied_embeddings: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(field, value, "must be a positive integer")
        if self.d_model % self.n_head:
            raise ConfigError("n_head", self.n_head, f"must divide d_model={self.d_model}")

    def with_dtype(self, dtype: str) -> GPTConfig:
        return replace(self, dtype=dtype)


PRESETS: dict[str, GPTConfig] = {
    # A toy for tests: every code path, microseconds per step.
    "tiny": GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16),
    # ~10M parameters: the simulator benchmark's model.
    "sim-10m": GPTConfig(vocab_size=8192, seq_len=64, n_layer=6, n_head=4, d_model=384),
    "gpt2-small": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=36, n_head=20, d_model=1280),
    # The ZeRO paper's 7.5B-class shape (Megatron-style, 36 x 4096).
    "gpt-7.5b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=36, n_head=32, d_model=4096),
    # GPT-3 175B shape.
    "gpt3-175b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
}


def get_preset(name: str) -> GPTConfig:
    """Look up a built-in config by name; a clear error names the field and the known presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model", name, f"unknown preset; known: {', '.join(PRESETS)}") from None
