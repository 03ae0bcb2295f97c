"""Where commands write their files, and how: never over files a user (or the repository) already has.

* :func:`fresh_run_dir`: the default output folder of a command run without ``--out``, a new
  ``reports/<name>-YYYYmmdd-HHMMSS/`` (``-2``, ``-3``... when that second is taken), which the
  repository's .gitignore covers; committed reports are regenerated only with an explicit ``--out``.
* :func:`write_text` / :func:`write_bytes` / :func:`save_figure`: write to a temporary name in the
  destination's folder, then rename over the destination, so a failed write (a full disk, a
  read-only folder) leaves the destination as it was and no partial file behind.
* :class:`OutputError`: any OSError while writing, as one line naming the path and the OS error
  (the command line turns it into exit status 2).
* :func:`remove_unused_output_dirs`: the folders this process made for its outputs (each one
  :func:`output_dir`, :func:`output_file` or :func:`fresh_run_dir` created, parents included) that
  still hold nothing, removed when a command ends without finishing (interrupted, or an error).
  Only folders made in this run, and only empty ones: a folder that exists already, or that holds
  anything (written by the command or by anyone else), stays.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ZeroSimError

DEFAULT_ROOT = Path("reports")
_MADE: list[Path] = []  # the folders this process created for its outputs, in the order made


class OutputError(ZeroSimError):
    """An output could not be written: names the path and the operating system's reason."""

    def __init__(self, path: str | Path, error: OSError | str):
        self.path = str(path)
        reason = error if isinstance(error, str) else (error.strerror or str(error))
        super().__init__(f"cannot write {self.path}: {reason}")


def describe_os_error(error: OSError) -> str:
    """One line for an OSError: the file it names (if any) and the operating system's reason."""
    reason = error.strerror or str(error)
    names = [str(n) for n in (error.filename, error.filename2) if n is not None]
    return f"{' -> '.join(names)}: {reason}" if names else reason


def fresh_run_dir(name: str, root: str | Path = DEFAULT_ROOT, now: _dt.datetime | None = None) -> Path:
    """A folder this call creates, ``root/<name>-YYYYmmdd-HHMMSS[-N]``; never one that already exists."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    root = Path(root)
    try:
        _mkdir_recorded(root)
    except OSError as e:
        raise OutputError(root, e) from None
    for n in range(1, 1000):
        path = root / (f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise OutputError(path, e) from None
        _MADE.append(path)
        return path
    raise OutputError(root / f"{name}-{stamp}", "999 folders of that name exist already")


def _make_folder(path: Path) -> None:
    """``mkdir -p path``; OutputError naming the first part of it that is a file, or the OS error."""
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise OutputError(part, "exists and is not a directory")
            break
    try:
        _mkdir_recorded(path)
    except OSError as e:
        raise OutputError(path, e) from None


def _mkdir_recorded(path: Path) -> None:
    """``mkdir -p path``, noting in :data:`_MADE` each folder of it that this call created."""
    for part in reversed([p for p in (path, *path.parents) if not p.exists()]):
        try:
            part.mkdir()
        except FileExistsError:
            continue  # made by someone else meanwhile (or a file in the way: the next line says so)
        except OSError:
            break
        _MADE.append(part)
    path.mkdir(parents=True, exist_ok=True)


def require_output_dir(out: str | Path, field: str = "out") -> Path:
    """``out`` as a writable folder, created if missing (each folder made noted, so that
    :func:`remove_unused_output_dirs` can take it back); ConfigError naming ``field`` otherwise."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(field, str(out), "exists and is not a directory")
    try:
        _mkdir_recorded(path)
    except OSError as e:
        raise ConfigError(field, str(out), f"cannot create the directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(field, str(out), "the directory is not writable")
    return path


def remove_unused_output_dirs() -> list[Path]:
    """Remove every folder this process made for its outputs that is still empty, the last made
    first (so a made parent of a made folder goes too); returns those removed. ``os.rmdir`` refuses a
    folder that holds anything, so nothing written into one, by anyone, is lost."""
    removed = []
    for path in reversed(_MADE):
        try:
            path.rmdir()
        except OSError:
            continue
        removed.append(path)
    _MADE.clear()
    return removed


def output_dir(out: str | Path | None, name: str) -> Path:
    """``out`` (created if missing; OutputError if it is not a writable folder), or a fresh run folder."""
    if out is None:
        return fresh_run_dir(name)
    path = Path(out)
    _make_folder(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(path, "the directory is not writable")
    return path


def output_file(out: str | Path | None, name: str, file_name: str) -> Path:
    """Where a command's one report file goes: ``out`` as given (its folder created if missing), or
    ``file_name`` in a fresh run folder (:func:`fresh_run_dir`). OutputError when ``out`` is a folder
    or its folder cannot be made."""
    if out is None:
        return fresh_run_dir(name) / file_name
    path = Path(out)
    if path.is_dir():
        raise OutputError(path, "is a directory; give a file name for the report")
    _make_folder(path.parent)
    return path


def _replace_with(path: str | Path, write: Callable[[Any], None], mode: str) -> Path:
    path = Path(path)
    if path.exists() and not path.is_file():  # never rename over a device, a folder or a FIFO
        raise OutputError(path, "exists and is not a regular file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OutputError(path, e) from None
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_UMASK)  # what open() would have given the file; mkstemp makes it 0600
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(path, e) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def write_text(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) in one rename; OutputError (nothing left behind) on failure."""
    return _replace_with(path, lambda f: f.write(text.encode()), "wb")


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` in one rename; OutputError (nothing left behind) on failure."""
    return _replace_with(path, lambda f: f.write(data), "wb")


def copy_file(src: str | Path, dst: str | Path) -> Path:
    """Replace ``dst`` with a copy of ``src`` in one rename; OutputError (nothing left behind) on failure."""
    with open(src, "rb") as f:
        return _replace_with(dst, lambda out: shutil.copyfileobj(f, out), "wb")


def publish_files(folder: str | Path, out: str | Path) -> list[Path]:
    """Copy every regular file directly in ``folder`` into ``out`` under the same name, each renamed
    into place (:func:`copy_file`); nothing else in ``out`` is read, moved or deleted. The paths written."""
    written = []
    for src in sorted(Path(folder).iterdir()):
        if src.is_file() and not src.is_symlink():
            written.append(copy_file(src, Path(out) / src.name))
    return written


def save_figure(fig: Any, path: str | Path, **kwargs: Any) -> Path:
    """``fig.savefig`` into ``path`` in one rename (the format is taken from ``path``'s suffix)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    return _replace_with(path, lambda f: fig.savefig(f, format=fmt, **kwargs), "wb")
