"""The index of a sharded checkpoint (``index.json``): its data types, the file geometry the writer
gives every shard file, and the index half of the one validator inspect, load and reshard share.

The geometry (:func:`plan_entries`, :func:`header_bytes`) lives here, beside the parser, because the
parser checks every file record against exactly what the writer would produce for it.

Why one module of this length: the index's types, the geometry the writer gives each file and the
checks of both are one validator, shared by inspect, load and reshard; a rule stated twice could
drift.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..values.dtypes import itemsize
from ..values.layout import ParamLayout, TensorSpec
from .files import checkpoint_directory, member_problem, open_member, parse_json_strict, read_bounded

FORMAT_NAME = "zerosim-sharded-checkpoint"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
DEFAULT_BLOCK_BYTES = 1 << 20  #: checksum block of a shard file's data section
SHARD_FILE = re.compile(r"^\d{8,19}-[0-9a-f]{12}-rank\d{5,}\.safetensors$")
INDEX_BASE_BYTES = 64 << 20  #: the part of the index size limit not tied to stored bytes (index_size_limit)
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


MAX_COUNT = 1 << 62  #: the largest element count, byte offset or step an index may hold (fits int64)
STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")
SAVE_ID = re.compile(r"^\d{8,19}-[0-9a-f]{12}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_KNOWN_KEYS = frozenset(
    "format version save_id layout strategy partitioner world_size shard_group_size writers precision "
    "state_dtype optimizer step states block_bytes files".split()
)


def _need(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ConfigError(f"{where}.{key}", None, "missing from the checkpoint index")
    v = data[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ConfigError(f"{where}.{key}", v, "has the wrong type in the checkpoint index")
    return v


def _count(v: Any, field: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """``v`` as an int in ``[lo, hi]`` (bools and floats refused)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(field, v, "must be an integer in the checkpoint index")
    if not lo <= v <= hi:
        raise ConfigError(field, v, f"must lie in [{lo}, {hi}]")
    return v


