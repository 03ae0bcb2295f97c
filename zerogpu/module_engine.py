"""One rank's ZeRO step over a torch ``nn.Module``: autograd computes; the step functions reduce and step.

:class:`ModuleSchedule` is the autograd-hook schedule over one rank's
:class:`zerosim.engine.rank_state.RankState` (the state the simulator, MPI and torchrun backends
drive with the block model's schedule): it runs the step through a real module instead of the
simulator's hand-differentiated model. The state holds the shards; the step functions of
:mod:`zerosim.engine.gradients` and :mod:`zerosim.engine.step` do what follows the gradients; this
schedule owns the step (its micro-batches, given as an argument), the module's binding to the state
and the per-step state of its hooks:

* **Parameters.** NO_SHARD / ZeRO-1 / ZeRO-2: every parameter's ``.data`` is a view into the
  state's flat replicated parameters, so the in-place refresh after the step is what the next
  forward sees. ZeRO-3 / hybrid: each unit (:mod:`zerogpu.module_units`) owns one flat
  buffer in the parameter dtype whose storage is allocated only while the unit is in use; the
  parameters are views into it. Between uses the storage has size zero: the rank holds only its
  shard, as C-ZERO-004 demands. A shard group of one rank (hybrid with shard size 1, ZeRO-3 at
  world 1) holds every unit whole in its shard: the parameters are views into the shard itself,
  always resident, and nothing is gathered, copied or freed for them (an all-gather over one rank
  would only copy the shard).
* **ZeRO-3 schedule.** A forward pre-hook gathers the unit (the all-gather of every rank's chunk,
  with ``prefetch`` units gathered ahead) and unpacks it into the unit's buffer; the forward hook
  frees the buffer and hooks the unit's outputs, so the first gradient reaching them gathers the
  unit again before its backward runs. When autograd has
  accumulated the gradient of every parameter of a unit, its gradients are reduce-scattered
  (``accept_grads``) and the buffer is freed. The root unit follows the same rules, so
  every unit is gathered twice per step, the ZeRO-3 schedule the communication model counts.
  Refilling a storage that autograd saved for backward is done without bumping the tensor's
  version counter (FSDP does the same): the values written are the ones saved.
* **Gradients.** Everything after the gradients is the step functions': averaging reduce-scatter or
  all-reduce, accumulation, the global norm over owned elements, clipping, the optimizer step on
  the master shard, the all-gather or cast that refreshes the working parameters.
* **NO_SHARD / ZeRO-1 overlap.** On the last micro-batch, once autograd has completed the gradients
  of a block (a unit of :mod:`zerogpu.module_units`), the block's gradients are accumulated and
  checked for non-finite values on this rank. Then the all-reduce of their ranges of the flat
  gradient is started without waiting, so the bytes move while backward goes on. After backward the
  ranks agree once (one scalar) whether any of them found a non-finite gradient, naming the first,
  and the step waits for every all-reduce before the norm. No rank steps with a non-finite
  gradient. The arithmetic is the unoverlapped all-reduce's, element for element.
  Hybrid likewise starts each unit's all-reduce over the replicate group right after the unit's
  reduce-scatter.

Collectives are issued in autograd order, which is the same on every rank when every rank runs the
same graph. A parameter that receives no gradient in a step is reduced as zeros after backward (in
unit order on every rank); a graph that differs between ranks (data-dependent control flow that
skips a unit on some ranks) desynchronises the collectives and ends in the communicator's timeout.

Why one module of this length: it is one schedule of the step, and the parameter binding, the
autograd hooks, the overlapped reductions and the offload path all read and update the same per-step
state (which units are gathered, which gradients arrived, which reductions are in flight).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from zerosim.comm.base import Communicator
from zerosim.engine import wire
from zerosim.engine.gradients import (
    accept_grads,
    agree_finite,
    end_micro_batch,
    first_nonfinite_accumulated,
    full_grad_reduce_op,
    grad_reduce_op,
)
from zerosim.engine.rank_state import RankState
from zerosim.engine.step import begin_step, finish_step
from zerosim.errors import ConfigError
from zerosim.numerics.xp import ArrayNamespace
from zerosim.values.flat_buffers import FlatUnit
from zerosim.values.observe import StepObservation
from zerosim.values.unit_state import UnitState

from .module_run import ModuleFlat, ModuleRun
from .module_units import ModuleUnits

#: NO_SHARD / ZeRO-1 overlap: blocks whose gradients complete are queued until this many elements
#: wait, then share one all-reduce (gpt-50m's blocks each pass it alone; a small model's share one)
OVERLAP_BUCKET_MIN = 1 << 20

LossFn = Callable[[torch.nn.Module, Any, Any], torch.Tensor]


class ScheduleHook:
    """A hook registered on the module, a parameter or an output: ``schedule.<method>(*bound, *args)``,
    the schedule held weakly, nothing once it is gone.

    torch keeps a parameter's post-accumulate-grad hooks (and a tensor's gradient hooks) on the C++
    side, where Python's garbage collector cannot follow them. A hook that held the schedule strongly
    would make module -> parameter -> hook -> schedule -> module an uncollectable cycle: every trainer
    built and dropped would keep its model, flat buffers and optimizer state for the life of the
    process (0.5-0.7 GB per rank for a 50M-parameter model)."""

    __slots__ = ("_schedule", "_method", "_bound")

    def __init__(self, schedule: ModuleSchedule, method: str, *bound: Any):
        self._schedule = weakref.ref(schedule)
        self._method = method
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        schedule = self._schedule()
        if schedule is None:
            return None
        return getattr(schedule, self._method)(*self._bound, *args)


def _remove_handles(handles: list[Any]) -> None:
    """Detach every hook the schedule registered (also run when the schedule is collected)."""
    for handle in handles:
        handle.remove()
    handles.clear()


def module_engine(comm: Communicator, run: ModuleRun, xp: ArrayNamespace, described: ModuleUnits,
                  loss_fn: LossFn, offload: Any = None,
                  optimizer: Any = None) -> tuple[RankState, ModuleSchedule]:
    """One rank's state over a torch module and the schedule that runs its steps (the schedule holds
    the state; nothing holds the schedule back). ``optimizer``: what steps the master shard (default:
    the run's flat optimizer of its kernel)."""
    from .optimizer_kernels import make_step_optimizer

    # the module's current parameters, read lazily: a slice copies only the tensors it covers, so a
    # ZeRO-3 rank, which only slices out its own pieces, never holds a second full copy while it starts
    layout = run.layout
    initial = ModuleFlat([described.parameters[t.name] for t in layout.tensors], layout.offsets,
                         layout.total_numel, xp.dtype(run.precision.master_dtype))
    if optimizer is None:
        optimizer = make_step_optimizer(run.spec, xp, run.optimizer_kernel)
    # ZeRO-1/2: every rank's updated chunk is received straight into the parameters it covers
    state = RankState(comm, run, xp, optimizer=optimizer, initial=initial, receives_into_params=True)
    return state, ModuleSchedule(state, run, described, loss_fn, offload)


class ModuleSchedule:
    """The autograd-hook schedule over one rank's :class:`RankState` and a torch module (see the module
    docstring), built with its state by :func:`module_engine`. :meth:`step` runs one optimizer step
    over the micro-batches it is given."""

    #: a trainer steps inside its user's loop: no barrier before the step (no peer trainer has one;
    #: on gloo it cost a quarter of a small model's step), each rank times its step from its own start
    align_step_start = False
    #: a trainer runs for as long as the user trains, and nothing reads older steps (verify judges)
    keeps_history = False

    def __init__(self, state: RankState, run: ModuleRun, described: ModuleUnits, loss_fn: LossFn,
                 offload: Any = None):
        self.state = state
        self.run = run  # the state's run, whose micro-batch count each step sets
        self.described = described
        self.module = described.unit_modules["root"]
        self.loss_fn = loss_fn
        self.offload_manager = offload
        self._step_index = 0
        self._micro_index = 0
        self._buffers: dict[str, torch.Tensor] = {}
        self._resident_units: set[str] = set()  # units whose buffer is a view of the shard (k == 1)
        self._gathered: dict[str, Any] = {}  # unit -> its packed all-gather, until unpacked or dropped
        self._grads: dict[str, dict[str, torch.Tensor]] = {}
        self._reduced: set[str] = set()
        self._order: list[str] = []
        self._backward_order: list[str] = []
        self._hooks: list[Any] = []
        self._started_units: set[str] = set()
        self._arrived: dict[str, dict[str, torch.Tensor]] = {}  # block -> its gradients completed so far
        self._block_sizes: dict[str, int] = {}
        self._started: set[str] = set()  # tensors whose reduction is under way (or queued) this step
        self._bucket: list[str] = []  # accumulated, checked, waiting to share an all-reduce
        self._bucket_numel = 0
        self._pending: list[Any] = []
        self._local_bad = 0  # this rank's first non-finite gradient among those started (index + 1)
        # bind the module's parameters to the state's buffers and register the hooks
        # NO_SHARD / ZeRO-1: the full-gradient all-reduce is started block by block from backward
        self._overlap = self._overlap_possible()
        # hybrid: each unit's replica all-reduce is started right after its reduce-scatter
        self._overlap_replicas = self._replica_overlap_possible()
        self._bind_parameters()
        # a module that outlives its schedule keeps no hook of it (at interpreter exit nothing to do)
        weakref.finalize(self, _remove_handles, self._hooks).atexit = False
        if self.offload_manager is not None:
            self._register_offload()

    # ---- parameters as views into the state's buffers ----------------------------------------
    def _bind_parameters(self) -> None:
        e = self.state
        params = self.described.parameters
        if not e.sharded_params:
            for t in e.layout.tensors:
                g0, g1 = e.layout.tensor_range(t.name)
                params[t.name].data = e.params_full[g0:g1].view(t.shape)
            if self._overlap:
                for block in e.layout.blocks:
                    self._block_sizes[block.name] = len(block.tensor_indices)
                    for i in block.tensor_indices:
                        name = e.layout.tensors[i].name
                        self._hooks.append(params[name].register_post_accumulate_grad_hook(
                            ScheduleHook(self, "_on_overlap_grad", block.name, name)))
            return
        dtype = e.xp.dtype(e.precision.param_dtype)
        for unit in e.units.units:
            if self._resident(unit):
                off = e.units.shard_offsets[unit.index]
                buf = e.param_shard[off:off + unit.numel]
                self._resident_units.add(unit.name)
                e.unit_table.unshard(unit.name)  # whole in the shard, always
            else:
                buf = torch.empty(unit.numel, dtype=dtype, device=e.xp.device)
            pieces = zip(unit.tensor_names, unit.tensor_offsets, unit.tensor_shapes, strict=True)
            for name, off, shape in pieces:
                n = int(np.prod(shape, dtype=np.int64))
                params[name].data = buf[off:off + n].view(shape)
            if unit.name not in self._resident_units:
                buf.untyped_storage().resize_(0)
            self._buffers[unit.name] = buf
        self._order = [u for u in self.described.order if u in self._buffers]
        for unit_name in self._order:
            module = self.described.unit_modules[unit_name]
            self._hooks += [
                module.register_forward_pre_hook(ScheduleHook(self, "_on_pre_forward", unit_name)),
                module.register_forward_hook(ScheduleHook(self, "_on_post_forward", unit_name))]
        # after the whole forward nothing gathered ahead may wait for the next one (it would go stale)
        self._hooks.append(self.module.register_forward_hook(ScheduleHook(self, "_on_forward_end")))
        root, rest = self._order[:1], self._order[1:]
        if root != ["root"]:
            root, rest = [], self._order
        self._backward_order = [*root, *reversed(rest)]  # the root's output (the loss) is reached first
        for unit in e.units.units:
            for name in unit.tensor_names:
                self._hooks.append(params[name].register_post_accumulate_grad_hook(
                    ScheduleHook(self, "_on_unit_grad", unit.name, name)))

    def _resident(self, unit: FlatUnit) -> bool:
        """Whether ``unit`` lives in this rank's shard whole, in unit order: a shard group of one rank,
        an identity packing, and working parameters that are the master shard itself (no offload, no
        mixed precision: the optimizer updates them in place, so the views always see the step)."""
        e = self.state
        return (e.k == 1 and unit.is_identity and self.offload_manager is None
                and e.param_shard is e.master)

    def unit_resident_bytes(self) -> int:
        """Bytes of the ZeRO-3 unit buffers allocated right now (zero between uses; a unit resident
        in the shard is counted with the shard)."""
        return sum(b.untyped_storage().nbytes() for name, b in self._buffers.items()
                   if name not in self._resident_units)

    def _materialize(self, unit_name: str, order: list[str]) -> None:
        """Gather ``unit_name`` (and ``prefetch`` units ahead along ``order``, kept packed until their
        turn) and unpack it straight into its buffer, unless it is there already."""
        e = self.state
        if e.unit_table[unit_name] is UnitState.GATHERED:
            return
        buf = self._buffers[unit_name]
        position = order.index(unit_name)
        for ahead in order[position:position + 1 + e.run.prefetch]:
            if ahead not in self._gathered:
                packed = self._gather_packed(e.unit_by_block[ahead], order)
                e.tracker.alloc(f"gathered:{ahead}", "gathered", e.xp.nbytes(packed))
                self._gathered[ahead] = packed
                e.unit_table.start_gather(ahead)  # gathered ahead, packed until its turn
        packed = self._gathered[unit_name]
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buf):
            wire.unpack_into(e.xp, buf, packed, e.unit_by_block[unit_name])
        self._release_packed(unit_name)
        e.unit_table.unshard(unit_name)
        e.tracker.alloc(f"unit:{unit_name}", "gathered", buf.numel() * buf.element_size())

    def _free(self, unit_name: str) -> None:
        e = self.state
        if unit_name not in self._resident_units and e.unit_table[unit_name] is UnitState.GATHERED:
            self._buffers[unit_name].untyped_storage().resize_(0)
            e.unit_table.reshard(unit_name)
            e.tracker.free(f"unit:{unit_name}")

    def _release_packed(self, unit_name: str) -> None:
        """Free the packed all-gather of ``unit_name`` (unpacked into its buffer, or never needed)."""
        e = self.state
        if self._gathered.pop(unit_name, None) is not None:
            e.tracker.free(f"gathered:{unit_name}")
            e.unit_table.drop_gather(unit_name)

    def _drop_prefetched(self) -> None:
        for name in list(self._gathered):
            self._release_packed(name)

    # ---- hooks (registered as :class:`ScheduleHook`) -----------------------------------------------
    def _on_pre_forward(self, unit_name: str, module: Any, args: Any) -> None:
        self._materialize(unit_name, self._order)

    def _on_post_forward(self, unit_name: str, module: Any, args: Any, output: Any) -> None:
        """Free the unit; its outputs' first gradient gathers it again for backward."""
        self._free(unit_name)
        if not torch.is_grad_enabled():
            return
        regather = ScheduleHook(self, "_on_output_grad", unit_name)
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(regather)

    def _on_output_grad(self, unit_name: str, grad: torch.Tensor) -> None:
        self._materialize(unit_name, self._backward_order)

    def _on_forward_end(self, *_: Any) -> None:
        self._drop_prefetched()

    def _on_unit_grad(self, unit_name: str, name: str, param: torch.Tensor) -> None:
        """ZeRO-3: a parameter's gradient is complete; the unit's last one reduces the unit."""
        grads = self._grads.setdefault(unit_name, {})
        grads[name] = param.grad  # type: ignore[assignment]
        param.grad = None
        if len(grads) == len(self.state.unit_by_block[unit_name].tensor_names):
            self._reduce_unit(unit_name)

    # ---- NO_SHARD / ZeRO-1: the all-reduce overlapped with backward ---------------------------------
    def _overlap_possible(self) -> bool:
        """Whether the full-gradient all-reduce can start block by block during backward: a replicated
        gradient (NO_SHARD, ZeRO-1 reducing by all-reduce), more than one rank, and a communicator that
        can start an all-reduce without waiting for it."""
        e = self.state
        return (not e.sharded_grads and not e.zero1_reduce_scatter and e.comm.world_size > 1
                and callable(getattr(e.comm, "all_reduce_start", None)) and e.run.inject_nan is None)

    def _on_overlap_grad(self, block: str, name: str, param: torch.Tensor) -> None:
        """On the last micro-batch, a gradient waits with its block's until autograd has completed
        all of them; the block is then accumulated, checked and its all-reduce started."""
        if self._micro_index != self.state.run.micro_batches - 1:
            return  # earlier micro-batches only accumulate, after backward
        got = self._arrived.setdefault(block, {})
        got[name] = param.grad  # type: ignore[assignment]
        param.grad = None
        if len(got) == self._block_sizes[block]:
            grads = self._arrived.pop(block)
            accept_grads(self.state, self._step_index, self._micro_index, "model", grads)
            self._start_reduce(list(grads))

    def _start_reduce(self, names: list[str], *, flush: bool = False) -> None:
        """Queue ``names``; once the queue holds :data:`OVERLAP_BUCKET_MIN` elements (or on
        ``flush``), note this rank's first non-finite gradient among them (no collective: the ranks
        agree once, in :meth:`settle_gradients`, before anyone steps) and start the all-reduce of
        each contiguous run of them in the flat gradient. Small blocks so share one all-reduce, and
        one finiteness pass per run: on a small model each call's latency, not its bytes, is the cost."""
        e = self.state
        layout = e.layout
        self._started.update(names)
        self._bucket.extend(names)
        self._bucket_numel += sum(g1 - g0 for g0, g1 in map(layout.tensor_range, names))
        if not flush and self._bucket_numel < OVERLAP_BUCKET_MIN:
            return
        runs = e.grad_order.runs(self._bucket)
        bad = first_nonfinite_accumulated(e, self._bucket, runs)
        if bad and (not self._local_bad or bad < self._local_bad):
            self._local_bad = bad
        self._bucket, self._bucket_numel = [], 0
        op = full_grad_reduce_op(e)
        start = e.comm.all_reduce_start  # type: ignore[attr-defined]
        self._pending.extend(start(e.grad_acc[g0:g1], op) for g0, g1 in runs)

    def _replica_overlap_possible(self) -> bool:
        e = self.state
        rep = e.replicate_comm
        return (e.hybrid and rep is not None and rep.world_size > 1 and self.offload_manager is None
                and callable(getattr(rep, "all_reduce_start", None)) and e.run.inject_nan is None)

    def _start_replica_reduce(self, unit_name: str) -> None:
        """Hybrid: start averaging the unit's reduced gradient chunk over the replicate group."""
        e = self.state
        unit = e.unit_by_block[unit_name]
        off = e.units.shard_offsets[unit.index]
        start = e.replicate_comm.all_reduce_start  # type: ignore[union-attr]
        self._pending.append(start(e.grad_acc[off:off + unit.chunk], grad_reduce_op(e)))
        self._started_units.add(unit_name)

    def _settle_gradients(self, step: int) -> bool:
        """Overlapped reductions: start what backward left, then wait for every all-reduce. NO_SHARD /
        ZeRO-1: element for element the arithmetic of one all-reduce of the whole gradient (only how
        gloo or NCCL groups the additions inside a call may differ), after the ranks agreed it is
        finite. Hybrid: the units backward did not reach, then every replica all-reduce (the
        arithmetic of one all-reduce of the whole shard). False when nothing was overlapped."""
        e = self.state
        if self._overlap:
            rest = [t.name for t in e.layout.tensors if t.name not in self._started]
            if rest or self._bucket:
                self._start_reduce(rest, flush=True)
            bad, self._local_bad = self._local_bad, 0
            agree_finite(e, step, bad, "detected before the step; no rank stepped with it")
            self._wait_pending()
            self._started = set()
            return True
        if self._overlap_replicas and e.sharded_grads:
            for unit in e.units.units:
                if unit.name not in self._started_units:
                    self._start_replica_reduce(unit.name)
            self._wait_pending()
            self._started_units = set()
            return True
        return False

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()

    def _reduce_unit(self, unit_name: str) -> None:
        e = self.state
        unit = e.unit_by_block[unit_name]
        got = self._grads.pop(unit_name, {})
        grads = {n: got[n] if n in got else self._zero_grad(n) for n in unit.tensor_names}
        accept_grads(e, self._step_index, self._micro_index, unit_name, grads)
        if self._overlap_replicas and self._micro_index == e.run.micro_batches - 1:
            self._start_replica_reduce(unit_name)
        self._reduced.add(unit_name)
        self._free(unit_name)

    def _zero_grad(self, name: str) -> torch.Tensor:
        p = self.described.parameters[name]
        return torch.zeros(p.shape, dtype=p.dtype, device=p.device)

    # ---- offload: the units' parameter shards through the offload manager -------------------------
    def _register_offload(self) -> None:
        e = self.state
        manager = self.offload_manager
        for unit in e.units.units:
            manager.register_unit(unit.name, e.param_chunk(unit))
        state = [e.opt_state[n] for n in e.run.spec.state_names]
        if e.master is not e.param_shard:
            state.append(e.master)
        manager.register_host_state("optimizer", [*state, e.grad_acc])
        manager.validate()

    def _gather_packed(self, unit: FlatUnit, order: list[str], comm: Communicator | None = None) -> Any:
        """The all-gather of every rank's chunk of ``unit`` (packed, rank-major); with offload the chunk
        comes from the manager's device tier, the units after it in ``order`` prefetched."""
        e = self.state
        comm = comm or e.shard_comm
        assert comm is not None
        if self.offload_manager is None:
            return comm.all_gather(e.param_chunk(unit))
        at = order.index(unit.name) if unit.name in order else len(order)
        shard = self.offload_manager.fetch(unit.name, order[at + 1:])
        packed = comm.all_gather(shard)
        self.offload_manager.release(unit.name)
        return packed

    def params_refreshed(self) -> None:
        """After the working parameters were refreshed (a step, a load): with offload, the manager's
        host copy of every unit's shard follows them."""
        if self.offload_manager is not None:
            for unit in self.state.units.units:
                self.offload_manager.update_host(unit.name, self.state.param_chunk(unit))

    # ---- one step through the module --------------------------------------------------------------
    def step(self, step: int, batches: list[tuple[Any, Any]]) -> StepObservation:
        """C-ZERO-002/005: one optimizer step over ``batches`` (one ``(inputs, targets)`` per
        micro-batch, in order), reducing and averaging as the strategy does; the step's observation."""
        s = self.state
        self.run.micro_batches = len(batches)  # the state's run (the same object), writable here
        start = begin_step(s, step, align=self.align_step_start)
        losses = [self._micro_batch(step, m, batch) for m, batch in enumerate(batches)]
        s.tracker.set_phase("reduce")
        settled = self._settle_gradients(step)
        obs = finish_step(s, start, losses, settled=settled, keeps_history=self.keeps_history)
        self.params_refreshed()
        return obs

    def _micro_batch(self, step: int, micro: int, batch: tuple[Any, Any]) -> float:
        """Forward and backward of the module on ``batch``; gradients to the state (per unit as autograd
        completes them under ZeRO-3, all at once otherwise)."""
        e = self.state
        self._step_index, self._micro_index = step, micro
        self._grads, self._reduced = {}, set()
        if micro == 0 and (self._started or self._arrived or self._started_units):
            # a step that ended in an error (a non-finite gradient): finish what it started, keep nothing
            for work in self._pending:
                work.wait()
            self._arrived, self._started, self._pending, self._started_units = {}, set(), [], set()
            self._bucket, self._bucket_numel = [], 0
            self._local_bad = 0
        inputs, targets = batch
        e.tracker.set_phase(f"forward[{micro}]")
        loss = self.loss_fn(self.module, inputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError("loss", type(loss).__name__, "the loss function must return a 1-element tensor")
        e.tracker.set_phase(f"backward[{micro}]")
        loss.backward()
        if e.sharded_params:
            for unit_name in reversed(self._order):  # units autograd never completed: zeros for the rest
                if unit_name not in self._reduced:
                    self._reduce_unit(unit_name)
        else:
            params = self.described.parameters
            # overlap: gradients of blocks autograd did not complete arrived but were not accumulated yet
            arrived = {name: g for block in self._arrived.values() for name, g in block.items()}
            self._arrived = {}
            grads = {}
            for t in e.layout.tensors:
                if t.name in self._started:  # already accumulated and being reduced (overlap)
                    continue
                p = params[t.name]
                g = arrived.get(t.name, p.grad)
                grads[t.name] = g if g is not None else self._zero_grad(t.name)
                p.grad = None
            accept_grads(e, step, micro, "model", grads)
        self._drop_prefetched()
        end_micro_batch(e, step, micro)
        return float(loss.detach())

    def remove_hooks(self) -> None:
        """Detach the schedule from the module (the parameters stay views of the state's buffers)."""
        _remove_handles(self._hooks)
