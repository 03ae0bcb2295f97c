"""The block model's schedule: the driver ``zerosim simulate`` (and mpiexec, torchrun) runs.

Per micro-batch the hand-differentiated :class:`~zerosim.numerics.model.BlockModel` runs forward block by
block and backward in reverse. ZeRO-3 gathers each block's unit before it computes (with ``prefetch`` units
ahead) and frees it after, twice per micro-batch (forward, backward), and hands each block's gradients
to :func:`~zerosim.engine.gradients.accept_grads` as backward produces them; the other strategies
compute with the full replicated parameters and hand the gradients over per block. The schedule
owns the step: it opens it (:func:`~zerosim.engine.step.begin_step`), runs its micro-batches on one
rank's :class:`~zerosim.engine.rank_state.RankState`, and ends it
(:func:`~zerosim.engine.step.finish_step`); units change state only through the state's unit table.

Run-ahead (ZeRO-3 on a communicator that can start collectives and shares their results: the
simulator): each micro-batch *starts* its all-gathers (forward and backward, in schedule order)
before computing, and starts each block's finite vote and reduce-scatter without waiting; after
backward it takes the votes (raising for the first flagged block, as waiting block by block would)
and only then accumulates the reduced chunks. The collectives, their inputs, the traffic and the
arithmetic are the same; only the waiting moves, so a simulated rank runs its whole micro-batch while
its activations are still in cache instead of every rank advancing block by block. The memory tracker
accounts a gathered block when the rank takes it, as before.
"""

from __future__ import annotations

from typing import Any

from ..comm.base import Communicator
from ..numerics.model import BlockModel, synthetic_batch
from ..numerics.xp import ArrayNamespace
from ..values.flat_buffers import FlatUnit
from ..values.observe import StepObservation
from . import wire
from .engine_run import EngineRun
from .faults import EngineFault, Hook
from .gradients import (
    BEFORE_REDUCTION,
    accept_grads,
    accumulate_chunk,
    end_micro_batch,
    finite_flag,
    first_nonfinite,
    grad_reduce_op,
    raise_if_flagged,
)
from .matrix_layout import engine_optimizer
from .observation import use_gathered
from .rank_state import RankState
from .step import begin_step, finish_step


