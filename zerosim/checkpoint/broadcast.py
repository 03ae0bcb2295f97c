"""Rank-0 load of a full (unsharded) state dict: only rank 0 opens the file, tensors are broadcast one
at a time (or in bounded buckets) and each rank keeps only the pieces its plan gives it.

Collective over an engine's ranks (:class:`~zerosim.engine.rank_state.RankState`, whichever schedule
drives it: the block model's or :class:`zerogpu.module_engine.ModuleSchedule`):

1. Rank 0 opens the state dict (a ``.safetensors`` file, a torch ``.pt`` / ``.pth`` / ``.bin`` file
   loaded with ``weights_only=True``, or an in-memory mapping) and validates its names, shapes and
   dtypes against the engine's layout before any data moves. Tied weights may appear under any of
   their names (``layout.aliases``). One scalar all-reduce on the control group tells every rank the
   verdict; on failure every rank raises the same one-line :class:`~zerosim.errors.ConfigError`.
2. Rank 0 broadcasts which tensors it will send (non-strict loads may miss some) and the names it
   did not use; then the tensors, in layout order, over the engine's :meth:`load_comm` group, one at
   a time or packed into buckets of at most ``bucket_bytes`` (a tensor larger than a bucket travels
   alone). Every rank copies its owned pieces of each arriving tensor into a staged copy of its
   master shard (:meth:`~zerosim.engine.rank_state.RankState.keep_broadcast_tensor`) and drops the rest.
3. A second agreement covers read errors on rank 0 during streaming; only then does every rank
   copy the staged shard into its master in place and rebuild its working parameters
   (:func:`~zerosim.engine.step.refresh_params`: the ZeRO-1/2 all-gather, or the cast of the master;
   a schedule that keeps a copy of them, the offloaded module's, refreshes it after the load).

A rank other than 0 therefore holds at most one bucket (one tensor by default) of the full state
dict at a time, plus its staged shard. Optimizer state is not touched, as with torch's
``Module.load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..engine.step import refresh_params
from ..errors import ConfigError, install_hint
from ..values.dtypes import canonical_dtype, itemsize
from .engine_state import _agree

#: safetensors dtype codes -> canonical dtype names
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
MAX_NAMES_BYTES = 1 << 20  #: the longest list of unexpected names rank 0 shares


class StateDictReader(Protocol):
    """Rank 0's view of a full state dict: names with shapes and dtypes, and one tensor at a time."""

    where: str

    def entries(self) -> dict[str, tuple[tuple[int, ...], str]]: ...
    def read(self, name: str) -> np.ndarray: ...
    def close(self) -> None: ...


