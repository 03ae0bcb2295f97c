"""Save and load a :class:`~zerosim.engine.rank_state.RankState`'s state as a sharded checkpoint.

Saving (collective over the engine's ranks, data written by replica group 0 only): rank 0 draws a
save id and broadcasts it; every writing rank streams its owned global ranges of the master and of
each optimizer state into its own safetensors file (temporary name, fsync, rename); one small
all-gather over the control group brings every file's size and sha256s to rank 0, which writes the
index last (temporary name, fsync, rename, fsync of the directory) and removes files of older saves.
A final barrier returns on every rank once the index is in place.

Loading (collective): every rank reads the index, checks it against its own engine (layout,
optimizer, dtypes, strict or not, every named file present at its recorded size), reads only the
blocks of the files that overlap the global ranges it owns under its own plan (verifying each
block's sha256), and stages the values in new arrays. The ranks then agree through one scalar
all-reduce on the control group; only if every rank validated does any rank apply its staged
arrays, set the step counter and rebuild its working parameters. Otherwise every rank raises the
same one-line :class:`~zerosim.errors.ConfigError` (the first failing rank's), having changed nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checks.checkpoint import StateSnapshot
from ..engine.observation import full_params_view
from ..engine.step import refresh_params
from ..errors import ConfigError
from ..values.intervals import merge_adjacent
from .format import (
    DEFAULT_BLOCK_BYTES,
    CheckpointIndex,
    CheckpointReader,
    FileRecord,
    ReadStats,
    commit_index,
    plan_entries,
    read_index,
    shard_file_name,
    shard_metadata,
    write_shard_file,
)

DIGEST_WORDS = 8  #: a sha256 as eight 32-bit words, each exact in a float64
ERROR_BYTES = 2048  #: the longest validation message the ranks share


@dataclass
class SaveResult:
    """What one rank did in a save: the file it wrote (None on replicas and ranks owning nothing)."""

    directory: Path
    save_id: str
    file: str | None
    index: CheckpointIndex | None = None  # rank 0 only


@dataclass
class LoadResult:
    """What one rank loaded: torch's ``missing_keys`` / ``unexpected_keys`` (tensor names), the step
    counter restored, and the rank's reads."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    step: int
    stats: ReadStats = field(default_factory=ReadStats)


def state_names(engine: Any) -> tuple[str, ...]:
    """The states a checkpoint of ``engine`` holds: the master, then the optimizer's arrays."""
    return ("master", *engine.run.spec.state_names)


def state_array(engine: Any, name: str) -> Any:
    return engine.master if name == "master" else engine.opt_state[name]


def engine_pieces(engine: Any) -> tuple[tuple[int, int, int], ...]:
    """``(global start, global end, position in the rank's shard)`` of what the rank owns."""
    return tuple(engine.owned_pieces)


def writer_ranges_of(engine: Any) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """``(world rank, global ranges)`` of every rank of ``engine``'s run that writes a file."""
    if not engine.sharded_optim:
        return [(0, ((0, engine.total),))] if engine.total else []
    out = []
    for j in range(engine.k):
        ranges = merge_adjacent((g0, g1) for g0, g1, _ in engine.units.owned_global(j))
        if ranges:
            out.append((j, ranges))
    return out


# ---------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------


def _digest_words(hexdigest: str) -> list[float]:
    raw = bytes.fromhex(hexdigest)
    return [float(int.from_bytes(raw[i : i + 4], "little")) for i in range(0, 32, 4)]


def _words_digest(words: Sequence[float]) -> str:
    return b"".join(int(w).to_bytes(4, "little") for w in words).hex()


