"""The sharded checkpoint format: one safetensors file per writing rank plus one JSON index.

A checkpoint is a directory::

    index.json                                   the metadata index, written last
    <save id>-rank00000.safetensors              rank 0's shards (its owned global ranges)
    <save id>-rank00001.safetensors              ...

Each shard file is a plain safetensors file (8-byte little-endian header length, JSON header,
raw little-endian data): one 1-D entry per (state, global range) named ``"<state>/<start>:<end>"``
(``master/0:1024``, ``exp_avg/0:1024``), the states in index order and each state's ranges in
ascending order. Only owned elements are written: padding never is. The index holds what a loader
needs without opening a shard file: the layout (tensor names, shapes, dtypes, blocks, offsets),
the plan it was saved under (strategy, partitioner, world size, shard group size), the precision,
the optimizer spec and step count, and per file its global ranges, the byte offset of every entry,
its size, the sha256 of the whole file and of every ``block_bytes`` block of its data section (so
a rank that reads only part of a file still verifies every byte it uses).

Writes are atomic: every file goes to a temporary name, is fsync'd and renamed; the index is
written the same way last and the directory fsync'd after it. Shard files carry the save id in
their names, so a new save never overwrites a file the previous index names: a save that dies
before its index is renamed leaves the previous checkpoint loadable.

This module writes and reads the files; the index's types, the file geometry and the index's
validation live in :mod:`zerosim.checkpoint.index` (re-exported here), the safe opening of files in
:mod:`zerosim.checkpoint.files`.

Why one module of this length: writing a shard file, committing the index and reading a file back
are the two halves of one format; the index's own types and validation live in
:mod:`zerosim.checkpoint.index`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..values.dtypes import itemsize
from .files import member_problem, open_member
from .index import (
    DEFAULT_BLOCK_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_BASE_BYTES,
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SHARD_FILE,
    TEMP_PREFIX,
    CheckpointIndex,
    Entry,
    FileRecord,
    header_bytes,
    index_from_json,
    index_size_limit,
    leftover_files,
    plan_entries,
    read_index,
    shard_file_name,
    shard_metadata,
)

STREAM_BYTES = 64 << 20  #: the most bytes one read or write of a stream holds at once
RECENT_BYTES = 4 << 20  #: a span this small is kept for the next read of the same file
RECENT_FILES = 16  #: ... for at most this many files at once

# ---------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------


class _BlockHasher:
    """sha256 of the whole stream and of every ``block`` bytes of the data section after the header."""

    def __init__(self, block: int):
        self.block = block
        self.whole = hashlib.sha256()
        self.blocks: list[str] = []
        self._cur = hashlib.sha256()
        self._fill = 0

    def header(self, data: bytes) -> None:
        self.whole.update(data)

    def data(self, data: memoryview) -> None:
        self.whole.update(data)
        pos = 0
        while pos < len(data):
            take = min(self.block - self._fill, len(data) - pos)
            self._cur.update(data[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == self.block:
                self.blocks.append(self._cur.hexdigest())
                self._cur, self._fill = hashlib.sha256(), 0

    def finish(self) -> tuple[str, tuple[str, ...]]:
        if self._fill:
            self.blocks.append(self._cur.hexdigest())
        return self.whole.hexdigest(), tuple(self.blocks)


def fsync_directory(directory: Path) -> None:
    """Persist the directory's entries (renames) where the platform allows opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """The temporary name ``name`` is written under: ``.tmp-<pid>-<random>-<name>`` (never an existing
    file's name: it is created exclusively)."""
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"


