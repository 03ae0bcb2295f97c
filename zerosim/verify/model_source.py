"""The model ``zerosim verify`` trains: a built-in name or a user's ``MODULE:FACTORY``, as one source.

``--model`` is a built-in preset (``gpt``, ``gpt-tied``, ``gpt-50m``: :mod:`zerosim.verify.model`),
``moe`` (a top-k routed mixture of experts: :mod:`zerosim.verify.model_moe`, built through its factory
like a user's), ``hf-gpt2`` (a small GPT-2 built from ``transformers``' ``GPT2Config`` /
``GPT2LMHeadModel`` with random weights, no download; the optional ``[hf]`` extra), or
``MODULE:FACTORY``: a callable ``factory(seed) -> (model, make_batch)`` where ``model(inputs, targets)``
returns the scalar loss and ``make_batch(step, rank, world, micro) -> (inputs, targets)`` gives rank
``rank``'s micro-batch ``micro`` (0-based) of global step ``step`` (1-based) in a world of ``world``
ranks. The factory is called on every rank and by the reference with the same seed and must build the
same model each time.

:func:`model_source` resolves the name once; a :class:`ModelSource` builds the model in a dtype, gives
every micro-batch, and the sizes the rounding model of C-ZERO-002 needs (:class:`ModelSizes`).
:meth:`ModelSource.validate` calls the factory and checks what it returns, so that a wrong return,
a factory that raises, a loss that is not a scalar or batches of different shapes on different ranks
are one :class:`~zerosim.errors.ConfigError` line naming what is wrong (exit 2), before any rank trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerosim.errors import ConfigError, ZeroSimError
from zerosim.files.dotted import import_dotted

from .model import PRESETS, build_model, micro_batch, torch_dtype
from .model_moe import MOE_CONFIG, moe_factory
from .model_presets import BUILT_IN_MODELS, HF_INSTALL, HF_MODEL, MOE_MODEL, require_model_name

__all__ = ["BUILT_IN_MODELS", "HF_INSTALL", "HF_MODEL", "ModelSizes", "ModelSource", "batch_signature",
           "hf_gpt2_factory", "model_sizes_of", "model_source", "to_device"]


@dataclass(frozen=True)
class ModelSizes:
    """What bounds the reduction length of a model's gradient
    (:func:`zerosim.checks.tolerance.reduction_length`): sequences per micro-batch, tokens per
    sequence, layers, the longest dot product in one layer."""

    batch: int
    block: int
    n_layer: int
    widest: int


def model_sizes_of(model: nn.Module, inputs: Any) -> ModelSizes:
    """Sizes of a model verify knows nothing about: the micro-batch's leading dimension and elements per
    row of its inputs, the leaf modules that hold parameters as layers, and the largest dimension of any
    parameter as the longest dot product (a matrix-vector product runs over one of its dimensions)."""
    first = inputs if torch.is_tensor(inputs) else next((t for t in _tensors(inputs)), None)
    batch = int(first.shape[0]) if first is not None and first.dim() > 0 else 1
    per_row = int(first.numel()) // max(batch, 1) if first is not None else 1
    layers = sum(1 for m in model.modules()
                 if not list(m.children()) and any(True for _ in m.parameters(False)))
    widest = max((max(p.shape) for p in model.parameters() if p.dim() > 0), default=1)
    return ModelSizes(batch, max(per_row, 1), max(layers, 1), int(widest))


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def batch_signature(value: Any) -> Any:
    """The shapes and dtypes of a batch's tensors (nested like the batch): what must agree across ranks."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return ("dict", tuple((k, batch_signature(v)) for k, v in items))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(batch_signature(v) for v in value))
    return (type(value).__name__,)