def tree_nbytes(xp: ArrayNamespace, obj: Any) -> int:
    """Bytes of every array inside a (nested) dict / list / tuple (activation accounting)."""
    if isinstance(obj, dict):
        return sum(tree_nbytes(xp, v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_nbytes(xp, v) for v in obj)
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return xp.nbytes(obj)
    return 0


def block_rank_state(comm: Communicator, run: EngineRun, xp: ArrayNamespace,
                     fault: EngineFault | None = None) -> RankState:
    """One rank's state for the block model (what ``zerosim simulate`` runs); a matrix optimizer
    (Muon, Adafactor) steps the tensors the rank owns whole (:mod:`.matrix_layout`)."""
    return RankState(comm, run, xp, fault, optimizer=engine_optimizer(run, comm.rank, xp))


class BlockSchedule:
    """The block model's forward and backward, block by block, over one rank's :class:`RankState`."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self.model = BlockModel(state.run.model_cfg, state.xp)
        self._gathered: dict[str, tuple[Any, Any, dict[str, Any]]] = {}  # block -> (packed, flat, views)
        self._phase = "forward"
        self._started_gathers: dict[tuple[str, int], Any] = {}  # (phase, unit index) -> pending all-gather
        # (unit, pending finite vote, pending reduce-scatter), in backward order
        self._started_reductions: list[tuple[FlatUnit, Any, Any]] = []
        self._leaked: list[Any] = []  # gathered blocks a fault keeps instead of freeing
        self.runs_ahead = self._can_run_ahead()

    def step(self, step: int) -> StepObservation:
        """C-ZERO-002/005: one optimizer step: every rank starts it together, runs its micro-batches on
        its synthetic batches, then the step's end (:func:`~zerosim.engine.step.finish_step`)."""
        s = self.state
        start = begin_step(s, step, align=True)
        cfg, seed = s.run.model_cfg, s.run.seed
        losses = [self.micro_batch(step, m, synthetic_batch(cfg, seed, step, s.rank, m))
                  for m in range(s.run.micro_batches)]
        return finish_step(s, start, losses)

    # ---- one micro-batch --------------------------------------------------------------------------
    def micro_batch(self, step: int, micro: int, batch: tuple[Any, Any]) -> float:
        """Forward and backward of one micro-batch (``batch``: tokens and targets), block by block,
        handing each block's gradients to :func:`~zerosim.engine.gradients.accept_grads`."""
        e = self.state
        xp, tr = e.xp, e.tracker
        tokens, targets = batch
        order = list(self.model.block_names)
        if self.runs_ahead:
            self._start_gathers(order)
        caches: list[Any] = []
        x: Any = tokens
        self._phase = "forward"
        tr.set_phase(f"forward[{micro}]")
        for i, block in enumerate(order):
            params = self.block_params(block, step, order, i)
            x, cache = self.model.forward(block, params, x, targets if block == "lm_head" else None)
            del params
            if e.sharded_params:
                self.release(block)
            tr.alloc(f"act:{block}", "activations", tree_nbytes(xp, cache))
            caches.append(cache)
        loss = xp.to_float(x)
        dy: Any = 1.0
        self._phase = "backward"
        tr.set_phase(f"backward[{micro}]")
        rev = list(reversed(order))
        defer = self._start_reduce_scatter if self.runs_ahead else None
        for i, block in enumerate(rev):
            params = self.block_params(block, step, rev, i)
            cache = caches.pop()
            dy, grads = self.model.backward(block, params, cache, dy)
            del params, cache
            tr.free(f"act:{block}")
            if e.sharded_params:
                self.release(block)
            accept_grads(e, step, micro, block, grads, defer=defer)
            del grads
        if self.runs_ahead:
            self._finish_started(step, micro)
        end_micro_batch(e, step, micro)
        return loss

    # ---- parameters of a block --------------------------------------------------------------------
    def block_params(self, block: str, step: int, order: list[str], position: int) -> dict[str, Any]:
        """The block's parameters for computing. ZeRO-3: gather it (and up to ``prefetch`` blocks ahead)."""
        e = self.state
        if not e.sharded_params:
            unit = e.units.units[0]
            views = {}
            for name in self.model.tensor_names(block):
                g0, g1 = e.layout.tensor_range(name)
                i = unit.tensor_names.index(name)
                views[name] = e.xp.reshape(e.params_full[g0:g1], unit.tensor_shapes[i])
            return views
        for ahead in order[position:position + 1 + e.run.prefetch]:
            if ahead not in self._gathered:
                unit = e.unit_by_block[ahead]
                assert e.shard_comm is not None
                packed = self.gather_packed(unit, e.shard_comm)
                flat = wire.all_gather_unit(e.xp, e.shard_comm, unit, packed, e.precision.param_dtype)
                views = wire.tensor_views(e.xp, unit, flat)
                nbytes = e.xp.nbytes(packed) + (0 if unit.is_identity else e.xp.nbytes(flat))
                e.tracker.alloc(f"gathered:{ahead}", "gathered", nbytes)
                self._gathered[ahead] = (packed, flat, views)
                e.unit_table.unshard(ahead)
        return use_gathered(e, block, self._gathered[block][2], step)

    def gather_packed(self, unit: FlatUnit, comm: Communicator) -> Any:
        """All-gather the unit's parameter chunks over ``comm``. Run-ahead: the all-gather this
        micro-batch started for the unit's current phase."""
        e = self.state
        started = self._started_gathers.pop((self._phase, unit.index), None) if comm is e.shard_comm else None
        return comm.all_gather(e.param_chunk(unit)) if started is None else started.wait()

    def release(self, block: str) -> None:
        """Free a gathered block (ZeRO-3 frees after forward and after backward; a fault keeps it)."""
        e = self.state
        item = self._gathered.pop(block, None)
        if item is not None:
            if e.corruption(Hook.RELEASE) == "keep":
                self._leaked.append(item)
                nbytes = e.tracker.live_keys("gathered")[f"gathered:{block}"][2]
                e.tracker.free(f"gathered:{block}")
                e.tracker.alloc(f"leaked:{block}:{len(self._leaked)}", "gathered", nbytes)
            else:
                e.tracker.free(f"gathered:{block}")
            # back to its shard, unless run-ahead already started the unit's next all-gather
            index = e.unit_by_block[block].index
            e.unit_table.release(block, regathering=any(key[1] == index for key in self._started_gathers))

    # ---- run-ahead (see the module docstring) -----------------------------------------------------
    def _can_run_ahead(self) -> bool:
        """ZeRO-3 whose shard-group communicator can start an all-gather and a reduce-scatter and
        shares all-gather results among its members (the simulator: starting every gather of a
        micro-batch ahead then costs the process one copy of the model, not one per rank)."""
        e = self.state
        comm = e.shard_comm
        return (e.sharded_params and comm is not None and getattr(comm, "shares_results", False)
                and callable(getattr(comm, "all_gather_start", None))
                and callable(getattr(comm, "reduce_scatter_start", None))
                and callable(getattr(e.control, "all_reduce_start", None)))

    def _start_gathers(self, order: list[str]) -> None:
        """Start the micro-batch's all-gathers in the order the schedule takes them: every block for
        the forward, then every block again for the backward."""
        e = self.state
        assert e.shard_comm is not None
        for phase, blocks in (("forward", order), ("backward", order[::-1])):
            for block in blocks:
                unit = e.unit_by_block[block]
                self._started_gathers[(phase, unit.index)] = e.shard_comm.all_gather_start(  # type: ignore[attr-defined]
                    e.param_chunk(unit))
                e.unit_table.start_gather(block)

    def _start_reduce_scatter(self, unit: FlatUnit, grads: dict[str, Any], packed: Any) -> None:
        """Start the block's finite vote (:func:`~zerosim.engine.gradients.check_finite`'s all-reduce)
        and its reduce-scatter; the packed buffer is donated."""
        e = self.state
        assert e.shard_comm is not None
        vote = e.control.all_reduce_start(  # type: ignore[attr-defined]
            finite_flag(e, first_nonfinite(e, grads, packed)), "max")
        reduction = e.shard_comm.reduce_scatter_start(  # type: ignore[attr-defined]
            packed, grad_reduce_op(e), donate=True)
        self._started_reductions.append((unit, vote, reduction))

    def _finish_started(self, step: int, micro: int) -> None:
        """After backward: every block's finite vote in backward order (the first flagged block raises,
        naming the same rank and tensor as waiting block by block would), and only then the reduced
        chunks are accumulated, so no rank's state ever holds a non-finite gradient. A gather the
        schedule did not take is dropped (its rendezvous completed when every rank started it)."""
        e = self.state
        self._started_gathers.clear()
        e.unit_table.drop_in_flight()
        started, self._started_reductions = self._started_reductions, []
        for _, vote, _ in started:
            raise_if_flagged(e, step, vote.wait(), BEFORE_REDUCTION)
        for unit, _, reduction in started:
            accumulate_chunk(e, unit, reduction.wait(), micro)