def _create_exclusive(path: Path, created: list[Path] | None) -> Any:
    """Open ``path`` for writing, failing if anything (a file, a link) already has that name; record it
    in ``created`` (the files this write made, for the clean-up of a failed write)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    if created is not None:
        created.append(path)
    return os.fdopen(fd, "wb")


def atomic_write_bytes(path: Path, data: bytes, created: list[Path] | None = None) -> None:
    """Write ``data`` to a temporary name beside ``path``, fsync it, rename it over ``path``, fsync the
    directory: a reader sees the old file or the new one, never a partial one."""
    tmp = path.with_name(temp_name(path.name))
    with _create_exclusive(tmp, created) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def write_shard_file(
    directory: Path,
    name: str,
    rank: int,
    ranges: Sequence[tuple[int, int]],
    states: Sequence[str],
    dtype: str,
    chunks: Any,
    block_bytes: int,
    metadata: dict[str, str],
    created: list[Path] | None = None,
) -> FileRecord:
    """Stream one shard file to ``directory/name`` atomically and return its index record.

    ``chunks(state, start, end)`` yields numpy arrays of ``dtype`` whose concatenation is the state's
    global elements ``[start, end)``; nothing larger than one yielded array is held here. The paths
    this call creates (its temporary, then the file) are appended to ``created``."""
    isz = itemsize(dtype)
    entries = plan_entries(states, ranges, isz)
    head = header_bytes(entries, dtype, metadata)
    hasher = _BlockHasher(block_bytes)
    hasher.header(head)
    tmp = directory / temp_name(name)
    size = len(head)
    with _create_exclusive(tmp, created) as fh:
        fh.write(head)
        for e in entries:
            got = 0
            for arr in chunks(e.state, e.start, e.end):
                a = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))
                mv = a.data.cast("B")
                fh.write(mv)
                hasher.data(mv)
                got += a.shape[0]
            if got != e.numel:
                raise ValueError(f"{e.state} [{e.start}, {e.end}): the source gave {got} elements")
            size += e.numel * isz
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / name)
    if created is not None:
        created.append(directory / name)
    whole, blocks = hasher.finish()
    return FileRecord(name, rank, tuple(ranges), entries, len(head), size, whole, blocks)


def commit_index(
    directory: Path, index: CheckpointIndex, *, prune: bool = True, created: list[Path] | None = None
) -> None:
    """Write the index last (atomically); with ``prune`` (an engine save into its own directory) then
    remove shard files and temporaries no index names."""
    atomic_write_bytes(
        directory / INDEX_NAME, (json.dumps(index.to_json(), indent=1) + "\n").encode(), created
    )
    if not prune:
        return
    keep = {f.name for f in index.files}
    for p in directory.iterdir():
        stale_shard = SHARD_FILE.match(p.name) and p.name not in keep
        stale_temp = p.name.startswith(TEMP_PREFIX)
        if (stale_shard or stale_temp) and p.is_file():
            p.unlink(missing_ok=True)
    fsync_directory(directory)


# ---------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------


@dataclass
class ReadStats:
    """What a reader did: files opened, read calls, bytes read, blocks verified."""

    files_opened: list[str] = field(default_factory=list)
    reads: int = 0
    bytes_read: int = 0
    blocks_verified: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "files_opened": list(self.files_opened),
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "blocks_verified": self.blocks_verified,
        }


class CheckpointReader:
    """Reads global element ranges of a checkpoint's states, touching only the files and the
    checksum blocks that overlap them; every block read is verified against the index first."""

    def __init__(self, directory: str | Path, index: CheckpointIndex | None = None):
        self.directory = Path(directory)
        self.index = index if index is not None else read_index(self.directory)
        self.dtype = np.dtype(self.index.state_dtype).newbyteorder("<")
        self.isz = self.dtype.itemsize
        self.stats = ReadStats()
        self._handles: dict[str, Any] = {}
        #: per file, the last small verified span read (at most RECENT_FILES spans of RECENT_BYTES)
        self._recent: dict[str, tuple[int, bytes]] = {}
        by_state: dict[str, list[tuple[int, int, Entry, FileRecord]]] = {}
        for f in self.index.files:
            for e in f.entries:
                by_state.setdefault(e.state, []).append((e.start, e.end, e, f))
        self._by_state = {s: sorted(v, key=lambda t: t[0]) for s, v in by_state.items()}

    def check_files_present(self) -> None:
        """Every file the index names is a regular file inside the directory with the recorded size
        (judged by ``lstat``: no file is opened, no link followed)."""
        for f in self.index.files:
            p = self.directory / f.name
            why = member_problem(self.directory, f.name)
            if why is None:
                size = os.lstat(p).st_size
                if size != f.nbytes:
                    why = f"has {size} bytes, the index records {f.nbytes} (truncated or replaced)"
            if why is not None:
                raise ConfigError("checkpoint file", str(p), why)

    def open_file(self, f: FileRecord) -> Any:
        """The file half of the one validator (the index half is :func:`index_from_json`): open ``f``
        as a regular file inside the directory (:func:`open_member`), check its size and compare its
        safetensors header byte for byte with the header the writer emits for the index's entries.
        Data blocks are checked against their digests as they are read (:meth:`_read_blocks`)."""
        p = self.directory / f.name
        fh, size = open_member(self.directory, f.name)
        try:
            if size != f.nbytes:
                raise ConfigError(
                    "checkpoint file",
                    str(p),
                    f"has {size} bytes, the index records {f.nbytes} (truncated or replaced)",
                )
            want = header_bytes(f.entries, self.index.state_dtype, shard_metadata(self.index.save_id, f.rank))
            got = fh.read(len(want))
            if got != want:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)),
                )
                raise ConfigError(
                    "checkpoint file",
                    str(p),
                    f"its safetensors header differs from the index's entries at byte {at}: corrupted",
                )
        except OSError as e:
            fh.close()
            raise ConfigError("checkpoint file", str(p), f"cannot be read: {e.strerror or e}") from None
        except BaseException:
            fh.close()
            raise
        return fh

    def verify_file(self, f: FileRecord) -> str | None:
        """None when ``f`` passes :meth:`open_file` and every data block matches its digest (read through
        the same path a load reads by); else what is wrong with it."""
        try:
            for e in f.entries:
                for _ in self.iter_chunks(e.state, e.start, e.end):
                    pass
        except ConfigError as err:
            return err.reason
        return None

    def files_for(self, state: str, ranges: Iterable[tuple[int, int]]) -> set[str]:
        """The files holding any element of ``ranges`` of ``state``."""
        out = set()
        for a, b in ranges:
            for s, e, _, f in self._by_state.get(state, []):
                if s < b and a < e:
                    out.add(f.name)
        return out

    def _handle(self, f: FileRecord) -> Any:
        h = self._handles.get(f.name)
        if h is None:
            h = self.open_file(f)  # kept open until close()
            self._handles[f.name] = h
            self.stats.files_opened.append(f.name)
        return h

    def read_into(self, state: str, start: int, out: np.ndarray) -> None:
        """Fill ``out`` with the state's global elements ``[start, start + len(out))``."""
        end = start + out.shape[0]
        for s, e, entry, f in self._by_state.get(state, []):
            a, b = max(start, s), min(end, e)
            if b <= a:
                continue
            self._read_span(
                f, entry.offset + (a - s) * self.isz, (b - a) * self.isz, out[a - start : b - start]
            )

    def _read_span(self, f: FileRecord, pos: int, nbytes: int, out: np.ndarray) -> None:
        """Read data-section bytes ``[pos, pos + nbytes)`` of ``f`` into ``out``, in block-aligned pieces of
        at most STREAM_BYTES, each block checked against its sha256 before it is used."""
        blk = self.index.block_bytes
        data_len = f.nbytes - f.data_start
        done = 0
        while done < nbytes:
            p0 = pos + done
            b0 = p0 // blk
            want_end = min(pos + nbytes, p0 + max(STREAM_BYTES, blk))
            b1 = -(-want_end // blk)
            lo, hi = b0 * blk, min(b1 * blk, data_len)
            last = self._recent.get(f.name)
            if last is not None and last[0] <= p0 and want_end <= last[0] + len(last[1]):
                lo, raw = last  # verified blocks a recent read of this file returned
                hi = lo + len(raw)
            else:
                raw = self._read_blocks(f, b0, b1, lo, hi)
                self._remember(f.name, lo, raw)
            take = min(want_end, hi) - p0
            n = take // self.isz
            out_start = done // self.isz
            out[out_start : out_start + n] = np.frombuffer(raw, self.dtype, count=n, offset=p0 - lo)
            done += take

    def _remember(self, name: str, lo: int, raw: bytes) -> None:
        self._recent.pop(name, None)
        if len(raw) <= RECENT_BYTES:
            self._recent[name] = (lo, raw)
            while len(self._recent) > RECENT_FILES:
                self._recent.pop(next(iter(self._recent)))

    def _read_blocks(self, f: FileRecord, b0: int, b1: int, lo: int, hi: int) -> bytes:
        """Data-section bytes ``[lo, hi)`` (blocks ``b0 .. b1-1``) of ``f``, every block's sha256 checked."""
        blk = self.index.block_bytes
        h = self._handle(f)
        try:
            h.seek(f.data_start + lo)
            raw = h.read(hi - lo)
        except OSError as e:
            raise ConfigError(
                "checkpoint file", str(self.directory / f.name), f"cannot be read: {e.strerror or e}"
            ) from None
        self.stats.reads += 1
        self.stats.bytes_read += len(raw)
        if len(raw) != hi - lo:
            raise ConfigError(
                "checkpoint file",
                str(self.directory / f.name),
                f"ends early: {len(raw)} of {hi - lo} bytes at offset {f.data_start + lo}",
            )
        for b in range(b0, b1):
            piece = raw[b * blk - lo : min((b + 1) * blk, hi) - lo]
            if b >= len(f.block_sha256) or hashlib.sha256(piece).hexdigest() != f.block_sha256[b]:
                raise ConfigError(
                    "checkpoint file",
                    str(self.directory / f.name),
                    f"checksum mismatch in data block {b} (bytes [{f.data_start + b * blk}, "
                    f"{f.data_start + b * blk + len(piece)})): corrupted",
                )
            self.stats.blocks_verified += 1
        return raw

    def iter_chunks(
        self, state: str, start: int, end: int, chunk_elems: int | None = None
    ) -> Iterator[np.ndarray]:
        """The state's elements ``[start, end)`` in arrays of at most ``chunk_elems`` (a stream)."""
        step = chunk_elems or max(1, STREAM_BYTES // self.isz)
        for a in range(start, end, step):
            buf = np.empty(min(step, end - a), self.dtype)
            self.read_into(state, a, buf)
            yield buf

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self._recent.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_full_state(directory: str | Path) -> tuple[CheckpointIndex, dict[str, np.ndarray]]:
    """Every state of the checkpoint in ``directory``, whole: what a load at world size 1 reads, through
    the same validation (:func:`read_index`, :meth:`CheckpointReader.check_files_present`, every file
    opened by :meth:`CheckpointReader.open_file`, every block checked as it is read)."""
    index = read_index(directory)
    with CheckpointReader(directory, index) as reader:
        reader.check_files_present()
        out = {}
        for state in index.states:
            arr = np.empty(index.total_numel, reader.dtype)
            reader.read_into(state, 0, arr)
            out[state] = arr
    return index, out


__all__ = [  # the index's names are part of this module's interface too
    "DEFAULT_BLOCK_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_BASE_BYTES",
    "INDEX_NAME",
    "SAFETENSORS_DTYPES",
    "SHARD_FILE",
    "TEMP_PREFIX",
    "CheckpointIndex",
    "CheckpointReader",
    "Entry",
    "FileRecord",
    "ReadStats",
    "atomic_write_bytes",
    "commit_index",
    "fsync_directory",
    "header_bytes",
    "index_from_json",
    "index_size_limit",
    "leftover_files",
    "plan_entries",
    "read_full_state",
    "read_index",
    "shard_file_name",
    "shard_metadata",
    "temp_name",
    "write_shard_file",
]