def to_device(value: Any, device: Any) -> Any:
    """A batch (tensors, possibly nested in dicts, lists and tuples) on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


class ModelSource:
    """One ``--model``: builds the model and every micro-batch (see the module docstring)."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.seed = seed
        self.built_in = name in PRESETS
        self._factory: Callable[..., Any] | None = None
        self._make_batch: Callable[..., Any] | None = None
        self._sizes: ModelSizes | None = None

    # -- building -------------------------------------------------------------------------------------
    def build(self, dtype: str) -> nn.Module:
        """A fresh model with the run's seeded weights, in ``dtype`` (identical on every call)."""
        if self.built_in:
            return build_model(self.name, dtype, self.seed)
        model, make_batch = self._call_factory()
        self._make_batch = make_batch
        return model.to(torch_dtype(dtype))

    def batch(self, rank: int, step: int, micro: int = 0, world: int = 1) -> tuple[Any, Any]:
        """Rank ``rank``'s micro-batch ``micro`` of global step ``step`` (on the CPU)."""
        if self.built_in:
            return micro_batch(rank, step, self.seed, self.name, micro)
        if self._make_batch is None:
            self._make_batch = self._call_factory()[1]
        return self._checked_batch(self._make_batch, step, rank, world, micro)

    @property
    def concatenable(self) -> bool:
        """Whether the reference may train on the concatenation of the micro-batches (the built-in
        models' mean loss over equal micro-batches); otherwise it averages per-micro-batch gradients."""
        return self.built_in

    def sizes(self) -> Any:
        """The sizes the rounding model needs: the preset's own, or :func:`model_sizes_of`."""
        if self.built_in:
            return PRESETS[self.name]
        if self.name == MOE_MODEL:
            return MOE_CONFIG
        if self._sizes is None:
            model = self.build("float64")
            inputs, _ = self.batch(0, 1)
            self._sizes = model_sizes_of(model, inputs)
        return self._sizes

    # -- validation -----------------------------------------------------------------------------------
    def validate(self, world: int, grad_accum: int = 1) -> None:
        """ConfigError (field ``model``) unless the factory returns ``(nn.Module, callable)``, every
        rank's micro-batches of the first step have one shape, and the model's loss is a scalar tensor
        that autograd can differentiate. The built-in presets need nothing."""
        if self.built_in:
            return
        model, make_batch = self._call_factory()
        signatures = {}
        for rank in range(world):
            for micro in range(grad_accum):
                inputs, targets = self._checked_batch(make_batch, 1, rank, world, micro)
                signatures[(rank, micro)] = batch_signature((inputs, targets))
        first = signatures[(0, 0)]
        for (rank, micro), sig in signatures.items():
            if sig != first:
                raise ConfigError(
                    "model", self.name,
                    f"make_batch returned {_describe(sig)} for rank {rank}, micro-batch {micro} but "
                    f"{_describe(first)} for rank 0, micro-batch 0: every micro-batch must have the same "
                    "shape",
                )
        inputs, targets = self._checked_batch(make_batch, 1, 0, world, 0)
        try:
            loss = model.to(torch.float64)(inputs, targets)
        except Exception as e:  # noqa: BLE001 - the user's forward raised: bad input, named
            raise ConfigError("model", self.name,
                              f"model(inputs, targets) raised {type(e).__name__}: {e}") from None
        if not torch.is_tensor(loss) or loss.numel() != 1 or not loss.is_floating_point():
            raise ConfigError(
                "model", self.name,
                f"model(inputs, targets) returned {_what(loss)}, expected the loss as a scalar float tensor",
            )
        if not loss.requires_grad:
            raise ConfigError("model", self.name, "model(inputs, targets) returned a loss without a gradient "
                                                  "(requires_grad=False): nothing to train")

    def _call_factory(self) -> tuple[nn.Module, Callable[..., Any]]:
        factory = self._resolve()
        try:
            made = factory(self.seed)
        except ZeroSimError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's factory raised: bad input, named
            raise ConfigError("model", self.name, f"the factory raised {type(e).__name__}: {e}") from None
        if not isinstance(made, tuple) or len(made) != 2:
            raise ConfigError("model", self.name,
                              f"the factory returned {_what(made)}; expected a pair (model, make_batch)")
        model, make_batch = made
        if not isinstance(model, nn.Module):
            raise ConfigError("model", self.name,
                              f"the factory returned {_what(model)} as the model; expected a torch.nn.Module")
        if not any(True for _ in model.parameters()):
            raise ConfigError("model", self.name, "the factory's model has no parameters: nothing to train")
        if not callable(make_batch):
            raise ConfigError("model", self.name,
                              f"the factory returned {_what(make_batch)} as make_batch; expected a callable "
                              "make_batch(step, rank, world, micro) -> (inputs, targets)")
        return model, make_batch

    def _resolve(self) -> Callable[..., Any]:
        if self._factory is None:
            if self.name == HF_MODEL:
                self._factory = hf_gpt2_factory
            elif self.name == MOE_MODEL:
                self._factory = moe_factory
            else:
                try:
                    self._factory = import_dotted(self.name, "model")
                except ConfigError:
                    raise
                except ZeroSimError as e:
                    raise ConfigError("model", self.name, str(e).split(": ", 1)[-1]) from None
        return self._factory

    def _checked_batch(self, make_batch: Callable[..., Any], step: int, rank: int, world: int,
                       micro: int) -> tuple[Any, Any]:
        try:
            made = make_batch(step, rank, world, micro)
        except Exception as e:  # noqa: BLE001 - the user's make_batch raised: bad input, named
            raise ConfigError("model", self.name, f"make_batch({step}, {rank}, {world}, {micro}) raised "
                                                  f"{type(e).__name__}: {e}") from None
        if not isinstance(made, tuple) or len(made) != 2:
            raise ConfigError("model", self.name, f"make_batch({step}, {rank}, {world}, {micro}) returned "
                                                  f"{_what(made)}; expected a pair (inputs, targets)")
        if not _tensors(made):
            raise ConfigError("model", self.name, f"make_batch({step}, {rank}, {world}, {micro}) returned no "
                                                  "tensor")
        return made