def _dtype_name(dtype: Any, where: str) -> str:
    try:
        return canonical_dtype(str(dtype), where)
    except ConfigError:
        return str(dtype).removeprefix("torch.")


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class MappingReader:
    """An in-memory state dict: name -> numpy array or torch tensor."""

    def __init__(self, state: Mapping[str, Any], where: str = "state_dict"):
        self.where = where
        self._state = state

    def entries(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for name, value in self._state.items():
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise ConfigError("state_dict", name,
                                  f"is a {type(value).__name__}, not a tensor ({self.where})")
            out[str(name)] = (tuple(int(d) for d in value.shape), _dtype_name(value.dtype, name))
        return out

    def read(self, name: str) -> np.ndarray:
        value = self._state[name]
        arr = value if isinstance(value, np.ndarray) else _torch_to_numpy(value)
        return np.ascontiguousarray(arr).reshape(-1)

    def close(self) -> None:
        self._state = {}


class SafetensorsReader:
    """A ``.safetensors`` file, read one tensor at a time with ``safetensors.safe_open``."""

    def __init__(self, path: Path):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ConfigError("checkpoint", str(path), "reading safetensors needs the safetensors package "
                              f"({install_hint('torch')})") from e
        self.where = str(path)
        try:
            self._file: Any = safe_open(str(path), framework="numpy")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError("checkpoint", str(path), f"not a readable safetensors file: {e}") from e
        self._torch_file: Any = None

    def entries(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for name in self._file.keys():
            s = self._file.get_slice(name)
            code = s.get_dtype()
            out[name] = (tuple(int(d) for d in s.get_shape()), SAFETENSORS_DTYPES.get(code, code))
        return out

    def read(self, name: str) -> np.ndarray:
        try:
            if self._file.get_slice(name).get_dtype() == "BF16":  # numpy has no bfloat16 of its own
                if self._torch_file is None:
                    from safetensors import safe_open

                    self._torch_file = safe_open(self.where, framework="pt")
                return _torch_to_numpy(self._torch_file.get_tensor(name)).reshape(-1)
            return np.ascontiguousarray(self._file.get_tensor(name)).reshape(-1)
        except Exception as e:  # noqa: BLE001
            raise ConfigError("checkpoint", self.where, f"cannot read tensor {name!r}: {e}") from e

    def close(self) -> None:
        self._file = None
        self._torch_file = None


class TorchReader(MappingReader):
    """A torch ``.pt`` file: ``torch.load(weights_only=True)`` (never unpickles code), memory-mapped
    where the file format allows, so rank 0 too reads one tensor at a time."""

    def __init__(self, path: Path):
        try:
            import torch
        except ImportError as e:
            raise ConfigError("checkpoint", str(path), "reading a .pt file needs torch") from e
        try:
            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
            raise ConfigError("checkpoint", str(path), f"not a loadable torch state dict: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        if not isinstance(state, Mapping):
            raise ConfigError("checkpoint", str(path), f"holds a {type(state).__name__}, not a state dict")
        super().__init__(state, str(path))


def open_state_dict(source: str | Path | Mapping[str, Any]) -> StateDictReader:
    """A reader for a state dict file (by suffix: ``.safetensors``; ``.pt`` / ``.pth`` / ``.bin``) or an
    in-memory mapping. Only rank 0 calls this."""
    if isinstance(source, Mapping):
        return MappingReader(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError("checkpoint", str(path), "no such file")
    if path.suffix == ".safetensors":
        return SafetensorsReader(path)
    if path.suffix in TORCH_SUFFIXES:
        return TorchReader(path)
    known = ", ".join((".safetensors", *TORCH_SUFFIXES))
    raise ConfigError("checkpoint", str(path), f"unknown state dict format (known suffixes: {known})")


@dataclass
class BroadcastLoadResult:
    """What one rank did in a rank-0 load: torch's ``missing_keys`` / ``unexpected_keys``, the files it
    opened (1 on rank 0, 0 elsewhere), the bytes it read from the file, the broadcasts it took part
    in, and the largest broadcast buffer it held (bytes)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    files_opened: int = 0
    bytes_read: int = 0
    broadcasts: int = 0
    largest_buffer_bytes: int = 0
    loaded: list[str] = field(default_factory=list)
    #: the ``replicated`` entries rank 0 sent, whole, on every rank (e.g. a torch module's buffers)
    replicated: dict[str, np.ndarray] = field(default_factory=dict)


def plan_load(
    layout: Any,
    entries: Mapping[str, tuple[tuple[int, ...], str]],
    strict: bool,
    where: str,
    replicated: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
) -> tuple[dict[str, str], list[str], list[str]]:
    """Match a state dict's entries to the layout's tensors and the ``replicated`` entries: ``(name ->
    key it is read from, missing names, unexpected keys)``. A tensor may be given under its name or any
    alias (its own name wins); a shape or dtype mismatch is an error, strict or not, and strict loads
    refuse missing or unexpected keys."""
    aliases = dict(layout.aliases)
    known = {t.name: (tuple(t.shape), t.dtype) for t in layout.tensors}
    for name, (shape, dtype) in (replicated or {}).items():
        known.setdefault(name, (tuple(shape), dtype))
    chosen: dict[str, str] = {}
    unexpected = []
    for key, (shape, dtype) in entries.items():
        name = aliases.get(key, key)
        want = known.get(name)
        if want is None:
            unexpected.append(key)
            continue
        if tuple(shape) != want[0]:
            raise ConfigError("state_dict", key, f"has shape {tuple(shape)}, the model {want[0]} ({where})")
        if dtype != want[1]:
            raise ConfigError("state_dict", key, f"has dtype {dtype}, the model {want[1]} ({where})")
        if name not in chosen or key == name:
            chosen[name] = key
    missing = [name for name in known if name not in chosen]
    if strict and missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError("state_dict", missing[0], f"missing from {where}{more} (strict load)")
    if strict and unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ConfigError("state_dict", unexpected[0], f"unexpected key in {where}{more} (strict load)")
    return chosen, missing, unexpected


def _share_names(engine: Any, names: list[str]) -> list[str]:
    """Rank 0's list of names on every rank (a length, then the bytes, over the control group)."""
    xp = engine.xp
    raw = "\x1f".join(names).encode()[:MAX_NAMES_BYTES] if engine.rank == 0 else b""
    n = np.array([float(len(raw))])
    length = int(xp.to_numpy(engine.control.broadcast(xp.from_numpy(n), root=0))[0])
    if not length:
        return []
    buf = np.zeros(length, np.uint8)
    if engine.rank == 0:
        buf[:] = np.frombuffer(raw, np.uint8)
    got = xp.to_numpy(engine.control.broadcast(xp.from_numpy(buf), root=0))
    return bytes(np.asarray(got, np.uint8)).decode(errors="replace").split("\x1f")


def _buckets(layout: Any, present: list[bool], isz: int, bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups of present, non-empty tensor indices of at most ``bucket_bytes`` (0: one each)."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(layout.tensors):
        if not present[i] or not t.numel:
            continue
        nbytes = t.numel * isz
        if out and bucket_bytes and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def broadcast_and_shard_state_dict(
    engine: Any,
    source: str | Path | Mapping[str, Any] | None,
    *,
    strict: bool = True,
    bucket_bytes: int = 0,
    replicated: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
) -> BroadcastLoadResult:
    """Load a full state dict into ``engine`` from rank 0 (collective: every rank calls it between
    steps). ``source`` is read on rank 0 only (other ranks may pass anything, e.g. None);
    ``bucket_bytes`` > 0 packs consecutive tensors into broadcasts of at most that many bytes.
    ``replicated`` names further entries (name -> shape, dtype; the same on every rank) that are not
    sharded parameters: each is broadcast whole and returned in ``result.replicated``. Returns
    this rank's :class:`BroadcastLoadResult`; raises the same ConfigError on every rank if rank 0
    finds the state dict unusable, with nothing changed."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ConfigError("bucket_bytes", bucket_bytes, "must be a non-negative integer")
    xp, layout = engine.xp, engine.layout
    result = BroadcastLoadResult([], [])
    reader: StateDictReader | None = None
    chosen: dict[str, str] = {}
    error: ConfigError | None = None
    try:
        if engine.rank == 0:
            if source is None:
                raise ConfigError("checkpoint", None, "rank 0 needs a state dict to load")
            reader = open_state_dict(source)
            result.files_opened = 0 if isinstance(source, Mapping) else 1
            chosen, _, result.unexpected_keys = plan_load(
                layout, reader.entries(), strict, reader.where, replicated)
    except ConfigError as e:
        error = e
    try:
        _agree(engine, error)
        extra = [name for name in (replicated or {}) if name not in {t.name for t in layout.tensors}]
        names = [t.name for t in layout.tensors] + extra
        present_flags = np.array([1.0 if name in chosen else 0.0 for name in names])
        present_arr = xp.to_numpy(engine.control.broadcast(xp.from_numpy(present_flags), root=0))
        flags = [bool(x) for x in present_arr]
        present = flags[: len(layout.tensors)]
        result.missing_keys = [name for name, p in zip(names, flags, strict=True) if not p]
        result.unexpected_keys = _share_names(engine, result.unexpected_keys)
        sdt = engine.state_dtype
        isz = itemsize(sdt)
        staged = xp.copy(engine.master)
        comm = engine.load_comm()
        for bucket in _buckets(layout, present, isz, bucket_bytes):
            numel = sum(layout.tensors[i].numel for i in bucket)
            if reader is not None and error is None:
                try:
                    parts = [reader.read(chosen[layout.tensors[i].name]) for i in bucket]
                    result.bytes_read += sum(int(p.nbytes) for p in parts)
                    host = parts[0].astype(sdt) if len(parts) == 1 else np.concatenate(
                        [p.astype(sdt) for p in parts])
                    del parts
                    buf = xp.from_numpy(host)
                    del host
                except ConfigError as e:
                    error, buf = e, xp.zeros(numel, sdt)
            else:
                buf = xp.zeros(numel, sdt)
            got = comm.broadcast(buf, root=0)
            del buf
            result.broadcasts += 1
            result.largest_buffer_bytes = max(result.largest_buffer_bytes, numel * isz)
            off = 0
            for i in bucket:
                t = layout.tensors[i]
                engine.keep_broadcast_tensor(layout.offsets[i], got[off:off + t.numel], staged)
                off += t.numel
            del got
        for name, p in zip(extra, flags[len(layout.tensors):], strict=True):
            if not p:
                continue
            shape, dtype = (replicated or {})[name]
            numel = int(np.prod(shape, dtype=np.int64))
            buf = xp.zeros(numel, dtype)
            if reader is not None and error is None:
                try:
                    buf = xp.from_numpy(np.ascontiguousarray(reader.read(chosen[name])))
                except ConfigError as e:
                    error = e
            got = comm.broadcast(buf, root=0)
            result.broadcasts += 1
            result.replicated[name] = xp.to_numpy(got, copy=True).reshape(shape)
            del buf, got
        _agree(engine, error)
    finally:
        if reader is not None:
            reader.close()
    xp.assign(engine.master, staged)
    del staged
    refresh_params(engine)
    result.loaded = [t.name for t, p in zip(layout.tensors, present, strict=True) if p]
    return result
