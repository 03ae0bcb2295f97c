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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import itemsize
from ..errors import ConfigError
from ..layout import ParamLayout, TensorSpec

FORMAT_NAME = "zerosim-sharded-checkpoint"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
DEFAULT_BLOCK_BYTES = 1 << 20  #: checksum block of a shard file's data section
STREAM_BYTES = 64 << 20  #: the most bytes one read or write of a stream holds at once
RECENT_BYTES = 4 << 20  #: a span this small is kept for the next read of the same file
RECENT_FILES = 16  #: ... for at most this many files at once
SHARD_FILE = re.compile(r"^\d{8}-[0-9a-f]{12}-rank\d{5}\.safetensors$")
TEMP_PREFIX = ".tmp-"

#: safetensors dtype codes of the state dtypes a checkpoint stores
SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}


def shard_file_name(save_id: str, rank: int) -> str:
    return f"{save_id}-rank{rank:05d}.safetensors"


# ---------------------------------------------------------------------------------------------------
# the index
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One safetensors entry: global elements ``[start, end)`` of ``state``, at byte ``offset`` of the
    file's data section."""

    state: str
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileRecord:
    """One shard file as the index lists it."""

    name: str
    rank: int
    ranges: tuple[tuple[int, int], ...]
    entries: tuple[Entry, ...]
    data_start: int  # bytes before the data section (8 + header length)
    nbytes: int  # the whole file
    sha256: str
    block_sha256: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rank": self.rank,
            "ranges": [list(r) for r in self.ranges],
            "entries": [[e.state, e.start, e.end, e.offset] for e in self.entries],
            "data_start": self.data_start,
            "bytes": self.nbytes,
            "sha256": self.sha256,
            "block_sha256": list(self.block_sha256),
        }


@dataclass(frozen=True)
class CheckpointIndex:
    """The metadata index of one checkpoint (``index.json``)."""

    layout: ParamLayout
    strategy: str
    partitioner: str
    world_size: int
    shard_group_size: int
    precision: str
    state_dtype: str
    optimizer: dict[str, Any]
    step: int
    states: tuple[str, ...]  # "master" first, then the optimizer's state names
    block_bytes: int
    save_id: str
    files: tuple[FileRecord, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_numel(self) -> int:
        return self.layout.total_numel

    def to_json(self) -> dict[str, Any]:
        t = self.layout
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "save_id": self.save_id,
            "layout": {
                "name": t.name,
                "total_numel": t.total_numel,
                "aliases": dict(t.aliases),
                "tensors": [
                    {
                        "name": s.name,
                        "shape": list(s.shape),
                        "dtype": s.dtype,
                        "block": s.block,
                        "offset": off,
                    }
                    for s, off in zip(t.tensors, t.offsets, strict=True)
                ],
            },
            "strategy": self.strategy,
            "partitioner": self.partitioner,
            "world_size": self.world_size,
            "shard_group_size": self.shard_group_size,
            "writers": "the ranks of replica group 0 (one copy of the state)",
            "precision": self.precision,
            "state_dtype": self.state_dtype,
            "optimizer": self.optimizer,
            "step": self.step,
            "states": list(self.states),
            "block_bytes": self.block_bytes,
            "files": [f.to_json() for f in self.files],
            **self.extra,
        }


