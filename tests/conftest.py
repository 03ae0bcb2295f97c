"""Fixtures shared by test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo process group in this process, for the module's tests (ZeroTrainer needs an
    initialised world); destroyed when the module is done."""
    pytest.importorskip("torch")
    from zerogpu.launch import torch_unavailable_reason

    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Progress:
    """A line every ``every_s`` seconds on the controlling process: tests done of all collected,
    failures so far and the time so far. pytest's dots say how far along the run is; this line says
    it in words. No estimate of the time left: the launches that take longest come last, so a linear
    one would promise minutes that turn into a quarter of an hour."""

    def __init__(self, config: pytest.Config, every_s: float = 20.0) -> None:
        import time

        self._clock = time.monotonic
        self._config = config
        self._every_s = every_s
        self._start = self._clock()
        self._last = self._start
        self._total = 0
        self._done = 0
        self._failed = 0

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._total = len(session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self._total = max(self._total, len(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self._done += 1
        if report.failed:
            self._failed += 1
        now = self._clock()
        if now - self._last < self._every_s or not self._total:
            return
        self._last = now
        elapsed = now - self._start
        reporter = self._config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(
                f"-- {self._done} of {self._total} tests done, {self._failed} failed, "
                f"{elapsed / 60:.1f} min so far"
            )


def _start_fork_server(config: pytest.Config) -> None:
    """On the process that runs tests (each xdist worker, or pytest itself without xdist): a fork server
    (:mod:`zerogpu.fork_server`) for the session, named in ``$ZEROGPU_FORK_SERVER`` so that every launch
    of ranks this process or its subprocesses make forks its zygote from it instead of importing torch.
    ``ZEROGPU_FORK_SERVER=off`` (or any value already set) is left as it is."""
    from zerogpu.fork_server import FORK_SERVER_ENV, start_fork_server

    is_controller = not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None)
    if is_controller or FORK_SERVER_ENV in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return
    except (ImportError, ValueError):
        return
    server = start_fork_server({"OMP_NUM_THREADS": "1", **os.environ})  # what launches default to
    os.environ[FORK_SERVER_ENV] = server.address
    config.stash[_FORK_SERVER] = server


#: the project's source folders, relative to the repository root, whose modules the suite's processes import
_PROJECT_SOURCES = ("zerosim", "zerogpu", "tests", "examples")


def _write_project_bytecode() -> list[Path]:
    """Where Python is told not to write bytecode (``PYTHONDONTWRITEBYTECODE``, set on some CI images),
    every process the suite starts (ranks under ``mpiexec``, launchers, the fork servers, ``zerosim``
    commands: several hundred) compiles the project's modules again from source, 0.2-0.6 CPU-s each,
    since the editable install never compiled them. Under that setting Python still reads bytecode
    that exists: write it once, where Python would have (``__pycache__`` beside each source), for
    every project module that has none. Returns the files and folders made, which the session removes
    at its end (those only: bytecode that was already there is left as it was)."""
    if not sys.flags.dont_write_bytecode and not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return []  # Python writes bytecode as processes import
    import importlib.util
    import py_compile

    root = Path(__file__).resolve().parent.parent
    written: list[Path] = []
    made: list[Path] = []
    for folder in _PROJECT_SOURCES:
        for source in sorted((root / folder).rglob("*.py")):
            target = Path(importlib.util.cache_from_source(str(source)))
            if target.exists():
                continue
            if not target.parent.exists():
                made.append(target.parent)
            try:
                py_compile.compile(str(source), cfile=str(target), doraise=True)
            except (OSError, py_compile.PyCompileError):
                continue  # a read-only tree, or a file that does not compile: imports compile it as before
            written.append(target)
    return written + made  # files first: each folder is empty once they are removed


def _remove_bytecode(made: list[Path]) -> None:
    """Remove what :func:`_write_project_bytecode` made: its files, then its folders if nothing else
    was written into them since."""
    for path in made:
        try:
            path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
        except OSError:
            pass  # a folder that holds files this session did not write


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``-n`` with xdist's default distribution, each module's tests run on one worker (xdist's
    ``loadscope``): a module-scoped fixture (a shared launch of ranks, a report, a matrix) is then made
    once, where per-test load balancing would make it again on every worker given some of the module's
    tests. An explicit ``--dist`` other than ``load`` is left as it is."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    return LoadScopeScheduling(config, log)


_FORK_SERVER = pytest.StashKey[object]()
_BYTECODE = pytest.StashKey[list[Path]]()


def pytest_configure(config: pytest.Config) -> None:
    """Register the progress line on the process that prints (not on xdist's workers); start the
    session's fork server on the processes that run tests."""
    if not hasattr(config, "workerinput") and config.getoption("verbose") < 1:
        config.pluginmanager.register(_Progress(config), "zerosim-progress")
    if not hasattr(config, "workerinput"):
        config.stash[_BYTECODE] = _write_project_bytecode()
    _start_fork_server(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the session's fork server, if this process started one; remove the bytecode it wrote."""
    _remove_bytecode(config.stash.get(_BYTECODE, []))
    server = config.stash.get(_FORK_SERVER, None)
    if server is not None:
        from zerogpu.fork_server import FORK_SERVER_ENV

        server.stop()  # type: ignore[attr-defined]
        os.environ.pop(FORK_SERVER_ENV, None)