def _what(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    return type(value).__name__


def _describe(sig: Any) -> str:
    shapes = []

    def walk(s: Any) -> None:
        if s and s[0] == "tensor":
            shapes.append(f"{list(s[1])} {s[2].replace('torch.', '')}")
        elif s and s[0] == "dict":
            for _, v in s[1]:
                walk(v)
        elif len(s) > 1:
            for v in s[1]:
                walk(v)

    walk(sig)
    return "tensors " + ", ".join(shapes) if shapes else "no tensors"


def model_source(name: Any, seed: int = 0) -> ModelSource:
    """The source ``--model`` names; ConfigError (field ``model``) for a name that is neither a built-in
    model nor ``MODULE:FACTORY``, and for ``hf-gpt2`` without transformers
    (:func:`~zerosim.verify.model_presets.require_model_name`)."""
    return ModelSource(require_model_name(name), seed)


# ---- the built-in GPT-2 from transformers -------------------------------------------------------------

HF_VOCAB, HF_BLOCK, HF_BATCH = 37, 7, 2


class HFCausalLM(nn.Module):
    """``GPT2LMHeadModel`` behind the verify protocol: ``model(inputs, targets)`` -> mean next-token loss."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def hf_gpt2_factory(seed: int) -> tuple[nn.Module, Callable[..., Any]]:
    """A 2-layer GPT-2 (width 24, 3 heads, vocabulary 37, 7 positions) from ``GPT2Config`` with weights
    drawn from ``seed`` (no download), dropout off; its micro-batches as :func:`micro_batch` draws them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=HF_VOCAB, n_positions=HF_BLOCK, n_embd=24, n_layer=2, n_head=3,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):  # the weights from the seed, the caller's generator untouched
        torch.manual_seed(1_000_003 * seed + 29)
        model = HFCausalLM(GPT2LMHeadModel(config)).to(torch.float64)
    model.eval()  # no dropout; gradients flow as in training

    def make_batch(step: int, rank: int, world: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seed * 7919 + step) * 104_729 + rank + micro * 15_485_863
        gen = torch.Generator().manual_seed(key % 2**62)
        tokens = torch.randint(0, HF_VOCAB, (HF_BATCH, HF_BLOCK + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return model, make_batch