def _need(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ConfigError(f"{where}.{key}", None, "missing from the checkpoint index")
    v = data[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ConfigError(f"{where}.{key}", v, "has the wrong type in the checkpoint index")
    return v


def index_from_json(data: Any, where: str = INDEX_NAME) -> CheckpointIndex:
    """Parse and validate an index; every problem is a ConfigError naming the field."""
    if not isinstance(data, dict):
        raise ConfigError(where, type(data).__name__, "is not a JSON object")
    if data.get("format") != FORMAT_NAME:
        raise ConfigError(f"{where}.format", data.get("format"), f"not a {FORMAT_NAME} index")
    if data.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{where}.version", data.get("version"), f"this zerosim reads version {FORMAT_VERSION}"
        )
    lay = _need(data, "layout", dict, where)
    try:
        tensors = tuple(
            TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["block"])
            for t in _need(lay, "tensors", list, f"{where}.layout")
        )
        layout = ParamLayout(tensors, dict(lay.get("aliases", {})), str(lay.get("name", "custom")))
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{where}.layout.tensors", None, f"malformed tensor entry ({e})") from None
    offsets = [t.get("offset") for t in lay["tensors"]]
    if offsets != list(layout.offsets):
        raise ConfigError(f"{where}.layout.tensors", offsets, "offsets do not follow the tensor sizes")
    states = tuple(_need(data, "states", list, where))
    state_dtype = _need(data, "state_dtype", str, where)
    if state_dtype not in SAFETENSORS_DTYPES:
        raise ConfigError(f"{where}.state_dtype", state_dtype, f"known: {', '.join(SAFETENSORS_DTYPES)}")
    block = _need(data, "block_bytes", int, where)
    if block <= 0:
        raise ConfigError(f"{where}.block_bytes", block, "must be positive")
    files = []
    for i, f in enumerate(_need(data, "files", list, where)):
        fw = f"{where}.files[{i}]"
        if not isinstance(f, dict):
            raise ConfigError(fw, f, "is not an object")
        name = _need(f, "name", str, fw)
        if "/" in name or "\\" in name or name.startswith("."):
            raise ConfigError(f"{fw}.name", name, "must be a plain file name inside the checkpoint directory")
        try:
            entries = tuple(
                Entry(str(s), int(a), int(b), int(o)) for s, a, b, o in _need(f, "entries", list, fw)
            )
            ranges = tuple((int(a), int(b)) for a, b in _need(f, "ranges", list, fw))
        except (TypeError, ValueError):
            raise ConfigError(f"{fw}.entries", None, "malformed entry list") from None
        files.append(
            FileRecord(
                name,
                _need(f, "rank", int, fw),
                ranges,
                entries,
                _need(f, "data_start", int, fw),
                _need(f, "bytes", int, fw),
                _need(f, "sha256", str, fw),
                tuple(_need(f, "block_sha256", list, fw)),
            )
        )
    known = {
        "format",
        "version",
        "save_id",
        "layout",
        "strategy",
        "partitioner",
        "world_size",
        "shard_group_size",
        "writers",
        "precision",
        "state_dtype",
        "optimizer",
        "step",
        "states",
        "block_bytes",
        "files",
    }
    idx = CheckpointIndex(
        layout,
        _need(data, "strategy", str, where),
        _need(data, "partitioner", str, where),
        _need(data, "world_size", int, where),
        _need(data, "shard_group_size", int, where),
        _need(data, "precision", str, where),
        state_dtype,
        _need(data, "optimizer", dict, where),
        _need(data, "step", int, where),
        states,
        block,
        _need(data, "save_id", str, where),
        tuple(files),
        {k: v for k, v in data.items() if k not in known},
    )
    _check_coverage(idx, where)
    return idx


def _check_coverage(idx: CheckpointIndex, where: str) -> None:
    """Every state's entries cover ``[0, total)`` exactly once (a missing range is a missing piece)."""
    for state in idx.states:
        spans = sorted((e.start, e.end, f.name) for f in idx.files for e in f.entries if e.state == state)
        pos = 0
        for a, b, name in spans:
            if a != pos:
                what = "overlaps the previous entry" if a < pos else f"leaves elements [{pos}, {a}) unwritten"
                raise ConfigError(f"{where}.files", name, f"{state} range [{a}, {b}) {what}")
            pos = b
        if pos != idx.total_numel:
            raise ConfigError(f"{where}.files", state, f"elements [{pos}, {idx.total_numel}) are in no file")
    for f in idx.files:
        unknown = {e.state for e in f.entries} - set(idx.states)
        if unknown:
            raise ConfigError(f"{where}.files", f.name, f"entries of unknown states {sorted(unknown)}")


