"""One rank's state under ZeRO: :class:`RankState`, the one value every step function reads and writes.

What a rank holds between steps (C-ZERO-001/004): its communicator and groups (shard, replicate,
control, observe), the run it serves, the float32 master (its packed shard, or the whole model
unsharded), the working parameters (the ZeRO-3 shard, or the full replicated copy), the gradient
accumulator (the shard, or the full flat gradient), the optimizer state, the memory tracker, the
rank's observation, the unit table (:mod:`zerosim.engine.unit_table`), the fault it applies (None:
none) and the step under way. Building it is collective only for ``load="broadcast"``.

Nothing here runs a step: what a step does is the plain functions of :mod:`zerosim.engine.gradients`
(gradients in, reductions, the end of a micro-batch) and :mod:`zerosim.engine.step` (norm, clip,
optimizer step, refresh, the step's observation), called by the schedule that runs the micro-batches
(:mod:`zerosim.engine.block_schedule`, :mod:`zerogpu.module_engine`). The state's methods build it
and answer questions about it: its pieces of the flat layout, its chunk of a unit, where its fault acts.

Dtypes: master, gradient shard and optimizer state are float32 (``precision.master_dtype``); a float64
torch model trained by :class:`zerogpu.trainer.ZeroTrainer` keeps them in float64 (precision "fp64").
"""

from __future__ import annotations

import bisect
from typing import Any

from ..comm.base import Communicator
from ..errors import ConfigError
from ..numerics.flat import flatten
from ..numerics.model import init_params
from ..numerics.optim import make_optimizer
from ..numerics.xp import ArrayNamespace
from ..values.flat_buffers import FlatUnit
from ..values.observe import RankObservation
from . import wire
from .engine_run import EngineRun
from .faults import EngineFault, Hook
from .grad_order import GradOrder
from .memory_tracker import MemoryTracker
from .rank_groups import make_groups
from .unit_table import UnitTable


