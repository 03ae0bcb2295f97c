"""The simulator's model: a GPT-shaped stack of residual MLP blocks with exact, hand-written gradients.

Forward, block by block (``BlockModel.block_names``)::

    embedding   x = E[tokens]                                   E: (V, d)
    blocks.i    x = x + W_out @ silu(W_in @ rmsnorm(x) * g)      g: (d,), W_in: (d_ff, d), W_out: (d, d_ff)
    final_norm  h = rmsnorm(x) * g_f                            g_f: (d,)
    lm_head     loss = mean_t cross_entropy(h @ W_head^T, targets)   W_head: (V, d)

Attention is omitted (the shapes of embedding, MLP, norms and head follow the preset; attention
would add nothing the engine treats differently: more tensors in a block). The model exists so the
ZeRO engine has real gradients to shard, reduce and step, per block, in the order a real model
produces them, and so ground truth can be computed exactly.

Numerics (documented choices):

* Parameters may be float32, bfloat16, float16 (mixed precision) or float64 (finite-difference
  tests). Every op upcasts its parameters and computes in the *compute dtype*: float64 for float64
  parameters, float32 otherwise. Hidden activations between blocks stay in the compute dtype.
  Gradients are returned in the parameters' dtype (rounded to nearest even once, at the end).
* RMSNorm: ``x * (mean(x**2) + 1e-6) ** -0.5 * g`` (eps 1e-6, inside the root, as in LLaMA).
* Activation: SiLU (smooth, so finite differences are meaningful), via a stable sigmoid.
* Cross-entropy: stable log-softmax (max subtracted), mean over the micro-batch's B*T tokens.

Everything goes through the array-namespace seam (:mod:`zerosim.numerics.xp`), so the same code runs on
numpy and on torch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ..errors import ConfigError, require_non_negative_int, require_positive_int
from ..values.layout import ParamLayout, block_model_layout
from ..values.presets import GPTConfig, require_simulator_preset
from .xp import ArrayNamespace, get_namespace

RMS_EPS = 1e-6


@dataclass(frozen=True)
class SimModelConfig:
    """Shapes of the simulator model. ``batch_size`` x ``seq_len`` tokens per micro-batch per rank."""

    vocab_size: int
    d_model: int
    n_layer: int
    d_ff: int
    seq_len: int
    batch_size: int

    def __post_init__(self) -> None:
        for f in fields(self):
            require_positive_int(f.name, getattr(self, f.name))

    @classmethod
    def from_gpt(
        cls, gpt_config: GPTConfig, batch_size: int = 2, seq_len: int | None = None
    ) -> SimModelConfig:
        """Map a GPT preset onto this model: same vocab, width and depth, ``d_ff = mlp_ratio * d_model``;
        attention, position embeddings and biases are omitted."""
        if not isinstance(gpt_config, GPTConfig):
            raise ConfigError("gpt_config", gpt_config, "expected a zerosim.values.presets.GPTConfig")
        return cls(
            vocab_size=gpt_config.vocab_size,
            d_model=gpt_config.d_model,
            n_layer=gpt_config.n_layer,
            d_ff=gpt_config.mlp_ratio * gpt_config.d_model,
            seq_len=gpt_config.seq_len if seq_len is None else seq_len,
            batch_size=batch_size,
        )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> SimModelConfig:
        """``from_gpt`` of the block-model preset ``name`` with any field overridden (``batch_size=4``,
        ``seq_len=16``). A GPT-2-layout preset (``gpt2-small``, ...) is a ConfigError: it names a
        different model, which the simulator does not run."""
        cfg = cls.from_gpt(require_simulator_preset(name))
        known = {f.name for f in fields(cls)}
        for key in overrides:
            if key not in known:
                raise ConfigError(key, overrides[key], f"unknown model field; known: {sorted(known)}")
        return replace(cfg, **overrides)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.batch_size * self.seq_len


def sim_layout(cfg: SimModelConfig) -> ParamLayout:
    """The model's tensors in flat order (float32: mixed precision changes the working dtype, not
    the layout). Blocks: "embedding", "blocks.{i}", "final_norm", "lm_head"
    (:func:`zerosim.values.layout.block_model_layout`, the layout plan, memory and comm use for the same
    preset)."""
    return block_model_layout(cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.d_ff, "float32", "sim")


def init_params(cfg: SimModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic float32 initial parameters (``np.random.default_rng(seed)``, drawn in layout order).

    Embedding N(0, 1); norm gains 1; ``w_in`` N(0, 1/d); ``w_out`` N(0, 1/(2 * n_layer * d_ff)) so the
    residual stream grows slowly with depth; head N(0, 1/(4d)) so initial logits have std 1/2 and the
    initial loss is close to ln V. Stable under Adam at lr 1e-3 (see tests/test_groundtruth.py).
    """
    require_non_negative_int("seed", seed)
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    d, f = cfg.d_model, cfg.d_ff
    for t in sim_layout(cfg).tensors:
        if t.name.endswith("norm.weight"):
            a = np.ones(t.shape)
        elif t.name == "embedding.weight":
            a = rng.standard_normal(t.shape)
        elif t.name.endswith("mlp.w_in"):
            a = rng.standard_normal(t.shape) / math.sqrt(d)
        elif t.name.endswith("mlp.w_out"):
            a = rng.standard_normal(t.shape) / math.sqrt(2 * cfg.n_layer * f)
        else:  # lm_head.weight
            a = rng.standard_normal(t.shape) / (2.0 * math.sqrt(d))
        out[t.name] = a.astype(np.float32)
    return out


