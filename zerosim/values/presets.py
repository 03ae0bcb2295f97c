"""Built-in model configurations (the shapes, never the weights).

Every preset names one model with one structure (``GPTConfig.structure``), used by every command
(``zerosim verify``'s torch GPTs, :data:`zerosim.verify.model_presets.PRESETS`, are the same class):

* ``"gpt2"``: a GPT-2-style decoder (token + position embedding, attention and MLP with biases,
  final norm, head tied to the token embedding). ``zerosim plan``, ``memory`` and ``comm`` model it.
* ``"block"``: the simulator's block model (token embedding, ``n_layer`` x [RMSNorm gain, MLP
  ``w_in``, ``w_out``], final norm gain, untied head; :func:`zerosim.values.layout.block_model_layout`).
  ``zerosim simulate`` trains it; plan, memory and comm model the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError

#: The structures a preset can have: a GPT-2-style decoder, or the simulator's block model.
STRUCTURES = ("gpt2", "block")


@dataclass(frozen=True)
class GPTConfig:
    """A model's shapes. ``structure="gpt2"`` (default): a GPT-2-style decoder (token + position
    embedding, ``n_layer`` pre-norm attention + MLP blocks, final norm, lm head). ``structure="block"``:
    the simulator's block model (embedding, ``n_layer`` x [norm, MLP], final norm, untied head), which
    uses ``vocab_size``, ``seq_len``, ``n_layer``, ``d_model``, ``mlp_ratio`` and ``dtype`` only.

    ``zerosim verify``'s torch GPTs (:mod:`zerosim.verify.model`) read the same value: ``mlp_width``
    (the MLP's hidden width when it is not ``mlp_ratio * d_model``), ``batch`` (sequences per rank per
    step) and ``small_tensors`` (the 3- and 1-element tensors that exercise tiny shards); ``vocab``,
    ``block``, ``tied``, ``d_mlp`` and ``widest`` are their names for the shapes."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    mlp_ratio: int = 4
    bias: bool = True
    tied_embeddings: bool = True
    dtype: str = "float32"
    structure: str = "gpt2"
    mlp_width: int | None = None
    batch: int = 2
    small_tensors: bool = False

    @property
    def vocab(self) -> int:
        return self.vocab_size

    @property
    def block(self) -> int:
        """The context length (``seq_len``)."""
        return self.seq_len

    @property
    def tied(self) -> bool:
        return self.tied_embeddings

    @property
    def d_mlp(self) -> int:
        """The MLP's hidden width: ``mlp_width``, else ``mlp_ratio * d_model``."""
        return self.mlp_width if self.mlp_width is not None else self.mlp_ratio * self.d_model

    @property
    def widest(self) -> int:
        """The longest dot product in one layer (for :mod:`zerosim.checks.tolerance`'s rounding model)."""
        return max(self.d_model, self.d_mlp, self.vocab_size, self.seq_len)

    def __post_init__(self) -> None:
        if self.structure not in STRUCTURES:
            raise ConfigError("structure", self.structure, f"known: {', '.join(STRUCTURES)}")
        for field in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio", "batch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(field, value, "must be a positive integer")
        width = self.mlp_width
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width <= 0):
            raise ConfigError("mlp_width", self.mlp_width, "must be a positive integer")
        if self.d_model % self.n_head:
            raise ConfigError("n_head", self.n_head, f"must divide d_model={self.d_model}")

    def with_dtype(self, dtype: str) -> GPTConfig:
        return replace(self, dtype=dtype)


PRESETS: dict[str, GPTConfig] = {
    # Simulator block models (``zerosim simulate`` trains them; plan, memory and comm model the same layout).
    # A toy for tests: every code path, microseconds per step (6,192 parameters).
    "tiny": GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16, structure="block"),
    # The simulator benchmark's model (13,372,032 parameters).
    "sim-10m": GPTConfig(vocab_size=8192, seq_len=64, n_layer=6, n_head=4, d_model=384, structure="block"),
    # GPT-2-style layouts (plan, memory and comm model them; too large or not built for the simulator).
    "gpt2-small": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=36, n_head=20, d_model=1280),
    # The ZeRO paper's 7.5B-class shape (Megatron-style, 36 x 4096).
    "gpt-7.5b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=36, n_head=32, d_model=4096),
    # GPT-3 175B shape.
    "gpt3-175b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
}


def simulator_presets() -> tuple[str, ...]:
    """The presets ``zerosim simulate`` runs: those with the block-model structure."""
    return tuple(name for name, cfg in PRESETS.items() if cfg.structure == "block")


def require_simulator_preset(name: str) -> GPTConfig:
    """The preset ``name`` if it is a block model; else a ConfigError (field ``model``) saying which are."""
    cfg = get_preset(name)
    if cfg.structure != "block":
        raise ConfigError(
            "model", name,
            f"is a GPT-2 layout; the simulator runs the block models ({', '.join(simulator_presets())}); "
            "zerosim plan, memory and comm model the GPT-2 layouts",
        )
    return cfg


def get_preset(name: str) -> GPTConfig:
    """Look up a built-in config by name; a clear error names the field and the known presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model", name, f"unknown preset; known: {', '.join(PRESETS)}") from None
