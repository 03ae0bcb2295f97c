"""The ZeRO engine of one rank: every strategy, written once against the Communicator and xp seams.

No numpy here: arrays are touched only through :class:`~zerosim.xp.ArrayNamespace` (numpy in the
simulator and under MPI, torch in zerogpu and in the torch-CPU test), and other ranks only through
the :class:`~zerosim.comm.base.Communicator`. The collective schedule per optimizer step (M
micro-batches, ``k`` = shard group size, ``r`` = replicas; :mod:`zerosim.cost.comm_model` predicts
exactly this):

* NO_SHARD: gradients accumulated locally; one ``all_reduce(avg)`` of the flat gradient over the
  world; every rank steps everything.
* SHARD_OPTIMIZER (ZeRO-1): the same all-reduce (``zero1_grad_reduce="all_reduce"``, torch's
  ZeroRedundancyOptimizer) or, with ``"reduce_scatter"`` (DeepSpeed stage 1, the paper's P_os), one
  ``reduce_scatter(avg)`` of the packed full gradient into the rank's chunk after the last
  micro-batch; each rank steps its packed chunk; one ``all_gather`` of the updated chunks
  refreshes the replicated parameters.
* SHARD_GRAD_OP (ZeRO-2): after each micro-batch, ``reduce_scatter(avg)`` of the packed flat
  gradient, accumulated in the rank's float32 gradient shard; step; one ``all_gather``.
* FULL_SHARD (ZeRO-3): per micro-batch and block, ``all_gather`` before forward (freed after),
  ``all_gather`` again before backward (freed after), ``reduce_scatter(avg)`` of its gradient.
* HYBRID_SHARD / HYBRID_SHARD_ZERO2: ZeRO-3 / ZeRO-2 inside the shard group, then once per step an
  ``all_reduce(avg)`` of the gradient shard over the replicate group (ZERO2: then the all-gather).

Dtypes: master, gradient shard and optimizer state are float32 (``precision.master_dtype``); a float64
torch model trained by :class:`zerogpu.trainer.ZeroTrainer` keeps them in float64 (precision "fp64").

Averaging: each reduction averages over its group (``avg`` = rank-order sum / group size); after
the M micro-batches the accumulated gradient is divided by M. The global gradient norm is the
float64 sum of squares over the elements each rank *owns* (padding excluded), all-reduced once
over the shard group (replicas hold identical reduced gradients: summing over them would
over-count); NO_SHARD and all-reduce ZeRO-1 hold the full reduced gradient and need no collective
for it (reduce-scatter ZeRO-1 holds only its chunk and sums like ZeRO-2).

Non-finite gradients are detected before every reduction; the ranks agree through one small
``all_reduce(max)`` of a per-rank flag on the ``world.control`` group and all raise
:class:`~zerosim.errors.NonFiniteGradientError` naming the first offending rank and tensor, so a
NaN is never averaged into every rank's state.

The engine holds one rank's state and the step's order; *when* each unit is gathered and each
block's gradients are handed over is its :class:`~zerosim.engine.schedule.Schedule`'s: the block
model's (:mod:`zerosim.engine.block_schedule`, with run-ahead on the simulator) or the autograd hooks
over a torch module (:mod:`zerogpu.module_engine`). The collective steps themselves are the
functions of :mod:`zerosim.engine.wire`.

Deliberately broken variants are values, not subclasses: an
:class:`~zerosim.engine.faults.EngineFault` handed to the engine (``fault=``) names one hook point
(``grad_reduce_op``, ``global_sumsq``, ...), the rank and step, and the corruption; each hook
consults it and otherwise does what the reference engine does.

Why one module of this length: it is the one place that owns a rank's sharded state (master,
gradient shard, optimizer state, working parameters) and every path that writes it, read top to
bottom (set-up, gradients in, reduction, norm, clip, step, refresh, observation); the corruptions a
fault applies only make sense next to the code they replace.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from ..comm.base import Communicator
from ..errors import ConfigError, NonFiniteGradientError
from ..flat import flatten
from ..flat_buffers import FlatUnit
from ..intervals import merge_adjacent
from ..model import init_params
from ..observe import Holding, RankObservation, ShardValues, StepObservation, TrafficItem, digest
from ..optim import make_optimizer
from ..unit_state import UnitState
from ..xp import ArrayNamespace, divide_
from . import finite_vote, wire
from .engine_run import EngineRun
from .faults import EngineFault, Hook
from .memory_tracker import MemoryTracker
from .rank_groups import make_groups
from .schedule import Schedule

BEFORE_REDUCTION = "detected before the gradient reduction; no rank stepped with it"


class ZeroEngine:
    """One rank's engine, driven by ``schedule``. ``train()`` runs every step and returns the rank's
    observations. ``optimizer`` (default: the reference optimizer of the run's spec) steps the master
    shard; ``initial`` (default: the run's seeded model) gives the full initial parameters as a flat
    host array in layout order (sliceable, read-only)."""

    def __init__(self, comm: Communicator, run: EngineRun, xp: ArrayNamespace, schedule: Schedule,
                 fault: EngineFault | None = None, *, optimizer: Any = None, initial: Any = None):
        if comm.world_size != run.world_size:
            raise ConfigError(
                "world_size",
                run.world_size,
                f"the communicator has {comm.world_size} ranks; the run expects {run.world_size}",
            )
        self.comm = comm
        self.run = run
        self.schedule = schedule
        self._initial = initial
        self.fault = fault  # the deliberate corruption this engine applies at its hooks (None: none)
        self._step = 0  # the optimizer step under way (what a fault's ``step`` is compared with)
        self._micro_grads: dict[str, Any] = {}  # this micro-batch's gradients, until they are reduced
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
        self._moved = {"host_to_device": 0, "device_to_host": 0}
        self.layout = run.layout
        self.total = self.layout.total_numel
        self.obs = RankObservation(
            self.rank, comm.world_size, self.group_index, self.local, {}, getattr(comm, "backend", "?")
        )
        # ZeRO-3: every unit starts as its shard; otherwise every rank holds the full parameters
        initial = UnitState.SHARDED if self.sharded_params else UnitState.GATHERED
        self.unit_states: dict[str, UnitState] = {u.name: initial for u in self.units.units}
        groups = make_groups(comm, self.k, self.replicas, self.sharded_optim, self.sharded_params)
        self.shard_comm, self.replicate_comm = groups.shard, groups.replicate
        self.control, self.shard_control = groups.control, groups.shard_control
        self.observe_comm = groups.observe
        self.obs.groups.update(groups.members(comm))
        self._init_state()
        schedule.attach(self)

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
        self.opt_state = self.opt.init_state(self.master.shape[0], self.state_dtype)
        self._track_state()

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
            self._hidden = xp.zeros(self.total, "float32")
            tr.alloc("hidden", "optimizer", xp.nbytes(self._hidden))

    @property
    def optimizer_location(self) -> str:
        """Where the float32 master, the optimizer state and the gradient shard live (CPU offload: host)."""
        return "host" if self.offload else "device"

    # =============================================================================================
    # hooks (each consults the engine's fault, :mod:`zerosim.engine.faults`)
    # =============================================================================================
    def corruption(self, hook: Hook) -> str | None:
        """How the engine's fault corrupts ``hook`` on this rank at this step; None: not at all."""
        fault = self.fault
        if fault is None or not fault.acts(hook, self.rank, self.comm.world_size, self._step):
            return None
        return fault.corruption

    def grad_reduce_op(self) -> str:
        """The reduction of gradients across ranks: the mean (bug class 1: ``sum`` or a wrong divisor)."""
        return "sum" if self.corruption(Hook.GRAD_REDUCE_OP) else "avg"

    def pad_value(self) -> float:
        """What packed gradient padding is filled with: zero (bug class 8: padding leaking into values)."""
        return 1.0 if self.corruption(Hook.PADDING) else 0.0

    def global_sumsq(self, local: float) -> float:
        """Sum of squares over every gradient element: one scalar all-reduce over the shard group (bug
        class 3 keeps the rank-local sum; bug class 4 sums over the world, counting every replica)."""
        how = self.corruption(Hook.GLOBAL_NORM)
        if how == "rank-local":
            return local
        x = self.xp.asarray([local], dtype=self.xp.dtype("float64"), device=self.xp.device)
        group = self.control if how == "world" else self.shard_control
        return self.xp.to_float(group.all_reduce(x, "sum")[0])

    def replicate_reduce(self, acc: Any) -> Any:
        """Hybrid: average the accumulated gradient shard over the replicate group (bug class 5 skips it;
        bug class 1's hybrid form sums it, leaving the divisor the shard group size)."""
        how = self.corruption(Hook.REPLICATE_REDUCE)
        if how == "skip":
            return acc
        assert self.replicate_comm is not None
        return self.replicate_comm.all_reduce(acc, "sum" if how == "sum" else self.grad_reduce_op())

    def use_gathered(self, block: str, views: dict[str, Any], step: int) -> dict[str, Any]:
        """The parameters the block computes with: the freshly gathered ones (bug class 7 keeps those the
        rank gathered first)."""
        if self.corruption(Hook.GATHERED_PARAMS) != "stale":
            return views
        stale = self.__dict__.setdefault("_stale", {})
        if block not in stale:
            stale[block] = {k: self.xp.copy(v) for k, v in views.items()}
        return stale[block]

    def write_gathered_params(self, gathered: Any, unit: FlatUnit) -> None:
        """ZeRO-1/2: copy the all-gathered updated chunks into the replicated parameters (bug class 7:
        a stale rank ignores them, or every chunk but the last rank's is written back)."""
        how = self.corruption(Hook.GATHERED_PARAMS)
        if how == "stale":
            return
        if how == "drop-last-chunk":
            for segs in unit.segments[:-1]:
                for s in segs:
                    self.xp.assign(self.params_full[s.unit_start:s.unit_start + s.length],
                                   gathered[s.packed_start:s.packed_start + s.length])
            return
        wire.unpack_into(self.xp, self.params_full, gathered, unit)

    def extra_step_collectives(self, step: int) -> None:
        """Nothing: the schedule has no other collectives (a fault adds an all-gather of the shards)."""
        if self.corruption(Hook.STEP_COLLECTIVES) == "extra-all-gather":
            assert self.shard_comm is not None
            self.shard_comm.all_gather(self.master)

    def finish_accumulation(self, acc: Any) -> None:
        """Divide the accumulated gradient by the number of micro-batches (bug class 2 forgets)."""
        if self.run.micro_batches > 1 and not self.corruption(Hook.ACCUMULATION_AVERAGE):
            divide_(acc, self.run.micro_batches)

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

    # =============================================================================================
    # the rank's chunk
    # =============================================================================================
    def _pack_grads(self, unit: FlatUnit, grads: dict[str, Any]) -> Any:
        """The unit's gradients in packed order, master dtype, padded with :meth:`pad_value`."""
        return wire.pack_grads(self.xp, unit, grads, self.state_dtype, self.pad_value())

    def own_chunk(self, full: Any) -> Any:
        """This rank's packed chunk (owned elements in shard order, zero padding) of a full flat array."""
        cached = self.__dict__.get("_padding_cache")
        if cached is None or cached[0] is not self.owned_pieces:
            spans = wire.padding_spans(self.owned_pieces, self.units.shard_numel)
            cached = self.__dict__["_padding_cache"] = (self.owned_pieces, spans)
        return wire.own_chunk(self.xp, full, self.owned_pieces, cached[1], self.units.shard_numel,
                              self.state_dtype)

    # =============================================================================================
    # parameters of a unit
    # =============================================================================================
    def param_chunk(self, unit: FlatUnit) -> Any:
        """This rank's chunk of ``unit`` in its working-parameter shard (what an all-gather sends)."""
        off = self.units.shard_offsets[unit.index]
        return self.param_shard[off:off + unit.chunk]

    def gather_unit(self, unit: FlatUnit, comm: Communicator) -> tuple[Any, Any]:
        """All-gather the unit's parameter chunks over ``comm`` (as the schedule gathers them); returns
        (packed buffer, unit-space params)."""
        packed = self.schedule.gather_packed(unit, comm)
        return packed, wire.all_gather_unit(self.xp, comm, unit, packed, self.precision.param_dtype)

    # =============================================================================================
    # gradients
    # =============================================================================================
    def check_finite(self, step: int, named: dict[str, Any], flat: Any | None = None) -> None:
        """Before a reduction: all ranks agree whether any rank holds a non-finite gradient."""
        self.agree_finite(step, self.first_nonfinite(named, flat), BEFORE_REDUCTION)

    def first_nonfinite(self, named: dict[str, Any], flat: Any | None = None) -> int:
        """This rank's first non-finite gradient among ``named`` (layout index + 1; 0: none)."""
        return finite_vote.first_nonfinite(self.xp, self.layout, named, flat)

    def agree_finite(self, step: int, bad: int, when: str) -> None:
        """All ranks agree whether any rank found a non-finite gradient (``bad``: layout index + 1, or
        0) with one scalar all-reduce (:mod:`zerosim.engine.finite_vote`). Raises
        :class:`NonFiniteGradientError` naming the lowest offending (rank, tensor)."""
        self.raise_if_flagged(step, self.control.all_reduce(self.finite_flag(bad), "max"), when)

    def finite_flag(self, bad: int) -> Any:
        """This rank's vote for :meth:`agree_finite`."""
        return finite_vote.vote(self.xp, bad, self.rank, self.comm.world_size, len(self.layout.tensors))

    def raise_if_flagged(self, step: int, agreed: Any, when: str) -> None:
        """Raise :class:`NonFiniteGradientError` naming the (rank, tensor) the all-reduced vote encodes."""
        world, tensors = self.comm.world_size, len(self.layout.tensors)
        named = finite_vote.offender(self.xp.to_float(agreed[0]), world, tensors)
        if named is not None:
            raise NonFiniteGradientError(named[0], self.layout.tensors[named[1]].name, step, when)

    def on_block_grads(self, step: int, micro: int, block: str, grads: dict[str, Any],
                       defer: Any = None) -> None:
        """Where a block's fresh gradients go: reduce-scatter (ZeRO-3), the micro-batch buffer (ZeRO-2),
        or the local accumulator (NO_SHARD, ZeRO-1). ``defer(unit, grads, packed)``, when given, takes
        a ZeRO-3 unit's packed gradient instead of the finite vote and reduce-scatter here (a schedule
        that starts them and waits later)."""
        xp = self.xp
        grads = finite_vote.inject(xp, self.run.inject_nan, self.rank, step, micro, grads)
        if self.sharded_params:
            unit = self.unit_by_block[block]
            packed = self._pack_grads(unit, grads)
            self.tracker.alloc(f"gradbuf:{block}", "grad_buffers", xp.nbytes(packed))
            if defer is not None:
                defer(unit, grads, packed)
            else:
                self.check_finite(step, grads, packed)
                self._reduce_scatter_into_acc(unit, packed, micro)
            self.tracker.free(f"gradbuf:{block}")
        elif self.sharded_grads:
            self._micro_grads.update(grads)
            self.tracker.alloc("gradbuf:micro", "grad_buffers",
                               sum(xp.nbytes(g) for g in self._micro_grads.values()))
        else:
            for name, g in grads.items():
                g0, g1 = self.layout.tensor_range(name)
                view = self.grad_acc[g0:g1]
                flat = xp.reshape(g, (-1,))
                if micro == 0:
                    xp.assign(view, flat)
                else:
                    view += xp.astype(flat, self.state_dtype)

    def reduce_full_grad(self, step: int) -> Any | None:
        """NO_SHARD / ZeRO-1, after the last micro-batch: every rank agrees the accumulated full gradient
        is finite, then it is averaged over the world (all-reduce, in ``grad_acc``), or reduce-scattered
        into this rank's chunk (``zero1_reduce_scatter``: the chunk is returned; otherwise None)."""
        named = {
            t.name: self.grad_acc[g0 : g0 + t.numel]
            for t, g0 in zip(self.layout.tensors, self.layout.offsets, strict=True)
        }
        self.check_finite(step, named, self.grad_acc)
        if self.zero1_reduce_scatter:
            return self._reduce_scatter_full_grad()
        self.grad_acc = wire.all_reduce_grads(self.comm, self.grad_acc, self.grad_reduce_op())
        return None

    def _reduce_scatter_into_acc(self, unit: FlatUnit, packed: Any, micro: int) -> None:
        assert self.shard_comm is not None
        # the packed buffer is read by nothing after this: the communicator may use it as scratch
        self.accumulate_chunk(unit, wire.reduce_scatter_grads(self.shard_comm, packed, self.grad_reduce_op()),
                              micro)

    def accumulate_chunk(self, unit: FlatUnit, part: Any, micro: int) -> None:
        """Add the unit's reduced gradient chunk into this rank's gradient shard (micro-batch 0: write)."""
        if self.offload:  # the reduced shard goes to the host accumulator right away
            self._moved["device_to_host"] += self.xp.nbytes(part)
        wire.accumulate_chunk(self.xp, self.grad_acc, self.units.shard_offsets[unit.index], part, micro == 0)

    def _reduce_scatter_full_grad(self) -> Any:
        """ZeRO-1 with ``zero1_grad_reduce="reduce_scatter"`` (DeepSpeed stage 1, the paper's P_os): after
        the last micro-batch, ``reduce_scatter(avg)`` of the packed (padded) full gradient over the shard
        group into this rank's float32 chunk. The full accumulation buffer stays (ZeRO-1 shards only the
        optimizer state); the packed copy is transient, the chunk lives until the params are refreshed."""
        assert self.shard_comm is not None
        unit = self.units.units[0]
        named = {
            t.name: self.grad_acc[g0 : g0 + t.numel]
            for t, g0 in zip(self.layout.tensors, self.layout.offsets, strict=True)
        }
        packed = self._pack_grads(unit, named)
        self.tracker.alloc("gradbuf:packed", "grad_buffers", self.xp.nbytes(packed))
        part = wire.reduce_scatter_grads(self.shard_comm, packed, self.grad_reduce_op(), donate=False)
        del packed
        self.tracker.alloc("grad_chunk", "grad_buffers", self.xp.nbytes(part))
        self.tracker.free("gradbuf:packed")
        return part

    def on_micro_batch_end(self, step: int, micro: int) -> None:
        if self.sharded_grads and not self.sharded_params:
            unit = self.units.units[0]
            packed = self._pack_grads(unit, self._micro_grads)
            self.tracker.alloc("gradbuf:packed", "grad_buffers", self.xp.nbytes(packed))
            self.check_finite(step, self._micro_grads, packed)
            self._micro_grads = {}
            self.tracker.free("gradbuf:micro")
            self._reduce_scatter_into_acc(unit, packed, micro)
            self.tracker.free("gradbuf:packed")

    # =============================================================================================
    # one step
    # =============================================================================================
    def step(self, step: int) -> StepObservation:
        """One optimizer step over M micro-batches; returns the observation (taken after the timed part)."""
        xp, tr = self.xp, self.tracker
        before = _snapshot(self.comm.traffic)
        if self.schedule.align_step_start:
            self.control.barrier()  # every rank starts the step together (control group: no data traffic)
        t0 = time.perf_counter()
        tr.begin_step(step)
        self._step = step
        self._micro_grads = {}
        losses = [self.schedule.micro_batch(step, m) for m in range(self.run.micro_batches)]
        tr.set_phase("reduce")
        grad_shard = None  # ZeRO-1 with reduce_scatter: the rank's averaged gradient chunk
        if self.schedule.settle_gradients(step):
            pass  # the schedule finished the reduction it started during backward
        elif not self.sharded_grads:
            grad_shard = self.reduce_full_grad(step)
        elif self.hybrid and self.replicate_comm is not None:
            self.grad_acc = self.replicate_reduce(self.grad_acc)
        tr.alloc(
            "grads",
            "grads",
            xp.nbytes(self.grad_acc),
            self.optimizer_location if self.sharded_grads else "device",
        )
        self.finish_accumulation(self.grad_acc if grad_shard is None else grad_shard)
        # ---- norm, clip, step ---------------------------------------------------------------------
        tr.set_phase("optimizer")
        if self.sharded_grads or grad_shard is not None:
            grad = self.grad_acc if grad_shard is None else grad_shard
            sumsq = self.global_sumsq(wire.owned_sumsq(xp, grad, self.units, self.local))
        else:
            sumsq = xp.sum_of_squares(self.grad_acc)
            grad = self.own_chunk(self.grad_acc) if self.sharded_optim else self.grad_acc
            if grad is not self.grad_acc:
                tr.alloc("grad_chunk", "grad_buffers", xp.nbytes(grad))
        norm, coef = wire.clip_(xp, grad, sumsq, self.run.spec.max_grad_norm, self.state_dtype)
        self.optimizer_step(grad)
        self._stepped_grad = grad
        # ---- refresh the working parameters ----------------------------------------------------
        tr.set_phase("params")
        self.refresh_params()
        self.extra_step_collectives(step)
        tr.free("grad_chunk")
        local_loss = sum(losses) / len(losses)
        loss_arr = xp.asarray([local_loss], dtype=xp.dtype("float64"), device=xp.device)
        loss = xp.to_float(self.control.all_reduce(loss_arr, "avg")[0])
        t1 = time.perf_counter()
        memory = tr.end_step()
        after = _snapshot(self.comm.traffic)
        obs = StepObservation(step, loss, local_loss, norm, coef, int(self.opt_state["step"]),
                              self.holdings(), _delta(before, after), memory, t0, t1)
        if self.offload:
            self.obs.offload.setdefault("steps", []).append(dict(self._moved))
            self._moved = {"host_to_device": 0, "device_to_host": 0}
        self.observe(obs)
        if not self.schedule.keeps_history:  # a trainer runs for as long as its user trains
            del self.obs.steps[:-1]
            del self.tracker.steps[:-1]
        if self.run.cfg.reshard_at == step:
            self.reshard_round_trip()
        return obs

    def reshard_round_trip(self) -> None:
        """Save the full state dict and load it back at the same world size, between two steps.

        Every sharded float32 state (master, optimizer moments) is all-gathered over the shard group,
        assembled into the full flat array by the plan (:meth:`assemble_full_state`), and this rank
        keeps its own pieces. Correct code changes no bit, which C-ZERO-002 checks at the next step.
        The traffic falls between steps, outside every step's C-ZERO-005 count."""
        if not self.sharded_optim or self.shard_comm is None:
            return  # every rank already holds the full state
        arrays = [self.master, *(self.opt_state[n] for n in self.run.spec.state_names)]
        for arr in arrays:
            full = self.assemble_full_state(self.shard_comm.all_gather(arr))
            self.xp.assign(arr, self.own_chunk(full))

    def assemble_full_state(self, gathered: Any) -> Any:
        """The full flat array from an all-gather of every rank's packed shard (padding dropped)."""
        return wire.assemble_full(self.xp, gathered, self.units, self.k, self.total, self.state_dtype,
                                  self.gathered_chunk_index)

    def optimizer_step(self, grad: Any) -> None:
        """The optimizer step on the master shard (C-ZERO-002); bug class 11 advances the counter twice."""
        wire.optimizer_step(self.opt, self.master, grad, self.opt_state)
        if self.corruption(Hook.OPTIMIZER_STEP) == "count-twice":
            self.opt_state["step"] += 1

    def refresh_params(self) -> None:
        """After the step: the working copy the next forward uses (bug class 12: the offloaded update is
        accounted for as copied back, but never reaches the device shard)."""
        xp = self.xp
        if self.corruption(Hook.PARAM_REFRESH) == "skip-copy-back":
            self._moved["host_to_device"] += xp.nbytes(self.param_shard)
            return
        if self.sharded_params:
            if self.mixed or self.offload:
                work = self.precision.to_params(self.master, xp)
                self.param_shard = xp.copy(work) if work is self.master else work
                self.tracker.alloc("params", "params", xp.nbytes(self.param_shard))
                if self.offload:  # the updated working shard goes back to the device
                    self._moved["host_to_device"] += xp.nbytes(self.param_shard)
        elif self.sharded_optim:
            assert self.shard_comm is not None
            work = self.precision.to_params(self.master, xp)
            gather_into = getattr(self.shard_comm, "all_gather_into", None)
            if self.schedule.receives_into_params and callable(gather_into):
                # every rank's updated chunk is received straight into the parameters it covers
                gather_into(work, self._param_destinations())
                return
            gathered = self.shard_comm.all_gather(work)
            self.tracker.alloc("gathered:params", "gathered", xp.nbytes(gathered))
            self.write_gathered_params(gathered, self.units.units[0])
            del gathered
            self.tracker.free("gathered:params")
        elif self.mixed:
            xp.assign(self.params_full, self.precision.to_params(self.master, xp))
        self.schedule.params_refreshed()

    def _param_destinations(self) -> list[list[tuple[int, Any]]]:
        """Per shard-group rank, where each piece of its chunk lives in the full parameters:
        ``(position in the chunk, view of params_full)``, the all-gather's unpacking done by the
        receive itself (C-ZERO-003: every rank then holds the same full parameters)."""
        cached = self.__dict__.get("_destinations")
        if cached is None or cached[0] is not self.params_full:
            dests = [[(pos, self.params_full[g0:g1]) for g0, g1, pos in self.units.owned_global(j)]
                     for j in range(self.k)]
            cached = self.__dict__["_destinations"] = (self.params_full, dests)
        return cached[1]

    # =============================================================================================
    # observation (outside the timed part of the step)
    # =============================================================================================
    def holdings(self) -> dict[str, Holding]:
        """What this rank holds, measured from its live arrays (C-ZERO-004)."""
        xp = self.xp
        own = merge_adjacent((g0, g1) for g0, g1, _ in self.owned_pieces)
        full = ((0, self.total),) if self.total else ()
        out: dict[str, Holding] = {}
        if self.sharded_params:
            out["params"] = Holding("params", own, self.param_shard.shape[0], xp.nbytes(self.param_shard),
                                    self.precision.param_dtype)
        else:
            out["params"] = Holding("params", full, self.params_full.shape[0], xp.nbytes(self.params_full),
                                    self.precision.param_dtype)
        out["grads"] = Holding("grads", own if self.sharded_grads else full, self.grad_acc.shape[0],
                               xp.nbytes(self.grad_acc), self.state_dtype,
                               self.optimizer_location if self.sharded_grads else "device")
        arrays = [self.opt_state[n] for n in self.run.spec.state_names]
        master_separate = not (self.master is self.param_shard or self.master is self.params_full)
        if master_separate:
            arrays.append(self.master)
        stored = self.master.shape[0]
        out["optimizer"] = Holding("optimizer", own if self.sharded_optim else full, stored,
                                   sum(xp.nbytes(a) for a in arrays), self.state_dtype,
                                   self.optimizer_location)
        if self.corruption(Hook.HOLDINGS) == "hidden-full-copy":
            o = out["optimizer"]
            out["optimizer"] = Holding("optimizer", ((0, self.total),), o.stored_numel + self.total,
                                       o.nbytes + xp.nbytes(self._hidden), o.dtype, o.location)
        return out

    def observe(self, obs: StepObservation) -> None:
        """Copy what the contracts need out of the live state (after the timed part of the step)."""
        xp, run = self.xp, self.run
        pieces = self.owned_pieces
        if run.observe_values:
            obs.master = ShardValues(pieces, xp.to_numpy(self.master, copy=True))
            obs.optimizer = {n: ShardValues(pieces, xp.to_numpy(self.opt_state[n], copy=True))
                             for n in run.spec.state_names}
            if run.observe_full:
                obs.grads = ShardValues(pieces, xp.to_numpy(self._stepped_grad, copy=True))
        self._stepped_grad = None
        if run.observe_gathered:
            gathered = self.full_params_view()
            if run.observe_full:
                obs.gathered = gathered
            else:
                obs.gathered_digest = tensor_digests(self.layout, gathered)
        self.obs.steps.append(obs)

    def full_params_view(self) -> Any:
        """The full working parameters this rank would compute with next, as numpy (param dtype).

        ZeRO-3 gathers every unit through the same code path as the forward pass, on the
        ``.observe`` group (so the step's data traffic is untouched)."""
        xp = self.xp
        if not self.sharded_params:
            return xp.to_numpy(self.params_full, copy=True)
        out = xp.zeros(self.total, self.precision.param_dtype)
        assert self.observe_comm is not None
        for unit in self.units.units:
            _, flat = self.gather_unit(unit, self.observe_comm)
            views = self.use_gathered(unit.name, wire.tensor_views(xp, unit, flat), len(self.obs.steps) + 1)
            for name, v in views.items():
                g0, g1 = self.layout.tensor_range(name)
                xp.assign(out[g0:g1], xp.reshape(v, (-1,)))
        return xp.to_numpy(out)

    def train(self) -> RankObservation:
        for s in range(self.run.steps):
            self.step(s)
        self.obs.memory_timeline = self.tracker.timeline_json()
        self.obs.init_peak_bytes = dict(self.tracker.init_peak_by_location)
        return self.obs


# ---- small helpers ----------------------------------------------------------------------------------

def tensor_digests(layout: Any, flat: Any) -> dict[str, str]:
    """Per-tensor digests of a full flat numpy array (C-ZERO-003 on large runs)."""
    return {
        t.name: digest(flat[g0 : g0 + t.numel]) for t, g0 in zip(layout.tensors, layout.offsets, strict=True)
    }


def _snapshot(counter: Any) -> dict[tuple[str, str], tuple[int, Any, Any, int, dict[str, int]]]:
    return {k: (r.calls, r.bytes_sent, r.bytes_received, r.payload_bytes, dict(r.dtypes))
            for k, r in counter.records.items()}


def _delta(before: dict, after: dict) -> list[TrafficItem]:
    out = []
    for key, (calls, sent, recv, payload, dtypes) in sorted(after.items()):
        b = before.get(key, (0, 0, 0, 0, {}))
        if calls - b[0]:
            moved = {d: n - b[4].get(d, 0) for d, n in dtypes.items() if n - b[4].get(d, 0)}
            out.append(TrafficItem(key[0], key[1], calls - b[0], sent - b[1], recv - b[2], payload - b[3],
                                   moved))
    return out