class RankState:
    """One rank's sharded state (C-ZERO-001/004: what it owns and holds). ``optimizer`` (default: the
    reference optimizer of the run's spec) steps the master shard; ``initial`` (default: the run's
    seeded model) gives the full initial parameters as a flat host array in layout order (sliceable,
    read-only); ``receives_into_params``: the ZeRO-1/2 refresh receives the all-gathered chunks
    straight into the parameters they cover where the communicator can (``all_gather_into``; the
    arithmetic is the same as gathering and unpacking)."""

    def __init__(self, comm: Communicator, run: EngineRun, xp: ArrayNamespace,
                 fault: EngineFault | None = None, *, optimizer: Any = None, initial: Any = None,
                 receives_into_params: bool = False):
        if comm.world_size != run.world_size:
            raise ConfigError(
                "world_size",
                run.world_size,
                f"the communicator has {comm.world_size} ranks; the run expects {run.world_size}",
            )
        self.comm = comm
        self.run = run
        self._initial = initial
        self.fault = fault  # the deliberate corruption the step functions apply (None: none)
        self.receives_into_params = receives_into_params
        self.step_index = 0  # the optimizer step under way (what a fault's ``step`` is compared with)
        self.micro_grads: dict[str, Any] = {}  # ZeRO-2: this micro-batch's gradients, until reduced
        self.stepped_grad: Any = None  # the gradient the last optimizer step used, until observed
        self.stale: dict[str, dict[str, Any]] = {}  # a stale-gather fault: the first gathered views
        self.hidden: Any = None  # a hidden-copy fault: the full copy beside the shard
        self.xp = xp
        self.rank = comm.rank
        self.strategy = run.strategy
        self.k = run.k
        self.replicas = run.replicas
        self.group_index, self.local = divmod(self.rank, self.k)
        self.units = run.unit_plan
        self.unit_by_block = {u.name: u for u in self.units.units}
        self.sharded_params = self.strategy.shards_params
        self.sharded_grads = self.strategy.shards_grads
        self.sharded_optim = self.strategy.shards_optimizer
        self.hybrid = self.strategy.is_hybrid
        self.zero1_reduce_scatter = run.zero1_reduce_scatter
        self.precision = run.precision
        self.mixed = self.precision.is_mixed
        self.state_dtype = self.precision.master_dtype  # master, gradient shard, optimizer state
        # what steps the master shard (C-ZERO-002's "full optimizer step" on owned elements)
        self.opt = make_optimizer(run.spec, xp) if optimizer is None else optimizer
        self.tracker = MemoryTracker(self.rank)
        self.offload = bool(run.cfg.offload)
        self.moved = {"host_to_device": 0, "device_to_host": 0}  # offload: bytes this step moved
        self.layout = run.layout
        self.total = self.layout.total_numel
        self.obs = RankObservation(
            self.rank, comm.world_size, self.group_index, self.local, {}, getattr(comm, "backend", "?")
        )
        # ZeRO-3: every unit starts as its shard; otherwise every rank holds the full parameters
        self.unit_table = UnitTable((u.name for u in self.units.units), self.sharded_params)
        groups = make_groups(comm, self.k, self.replicas, self.sharded_optim, self.sharded_params)
        self.shard_comm, self.replicate_comm = groups.shard, groups.replicate
        self.control, self.shard_control = groups.control, groups.shard_control
        self.observe_comm = groups.observe
        self.obs.groups.update(groups.members(comm))
        self._init_state()

    # =============================================================================================
    # state
    # =============================================================================================
    def initial_flat(self) -> Any:
        """The full initial parameters as one flat host numpy array in layout order (read-only)."""
        if self._initial is not None:
            return self._initial
        cfg, seed = self.run.model_cfg, self.run.seed

        def make() -> Any:
            flat = flatten(init_params(cfg, seed), self.layout)  # host numpy, transient
            if self.xp.backend == "numpy":  # shared between simulated ranks: nobody may write into it (torch
                flat.flags.writeable = False  # would warn on wrapping a read-only array; it only copies out)
            return flat

        share = getattr(self.comm, "shared", None)  # the simulator builds it once for all its ranks
        return share(("init_params", cfg, seed), make) if callable(share) else make()

    def _init_state(self) -> None:
        """Every rank builds the same initial parameters and keeps only what it owns (``load="broadcast"``:
        only rank 0 builds them; the others receive them one tensor at a time)."""
        xp = self.xp
        self.owned_pieces = (
            tuple(self.units.owned_global(self.local)) if self.sharded_optim else ((0, self.total, 0),)
        )
        if self.run.cfg.load == "broadcast":
            self.master, params_full = self.receive_initial_weights(self.initial_flat)
        else:
            self.master, params_full = self._state_from_full(self.initial_flat())
        if self.sharded_params:
            if self.mixed:
                self.param_shard = self.precision.to_params(self.master, xp)
            else:  # fp32: the shard is the master, unless the master lives on the host (offload)
                self.param_shard = xp.copy(self.master) if self.offload else self.master
            self.params_full: Any = None  # ZeRO-3 holds no full copy between uses
        else:
            self.param_shard = None
            # NO_SHARD fp32: the params are the master copy
            self.params_full = params_full if params_full is not None else self.master
        n_grad = self.units.shard_numel if self.sharded_grads else self.total
        self.grad_acc = xp.zeros(n_grad, self.state_dtype)
        # where each tensor's gradient lives in grad_acc: all-reduce ZeRO-1 keeps each rank's owned
        # gradient contiguous (shard order; its plan is one unit, whose shards pad only at the end),
        # everything else tensor after tensor
        self.grad_order = GradOrder.layout_order(self.layout)
        if self.all_reduce_zero1:
            shard_order = GradOrder.shard_order(self.layout, self.units, self.local)
            assert shard_order is not None, "a ZeRO-1 plan of one unit pads each shard only at its end"
            self.grad_order = shard_order
        self.opt_state = self.opt.init_state(self.master.shape[0], self.state_dtype)
        self._track_state()

    @property
    def all_reduce_zero1(self) -> bool:
        """ZeRO-1 reducing its full gradient with one all-reduce (not ``zero1_reduce_scatter``)."""
        return self.sharded_optim and not self.sharded_grads and not self.zero1_reduce_scatter

    @property
    def separate_full_params(self) -> bool:
        """Whether the rank keeps full working parameters apart from its master (ZeRO-1/2, mixed NO_SHARD)."""
        return not self.sharded_params and (self.sharded_optim or self.mixed)

    def _state_from_full(self, full: Any) -> tuple[Any, Any]:
        """The master (this rank's packed pieces) and the separate full working parameters (or None)
        from the full flat host array."""
        xp, sdt = self.xp, self.state_dtype
        if self.sharded_optim:
            master = xp.zeros(self.units.shard_numel, sdt)
            host = xp.to_numpy(master) if xp.backend == "numpy" else None
            if host is not None:
                for g0, g1, pos in self.owned_pieces:
                    host[pos:pos + g1 - g0] = full[g0:g1]
            else:
                for g0, g1, pos in self.owned_pieces:
                    xp.assign(master[pos:pos + g1 - g0], xp.from_numpy(full[g0:g1]))
        else:
            master = xp.astype(xp.from_numpy(full, copy=True), sdt)
        params = None
        if self.separate_full_params:
            params = xp.astype(xp.from_numpy(full, copy=True), self.precision.param_dtype)
        return master, params

    def receive_initial_weights(self, make: Any) -> tuple[Any, Any]:
        """The rank-0 load path (``load="broadcast"``): only world rank 0 builds the weights (``make()``);
        they are broadcast one tensor at a time over :meth:`load_comm` and each rank keeps, as each
        tensor arrives, only its own pieces (:meth:`keep_broadcast_tensor`). Returns the master and the
        separate full working parameters (or None), bitwise what :meth:`_state_from_full` gives.
        C-ZERO-002/003 hold every rank to the same weights; C-ZERO-006 to its shard."""
        xp, sdt = self.xp, self.state_dtype
        comm = self.load_comm()
        source = make() if self.rank == 0 else None
        master = xp.zeros(self.units.shard_numel if self.sharded_optim else self.total, sdt)
        params = xp.zeros(self.total, self.precision.param_dtype) if self.separate_full_params else None
        for t, g0 in zip(self.layout.tensors, self.layout.offsets, strict=True):
            if not t.numel:
                continue
            if source is not None:
                buf = xp.astype(xp.from_numpy(source[g0:g0 + t.numel], copy=True), sdt)
            else:
                buf = xp.zeros(t.numel, sdt)
            self.keep_broadcast_tensor(g0, comm.broadcast(buf, root=0), master, params)
            del buf
        del source
        return master, params

    def keep_broadcast_tensor(self, g0: int, flat: Any, master: Any, params: Any = None) -> None:
        """Keep this rank's share of a broadcast 1-D array whose elements are the global flat range
        ``[g0, g0 + len(flat))``: the owned pieces go into ``master`` (the packed shard, or the full
        master when unsharded), and the whole range, cast, into the full working ``params`` if given."""
        xp = self.xp
        g1 = g0 + int(flat.shape[0])
        for a, b, pos in self.owned_in(g0, g1):
            xp.assign(master[pos:pos + b - a], flat[a - g0:b - g0])
        if params is not None:
            xp.assign(params[g0:g1], xp.astype(flat, self.precision.param_dtype))

    def owned_in(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(global start, global end, position in the shard)`` of the owned elements in ``[lo, hi)``."""
        cached = self.__dict__.get("_pieces_by_start")
        if cached is None or cached[0] is not self.owned_pieces:
            ordered = sorted(self.owned_pieces)
            cached = self.__dict__["_pieces_by_start"] = (self.owned_pieces, ordered, [p[0] for p in ordered])
        _, ordered, starts = cached
        out = []
        for g0, g1, pos in ordered[max(bisect.bisect_right(starts, lo) - 1, 0):]:
            if g0 >= hi:
                break
            a, b = max(g0, lo), min(g1, hi)
            if a < b:
                out.append((a, b, pos + a - g0))
        return out

    def _track_state(self) -> None:
        xp, tr = self.xp, self.tracker
        loc = self.optimizer_location
        if self.sharded_params:
            tr.alloc("params", "params", xp.nbytes(self.param_shard))
        else:
            tr.alloc("params", "params", xp.nbytes(self.params_full))
        master_is_params = self.master is self.param_shard or self.master is self.params_full
        if not master_is_params:
            tr.alloc("master", "optimizer", xp.nbytes(self.master), loc)
        for name in self.run.spec.state_names:
            tr.alloc(f"optim.{name}", "optimizer", xp.nbytes(self.opt_state[name]), loc)
        tr.alloc("grads", "grads", xp.nbytes(self.grad_acc), loc if self.sharded_grads else "device")
        if self.corruption(Hook.HOLDINGS) == "hidden-full-copy":  # a full float32 copy beside the shard
            self.hidden = xp.zeros(self.total, "float32")
            tr.alloc("hidden", "optimizer", xp.nbytes(self.hidden))

    @property
    def optimizer_location(self) -> str:
        """Where the float32 master, the optimizer state and the gradient shard live (CPU offload: host)."""
        return "host" if self.offload else "device"

    def corruption(self, hook: Hook) -> str | None:
        """How the rank's fault corrupts ``hook`` on this rank at this step; None: not at all."""
        fault = self.fault
        if fault is None or not fault.acts(hook, self.rank, self.comm.world_size, self.step_index):
            return None
        return fault.corruption

    def load_comm(self) -> Communicator:
        """The group the rank-0 load broadcasts over: the whole world (a fault uses the shard group, so
        every other replica group broadcasts from its own first rank, which loaded nothing)."""
        if self.corruption(Hook.LOAD_BROADCAST) == "shard-group" and self.shard_comm is not None:
            return self.shard_comm
        return self.comm

    def gathered_chunk_index(self, local_rank: int) -> int:
        """Where shard-group rank ``local_rank``'s shard sits in an all-gathered buffer: at its own rank
        (a full-state-dict assembly in reverse order reloads another rank's shard)."""
        return self.k - 1 - local_rank if self.corruption(Hook.STATE_ASSEMBLY) else local_rank

    def own_chunk(self, full: Any) -> Any:
        """This rank's packed chunk (owned elements in shard order, zero padding) of a full flat array."""
        cached = self.__dict__.get("_padding_cache")
        if cached is None or cached[0] is not self.owned_pieces:
            spans = wire.padding_spans(self.owned_pieces, self.units.shard_numel)
            cached = self.__dict__["_padding_cache"] = (self.owned_pieces, spans)
        return wire.own_chunk(self.xp, full, self.owned_pieces, cached[1], self.units.shard_numel,
                              self.state_dtype)

    def param_chunk(self, unit: FlatUnit) -> Any:
        """This rank's chunk of ``unit`` in its working-parameter shard (what an all-gather sends)."""
        off = self.units.shard_offsets[unit.index]
        return self.param_shard[off:off + unit.chunk]

    def assemble_full_state(self, gathered: Any) -> Any:
        """The full flat array from an all-gather of every rank's packed shard (padding dropped)."""
        return wire.assemble_full(self.xp, gathered, self.units, self.k, self.total, self.state_dtype,
                                  self.gathered_chunk_index)