def target_multiplier(vocab_size: int) -> int:
    """The odd multiplier ``a`` of the task ``target = (a * token + 3) mod V``: the smallest prime >= 7
    that does not divide V, so the map is a permutation of the vocabulary."""
    a = 7
    while math.gcd(a, vocab_size) != 1 or any(a % p == 0 for p in range(2, int(math.isqrt(a)) + 1)):
        a += 1
    return a


def synthetic_batch(
    cfg: SimModelConfig, seed: int, step: int, rank: int, micro: int
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic micro-batch ``(tokens, targets)``, int64 arrays of shape (batch_size, seq_len).

    Tokens are uniform over the vocabulary from ``np.random.default_rng([seed, step, rank, micro])``,
    so every (step, rank, micro) gets its own stream. The task is learnable without attention:
    ``targets = (a * tokens + 3) mod V`` (a fixed permutation, :func:`target_multiplier`).
    """
    for name, v in (("seed", seed), ("step", step), ("rank", rank), ("micro", micro)):
        require_non_negative_int(name, v)
    rng = np.random.default_rng([seed, step, rank, micro])
    tokens = rng.integers(0, cfg.vocab_size, size=(cfg.batch_size, cfg.seq_len), dtype=np.int64)
    targets = (target_multiplier(cfg.vocab_size) * tokens + 3) % cfg.vocab_size
    return tokens, targets.astype(np.int64)


class BlockModel:
    """Per-block forward and backward with exact gradients, on any :class:`ArrayNamespace`.

    ``forward(block, params, x, targets=None) -> (y, cache)`` and ``backward(block, params, cache, dy)
    -> (dx, grads)``. ``params`` holds the block's tensors (by full name) in the working dtype; they
    are passed again to ``backward`` because FULL_SHARD frees them in between, so ``cache`` keeps
    only activations. ``x`` is the token array (B, T) for "embedding" and the hidden state (B*T, d)
    otherwise. For "lm_head", ``targets`` is required, ``y`` is the 0-d mean cross-entropy and ``dy``
    the scalar gradient of the objective w.r.t. that loss (1.0, or a scale such as 1/M for gradient
    accumulation over M micro-batches). For "embedding", ``dx`` is None.

    Stacked micro-batches: tokens of shape (S, B, T) run S micro-batches at once (hidden states
    (S, B*T, d), the lm_head's ``y`` the (S,) per-micro-batch losses, every gradient with a leading
    S axis). Every matrix product is then a stack of the same per-micro-batch products (numpy's
    stacked ``matmul`` runs one BLAS call per micro-batch, with the shapes and strides of the
    single micro-batch), the elementwise and per-token ops are unchanged, and the sums over tokens
    stay inside each micro-batch, so on numpy each micro-batch's loss and gradients are bitwise
    those of running it alone (tests/test_model_stacked.py holds that).
    """

    def __init__(self, cfg: SimModelConfig, xp: ArrayNamespace | str | None = None):
        if not isinstance(cfg, SimModelConfig):
            raise ConfigError("cfg", cfg, "expected a SimModelConfig")
        self.cfg = cfg
        self.xp = get_namespace(xp)
        self.layout = sim_layout(cfg)
        self.block_names: tuple[str, ...] = tuple(b.name for b in self.layout.blocks)
        self._tensors = {
            b.name: tuple(self.layout.tensors[i].name for i in b.tensor_indices) for b in self.layout.blocks
        }
        self._dtype_names: dict[Any, tuple[str, str]] = {}

    def tensor_names(self, block: str) -> tuple[str, ...]:
        """The full names of ``block``'s tensors, in layout order."""
        try:
            return self._tensors[block]
        except KeyError:
            raise ConfigError(
                "block", block, f"unknown block; known: {', '.join(self.block_names)}"
            ) from None

    # ---- helpers ---------------------------------------------------------------------------------
    def _compute(self, p: Any) -> tuple[Any, str]:
        """``p`` upcast to the compute dtype, and the name of its own dtype."""
        names = self._dtype_names.get(p.dtype)
        if names is None:  # once per dtype: (its name, the compute dtype's)
            name = self.xp.dtype_name(p)
            names = self._dtype_names[p.dtype] = (name, "float64" if name == "float64" else "float32")
        return self.xp.astype(p, names[1]), names[0]

    def _param(self, params: dict[str, Any], name: str) -> Any:
        try:
            return params[name]
        except KeyError:
            raise ConfigError("params", name, "missing from the block's parameters") from None

    def _sigmoid(self, u: Any) -> Any:
        xp = self.xp
        e = xp.exp(-xp.abs(u))
        d = 1.0 + e
        return xp.where(u >= 0, 1.0 / d, e / d)

    def _rms(self, x: Any) -> Any:
        """1 / sqrt(mean(x**2) + eps), shape (N, 1)."""
        xp = self.xp
        return 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + RMS_EPS)

    def _rmsnorm_backward(self, dxhat: Any, xhat: Any, r: Any) -> Any:
        xp = self.xp
        return r * (dxhat - xhat * xp.mean(dxhat * xhat, axis=-1, keepdims=True))

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self, block: str, params: dict[str, Any], x: Any, targets: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        xp = self.xp
        names = self.tensor_names(block)
        if block == "embedding":
            tokens = xp.ensure(x)
            if tokens.ndim not in (2, 3):
                raise ConfigError("tokens", tuple(tokens.shape), "expected a (batch, seq) integer array "
                                  "(or a (micro-batches, batch, seq) stack)")
            idx = xp.reshape(xp.astype(tokens, "int64"), (-1,))
            w = self._param(params, names[0])
            self._check_tokens(idx, "tokens")
            y, _ = self._compute(xp.take(w, idx, axis=0))  # gather first, then upcast the rows only
            if tokens.ndim == 3:  # a stack: (S, B*T, d)
                y = xp.reshape(y, (tokens.shape[0], -1, y.shape[-1]))
            return y, {"idx": idx, "dtype": xp.dtype_name(w)}
        if block == "lm_head":
            if targets is None:
                raise ConfigError("targets", None, "lm_head forward needs the targets")
            w, _ = self._compute(self._param(params, names[0]))
            h = x
            tgt = xp.reshape(xp.astype(xp.ensure(targets), "int64"), (-1,))
            n_tok = h.shape[0] if h.ndim == 2 else h.shape[0] * h.shape[1]
            if tgt.shape[0] != n_tok:
                raise ConfigError(
                    "targets", tuple(targets.shape), f"expected {n_tok} targets, one per token"
                )
            self._check_tokens(tgt, "targets")
            logits = xp.matmul(h, xp.matrix_transpose(w))
            z = logits - xp.max(logits, axis=-1, keepdims=True)
            ez = xp.exp(z)
            sez = xp.sum(ez, axis=-1, keepdims=True)
            logp_t = xp.take(xp.reshape(z, (-1,)), self._flat_target_index(tgt), axis=0) - xp.reshape(
                xp.log(sez), (-1,)
            )
            if h.ndim == 3:  # a stack: one mean per micro-batch, over its own tokens
                loss = -xp.mean(xp.reshape(logp_t, h.shape[:2]), axis=-1)
            else:
                loss = -xp.mean(logp_t)
            return loss, {"h": h, "probs": ez / sez, "targets": tgt}
        if block == "final_norm":
            g, _ = self._compute(self._param(params, names[0]))
            r = self._rms(x)
            return x * r * g, {"x": x, "r": r}
        # residual MLP block
        g, _ = self._compute(self._param(params, names[0]))
        w_in, _ = self._compute(self._param(params, names[1]))
        w_out, _ = self._compute(self._param(params, names[2]))
        r = self._rms(x)
        n = x * r * g
        u = xp.matmul(n, xp.matrix_transpose(w_in))
        a = u * self._sigmoid(u)
        y = x + xp.matmul(a, xp.matrix_transpose(w_out))
        return y, {"x": x, "r": r, "u": u}

    # ---- backward ------------------------------------------------------------------------------
    def backward(
        self, block: str, params: dict[str, Any], cache: dict[str, Any], dy: Any
    ) -> tuple[Any, dict[str, Any]]:
        xp = self.xp
        names = self.tensor_names(block)
        if block == "embedding":
            idx = cache["idx"]
            vocab = self.cfg.vocab_size
            if dy.ndim == 3:  # a stack: micro-batch s adds into its own rows s * V .. (s + 1) * V
                n_stack, n_tok, d = dy.shape
                base = xp.arange(n_stack, dtype=xp.dtype("int64"), device=xp.device) * vocab
                rows = xp.reshape(xp.reshape(idx, (n_stack, n_tok)) + xp.reshape(base, (-1, 1)), (-1,))
                dw = xp.index_add_rows(n_stack * vocab, rows, xp.reshape(dy, (-1, d)))
                dw = xp.reshape(dw, (n_stack, vocab, d))
            else:
                dw = xp.index_add_rows(vocab, idx, dy)
            return None, {names[0]: xp.astype(dw, cache["dtype"])}
        if block == "lm_head":
            w, wdt = self._compute(self._param(params, names[0]))
            h, probs, tgt = cache["h"], cache["probs"], cache["targets"]
            n_tok, vocab = probs.shape[-2:]
            scale = xp.to_float(dy) / n_tok
            onehot = xp.astype(
                xp.reshape(xp.reshape(tgt, (-1, 1)) == xp.arange(vocab, device=xp.device), probs.shape),
                xp.dtype_name(probs),
            )
            dlogits = (probs - onehot) * scale
            dw = xp.matmul(xp.matrix_transpose(dlogits), h)
            dh = xp.matmul(dlogits, w)
            return dh, {names[0]: xp.astype(dw, wdt)}
        if block == "final_norm":
            g, gdt = self._compute(self._param(params, names[0]))
            x, r = cache["x"], cache["r"]
            xhat = x * r
            dg = xp.sum(dy * xhat, axis=-2)
            dx = self._rmsnorm_backward(dy * g, xhat, r)
            return dx, {names[0]: xp.astype(dg, gdt)}
        g, gdt = self._compute(self._param(params, names[0]))
        w_in, wdt_in = self._compute(self._param(params, names[1]))
        w_out, wdt_out = self._compute(self._param(params, names[2]))
        x, r, u = cache["x"], cache["r"], cache["u"]
        xhat = x * r
        n = xhat * g
        s = self._sigmoid(u)
        a = u * s
        dw_out = xp.matmul(xp.matrix_transpose(dy), a)
        da = xp.matmul(dy, w_out)
        du = da * (s * (1.0 + u * (1.0 - s)))
        dw_in = xp.matmul(xp.matrix_transpose(du), n)
        dn = xp.matmul(du, w_in)
        dg = xp.sum(dn * xhat, axis=-2)
        dx = dy + self._rmsnorm_backward(dn * g, xhat, r)
        return dx, {
            names[0]: xp.astype(dg, gdt),
            names[1]: xp.astype(dw_in, wdt_in),
            names[2]: xp.astype(dw_out, wdt_out),
        }

    # ---- whole model -----------------------------------------------------------------------------
    def loss_and_grads(self, params_all: dict[str, Any], tokens: Any, targets: Any,
                       loss_scale: float = 1.0) -> tuple[float, dict[str, Any]]:
        """Chain every block: returns the mean loss (Python float) and the gradients of
        ``loss_scale * loss`` for every tensor (dtype of the parameters)."""
        loss, grads = self._chain(params_all, tokens, targets, loss_scale)
        return self.xp.to_float(loss), grads

    def stacked_loss_and_grads(self, params_all: dict[str, Any], tokens: Any, targets: Any,
                               loss_scale: float = 1.0) -> tuple[list[float], dict[str, Any]]:
        """:meth:`loss_and_grads` of S micro-batches at once (``tokens`` and ``targets`` of shape
        (S, B, T)): the S mean losses and every tensor's gradients stacked along a leading axis,
        (S, *shape). On numpy each micro-batch's values are bitwise those of running it alone (see
        the class docstring)."""
        if len(tokens.shape) != 3:
            raise ConfigError("tokens", tuple(tokens.shape), "expected a (micro-batches, batch, seq) stack")
        losses, grads = self._chain(params_all, tokens, targets, loss_scale)
        return [float(v) for v in self.xp.to_numpy(losses)], grads

    def _chain(self, params_all: dict[str, Any], tokens: Any, targets: Any,
               loss_scale: float) -> tuple[Any, dict[str, Any]]:
        caches = []
        x: Any = tokens
        for block in self.block_names:
            p = {n: self._param(params_all, n) for n in self.tensor_names(block)}
            x, cache = self.forward(block, p, x, targets if block == "lm_head" else None)
            caches.append(cache)
        loss = x
        grads: dict[str, Any] = {}
        dy: Any = float(loss_scale)
        for block, cache in zip(reversed(self.block_names), reversed(caches), strict=True):
            p = {n: params_all[n] for n in self.tensor_names(block)}
            dy, g = self.backward(block, p, cache, dy)
            grads.update(g)
        return loss, {t.name: grads[t.name] for t in self.layout.tensors}

    def loss(self, params_all: dict[str, Any], tokens: Any, targets: Any) -> float:
        """Forward only: the mean cross-entropy over the batch's tokens."""
        x: Any = tokens
        for block in self.block_names:
            p = {n: self._param(params_all, n) for n in self.tensor_names(block)}
            x, _ = self.forward(block, p, x, targets if block == "lm_head" else None)
        return self.xp.to_float(x)

    # ---- validation --------------------------------------------------------------------------------
    def _check_tokens(self, idx: Any, field: str) -> None:
        xp = self.xp
        if idx.shape[0] == 0:
            return
        lo, hi = int(xp.min(idx)), int(xp.max(idx))
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise ConfigError(field, bad, f"token id out of range [0, {self.cfg.vocab_size})")

    def _flat_target_index(self, tgt: Any) -> Any:
        xp = self.xp
        n = tgt.shape[0]
        return xp.arange(n, dtype=xp.dtype("int64"), device=xp.device) * self.cfg.vocab_size + tgt
