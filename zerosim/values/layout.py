"""ParamLayout: the model's named tensors, grouped into blocks, laid out in one flat index space.

A layout is a plain value (no arrays): every partitioner, plan, contract and cost model works on it.
Tensor ``i`` occupies ``[offsets[i], offsets[i] + numel)`` of the flat space, in declaration order.
A tied (shared) weight appears once in ``tensors``; its other names are kept in ``aliases`` so a
user can look them up, but it is counted and partitioned once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import ConfigError
from .dtypes import canonical_dtype, itemsize
from .presets import GPTConfig, get_preset

BLOCK_KINDS = ("embedding", "block", "final_norm", "lm_head", "other")


@dataclass(frozen=True)
class TensorSpec:
    """One named parameter: its shape, dtype and the block it belongs to (e.g. ``blocks.3``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    block: str = "other"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise ConfigError(f"{self.name}.shape", self.shape, "dimensions must be >= 0")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, f"{self.name}.dtype"))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class Block:
    """A unit of the model that is gathered / freed together under FULL_SHARD (FSDP's 'unit')."""

    name: str
    kind: str
    tensor_indices: tuple[int, ...]
    index: int | None = None  # position among ``blocks.*`` for kind == "block"


@dataclass(frozen=True)
class ParamLayout:
    """Named tensors in flat order, grouped into blocks. Tied weights counted once (see ``aliases``)."""

    tensors: tuple[TensorSpec, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias name -> canonical tensor name
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ConfigError(
                    "tensors", t.name, "duplicate tensor name (list a tied weight once, as an alias)"
                )
            seen.add(t.name)
        for alias, target in self.aliases.items():
            if target not in seen:
                raise ConfigError("aliases", alias, f"points at unknown tensor {target!r}")

    # ---- flat index space -------------------------------------------------------------------
    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for t in self.tensors:
            out.append(acc)
            acc += t.numel
        return tuple(out)

    @property
    def total_numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def numels(self) -> list[int]:
        return [t.numel for t in self.tensors]

    def tensor_range(self, name: str) -> tuple[int, int]:
        """Flat ``[start, end)`` of a tensor (aliases resolve to the tensor they share)."""
        name = self.aliases.get(name, name)
        for t, off in zip(self.tensors, self.offsets, strict=True):
            if t.name == name:
                return off, off + t.numel
        raise ConfigError("tensor", name, "no such tensor in the layout")

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    # ---- blocks -----------------------------------------------------------------------------
    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        """Blocks in first-appearance order; ``blocks.N`` tensors form transformer block N."""
        order: dict[str, list[int]] = {}
        for i, t in enumerate(self.tensors):
            order.setdefault(t.block, []).append(i)
        out = []
        for bname, idx in order.items():
            kind, index = _block_kind(bname)
            out.append(Block(bname, kind, tuple(idx), index))
        return tuple(out)

    @property
    def num_transformer_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "block")

    def block_numel(self, block: Block) -> int:
        return sum(self.tensors[i].numel for i in block.tensor_indices)

    def block_bytes(self, block: Block) -> int:
        return sum(self.tensors[i].nbytes for i in block.tensor_indices)

    def largest_block_numel(self) -> int:
        return max((self.block_numel(b) for b in self.blocks), default=0)

    def with_dtype(self, dtype: str) -> ParamLayout:
        """The same layout with every tensor in ``dtype``."""
        return ParamLayout(
            tuple(TensorSpec(t.name, t.shape, dtype, t.block) for t in self.tensors),
            dict(self.aliases),
            self.name,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_tensors": len(self.tensors),
            "num_blocks": len(self.blocks),
            "total_numel": self.total_numel,
            "bytes_by_dtype": self.bytes_by_dtype(),
            "blocks": {b.name: self.block_numel(b) for b in self.blocks},
            "tied": dict(self.aliases),
        }

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_list(
        cls, specs: Iterable[Any], name: str = "custom", aliases: Mapping[str, str] | None = None
    ) -> ParamLayout:
        """Build from ``TensorSpec`` objects, dicts, or ``(name, shape[, dtype[, block]])`` tuples.

        A tensor whose block is not given is grouped by its name (``blocks.3.mlp.w`` -> ``blocks.3``).
        """
        tensors = []
        for i, s in enumerate(specs):
            if isinstance(s, TensorSpec):
                tensors.append(s)
                continue
            if isinstance(s, Mapping):
                s = (s.get("name"), s.get("shape"), s.get("dtype", "float32"), s.get("block"))
            if not isinstance(s, (tuple, list)) or len(s) < 2:
                raise ConfigError(
                    f"specs[{i}]", s, "expected TensorSpec, dict or (name, shape[, dtype[, block]])"
                )
            tname, shape = s[0], s[1]
            if not isinstance(tname, str) or not tname:
                raise ConfigError(f"specs[{i}].name", tname, "must be a non-empty string")
            if isinstance(shape, int):
                shape = (shape,)
            try:
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                raise ConfigError(f"specs[{i}].shape", shape, "must be a tuple of integers") from None
            dtype = s[2] if len(s) > 2 and s[2] is not None else "float32"
            block = s[3] if len(s) > 3 and s[3] is not None else infer_block(tname)
            tensors.append(TensorSpec(tname, shape, dtype, block))
        return cls(tuple(tensors), dict(aliases or {}), name)

    @classmethod
    def from_config(cls, config: GPTConfig | str, name: str | None = None) -> ParamLayout:
        """The layout of a config or a preset name, in the config's own structure: a GPT-2-style
        decoder (``gpt2-small`` has 124,439,808 parameters), or for ``structure="block"`` the
        simulator's block model (:func:`block_model_layout`; ``tiny`` has 6,192 parameters)."""
        if isinstance(config, str):
            name = name or config
            config = get_preset(config)
        if not isinstance(config, GPTConfig):
            raise ConfigError("config", config, "expected a preset name or a "
                                                "zerosim.values.presets.GPTConfig")
        c = config
        if c.structure == "block":
            return block_model_layout(c.vocab_size, c.d_model, c.n_layer, c.mlp_ratio * c.d_model,
                                      dtype=c.dtype, name=name or "sim")
        d, f, dt = c.d_model, c.mlp_ratio * c.d_model, c.dtype
        t: list[TensorSpec] = [
            TensorSpec("wte.weight", (c.vocab_size, d), dt, "embedding"),
            TensorSpec("wpe.weight", (c.seq_len, d), dt, "embedding"),
        ]
        for i in range(c.n_layer):
            b = f"blocks.{i}"
            shapes: list[tuple[str, tuple[int, ...]]] = [
                ("ln_1.weight", (d,)),
                ("attn.c_attn.weight", (3 * d, d)),
                ("attn.c_proj.weight", (d, d)),
                ("ln_2.weight", (d,)),
                ("mlp.c_fc.weight", (f, d)),
                ("mlp.c_proj.weight", (d, f)),
            ]
            if c.bias:
                shapes += [("ln_1.bias", (d,)), ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.bias", (d,)),
                           ("ln_2.bias", (d,)), ("mlp.c_fc.bias", (f,)), ("mlp.c_proj.bias", (d,))]
            t += [TensorSpec(f"{b}.{n}", s, dt, b) for n, s in shapes]
        t.append(TensorSpec("ln_f.weight", (d,), dt, "final_norm"))
        if c.bias:
            t.append(TensorSpec("ln_f.bias", (d,), dt, "final_norm"))
        aliases: dict[str, str] = {}
        if c.tied_embeddings:
            aliases["lm_head.weight"] = "wte.weight"
        else:
            t.append(TensorSpec("lm_head.weight", (c.vocab_size, d), dt, "lm_head"))
        return cls(tuple(t), aliases, name or "gpt")

    @classmethod
    def from_module(cls, module: Any, name: str | None = None) -> ParamLayout:
        """Layout of a torch ``nn.Module`` (build it on the meta device: nothing is allocated).

        Shared parameters (tied embeddings) are counted once; their other names become aliases.
        torch is imported only here, so zerosim works without it.
        """
        try:
            named_all = list(module.named_parameters(remove_duplicate=False))
        except AttributeError:
            raise ConfigError("module", type(module).__name__, "is not a torch.nn.Module") from None
        canonical: dict[int, str] = {}
        tensors: list[TensorSpec] = []
        aliases: dict[str, str] = {}
        for pname, p in named_all:
            key = id(p)
            if key in canonical:
                aliases[pname] = canonical[key]
                continue
            canonical[key] = pname
            tensors.append(TensorSpec(pname, tuple(p.shape), str(p.dtype), infer_block(pname)))
        return cls(tuple(tensors), aliases, name or type(module).__name__)