def save_engine_state(
    engine: Any, directory: str | Path, *, block_bytes: int = DEFAULT_BLOCK_BYTES, before_index: Any = None
) -> SaveResult:
    """Save ``engine``'s master weights, optimizer state and step counter to ``directory`` (collective:
    every rank of the engine calls it between steps). ``before_index`` (rank 0, tests) runs after every
    shard file is in place and before the index is written."""
    xp = engine.xp
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ConfigError("block_bytes", block_bytes, "must be a positive number of bytes")
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ConfigError("checkpoint", str(d), "exists and is not a directory")
    d.mkdir(parents=True, exist_ok=True)
    nonce = np.array([float(secrets.randbits(48)) if engine.rank == 0 else 0.0])
    nonce = xp.to_numpy(engine.control.broadcast(xp.from_numpy(nonce), root=0))
    step = int(engine.opt_state["step"])
    save_id = f"{step:08d}-{int(nonce[0]):012x}"
    states = state_names(engine)
    dtype = engine.state_dtype
    isz = np.dtype(dtype).itemsize
    writers = writer_ranges_of(engine)
    mine = dict(writers).get(engine.rank) if engine.group_index == 0 else None
    n_blocks = max(
        (-(-len(states) * sum(b - a for a, b in r) * isz // block_bytes) for _, r in writers), default=0
    )
    width = 3 + DIGEST_WORDS * (1 + n_blocks)
    row = np.zeros(width)
    name = None
    if mine:
        name = shard_file_name(save_id, engine.rank)
        pieces = sorted(engine_pieces(engine))
        host = {s: xp.to_numpy(state_array(engine, s)) for s in states}

        def chunks(state: str, a: int, b: int) -> Iterator[np.ndarray]:
            arr = host[state]
            for g0, g1, pos in pieces:
                lo, hi = max(a, g0), min(b, g1)
                if hi > lo:
                    yield arr[pos + lo - g0 : pos + hi - g0]

        meta = shard_metadata(save_id, engine.rank)
        rec = write_shard_file(d, name, engine.rank, mine, states, dtype, chunks, block_bytes, meta)
        row[:3] = (1.0, rec.data_start, rec.nbytes)
        row[3 : 3 + DIGEST_WORDS] = _digest_words(rec.sha256)
        for i, h in enumerate(rec.block_sha256):
            row[3 + DIGEST_WORDS * (1 + i) : 3 + DIGEST_WORDS * (2 + i)] = _digest_words(h)
    table = xp.to_numpy(engine.control.all_gather(xp.from_numpy(row))).reshape(engine.comm.world_size, width)
    index = None
    if engine.rank == 0:
        files = []
        for j, ranges in writers:
            r = table[j]
            if r[0] != 1.0:
                raise ConfigError("checkpoint", str(d), f"rank {j} did not write its shard file")
            entries = plan_entries(states, ranges, isz)
            data_len = entries[-1].offset + entries[-1].numel * isz if entries else 0
            nb = -(-data_len // block_bytes)
            blocks = tuple(
                _words_digest(r[3 + DIGEST_WORDS * (1 + i) : 3 + DIGEST_WORDS * (2 + i)]) for i in range(nb)
            )
            files.append(
                FileRecord(
                    shard_file_name(save_id, j),
                    j,
                    ranges,
                    entries,
                    int(r[1]),
                    int(r[2]),
                    _words_digest(r[3 : 3 + DIGEST_WORDS]),
                    blocks,
                )
            )
        run = engine.run
        index = CheckpointIndex(
            layout=engine.layout,
            strategy=engine.strategy.name,
            partitioner=str(run.partitioner),
            world_size=engine.comm.world_size,
            shard_group_size=engine.k,
            precision=engine.precision.name,
            state_dtype=dtype,
            optimizer=run.spec.to_dict(),
            step=step,
            states=states,
            block_bytes=block_bytes,
            save_id=save_id,
            files=tuple(files),
        )
        if before_index is not None:
            before_index()
        commit_index(d, index)
    engine.control.barrier()
    return SaveResult(d, save_id, name, index)


# ---------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Copy:
    pos: int  # position in the rank's shard
    start: int  # global element in the checkpoint's flat space
    length: int


def _plan_copies(
    engine: Any, index: CheckpointIndex, strict: bool, where: str
) -> tuple[list[_Copy], list[str], list[str]]:
    """Validate the index against the engine; return the copies (by tensor name) and the missing and
    unexpected tensor names."""
    spec = engine.run.spec
    theirs = index.optimizer.get("name")
    if theirs != spec.name:
        raise ConfigError(
            "optimizer", theirs, f"the checkpoint holds {theirs} state; this engine runs {spec.name}"
        )
    want = state_names(engine)
    for s in want:
        if s not in index.states:
            raise ConfigError(
                "optimizer state", s, f"not in the checkpoint (it holds {', '.join(index.states)})"
            )
    if index.state_dtype != engine.state_dtype:
        raise ConfigError(
            "state_dtype",
            index.state_dtype,
            f"the checkpoint's master and optimizer state are {index.state_dtype}; "
            f"this engine keeps {engine.state_dtype}",
        )
    ck = {t.name: (t, off) for t, off in zip(index.layout.tensors, index.layout.offsets, strict=True)}
    mine = {t.name: (t, off) for t, off in zip(engine.layout.tensors, engine.layout.offsets, strict=True)}
    missing = [n for n in mine if n not in ck]
    unexpected = [n for n in ck if n not in mine]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise ConfigError(
            "checkpoint",
            where,
            "; ".join(parts) + " (a checkpoint of another model? strict=False loads the tensors both have)",
        )
    for n, (t, _) in mine.items():
        if n in ck:
            c = ck[n][0]
            if c.shape != t.shape:
                raise ConfigError(
                    f"tensor {n}", c.shape, f"the checkpoint's shape; this model's is {t.shape}"
                )
            if c.dtype != t.dtype:
                raise ConfigError(
                    f"tensor {n}", c.dtype, f"the checkpoint's dtype; this model's is {t.dtype}"
                )
    starts = sorted((off, off + t.numel, n) for n, (t, off) in mine.items() if t.numel and n in ck)
    copies: list[_Copy] = []
    for g0, g1, pos in engine_pieces(engine):
        for a, b, n in starts:
            lo, hi = max(g0, a), min(g1, b)
            if hi <= lo:
                continue
            cp = _Copy(pos + lo - g0, ck[n][1] + lo - a, hi - lo)
            last = copies[-1] if copies else None
            if last and last.pos + last.length == cp.pos and last.start + last.length == cp.start:
                copies[-1] = _Copy(last.pos, last.start, last.length + cp.length)
            else:
                copies.append(cp)
    return copies, missing, unexpected


def _stage(engine: Any, directory: Path, strict: bool) -> tuple[dict[str, np.ndarray], LoadResult]:
    index = read_index(directory)
    copies, missing, unexpected = _plan_copies(engine, index, strict, str(directory))
    with CheckpointReader(directory, index) as reader:
        reader.check_files_present()
        staged = {}
        for s in state_names(engine):
            arr = engine.xp.to_numpy(state_array(engine, s), copy=True)  # missing tensors keep their values
            for c in copies:
                reader.read_into(s, c.start, arr[c.pos : c.pos + c.length])
            staged[s] = arr
        return staged, LoadResult(missing, unexpected, index.step, reader.stats)


def _agree(engine: Any, error: ConfigError | None) -> None:
    """All ranks learn whether any rank failed to validate; if one did, every rank raises its error."""
    xp, n = engine.xp, engine.comm.world_size
    flag = np.array([float(n - engine.rank) if error is not None else 0.0])
    worst = float(xp.to_numpy(engine.control.all_reduce(xp.from_numpy(flag), "max"))[0])
    if worst == 0.0:
        return
    root = n - int(worst)
    msg = np.zeros(ERROR_BYTES)
    if engine.rank == root:
        assert error is not None
        raw = "\x1f".join((error.field, str(error.value), error.reason)).encode()[:ERROR_BYTES]
        msg[: len(raw)] = np.frombuffer(raw, np.uint8)
    got = xp.to_numpy(engine.control.broadcast(xp.from_numpy(msg), root=root))
    text = bytes(int(b) for b in got if b).decode(errors="replace")
    fld, value, reason = (text.split("\x1f") + ["", ""])[:3]
    raise ConfigError(fld, value, f"{reason} (found by rank {root}; nothing was loaded)")


def load_engine_state(engine: Any, directory: str | Path, *, strict: bool = True) -> LoadResult:
    """Load a checkpoint saved at any world size, strategy and partitioner into ``engine`` (collective:
    every rank calls it between steps). ``strict=False`` loads the tensors the model and the checkpoint
    share and reports the others, as torch's ``load_state_dict``; a tensor of another shape or dtype is
    an error either way."""
    d = Path(directory)
    error: ConfigError | None = None
    staged: dict[str, np.ndarray] = {}
    result = LoadResult([], [], 0)
    try:
        staged, result = _stage(engine, d, strict)
    except ConfigError as e:
        error = e
    _agree(engine, error)
    xp = engine.xp
    for s, arr in staged.items():
        xp.assign(state_array(engine, s), xp.from_numpy(arr))
    engine.opt_state["step"] = result.step
    refresh_params(engine)
    return result


def load_full_state(engine: Any, snapshot: StateSnapshot) -> None:
    """Give ``engine`` (collective) the full flat state of ``snapshot``, each rank keeping its own pieces:
    the same state a checkpoint load applies, without files."""
    xp = engine.xp
    for s in state_names(engine):
        arr = xp.to_numpy(state_array(engine, s), copy=True)
        full = snapshot.states[s]
        for g0, g1, pos in engine_pieces(engine):
            arr[pos : pos + g1 - g0] = full[g0:g1]
        xp.assign(state_array(engine, s), xp.from_numpy(arr))
    engine.opt_state["step"] = snapshot.step
    refresh_params(engine)


def engine_snapshot(engine: Any) -> StateSnapshot:
    """The full flat state of ``engine``'s run (collective over its ranks): every state array
    all-gathered over the shard group and assembled by the plan, the working parameters gathered."""
    xp = engine.xp
    states = {}
    for s in state_names(engine):
        arr = state_array(engine, s)
        if engine.sharded_optim and engine.shard_comm is not None:
            full = engine.assemble_full_state(engine.shard_comm.all_gather(arr))
            states[s] = xp.to_numpy(full, copy=True)
        else:
            states[s] = xp.to_numpy(arr, copy=True)
    return StateSnapshot(
        int(engine.opt_state["step"]),
        states,
        full_params_view(engine),
        label=f"{engine.strategy.name} world {engine.comm.world_size} rank {engine.rank}",
    )
