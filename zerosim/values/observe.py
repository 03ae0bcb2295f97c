"""Observations: what a run shows the contracts, as numpy arrays plus plain metadata.

A backend (the simulator, mpi4py, torch.distributed, a user's own code through an adapter) only has
to produce these; every step contract (C-ZERO-002..005) is a pure function of them. Nothing here
refers to a live array, a communicator or a device.

Per rank and per step:

* the shard values the rank holds (float32 master, optimizer state, the reduced gradient it
  stepped with), each with the map from storage position to the global flat index space;
* the full parameters the rank uses after the step (its gathered view), or a digest per tensor;
* what the rank holds (``Holding``: intervals, stored elements, bytes), measured from its live arrays;
* the traffic it recorded during the step (data and control separately);
* its memory peaks (``StepMemory``) and the step's wall-clock interval.

A live trainer (``zerosim verify``) shows less of its inside and more of its outside: per rank and
per step a :class:`TrainerObservation` holds its full parameters, its optimizer state where exposed,
the element ranges it owns, the traffic it recorded and its resident bytes, and the gradient norm it
logged. A :class:`TrainerStep` puts every rank's observation of one step beside the unsharded
reference's values and C-ZERO-002's per-element bound for them; the checks read nothing else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import numpy as np

from .observation_fields import monitor_observation_fields, need_ranges

Piece = tuple[int, int, int]  # (global_start, global_end, position in the stored array)


@dataclass
class ShardValues:
    """Values stored by one rank for one kind of state. ``values[pos:pos + (g1 - g0)]`` holds global
    ``[g0, g1)`` for every piece; elements of ``values`` covered by no piece are padding."""

    pieces: tuple[Piece, ...]
    values: np.ndarray

    @property
    def real_numel(self) -> int:
        return sum(g1 - g0 for g0, g1, _ in self.pieces)

    def padding_positions(self) -> np.ndarray:
        """Storage positions of the padding elements (no global flat index: padding is not data)."""
        mask = np.ones(self.values.shape[0], dtype=bool)
        for g0, g1, pos in self.pieces:
            mask[pos:pos + g1 - g0] = False
        return np.flatnonzero(mask)

    def padding_values(self) -> np.ndarray:
        return self.values[self.padding_positions()]


@dataclass(frozen=True)
class Holding:
    """What a rank holds of one kind of state, measured from its live arrays.

    ``intervals``: global flat intervals of real data (sorted, touching ones joined);
    ``stored_numel``: elements of the live arrays (real data + padding); ``nbytes``: their bytes.
    """

    kind: str
    intervals: tuple[tuple[int, int], ...]
    stored_numel: int
    nbytes: int
    dtype: str
    location: str = "device"

    @property
    def real_numel(self) -> int:
        return sum(e - s for s, e in self.intervals)

    @property
    def padding(self) -> int:
        return self.stored_numel - self.real_numel

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "real_numel": self.real_numel,
            "stored_numel": self.stored_numel,
            "padding": self.padding,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "location": self.location,
            "num_intervals": len(self.intervals),
        }


@dataclass(frozen=True)
class TrafficItem:
    """Traffic of one rank on one group for one collective kind during one step (ring attribution)."""

    group: str
    collective: str
    calls: int
    bytes_sent: Fraction
    bytes_received: Fraction
    payload_bytes: int
    #: element dtype of the buffers moved -> calls (empty where the counter did not record dtypes)
    dtypes: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def group_kind(self) -> str:
        """``world``, ``shard`` or ``replicate`` (the part of the group name before ``[`` or ``.``)."""
        return self.group.split("[", 1)[0].split(".", 1)[0]

    @property
    def channel(self) -> str:
        """``data`` (counted by C-ZERO-005), ``control`` or ``observe`` (reported apart)."""
        for suffix in ("control", "observe"):
            if self.group.endswith("." + suffix):
                return suffix
        return "data"

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "collective": self.collective, "calls": self.calls,
                "bytes_sent": float(self.bytes_sent), "bytes_received": float(self.bytes_received),
                "payload_bytes": self.payload_bytes, "dtypes": dict(self.dtypes)}


@dataclass
class StepMemory:
    """Peaks and end-of-step live bytes of one step (bytes, per category/location)."""

    step: int
    peak_by_location: dict[str, int] = field(default_factory=dict)
    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_live_params: int = 0  # peak of params + gathered on the device (ZeRO-3's bound)
    live_at_end: dict[str, dict[str, int]] = field(default_factory=dict)  # location -> category -> bytes
    live_keys_at_end: dict[str, list[str]] = field(default_factory=dict)  # transient category -> live buffers

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "peak_by_location": dict(self.peak_by_location),
                "peak_by_category": dict(self.peak_by_category), "peak_live_params": self.peak_live_params,
                "live_at_end": {k: dict(v) for k, v in self.live_at_end.items()},
                "live_keys_at_end": {k: list(v) for k, v in self.live_keys_at_end.items()}}


@dataclass
class StepObservation:
    """One rank after one optimizer step (``step`` is 0-based: the step that consumed batch ``step``)."""

    step: int
    loss: float                       # global mean loss of the step's batch (all ranks, all micro-batches)
    local_loss: float                 # this rank's mean over its micro-batches
    grad_norm: float                  # global grad norm the rank clipped with
    clip_coef: float
    optimizer_step: int
    holdings: dict[str, Holding]
    traffic: list[TrafficItem]
    memory: StepMemory | None
    t_start: float
    t_end: float
    master: ShardValues | None = None          # float32 master after the step
    optimizer: dict[str, ShardValues] = field(default_factory=dict)
    grads: ShardValues | None = None           # reduced, averaged, clipped gradient the optimizer consumed
    gathered: np.ndarray | None = None         # full flat working params the rank uses next (param dtype)
    gathered_digest: dict[str, str] = field(default_factory=dict)  # tensor name -> digest of its bytes

    def data_traffic(self) -> list[TrafficItem]:
        return [t for t in self.traffic if t.channel == "data"]

    def bytes_sent(self, channel: str = "data") -> Fraction:
        """Bytes this rank sent during the step on ``channel`` (``data``, ``control`` or ``observe``)."""
        return sum((Fraction(t.bytes_sent) for t in self.traffic if t.channel == channel), Fraction(0))

    def traffic_by_collective(self) -> dict[tuple[str, str], tuple[int, Fraction, Fraction]]:
        """(group kind, collective) -> (calls, bytes sent, bytes received) of the step's data traffic,
        barriers left out: what C-ZERO-005 compares with the ring model."""
        out: dict[tuple[str, str], tuple[int, Fraction, Fraction]] = {}
        for t in self.data_traffic():
            if t.collective == "barrier":
                continue
            key = (t.group_kind, t.collective)
            c, s, r = out.get(key, (0, Fraction(0), Fraction(0)))
            out[key] = (c + t.calls, s + Fraction(t.bytes_sent), r + Fraction(t.bytes_received))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": self.loss,
            "local_loss": self.local_loss,
            "grad_norm": self.grad_norm,
            "clip_coef": self.clip_coef,
            "optimizer_step": self.optimizer_step,
            "holdings": {k: h.to_json() for k, h in self.holdings.items()},
            "traffic": [t.to_json() for t in self.traffic],
            "memory": self.memory.to_json() if self.memory else None,
            "wall_s": self.t_end - self.t_start,
        }


@dataclass
class RankObservation:
    """Everything one rank observed over a run."""

    rank: int
    world_size: int
    shard_group: int
    local_rank: int
    groups: dict[str, tuple[int, ...]]   # group name -> global ranks (group-rank order)
    backend: str
    steps: list[StepObservation] = field(default_factory=list)
    memory_timeline: list[dict[str, Any]] = field(default_factory=list)
    init_peak_bytes: dict[str, int] = field(default_factory=dict)
    offload: dict[str, Any] = field(default_factory=dict)

    def to_json(self, with_steps: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "shard_group": self.shard_group,
            "local_rank": self.local_rank,
            "backend": self.backend,
            "groups": {k: list(v) for k, v in self.groups.items()},
            "init_peak_bytes": dict(self.init_peak_bytes),
            "offload": dict(self.offload),
        }
        if with_steps:
            out["steps"] = [s.to_json() for s in self.steps]
        return out


@dataclass
class TrainerObservation:
    """One rank of a live trainer after one step, as ``zerosim verify`` observes it.

    ``params``: its ``full_parameters()`` by tensor name; ``state``: its ``full_optimizer_state()``
    (tensor name -> state name -> array) where exposed; ``shards``: the flat element ranges
    ``[start, stop)`` per tensor it owns (``local_shards()``) where exposed; ``resources``: the step's
    counted traffic (``"traffic"``) and resident bytes (``"memory"``) where observed;
    ``grad_norm``: the global gradient norm the trainer logged for the step, where it logs one.
    """

    phase: str
    step: int  # global, 1-based
    rank: int
    loss: float
    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]] | None = None
    shards: dict[str, list[tuple[int, int]]] | None = None
    resources: dict[str, Any] | None = None
    grad_norm: float | None = None

    @property
    def traffic(self) -> Any:
        """The step's traffic records (None: not observed)."""
        return (self.resources or {}).get("traffic")

    @property
    def resident_bytes(self) -> dict[str, int] | None:
        """Resident bytes per kind of state at the end of the step (None: not observed)."""
        return (self.resources or {}).get("memory")


class TensorValues(Protocol):
    """Full values by tensor name: ``params`` and ``state`` (tensor name -> state name -> array)."""

    @property
    def params(self) -> dict[str, np.ndarray]: ...

    @property
    def state(self) -> dict[str, dict[str, np.ndarray]]: ...


class TrainerStep(Protocol):
    """One step of a live trainer as the checks read it: every rank's observation (rank order), the
    unsharded reference's values (``ref``) and the per-element bound C-ZERO-002 allows (``bounds``)."""

    @property
    def step(self) -> int: ...

    @property
    def phase(self) -> str: ...

    @property
    def ranks(self) -> list[TrainerObservation]: ...

    @property
    def ref(self) -> TensorValues: ...

    @property
    def bounds(self) -> TensorValues: ...


def ranges_from_json(data: dict[str, Any], path: str = "ranges") -> dict[str, list[tuple[int, int]]]:
    """Flat element ranges by tensor name, as JSON gives them (lists), as tuples of ints; ConfigError
    naming ``path`` and the entry when one is not an integer pair."""
    return need_ranges(data, path)


@dataclass
class MonitorObservation:
    """One rank at one check of a live run (:mod:`zerosim.monitor`): what C-ZERO-001, -002 and -003 read
    when the monitor judges a real training run, and what each rank appends to its observation file.

    ``held``: every tensor piece the rank holds, as ``(tensor, start, stop, digest)`` (flat element range
    of the full tensor, a hex digest of its bytes computed where it lives); ranks holding the same piece
    must hold the same bytes (C-ZERO-003). ``owned``: the flat ranges of each tensor whose optimizer
    state the rank owns (C-ZERO-001); ``numels``: every tensor's element count. ``state_missing`` /
    ``state_nonfinite``: how many owned tensors lack state for an owned element / hold a non-finite
    state value, and the first one's name; ``step_counters``: the least and largest optimizer step
    counter over the rank's owned tensors and the first tensor holding the least (None: its optimizer
    keeps none). ``grad_sq``: the sum of squares of the reduced gradient over ``grad_ranges`` (each
    piece's norm accumulated in :func:`~zerosim.checks.tolerance.norm_accumulation` of ``grad_dtype``,
    squared and summed in float64; None: no gradient held); ``grad_ranges``: the flat ranges of each
    tensor whose gradient it sums (None: the owned ranges; ranks that hold the same piece of the
    reduced gradient, under DDP or in HSDP's replica groups, split it, each summing its slice);
    ``grad_numel``: how many elements it sums;
    ``grad_norm``: the norm the training loop logged, in ``grad_dtype``, computed before clipping at
    ``max_norm`` (None: no clipping). The step checks (C-ZERO-002 ``grad_accounting``, ``update``,
    ``replay``; None where off): ``accounting``: ``tensors`` (names), per tensor the ``local`` row
    [projections..., L1, micro-batches] and the ``consumed`` row [projections..., L1, sum of squares]
    (NaN: none that step), ``dtype``, ``max_grad_norm``; ``update``: the finding of the rank's sampled
    update (``optimizer``, ``dtype``, ``checked``, ``bad``, the first bad ``tensor``, ``entry``,
    ``expected``, ``got``, ``bound``, ``worst_ratio``) and ``update_samples``: the samples it is
    recomputed from (the rank's own file only); ``replay``: the replay finding (``step``, ``checked``,
    the first mismatching ``tensor`` with its ``contributed``, ``first``, ``second`` projections and
    ``bound``); ``step_checks_off``: which of them are off for this framework, and why.
    """

    rank: int
    world_size: int
    step: int
    adapter: str
    held: list[tuple[str, int, int, str]] = field(default_factory=list)
    owned: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)
    state_missing: tuple[int, str | None] = (0, None)
    state_nonfinite: tuple[int, str | None] = (0, None)
    step_counters: tuple[int, int, str | None] | None = None
    grad_sq: float | None = None
    grad_ranges: dict[str, list[tuple[int, int]]] | None = None
    grad_numel: int = 0
    grad_norm: float | None = None
    grad_dtype: str = "float32"
    max_norm: float | None = None
    loss: float | None = None
    accounting: dict[str, Any] | None = None
    update: dict[str, Any] | None = None
    update_samples: list[dict[str, Any]] | None = None
    replay: dict[str, Any] | None = None
    step_checks_off: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "world_size": self.world_size, "step": self.step, "adapter": self.adapter,
            "held": [list(h) for h in self.held],
            "owned": {k: [list(r) for r in v] for k, v in self.owned.items()},
            "numels": dict(self.numels),
            "state_missing": list(self.state_missing), "state_nonfinite": list(self.state_nonfinite),
            "step_counters": None if self.step_counters is None else list(self.step_counters),
            "grad_sq": self.grad_sq, "grad_ranges": None if self.grad_ranges is None else
            {k: [list(r) for r in v] for k, v in self.grad_ranges.items()},
            "grad_numel": self.grad_numel, "grad_norm": self.grad_norm,
            "grad_dtype": self.grad_dtype, "max_norm": self.max_norm, "loss": self.loss,
            **{k: v for k, v in (("accounting", self.accounting), ("update", self.update),
                                 ("update_samples", self.update_samples), ("replay", self.replay),
                                 ("step_checks_off", self.step_checks_off)) if v is not None},
        }

    @classmethod
    def from_json(cls, data: Any) -> MonitorObservation:
        """The observation of one JSON line, every field checked for its type and range
        (:mod:`zerosim.values.observation_fields`); a ConfigError naming the field otherwise. Keys it does not
        know (``monitor_s``) are left alone."""
        return cls(**monitor_observation_fields(data))


def digest(array: np.ndarray) -> str:
    """A short content digest of an array's bytes (dtype and shape included)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{array.dtype.name}{array.shape}".encode())
    h.update(np.ascontiguousarray(array).view(np.uint8).tobytes())
    return h.hexdigest()


#: the dataclasses a stored run's observations are made of (:func:`zerosim.files.datafile.load`'s ``types``)
STORED_TYPES = (RankObservation, StepObservation, ShardValues, Holding, TrafficItem, StepMemory)
