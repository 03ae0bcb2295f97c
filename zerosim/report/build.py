"""``zerosim report``: the figures, the JSON behind each, and an index.md that states each in words.

Everything modelled comes from the closed forms (:mod:`zerosim.cost.memory_model`,
:mod:`zerosim.cost.comm_model`, :mod:`zerosim.cost.memory_timeline`); everything measured comes from
engine runs on the in-process simulator and, when mpi4py works, under ``mpiexec`` (the ranks' own
live-array bytes, memory-tracker timelines and traffic counters). Each figure and table says which
is which. The torch.distributed backend (zerogpu, gloo on CPU) is measured under ``torchrun`` when
it is importable.

This module runs the whole in order and writes it: the runs are :mod:`zerosim.report.runs`, the
figures' data :mod:`zerosim.report.figure_data`, the tables :mod:`zerosim.report.tables`.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cost.deepspeed_compare import compare_with_deepspeed
from ..files.outputs import write_text
from ..values.layout import ParamLayout
from . import figures
from .config import ReportConfig
from .figure_data import (
    Figure,
    comm_volume,
    equivalence_error,
    memory_by_strategy,
    memory_vs_dp,
    offload_timeline,
)
from .index import write_index
from .runs import (
    MPI_STRATEGIES,
    measure_mpi,
    measure_padding_demo,
    measure_simulator,
    measure_torch,
    strategy_names,
)
from .tables import contracts_table, launched_table, model_vs_measured


@dataclass
class ReportResult:
    out_dir: Path
    figures: list[Figure]
    tables: dict[str, Any]
    timings: dict[str, float]
    notes: list[str]

    @property
    def contracts(self) -> list[dict[str, Any]]:
        """One row per measured run (backend, world size, strategy) with its C-ZERO-001..005 verdicts."""
        return self.tables.get("contracts", [])

    @property
    def passed(self) -> bool:
        """Every step contract held on every measured run of every backend."""
        return all(row["passed"] for row in self.contracts)

    def to_json(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "figures": [{"name": f.name, "png": f.png, "json": f.json}
                                                            for f in self.figures],
                "passed": self.passed, "timings": self.timings, "notes": self.notes}


class _Progress:
    """A rich progress bar (or nothing) around the report's tasks."""

    def __init__(self, enabled: bool, total: int):
        self.enabled = enabled
        self._progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]zerosim report[/bold] {task.description:<48}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._progress.add_task("starting", total=total)

    def __enter__(self) -> _Progress:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def step(self, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description, advance=1)

    def describe(self, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description)


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the wall time of the ``with`` body under ``timings[key]`` (seconds)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = time.perf_counter() - t


def build_report(
    out_dir: str | Path, config: ReportConfig | None = None, progress: bool = True
) -> ReportResult:
    """Run every measurement, draw every figure, write the JSON and index.md into ``out_dir``."""
    cfg = config or ReportConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    notes: list[str] = []
    n_runs = sum(len(strategy_names(ws, cfg.ranks_per_node)) for ws in cfg.world_sizes)
    total = n_runs + 3 * len(cfg.world_sizes) + (len(MPI_STRATEGIES) if cfg.mpi else 0) + int(cfg.torch) + 7
    t_all = time.perf_counter()
    with _Progress(progress, total) as bar:
        with _timed(timings, "simulator_runs_s"):
            runs = measure_simulator(cfg, bar.step)
        with _timed(timings, "padding_demo_s"):
            padding_demo = measure_padding_demo(cfg, bar.step)
        mpi = torch_runs = None
        if cfg.mpi:
            with _timed(timings, "mpi_s"):
                mpi = measure_mpi(cfg, bar.step)
            if mpi["error"]:
                notes.append(f"MPI measurements skipped: {mpi['error']}")
        if cfg.torch:
            with _timed(timings, "torch_s"):
                torch_runs = measure_torch(cfg, bar.step)
            if torch_runs["error"]:
                notes.append(f"torch.distributed measurements skipped: {torch_runs['error']}")
        figure_plan = (  # (progress label, builds the figure's data, draws it)
            (
                "memory by strategy",
                lambda: memory_by_strategy(cfg, runs),
                figures.plot_memory_by_strategy,
            ),
            (
                "memory vs data-parallel degree",
                lambda: memory_vs_dp(cfg, runs),
                figures.plot_memory_vs_dp,
            ),
            ("communication volume", lambda: comm_volume(cfg, runs), figures.plot_comm_volume),
            (
                "equivalence error",
                lambda: equivalence_error(cfg, runs, mpi, torch_runs),
                figures.plot_equivalence_error,
            ),
            (
                "offload timeline",
                lambda: offload_timeline(cfg, runs, bar.describe),
                figures.plot_offload_timeline,
            ),
        )
        figs = []
        with _timed(timings, "figures_s"):
            for i, (label, build, plot) in enumerate(figure_plan):
                (bar.describe if i == 0 else bar.step)(f"figure: {label}")
                figs.append(build())
                plot(figs[-1].data, out / figs[-1].png)
        bar.step("DeepSpeed estimator comparison")
        with _timed(timings, "deepspeed_s"):
            ds = compare_with_deepspeed(
                ParamLayout.from_config(cfg.large_model),
                cfg.large_ranks_per_node,
                cfg.large_world_size // cfg.large_ranks_per_node,
                1,
                use_real=cfg.deepspeed,
            )
        bar.step("writing JSON and index.md")
        for f in figs:
            write_text(out / f.json, json.dumps(f.data, indent=1, default=_json_default) + "\n")
        tables = {"contracts": contracts_table(runs, mpi, torch_runs),
                  "model_vs_measured": model_vs_measured(cfg, runs), "padding_demo": padding_demo,
                  "deepspeed": ds, "mpi": launched_table(mpi), "torch": launched_table(torch_runs)}
        for name, table in tables.items():
            write_text(out / f"{name}.json", json.dumps(table, indent=1, default=_json_default) + "\n")
        timings["total_s"] = time.perf_counter() - t_all
        meta = {
            "config": cfg.to_json(),
            "timings": timings,
            "notes": notes,
            "python": platform.python_version(),
            "figures": [f.png for f in figs],
            "tables": [f"{n}.json" for n in tables],
        }
        write_text(out / "report.json", json.dumps(meta, indent=1) + "\n")
        write_index(out / "index.md", cfg, figs, tables, timings, notes)
        bar.step("done")
    return ReportResult(out, figs, tables, timings, notes)


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "__float__"):
        return float(o)
    return str(o)


__all__ = ["ReportResult", "build_report"]