def _need_count(data: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    _need(data, key, int, where)
    return _count(data[key], f"{where}.{key}", lo, hi)


def _parse_layout(lay: dict[str, Any], where: str) -> ParamLayout:
    raw = _need(lay, "tensors", list, where)
    tensors, offset = [], 0
    for i, t in enumerate(raw):
        tw = f"{where}.tensors[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(tw, t, "is not an object")
        name = _need(t, "name", str, tw)
        shape = _need(t, "shape", list, tw)
        dims = tuple(_count(d, f"{tw}.shape", 0, MAX_COUNT) for d in shape)
        numel = 1
        for d in dims:
            numel = min(numel * d, MAX_COUNT + 1)
        spec = TensorSpec(name, dims, _need(t, "dtype", str, tw), _need(t, "block", str, tw))
        if _need_count(t, "offset", tw) != offset:
            raise ConfigError(
                f"{tw}.offset", t["offset"], f"offsets do not follow the tensor sizes ({offset})"
            )
        offset += numel
        if offset > MAX_COUNT:
            raise ConfigError(f"{tw}.shape", list(dims), f"the layout would exceed {MAX_COUNT} elements")
        tensors.append(spec)
    aliases = lay.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise ConfigError(f"{where}.aliases", aliases, "must map alias names to tensor names")
    name = lay.get("name", "custom")
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name", name, "must be a string")
    return ParamLayout(tuple(tensors), dict(aliases), name)


def _parse_states(data: dict[str, Any], where: str) -> tuple[str, ...]:
    states = tuple(_need(data, "states", list, where))
    for s in states:
        if not isinstance(s, str) or not STATE_NAME.match(s):
            raise ConfigError(
                f"{where}.states", s, "a state name is a short identifier (master, exp_avg, ...)"
            )
    if len(set(states)) != len(states) or not states:
        raise ConfigError(f"{where}.states", list(states), "must name each state once, at least one")
    return states


def _parse_ranges(raw: Any, fw: str, total: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{fw}.ranges", raw, "has the wrong type in the checkpoint index")
    out: list[tuple[int, int]] = []
    for r in raw:
        if not isinstance(r, list) or len(r) != 2:
            raise ConfigError(f"{fw}.ranges", r, "a range is [start, end]")
        a, b = (_count(x, f"{fw}.ranges", 0, total) for x in r)
        if b <= a or (out and a < out[-1][1]):
            raise ConfigError(f"{fw}.ranges", r, "ranges are non-empty, ascending and disjoint")
        out.append((a, b))
    return tuple(out)


def _parse_file(f: Any, fw: str, idx_fields: dict[str, Any]) -> FileRecord:
    """One file record, checked against the geometry the writer gives it: the entries are every state
    of every range in order with packed offsets, the header is the one the writer emits for them, the
    size is header plus data, one digest per block."""
    if not isinstance(f, dict):
        raise ConfigError(fw, f, "is not an object")
    states, total, dtype = idx_fields["states"], idx_fields["total"], idx_fields["state_dtype"]
    save_id, world, block = idx_fields["save_id"], idx_fields["world_size"], idx_fields["block_bytes"]
    rank = _need_count(f, "rank", fw, 0, world - 1)
    name = _need(f, "name", str, fw)
    if name != shard_file_name(save_id, rank):
        raise ConfigError(
            f"{fw}.name",
            name,
            f"rank {rank}'s file of save {save_id} is named {shard_file_name(save_id, rank)!r}",
        )
    ranges = _parse_ranges(f.get("ranges"), fw, total)
    isz = itemsize(dtype)
    entries = plan_entries(states, ranges, isz)
    raw_entries = _need(f, "entries", list, fw)
    typed = all(
        isinstance(row, list)
        and len(row) == 4
        and type(row[0]) is str
        and all(type(x) is int for x in row[1:])
        for row in raw_entries
    )
    if not typed or raw_entries != [[e.state, e.start, e.end, e.offset] for e in entries]:
        raise ConfigError(
            f"{fw}.entries",
            None,
            "must list every state of every range in order, packed from offset 0 in elements of "
            f"the state_dtype {dtype} ({isz} bytes), as the writer lays them out",
        )
    data_len = sum(e.numel for e in entries) * isz
    head = len(header_bytes(entries, dtype, shard_metadata(save_id, rank)))
    data_start = _need_count(f, "data_start", fw)
    if data_start != head:
        raise ConfigError(f"{fw}.data_start", data_start, f"the header of these entries takes {head} bytes")
    nbytes = _need_count(f, "bytes", fw)
    if nbytes != head + data_len:
        raise ConfigError(f"{fw}.bytes", nbytes, f"header and data of these entries take {head + data_len}")
    whole = _need(f, "sha256", str, fw)
    if not SHA256_HEX.match(whole):
        raise ConfigError(f"{fw}.sha256", whole, "must be 64 lowercase hex digits")
    blocks = tuple(_need(f, "block_sha256", list, fw))
    if len(blocks) != -(-data_len // block) or not all(
        isinstance(h, str) and SHA256_HEX.match(h) for h in blocks
    ):
        raise ConfigError(
            f"{fw}.block_sha256",
            f"{len(blocks)} digests",
            f"needs {-(-data_len // block)} sha256 digests (64 hex digits each)",
        )
    return FileRecord(name, rank, ranges, entries, data_start, nbytes, whole, blocks)


def index_from_json(data: Any, where: str = INDEX_NAME) -> CheckpointIndex:
    """Parse and validate an index; every problem is a ConfigError naming the field.

    This is the index half of the one validator that inspect, load and reshard share (the file half
    is :meth:`CheckpointReader.open_file`): every number is an int in ``[0, 2**62]``, every file
    record has exactly the geometry the writer gives it (:func:`_parse_file`), ranks and names are
    unique, and every state's ranges cover ``[0, total)`` exactly once."""
    if not isinstance(data, dict):
        raise ConfigError(where, type(data).__name__, "is not a JSON object")
    if data.get("format") != FORMAT_NAME:
        raise ConfigError(f"{where}.format", data.get("format"), f"not a {FORMAT_NAME} index")
    if type(data.get("version")) is not int or data.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{where}.version", data.get("version"), f"this zerosim reads version {FORMAT_VERSION}"
        )
    layout = _parse_layout(_need(data, "layout", dict, where), f"{where}.layout")
    states = _parse_states(data, where)
    state_dtype = _need(data, "state_dtype", str, where)
    if state_dtype not in SAFETENSORS_DTYPES:
        raise ConfigError(f"{where}.state_dtype", state_dtype, f"known: {', '.join(SAFETENSORS_DTYPES)}")
    if layout.total_numel * itemsize(state_dtype) * len(states) > MAX_COUNT:
        raise ConfigError(f"{where}.layout", layout.total_numel, "more bytes than any file system holds")
    block = _need_count(data, "block_bytes", where, 1, 1 << 40)
    world = _need_count(data, "world_size", where, 1, 1 << 31)
    group = _need_count(data, "shard_group_size", where, 1, world)
    save_id = _need(data, "save_id", str, where)
    if not SAVE_ID.match(save_id):
        raise ConfigError(f"{where}.save_id", save_id, "is '<step, 8+ digits>-<12 hex digits>'")
    fields = {
        "states": states,
        "total": layout.total_numel,
        "state_dtype": state_dtype,
        "save_id": save_id,
        "world_size": world,
        "block_bytes": block,
    }
    files = [
        _parse_file(f, f"{where}.files[{i}]", fields) for i, f in enumerate(_need(data, "files", list, where))
    ]
    ranks = [f.rank for f in files]
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"{where}.files", ranks, "two files of the same rank")
    idx = CheckpointIndex(
        layout,
        _need(data, "strategy", str, where),
        _need(data, "partitioner", str, where),
        world,
        group,
        _need(data, "precision", str, where),
        state_dtype,
        _need(data, "optimizer", dict, where),
        _need_count(data, "step", where),
        states,
        block,
        save_id,
        tuple(files),
        {k: v for k, v in data.items() if k not in _KNOWN_KEYS},
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


def index_size_limit(directory: Path) -> int:
    """The most bytes ``index.json`` in ``directory`` may hold, derived from what it can describe.

    An index describes the layout, a few fixed fields, and the shard files beside it. The layout is
    about 100 bytes plus the name per tensor: ``INDEX_BASE_BYTES`` (64 MiB) holds half a million
    tensors with 30-character names, beyond any model's parameter list. Everything else describes
    stored bytes: per file a fixed record of under 1 KiB, per (state, range) one entry of under 100
    bytes standing for at least one element (2 or more bytes) of the file, per ``block_bytes`` of data
    one digest of 70 bytes of JSON. With ranges of a few elements or blocks of a few dozen bytes
    that is at most 2 bytes of index per stored byte; so the limit is ``INDEX_BASE_BYTES`` plus 1 KiB
    per shard file plus twice the bytes of the regular shard files in the directory (measured with
    ``lstat``: links are not followed). A checkpoint whose index exceeds that is refused before its
    index is parsed."""
    shard_bytes, shard_files = 0, 0
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if SHARD_FILE.match(entry.name) and entry.is_file(follow_symlinks=False):
                    shard_bytes += entry.stat(follow_symlinks=False).st_size
                    shard_files += 1
    except OSError as e:
        raise ConfigError("checkpoint", str(directory), f"cannot be listed: {e.strerror or e}") from None
    return INDEX_BASE_BYTES + 1024 * shard_files + 2 * shard_bytes


def read_index(directory: str | Path) -> CheckpointIndex:
    """The index of the checkpoint in ``directory`` (ConfigError naming the path when it is not one).

    ``index.json`` must be a regular file inside the directory (no link, FIFO or device), at most
    :func:`index_size_limit` bytes, read in bounded chunks, and strict JSON (UTF-8, no NaN, bounded
    integers and nesting, no duplicate keys)."""
    d = checkpoint_directory(directory)
    p = d / INDEX_NAME
    if member_problem(d, INDEX_NAME) == "is named by the index but does not exist":
        raise ConfigError(
            "checkpoint", str(d), f"has no {INDEX_NAME}: not a checkpoint (or no save finished)"
        )
    fh, size = open_member(d, INDEX_NAME, "checkpoint")
    try:
        with fh:
            raw = read_bounded(fh, size, index_size_limit(d), str(p))
    except OSError as e:
        raise ConfigError("checkpoint", str(p), f"cannot be read: {e.strerror or e}") from None
    return index_from_json(parse_json_strict(raw, str(p)), str(p))


def shard_metadata(save_id: str, rank: int) -> dict[str, str]:
    """The ``__metadata__`` of rank ``rank``'s shard file of save ``save_id`` (part of its header)."""
    return {"format": FORMAT_NAME, "save_id": save_id, "rank": str(rank)}


def leftover_files(directory: Path, index: CheckpointIndex | None) -> list[str]:
    """Names in ``directory`` an interrupted write left: temporaries (``.tmp-*``) and shard files the
    index does not name. Nothing is deleted: a later command only reports them."""
    keep = {f.name for f in index.files} if index is not None else set()
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it]
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(TEMP_PREFIX) or (SHARD_FILE.match(n) and n not in keep))


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
