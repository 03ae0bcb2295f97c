"""Offline resharding and inspection of a checkpoint: no ranks, no engine, a bounded amount of memory.

:func:`reshard` rewrites a checkpoint for another world size, strategy and partitioner: for every
rank that would write under the new plan it streams that rank's owned global ranges out of the old
files (through :class:`~zerosim.checkpoint.format.CheckpointReader`, every block verified) into a
new shard file, at most ``STREAM_BYTES`` at a time, then writes the new index last. The result is
the checkpoint engines at the new world size would have saved (same states, dtypes, step counter).

:func:`inspect_checkpoint` reads an index and verifies every file it names (size and whole-file
sha256, streamed).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, require_positive_int
from ..partition import get_partitioner
from ..values.strategy import ShardingStrategy
from .files import checkpoint_directory
from .format import (
    DEFAULT_BLOCK_BYTES,
    CheckpointIndex,
    CheckpointReader,
    ReadStats,
    commit_index,
    leftover_files,
    read_index,
    shard_file_name,
    shard_metadata,
    write_shard_file,
)
from .ownership import writer_ranges


@dataclass
class ReshardResult:
    """The new index and what was read to write it."""

    index: CheckpointIndex
    stats: ReadStats = field(default_factory=ReadStats)


def reshard(
    path: str | Path,
    world_size: int,
    strategy: str,
    partitioner: str | None,
    out: str | Path,
    *,
    block_bytes: int | None = None,
    chunk_elems: int | None = None,
) -> ReshardResult:
    """Write the checkpoint at ``path`` as saved at ``world_size`` ranks under ``strategy`` and
    ``partitioner`` (default: the checkpoint's own) to ``out``. ``chunk_elems`` bounds each stream.

    The source is validated as a load validates it (the index, then every file as it is opened and
    every block as it is read). A write that fails for any reason (a bad source block, a full or
    read-only destination, Ctrl-C) removes every file this call created, and the directory ``out``
    if this call created it, before the error propagates; a destination problem (``OSError``) is a
    ConfigError naming ``out``. ``out`` must be new or an empty directory: one that holds anything
    (another checkpoint, an interrupted write's leftovers, a user's file) is refused before anything
    is written, so a reshard never replaces or strands files it did not create."""
    src = checkpoint_directory(path)
    if "\x00" in str(out):
        raise ConfigError("out", str(out), "a path cannot hold a NUL byte")
    dst = Path(out)
    index = read_index(src)
    n = require_positive_int("world_size", world_size)
    strat = ShardingStrategy.parse(strategy)
    strat.shard_group_size(n)  # a hybrid group size that does not divide the world: ConfigError
    part = partitioner or index.partitioner
    get_partitioner(part)  # unknown: ConfigError
    if dst.exists() and src.resolve() == dst.resolve():
        raise ConfigError("out", str(dst), "is the checkpoint being read; write the resharded one elsewhere")
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise ConfigError("out", str(dst), "exists and is not a directory")
    _require_nothing_inside(dst)
    block = block_bytes or index.block_bytes
    made_dir = not dst.exists()
    created: list[Path] = []
    try:
        dst.mkdir(parents=True, exist_ok=True)
        new, stats = _write_resharded(src, dst, index, strat, part, n, block, chunk_elems, created)
    except BaseException as e:
        _remove_created(created, dst if made_dir else None)
        if isinstance(e, OSError):
            where = e.filename if isinstance(e.filename, str) else str(dst)
            raise ConfigError(
                "out", str(dst), f"cannot write {where}: {e.strerror or e}; nothing was kept"
            ) from None
        raise
    return ReshardResult(new, stats)


def _require_nothing_inside(dst: Path) -> None:
    """ConfigError (``out``) when the directory ``dst`` exists and holds any entry, naming one of them."""
    try:
        with os.scandir(dst) as entries:
            first = next(entries, None)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError("out", str(dst), f"cannot be read: {e.strerror or e}") from None
    if first is not None:
        raise ConfigError("out", str(dst), f"is not empty (it holds {first.name!r}); a reshard writes only "
                          "into a new or empty directory, never next to files it did not create")


def _write_resharded(
    src: Path,
    dst: Path,
    index: CheckpointIndex,
    strat: ShardingStrategy,
    part: str,
    n: int,
    block: int,
    chunk_elems: int | None,
    created: list[Path],
) -> tuple[CheckpointIndex, ReadStats]:
    """Stream every new rank's file into ``dst`` and write the index last (``created`` collects the
    paths made, in order)."""
    save_id = f"{index.step:08d}-{secrets.randbits(48):012x}"  # never a name the files in ``out`` use
    files = []
    with CheckpointReader(src, index) as reader:
        reader.check_files_present()

        def chunks(state: str, a: int, b: int) -> Iterator[np.ndarray]:
            yield from reader.iter_chunks(state, a, b, chunk_elems)

        for rank, ranges in writer_ranges(index.layout, strat, part, n):
            files.append(
                write_shard_file(
                    dst,
                    shard_file_name(save_id, rank),
                    rank,
                    ranges,
                    index.states,
                    index.state_dtype,
                    chunks,
                    block,
                    shard_metadata(save_id, rank),
                    created=created,
                )
            )
        stats = reader.stats
    new = replace(
        index,
        strategy=strat.name,
        partitioner=part,
        world_size=n,
        shard_group_size=strat.shard_group_size(n),
        block_bytes=block,
        save_id=save_id,
        files=tuple(files),
    )
    commit_index(dst, new, prune=False, created=created)
    created.clear()  # the index is in place: from here on the files are the checkpoint
    return new, stats


def _remove_created(created: list[Path], made_dir: Path | None) -> None:
    """Remove the files this write created (newest first) and the directory if it made it."""
    for p in reversed(created):
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass
    created.clear()
    if made_dir is not None:
        try:
            made_dir.rmdir()  # only when empty: nothing of anyone else's is touched
        except OSError:
            pass


@dataclass
class Inspection:
    """What a checkpoint holds and whether every file matched its checksum."""

    index: CheckpointIndex
    problems: dict[str, str]  # file name -> what is wrong
    leftovers: list[str] = field(default_factory=list)  # names an interrupted write left in the directory

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        ix = self.index
        isz = np.dtype(ix.state_dtype).itemsize
        return {
            "path": None,
            "ok": self.ok,
            "world_size": ix.world_size,
            "strategy": ix.strategy,
            "partitioner": ix.partitioner,
            "shard_group_size": ix.shard_group_size,
            "precision": ix.precision,
            "state_dtype": ix.state_dtype,
            "optimizer": ix.optimizer.get("name"),
            "step": ix.step,
            "states": list(ix.states),
            "num_params": ix.total_numel,
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "numel": t.numel} for t in ix.layout.tensors
            ],
            "bytes_per_state": ix.total_numel * isz,
            "leftovers": list(self.leftovers),
            "files": [
                {
                    "name": f.name,
                    "rank": f.rank,
                    "bytes": f.nbytes,
                    "sha256": f.sha256,
                    "elements": sum(b - a for a, b in f.ranges),
                    "ranges": len(f.ranges),
                    "verified": f.name not in self.problems,
                    "problem": self.problems.get(f.name),
                }
                for f in ix.files
            ],
        }


def inspect_checkpoint(path: str | Path) -> Inspection:
    """Read the index at ``path`` (ConfigError if there is none or it is invalid) and verify every file
    it names exactly as a load does: :meth:`CheckpointReader.open_file` (a regular file inside the
    directory, its size, its header) and every data block against its digest, read through the same
    reader. A file a load would refuse is a problem here, and only such a file."""
    d = checkpoint_directory(path)
    index = read_index(d)
    problems = {}
    with CheckpointReader(d, index) as reader:
        for f in index.files:
            why = reader.verify_file(f)
            if why is not None:
                problems[f.name] = why
    return Inspection(index, problems, leftover_files(d, index))


__all__ = ["DEFAULT_BLOCK_BYTES", "Inspection", "ReshardResult", "inspect_checkpoint", "reshard"]