def block_model_layout(
    vocab_size: int, d_model: int, n_layer: int, d_ff: int, dtype: str = "float32", name: str = "sim"
) -> ParamLayout:
    """The simulator's block model (:mod:`zerosim.numerics.model`) as a layout, in flat order: block
    "embedding" (``embedding.weight`` (V, d)); blocks "blocks.{i}" (``norm.weight`` (d,),
    ``mlp.w_in`` (d_ff, d), ``mlp.w_out`` (d, d_ff)); "final_norm" (``final_norm.weight`` (d,));
    "lm_head" (``lm_head.weight`` (V, d), untied)."""
    V, d, f = vocab_size, d_model, d_ff
    tensors = [TensorSpec("embedding.weight", (V, d), dtype, "embedding")]
    for i in range(n_layer):
        b = f"blocks.{i}"
        tensors += [
            TensorSpec(f"{b}.norm.weight", (d,), dtype, b),
            TensorSpec(f"{b}.mlp.w_in", (f, d), dtype, b),
            TensorSpec(f"{b}.mlp.w_out", (d, f), dtype, b),
        ]
    tensors += [
        TensorSpec("final_norm.weight", (d,), dtype, "final_norm"),
        TensorSpec("lm_head.weight", (V, d), dtype, "lm_head"),
    ]
    return ParamLayout(tuple(tensors), {}, name)


_BLOCK_RE = re.compile(r"(?:^|\.)(?:h|layers|blocks|layer|block)\.(\d+)(?:\.|$)")


def infer_block(param_name: str) -> str:
    """Group a parameter by its name: ``transformer.h.3.attn.w`` -> ``blocks.3``; embeddings, norms, head."""
    m = _BLOCK_RE.search(param_name)
    if m:
        return f"blocks.{int(m.group(1))}"
    low = param_name.lower()
    if "lm_head" in low or low.startswith("output.") or low.startswith("head."):
        return "lm_head"
    if any(k in low for k in ("wte", "wpe", "embed", "tok_embeddings")):
        return "embedding"
    if any(k in low for k in ("ln_f", "final_norm", "norm_f", "final_layernorm")) or low.startswith("norm."):
        return "final_norm"
    return "other"


def _block_kind(block_name: str) -> tuple[str, int | None]:
    if block_name.startswith("blocks."):
        return "block", int(block_name.split(".", 1)[1])
    if block_name in BLOCK_KINDS:
        return block_name, None
    return "other", None
