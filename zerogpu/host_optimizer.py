"""The offload host tier's optimizer step: fp32 master and optimizer state in host memory, one flat shard.

ZeRO-Offload keeps a rank's float32 master shard and its optimizer state on the host and runs the
update there: the reduced gradient shard is copied down into a host buffer, the host steps the
master in place, and the updated parameters are copied up. :class:`HostOptimizer` is that host side:
it owns the master, a gradient buffer and the state (pinned when asked, so copies from and to a GPU
can be asynchronous), and steps them with one of :data:`HOST_KERNELS`:

- ``"fused"`` (default): torch's fused CPU kernel (``torch.optim``'s ``adamw`` / ``adam`` / ``sgd``
  with ``fused=True``): one vectorised pass over the flat shard that reads each element's parameter,
  gradient and state once and writes them once, parallel over torch's intra-op threads. This is the
  kernel DeepSpeed's CPUAdam is: ``zerosim bench host-adam`` measures it against torch.optim.AdamW's
  for-loop and foreach kernels and zerosim's exact reference.
- ``"reference"``: zerosim's exact optimizer (:mod:`zerosim.numerics.optim`), which emulates each float32
  operation of torch's single-tensor kernel, fused multiply-adds included.

Rounding. Both kernels compute the same formula in the same order of operations: AdamW
``p *= 1 - lr wd``; ``m = lerp(m, g, 1 - b1)``; ``v = v b2 + ((1 - b2) g) g``;
``p += (-step_size m) / (sqrt(v) / sqrt(bc2) + eps)``, the coefficients rounded to float32 as torch
rounds them (Adam: ``g += wd p``; SGD as in :class:`zerosim.numerics.optim.SGD`). They differ only in
whether a multiply-add is rounded once or twice: the reference rounds ``a * b + c`` once (torch's
``lerp`` / ``addcmul`` / ``add(alpha=)`` on a CPU with FMA), and the fused kernel's vector loop also
rounds it once where torch's CPU build runs with FMA (``ATEN_CPU_CAPABILITY`` ``avx2`` or
``avx512``), so the two are bitwise equal there (tests/test_zerogpu_host_optimizer.py checks this for
SGD, Adam and AdamW over three steps) on every element the kernel's vector loop handles: all but the
last ``n mod W`` of each call (W = 16 floats on AVX-512, 8 on AVX2; a shard, or a piece stepped by
:meth:`HostOptimizer.step_piece`, whose length is a multiple of 16 has no such tail). The scalar tail
computes the state update in double with unrounded coefficients and rounds once at the end (for
AdamW's ``exp_avg_sq`` that formula matched all of 7 tail elements, the reference's 6): from the
second step on (once ``exp_avg_sq`` is not zero) some tail elements differ from the reference, each
within the bound below (tested on pieces of odd lengths). On the scalar build
(``ATEN_CPU_CAPABILITY=default``) the product is rounded before the addition: each multiply-add then
has two roundings, each faithful
(``|error| <= u |result|``, u = 2^-24), which is inside the per-operation model C-ZERO-002's bound is
derived from (:mod:`zerosim.checks.rounding`: every float32 operation faithful, the multiply-adds
counted as a product and a sum); the test runs that build in a subprocess and compares it with
the bound, element by element.
"""

from __future__ import annotations

from typing import Any

import torch

from zerosim.errors import ConfigError, require_non_negative_int
from zerosim.numerics.optim import OptimizerSpec
from zerosim.numerics.xp import torch_namespace

from .optimizer_kernels import make_step_optimizer
from .torch_kernels import FMA_CAPABILITIES, fused_kernel_is_exact

#: host kernels: torch's fused CPU kernel (one vectorised pass) and zerosim's exact reference
HOST_KERNELS = ("fused", "reference")
__all__ = ["FMA_CAPABILITIES", "HOST_KERNELS", "HostOptimizer", "fused_kernel_is_exact"]


def _host_tensor(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=pin)