def read_index(directory: str | Path) -> CheckpointIndex:
    """The index of the checkpoint in ``directory`` (ConfigError naming the path when it is not one)."""
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError("checkpoint", str(d), "is not a directory")
    p = d / INDEX_NAME
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            "checkpoint", str(d), f"has no {INDEX_NAME}: not a checkpoint (or no save finished)"
        ) from None
    except OSError as e:
        raise ConfigError("checkpoint", str(p), f"cannot be read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("checkpoint", str(p), f"is not valid JSON: {e}") from None
    return index_from_json(data, str(p))


# ---------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------


def plan_entries(states: Sequence[str], ranges: Sequence[tuple[int, int]], isz: int) -> tuple[Entry, ...]:
    """The entries of a file holding ``ranges`` of every state, in file order, with their byte offsets."""
    out, off = [], 0
    for state in states:
        for a, b in ranges:
            out.append(Entry(state, a, b, off))
            off += (b - a) * isz
    return tuple(out)


def header_bytes(entries: Sequence[Entry], dtype: str, metadata: dict[str, str]) -> bytes:
    """The safetensors header of a file with ``entries``: length prefix + JSON, padded to 8 bytes."""
    isz = itemsize(dtype)
    head: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        head[f"{e.state}/{e.start}:{e.end}"] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [e.numel],
            "data_offsets": [e.offset, e.offset + e.numel * isz],
        }
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, fsync it, rename it over ``path``, fsync the
    directory: a reader sees the old file or the new one, never a partial one."""
    tmp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{path.name}")
    with open(tmp, "wb") as fh:
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
) -> FileRecord:
    """Stream one shard file to ``directory/name`` atomically and return its index record.

    ``chunks(state, start, end)`` yields numpy arrays of ``dtype`` whose concatenation is the state's
    global elements ``[start, end)``; nothing larger than one yielded array is held here."""
    isz = itemsize(dtype)
    entries = plan_entries(states, ranges, isz)
    head = header_bytes(entries, dtype, metadata)
    hasher = _BlockHasher(block_bytes)
    hasher.header(head)
    tmp = directory / f"{TEMP_PREFIX}{os.getpid()}-{name}"
    size = len(head)
    with open(tmp, "wb") as fh:
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
    whole, blocks = hasher.finish()
    return FileRecord(name, rank, tuple(ranges), entries, len(head), size, whole, blocks)


def commit_index(directory: Path, index: CheckpointIndex) -> None:
    """Write the index last (atomically), then remove shard files and temporaries no index names."""
    atomic_write_bytes(directory / INDEX_NAME, (json.dumps(index.to_json(), indent=1) + "\n").encode())
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
        """Every file the index names exists with the recorded size (no file is opened)."""
        for f in self.index.files:
            p = self.directory / f.name
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise ConfigError(
                    "checkpoint file", str(p), "is named by the index but does not exist"
                ) from None
            if size != f.nbytes:
                raise ConfigError(
                    "checkpoint file",
                    str(p),
                    f"has {size} bytes, the index records {f.nbytes} (truncated or replaced)",
                )

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
            h = open(self.directory / f.name, "rb")  # noqa: SIM115 - kept open until close()
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
        h.seek(f.data_start + lo)
        raw = h.read(hi - lo)
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


def verify_file(directory: Path, f: FileRecord) -> str | None:
    """None if the file exists with the recorded size and whole-file sha256; else what is wrong."""
    p = directory / f.name
    if not p.is_file():
        return "is named by the index but does not exist"
    size = p.stat().st_size
    if size != f.nbytes:
        return f"has {size} bytes, the index records {f.nbytes} (truncated or replaced)"
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while chunk := fh.read(STREAM_BYTES):
            h.update(chunk)
    if h.hexdigest() != f.sha256:
        return f"sha256 {h.hexdigest()[:16]}... differs from the index's {f.sha256[:16]}...: corrupted"
    return None