class HostOptimizer:
    """A rank's master shard, gradient buffer and optimizer state on the host, stepped in place.

    ``spec``: the optimizer (:class:`zerosim.numerics.optim.OptimizerSpec`); ``n``: the shard's elements;
    ``kernel``: one of :data:`HOST_KERNELS`; ``pin_memory``: pin every host buffer (needs CUDA), so
    :meth:`receive_grad` from a GPU and a copy of :attr:`master` to a GPU can be ``non_blocking``.
    """

    def __init__(self, spec: OptimizerSpec, n: int, *, kernel: str = "fused", pin_memory: bool = False,
                 dtype: str = "float32"):
        if not isinstance(spec, OptimizerSpec):
            raise ConfigError("host_optimizer.spec", type(spec).__name__,
                              "must be a zerosim.numerics.optim.OptimizerSpec")
        require_non_negative_int("host_optimizer.n", n)
        if kernel not in HOST_KERNELS:
            raise ConfigError("host_optimizer.kernel", kernel, f"must be one of {', '.join(HOST_KERNELS)}")
        if dtype not in ("float32", "float64"):
            raise ConfigError("host_optimizer.dtype", dtype, "the master is float32 (or float64)")
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("host_optimizer.pin_memory", True, "pinned host memory needs CUDA")
        self.spec = spec
        self.kernel = kernel
        self.pinned = pin_memory
        tdtype = torch.float32 if dtype == "float32" else torch.float64
        self._optimizer = make_step_optimizer(spec, torch_namespace("cpu"), kernel)
        self.master = _host_tensor(n, tdtype, pin_memory)
        self.grad = _host_tensor(n, tdtype, pin_memory)
        self._pieces: list[tuple[int, int]] = []  # stepped by step_piece in the step under way
        self.state: dict[str, Any] = {"step": 0}
        for name in spec.state_names:
            self.state[name] = _host_tensor(n, tdtype, pin_memory)
        if kernel == "fused" and n > 0:
            self._require_fused(tdtype)

    @classmethod
    def over(cls, spec: OptimizerSpec, master: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], *,
             kernel: str = "fused") -> HostOptimizer:
        """A host optimizer over buffers the caller already holds (no copy): ``master`` and ``grad``
        flat CPU tensors of one dtype, ``state`` a dict as :meth:`zerosim.numerics.optim` ``init_state``
        makes."""
        for field, t in (("master", master), ("grad", grad)):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != 1:
                raise ConfigError(f"host_optimizer.{field}", type(t).__name__,
                                  "must be a flat CPU torch.Tensor")
        dtype = "float64" if master.dtype == torch.float64 else "float32"
        host = cls(spec, 0, kernel=kernel, dtype=dtype)
        host.master, host.grad, host.state = master, grad, state
        host.pinned = bool(master.is_pinned())
        if kernel == "fused":
            host._require_fused(master.dtype)
        host._check_flat("grad", grad)
        return host

    def _require_fused(self, dtype: torch.dtype) -> None:
        """Refuse, before training, a torch without a fused CPU kernel for this optimizer."""
        probe = make_step_optimizer(self.spec, torch_namespace("cpu"), "fused")
        state = probe.init_state(4, "float32" if dtype == torch.float32 else "float64")
        try:
            probe.step(torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype), state)
        except (RuntimeError, NotImplementedError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError("host_optimizer.kernel", "fused",
                              f"this torch has no fused CPU {self.spec.name} kernel ({first}); "
                              "use kernel='reference'") from None

    @property
    def numel(self) -> int:
        return int(self.master.numel())

    def host_tensors(self) -> list[torch.Tensor]:
        """Every buffer the host tier holds for this shard: master, gradient buffer, state."""
        return [self.master, self.grad, *(self.state[k] for k in self.spec.state_names)]

    def nbytes(self) -> int:
        """Bytes of :meth:`host_tensors` (what the offload manager's host budget counts)."""
        return sum(t.numel() * t.element_size() for t in self.host_tensors())

    def load_master(self, values: torch.Tensor) -> None:
        """The master becomes ``values`` (same numel and dtype: no cast, the bits are kept)."""
        self._check_flat("values", values)
        self.master.copy_(values.detach().reshape(-1))

    def receive_grad(self, grad: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy a reduced gradient shard (on any device) into the host gradient buffer.

        ``non_blocking`` from a GPU into pinned memory returns before the copy ends: the caller must
        order :meth:`step` after it (an event on the copy's stream, synchronised).
        """
        self._check_flat("grad", grad)
        self.grad.copy_(grad.detach().reshape(-1), non_blocking=non_blocking and self.pinned)

    def step(self) -> None:
        """One optimizer step of :attr:`master` and :attr:`state` with :attr:`grad`, in place."""
        self._optimizer.step(self.master, self.grad, self.state)

    def step_piece(self, lo: int, hi: int) -> None:
        """Step elements ``[lo, hi)`` (one unit's piece of the shard, once its gradient has landed)
        with the step count this step will have; :meth:`finish_step` ends the step after every piece.

        The kernels are elementwise, so pieces stepped in any order give the whole shard's bits: for
        the reference by construction, at any offsets; for the fused kernel where every piece's length
        is a multiple of 16 (its vector loop then covers every element; an odd length ends in the
        scalar tail, within the rounding bound but not bitwise: see the module docstring)."""
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= self.numel):
            raise ConfigError("host_optimizer.piece", (lo, hi), f"must satisfy 0 <= lo <= hi <= {self.numel}")
        piece = {"step": int(self.state["step"]), **{k: self.state[k][lo:hi] for k in self.spec.state_names}}
        if hi > lo:
            self._optimizer.step(self.master[lo:hi], self.grad[lo:hi], piece)
        self._pieces.append((lo, hi))

    def finish_step(self) -> None:
        """End a step taken piece by piece: the pieces must cover the shard exactly once."""
        covered = 0
        for lo, hi in sorted(self._pieces):
            if lo != covered:
                gap = "overlap" if lo < covered else "gap"
                raise ConfigError("host_optimizer.pieces", sorted(self._pieces),
                                  f"must tile [0, {self.numel}) once ({gap} at {min(lo, covered)})")
            covered = hi
        if covered != self.numel:
            raise ConfigError("host_optimizer.pieces", sorted(self._pieces),
                              f"must tile [0, {self.numel}) once (covered up to {covered})")
        self._pieces = []
        self.state["step"] = int(self.state["step"]) + 1

    def _check_flat(self, field: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"host_optimizer.{field}", type(t).__name__, "must be a torch.Tensor")
        if t.numel() != self.numel:
            raise ConfigError(f"host_optimizer.{field}.numel", t.numel(),
                              f"the shard holds {self.numel} elements")
        if t.dtype != self.master.dtype:
            raise ConfigError(f"host_optimizer.{field}.dtype", str(t.dtype),
                              f"the shard holds {self.master.dtype} (no cast: the bits must be kept)")
