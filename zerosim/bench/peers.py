"""``zerosim bench peers``: one optimizer step of the same model under every built-in adapter, timed.

Every adapter of :data:`zerosim.verify.adapters.ADAPTERS` whose library is installed here (DDP,
ZeroRedundancyOptimizer, FSDP2 in its ZeRO-2 / ZeRO-3 / hybrid forms, DeepSpeed ZeRO 1-3, and every
``zerogpu-*`` adapter the table holds at run time) trains the same seeded model (the verify GPT,
``gpt``, and ``gpt-50m``, 50.3M parameters) on the same per-rank micro-batches with the same
optimizer (AdamW, global-norm clip at 1.0; ``--optimizer sgd``: SGD with momentum, same clip).
``--adapters`` picks some of them, and may name your own trainer as ``MODULE:FACTORY`` (the factory
``zerosim verify`` takes), timed beside the peers.

Ranks are started by :func:`zerogpu.launch.run_ranks` (a wall-clock limit, no process left behind):
one ``-m zerosim.bench.peers_rank --config FILE`` launch per model (the launch's settings as
one value, :class:`zerosim.bench.peers_run.PeersRun`, in FILE) that runs the adapters one after the
other, ``--rounds`` times (default 2), the list forwards in even rounds and backwards in odd ones, so
that load drifting during the run falls on every adapter alike. Each run of an adapter builds its
own trainer from a fresh copy of the model and calls its optional ``close()`` after the last step.
gloo on the CPU at world 2 by default; ``--device cuda``: NCCL, one rank per GPU. Per run,
``--warmup`` steps are run and discarded, then ``--steps`` steps are timed, then more until the
timed steps add up to about ``--min-time`` seconds (default 1, at most :data:`MAX_TIMED_STEPS`;
the ranks agree on the count): every rank enters a barrier, times ``trainer.step()`` alone (on CUDA
between two device synchronisations), and a step's time is the slowest rank's. The adapter's time is
the median over all its runs; min, max, every sample and the steps of each round are kept.

Each adapter carries its ZeRO stage (0 for DDP, 1, 2, 3, or ``hybrid``): the trainer's own
``declared_strategy`` when it has one, else :data:`STAGES` (which must name every built-in adapter).
Two ratios per adapter and model: its median over the fastest *peer* of the same stage (a peer is a
built-in adapter not named ``zerogpu-*``), and over the fastest adapter of all; the fastest peer of
a stage is 1.0 exactly. With more than one round, the same ratio is also taken round by round
(the adapter's median in a round over that peer's median in the same round) and its range is
shown: a range on both sides of 1.0 says the two are level within the machine's noise, a range
wholly above or below says which is faster. The report records the load average before and after:
other processes on the machine slow every adapter, not equally.

An adapter that fails (raises on some rank, or a trainer call outlives ``--timeout``) ends that
launch; its error is recorded and the remaining adapters are run in a new launch. Exit status: 0
every adapter measured, 3 some adapter failed (the report names it), 2 bad input.
Writes ``<out>/bench_peers.json`` and ``<out>/bench_peers.md`` (default: a new
``reports/bench-peers-<timestamp>/``).

Under an external launcher (across nodes) run the rank program itself: ``torchrun --nnodes N ...
-m zerosim.bench.peers_rank --models ... --adapters ... --out DIR`` (see :mod:`zerosim.bench.peers_rank`).

Why one module of this length: the adapter selection, the round order, the timing rules and the
report that states them are one method; split, the report could describe a method the runner no
longer uses.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..dtypes import canonical_dtype
from ..errors import EXIT_RUN_FAILED, ConfigError, require_positive_int
from ..outputs import output_dir, write_text
from .peers_run import (  # noqa: F401 (the command's settings and their checks, used as peers.X)
    DEFAULT_MIN_TIME_S,
    DEFAULT_MODELS,
    DEFAULT_ROUNDS,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARMUP,
    DEVICES,
    DTYPES,
    MAX_TIMED_STEPS,
    OPTIMIZERS,
    PeersRun,
    parse_int,
    parse_seconds,
    select_adapters,
    select_models,
    split_names,
    validate_run,
    write_peers_run,
)

DEFAULT_OUT = "a new reports/bench-peers-<timestamp>/"
JSON_NAME = "bench_peers.json"
MD_NAME = "bench_peers.md"
MAX_GRAD_NORM = 1.0
OURS_PREFIX = "zerogpu-"  # built-in adapters whose name starts so are ours; the other built-ins are peers

#: ZeRO stage of every known adapter: 0 (replicated, DDP), 1, 2, 3, or "hybrid" (sharded within a group,
#: replicated across groups). A trainer's ``declared_strategy`` takes precedence at run time.
STAGES: dict[str, int | str] = {
    "ddp": 0,
    "torch-zero": 1,
    "deepspeed-1": 1,
    "zerogpu-1": 1,
    "fsdp2-grad-op": 2,
    "deepspeed-2": 2,
    "zerogpu-2": 2,
    "fsdp2": 3,
    "deepspeed-3": 3,
    "zerogpu-3": 3,
    "zerogpu-3-offload": 3,
    "fsdp2-hybrid": "hybrid",
    "zerogpu-hybrid": "hybrid",
    "zerogpu-1-native": 1,
    "zerogpu-2-native": 2,
    "zerogpu-3-native": 3,
    "zerogpu-3-offload-native": 3,
    "zerogpu-hybrid-native": "hybrid",
}
_STAGE_ORDER: dict[int | str | None, int] = {0: 0, 1: 1, 2: 2, 3: 3, "hybrid": 4, None: 5}


# ---- stages and peers -----------------------------------------------------------------------------------


def stage_from_strategy(declared: Any) -> int | str | None:
    """The stage a ``declared_strategy`` names (``ddp`` 0, ``zeroK`` K, ``hybrid[:k]``), or None."""
    if not isinstance(declared, str):
        return None
    text = declared.strip().lower()
    if text in ("ddp", "no_shard", "zero0"):
        return 0
    if text in ("zero1", "zero2", "zero3"):
        return int(text[-1])
    if text.startswith("hybrid"):
        return "hybrid"
    return None


def stage_of(adapter: str, declared: Any = None) -> tuple[int | str | None, str]:
    """(stage, where it came from: ``"declared"`` or ``"table"``; ``"unknown"`` when neither says)."""
    stage = stage_from_strategy(declared)
    if stage is not None:
        return stage, "declared"
    if adapter in STAGES:
        return STAGES[adapter], "table"
    return None, "unknown"


def is_peer(adapter: str) -> bool:
    """Whether ``adapter`` is a peer: a built-in adapter not named ``zerogpu-*`` (a ``MODULE:FACTORY``
    target is the user's own trainer, never a peer)."""
    from ..verify.adapters import ADAPTERS

    return adapter in ADAPTERS and not adapter.startswith(OURS_PREFIX)


# ---- rounds ------------------------------------------------------------------------------------------------


def sequence(adapters: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, adapter)`` in the order they run: the list forwards in even rounds, backwards in odd
    ones (A B C, C B A, A B C, ...). Load that drifts during a run then falls on every adapter alike
    on average, instead of on whichever ran last."""
    out: list[tuple[int, str]] = []
    for r in range(rounds):
        out += [(r, a) for a in (adapters if r % 2 == 0 else list(reversed(adapters)))]
    return out


def timed_steps(steps: int, min_time_s: float, first: Sequence[float]) -> int:
    """How many steps one rank wants timed in a round: at least ``steps``, and enough that they add up
    to about ``min_time_s`` at the median of the ``first`` ``steps`` samples, at most
    :data:`MAX_TIMED_STEPS`. The ranks run the largest of their wishes: a millisecond step then gets
    hundreds of samples and a second-long one the ``steps`` asked for."""
    if not first or min_time_s <= 0:
        return steps
    median = statistics.median(first)
    wanted = math.ceil(min_time_s / median) if median > 0 else MAX_TIMED_STEPS
    return max(steps, min(MAX_TIMED_STEPS, wanted))


def merge_rounds(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, adapter) from its rows of every round: samples (and each rank's) joined in
    round order, ``steps_per_round`` and ``round_indices`` kept; an adapter that failed in any round
    is its error row."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["adapter"]), []).append(row)
    merged: list[dict[str, Any]] = []
    for group in groups.values():
        failed = [r for r in group if r.get("status") != "ok"]
        if failed:
            merged.append(failed[0])
            continue
        group.sort(key=lambda r: r.get("round", 0))
        row = dict(group[-1])
        row["samples"] = [x for r in group for x in r["samples"]]
        row["warmup_samples"] = [x for r in group for x in r.get("warmup_samples", [])]
        ranks = len(group[0].get("rank_samples") or [])
        row["rank_samples"] = [[x for r in group for x in r["rank_samples"][k]] for k in range(ranks)]
        row["steps_per_round"] = [len(r["samples"]) for r in group]
        row["round_indices"] = [r.get("round", 0) for r in group]
        row["init_s"] = max(r.get("init_s", 0.0) for r in group)
        row["rounds"] = len(group)
        row.pop("round", None)
        row.pop("position", None)
        merged.append(row)
    return merged


# ---- options ----------------------------------------------------------------------------------------------


def optim_config(optimizer: str) -> dict[str, Any]:
    """The protocol's optim dict for ``optimizer``: verify's phase settings with a clip at 1.0."""
    from ..verify.suite import PHASE_CONFIGS

    return {**PHASE_CONFIGS[optimizer], "max_grad_norm": MAX_GRAD_NORM}


def default_world(device: str) -> int:
    """2 ranks on the CPU; on CUDA one rank per GPU (0 when there is none: refused later)."""
    if device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def model_info(name: str) -> dict[str, Any]:
    """A preset's parameter count and sizes (counted on the meta device: nothing is allocated)."""
    import dataclasses

    import torch

    from ..verify.model import GPT, require_model

    cfg = require_model(name)
    with torch.device("meta"):
        model = GPT(cfg)
    return {"params": sum(p.numel() for p in model.parameters()), "config": dataclasses.asdict(cfg)}


def environment(device: str) -> dict[str, Any]:
    """Machine and library versions for the report."""
    import importlib.metadata as md

    env: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    for package in ("torch", "deepspeed"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
            env["cuda"] = torch.version.cuda
    return env


# ---- the report -----------------------------------------------------------------------------------------


def summarize(rows: Iterable[dict[str, Any]], models: Sequence[str]) -> list[dict[str, Any]]:
    """Every (model, adapter) with its rounds merged (:func:`merge_rounds`), its median / min / max
    and both ratios, ordered by model, stage, table order.

    ``ratio_to_stage_peer``: median over the smallest median of a peer of the same stage (None when no
    peer of that stage was measured); ``ratio_to_fastest``: over the smallest median of the model;
    ``round_ratios_to_stage_peer``: the adapter's median in each round over that peer's median in the
    same round, for the rounds both ran (empty without a peer).
    """
    from ..verify.adapters import ADAPTERS, VARIANTS

    table_order = {name: i for i, name in enumerate([*ADAPTERS, *VARIANTS])}
    out: list[dict[str, Any]] = []
    for row in merge_rounds(rows):
        row = {k: v for k, v in row.items() if k != "kind"}
        row["peer"] = is_peer(row["adapter"])
        samples = row.get("samples") or []
        if row.get("status") == "ok" and samples:
            row["median_s"] = statistics.median(samples)
            row["min_s"] = min(samples)
            row["max_s"] = max(samples)
        out.append(row)
    for model in models:
        mine = [r for r in out if r["model"] == model and "median_s" in r]
        fastest = min(mine, key=lambda r: r["median_s"], default=None)
        for r in (r for r in out if r["model"] == model):
            measured = "median_s" in r
            r["fastest"] = fastest["adapter"] if fastest else None
            r["ratio_to_fastest"] = r["median_s"] / fastest["median_s"] if measured and fastest else None
            stage = r.get("stage")
            peers = [p for p in mine if p["peer"] and stage is not None and p.get("stage") == stage]
            best = min(peers, key=lambda p: p["median_s"], default=None)
            r["stage_peer"] = best["adapter"] if best else None
            r["ratio_to_stage_peer"] = r["median_s"] / best["median_s"] if measured and best else None
            r["round_ratios_to_stage_peer"] = _round_ratios(r, best) if measured and best else []
    model_order = {m: i for i, m in enumerate(models)}
    out.sort(key=lambda r: (model_order.get(r["model"], len(model_order)),
                            _STAGE_ORDER.get(r.get("stage"), len(_STAGE_ORDER)),
                            table_order.get(r["adapter"], len(table_order))))
    return out


def round_medians(row: dict[str, Any]) -> dict[int, float]:
    """``{round index: median of the row's samples in that round}`` (a merged row, :func:`merge_rounds`)."""
    out, at = {}, 0
    for index, count in zip(row["round_indices"], row["steps_per_round"], strict=True):
        out[index] = statistics.median(row["samples"][at:at + count])
        at += count
    return out


def _round_ratios(row: dict[str, Any], peer: dict[str, Any]) -> list[float]:
    mine, theirs = round_medians(row), round_medians(peer)
    return [mine[i] / theirs[i] for i in sorted(mine.keys() & theirs.keys()) if theirs[i] > 0]


def build_report(rows: Iterable[dict[str, Any]], *, models: Sequence[str], adapters: Sequence[str],
                 meta: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON report (see the module docstring)."""
    results = summarize(rows, models)
    return {
        "benchmark": "zerosim bench peers",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": meta.get("machine", {}),
        "torch": meta.get("machine", {}).get("torch"),
        "device": settings["device"],
        "backend": "nccl" if settings["device"] == "cuda" else "gloo",
        "world": settings["world"],
        "dtype": settings["dtype"],
        "optimizer": optim_config(settings["optimizer"]),
        "steps": settings["steps"],
        "warmup": settings["warmup"],
        "rounds": settings.get("rounds", 1),
        "min_time_s": settings.get("min_time_s", 0.0),
        "timeout_s": settings["timeout_s"],
        "timing": "per step: the slowest rank's trainer.step() after a barrier; per adapter: the median "
                  "of its steps of every round (rounds alternate the adapters' order)",
        "models": {m: model_info(m) for m in models},
        "adapters": list(adapters),
        "stages": {a: stage_of(a)[0] for a in adapters},
        "results": results,
        "failed": [{"model": r["model"], "adapter": r["adapter"], "error": r.get("error")}
                   for r in results if r.get("status") != "ok"],
    }


def _timing_words(report: dict[str, Any]) -> str:
    """How the medians were taken, in words (the ``steps`` column counts each adapter's samples)."""
    rounds = report.get("rounds", 1)
    words = f"median over {rounds} round(s) in alternating order" if rounds > 1 else "median of one round"
    words += (f"; per round a fresh trainer, {report['warmup']} warm-up step(s), "
              f"then at least {report['steps']}")
    min_time = report.get("min_time_s") or 0
    if min_time:
        words += f" timed step(s) and about {min_time:g} s of them (at most {MAX_TIMED_STEPS})"
    else:
        words += " timed step(s)"
    return words


def _seconds(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if value < 10 else f"{value:.2f}"


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio_range(values: Sequence[float]) -> str:
    """The per-round ratios as ``low-high`` (one value when they agree to the digit shown)."""
    if not values:
        return "-"
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row of cells per (model, adapter), as printed and written to the markdown."""
    rows = []
    for r in report["results"]:
        stage = r.get("stage")
        note = ""
        if r.get("status") != "ok":
            note = f"failed: {r.get('error') or 'unknown error'}"
        elif r.get("stage_peer") == r["adapter"]:
            note = "fastest peer of its stage"
        elif r.get("stage_peer"):
            note = f"vs {r['stage_peer']}"
        rows.append([
            r["model"], r["adapter"], "-" if stage is None else str(stage),
            str(len(r.get("samples") or [])) if r.get("status") == "ok" else "-",
            _seconds(r.get("median_s")), _seconds(r.get("min_s")), _seconds(r.get("max_s")),
            _ratio(r.get("ratio_to_stage_peer")), _ratio_range(r.get("round_ratios_to_stage_peer") or []),
            _ratio(r.get("ratio_to_fastest")), note,
        ])
    return rows


COLUMNS = ("model", "adapter", "stage", "steps", "median s", "min s", "max s", "/ stage peer", "by round",
           "/ fastest", "note")


def render_markdown(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    models = ", ".join(f"{m} ({info['params']:,} params)" for m, info in report["models"].items())
    lines = [
        "# zerosim bench peers",
        "",
        f"One optimizer step ({report['optimizer']['name']}, gradient clip {MAX_GRAD_NORM}) of {models}, "
        f"{report['dtype']}, {report['world']} ranks on {report['device']} ({report['backend']}); "
        f"{_timing_words(report)}, each step the slowest rank's `trainer.step()` after a barrier. "
        f"torch {machine.get('torch')}, deepspeed "
        f"{machine.get('deepspeed')}, Python {machine.get('python')}, {machine.get('cpus')} CPUs"
        + (f", {machine['gpu']}" if machine.get("gpu") else "") + f"; {report['created']}.",
        "",
        "`/ stage peer`: median over the fastest peer (a built-in adapter not named `zerogpu-*`) of the "
        "same ZeRO stage; `by round`: the range of that ratio taken within each round (both sides of 1 "
        "means level within the machine's noise); `/ fastest`: over the fastest adapter of the model.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(report)]
    load = report.get("load_average") or {}
    if report.get("wall_s") is not None:
        lines += ["", f"Wall time {report['wall_s']:g} s; load average (1, 5, 15 min) before "
                  f"{load.get('before')}, after {load.get('after')}."]
    return "\n".join(lines) + "\n"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..text_tables import print_table

    title = (f"one {report['optimizer']['name']} step, {report['dtype']}, world {report['world']} "
             f"({report['backend']}); {_timing_words(report)}")
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("model", "adapter", "note") else "right")
    for cells in table_rows(report):
        table.add_row(*cells)
    print_table(table, Console(width=140))


def write_report(report: dict[str, Any], out_dir: Path | None) -> tuple[Path, Path]:
    """``bench_peers.json`` and ``.md`` in ``out_dir`` (None: a new run folder), each renamed into place."""
    out = output_dir(out_dir, "bench-peers")
    json_path, md_path = out / JSON_NAME, out / MD_NAME
    write_text(json_path, json.dumps(report, indent=1) + "\n")
    write_text(md_path, render_markdown(report))
    return json_path, md_path


# ---- the command ------------------------------------------------------------------------------------------


def options(args: Any) -> dict[str, Any]:
    """The validated settings of a run from the command line (ConfigError for the first bad one)."""
    from ..verify.runner import require_startable

    settings: dict[str, Any] = {
        "steps": parse_int("steps", args.steps),
        "warmup": parse_int("warmup", args.warmup),
        "rounds": parse_int("rounds", args.rounds),
        "min_time_s": parse_seconds("min_time", args.min_time, allow_zero=True),
        "dtype": canonical_dtype(args.dtype, "dtype", allowed=DTYPES),  # fp32 / fp64 spell them too
        "device": args.device,
        "optimizer": args.optimizer,
        "timeout_s": parse_seconds("timeout", args.timeout),
    }
    validate_run(**settings)
    settings["world"] = default_world(args.device) if args.world is None else parse_int("world", args.world)
    if args.world is not None:
        require_positive_int("world", settings["world"])
    settings["models"] = select_models(args.models)
    settings["adapters"] = select_adapters(args.adapters)
    from zerogpu.launch import torch_unavailable_reason

    reason = torch_unavailable_reason()
    if reason:
        raise ConfigError("backend", "torch", reason)
    require_startable(settings["world"], settings["device"])
    settings["out"] = output_dir(args.out, "bench-peers")
    return settings


def rank_run(settings: dict[str, Any], model: str, results: Path, start: int = 0,
             skip: Sequence[str] = ()) -> PeersRun:
    """What one launch's ranks run, as one value: ``model`` x every adapter and round, from position
    ``start`` of :func:`sequence` on, the adapters in ``skip`` left out, rank 0 appending to ``results``."""
    return PeersRun(
        models=(model,),
        adapters=tuple(settings["adapters"]),
        steps=settings["steps"],
        warmup=settings["warmup"],
        rounds=settings["rounds"],
        min_time_s=settings["min_time_s"],
        dtype=settings["dtype"],
        device=settings["device"],
        optimizer=settings["optimizer"],
        timeout_s=settings["timeout_s"],
        from_position=start,
        skip=tuple(skip),
        results=str(results),
    )


def read_results(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the meta record, the result rows) rank 0 appended to ``path`` (missing file: nothing)."""
    meta: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return meta, rows
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a rank that died while writing it
        if record.get("kind") == "meta":
            meta = record
        elif record.get("kind") == "result":
            rows.append(record)
    return meta, rows


def launch_error(result: Any, limit_s: float) -> str:
    """One line for a launch that ended before every adapter was measured."""
    lines = (result.stderr or "").splitlines()
    for line in lines:
        if line.startswith("rank ") and " failed: " in line:
            return line.strip()[:500]
    if result.timed_out:
        return f"the launch did not finish within {limit_s:g}s; every rank was killed"
    tail = " | ".join(line.strip() for line in lines[-3:] if line.strip()) or "no output"
    return f"the ranks ended with status {result.returncode} ({tail[:400]})"


def measure_model(
    settings: dict[str, Any], model: str, tmp: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every adapter on ``model`` in every round: launches until each (round, adapter) has a result or
    its adapter an error (one launch if none fails). A failed adapter is left out of later rounds."""
    from zerogpu.launch import run_ranks

    order = sequence(settings["adapters"], settings["rounds"])
    start = 0
    skip: list[str] = []
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    path_env = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    attempt = 0
    while True:
        remaining = [i for i in range(start, len(order)) if order[i][1] not in skip]
        if not remaining:
            break
        attempt += 1
        results = tmp / f"{model}-{attempt}.jsonl"
        calls = len(remaining) * (settings["steps"] + settings["warmup"] + 2)
        limit_s = 300.0 + settings["timeout_s"] * calls + settings["min_time_s"] * len(remaining)
        names = sorted({order[i][1] for i in remaining}, key=settings["adapters"].index)
        print(f"{model}: {settings['world']} ranks, {len(remaining)} adapter run(s) of "
              f"{', '.join(names)}", file=sys.stderr, flush=True)
        run_file = write_peers_run(rank_run(settings, model, results, start, skip),
                                   tmp / f"{model}-{attempt}.run.json")
        argv = ["-m", "zerosim.bench.peers_rank", "--config", str(run_file)]
        result = run_ranks(settings["world"], argv, limit_s, env={"PYTHONPATH": path_env}, capture=True)
        got_meta, done = read_results(results)
        meta = meta or got_meta
        rows.extend(done)
        finished = {r.get("position") for r in done}
        rest = [i for i in remaining if i not in finished]
        if not rest:
            break
        failed = order[rest[0]][1]
        start, skip = rest[0] + 1, [*skip, failed]
        error = launch_error(result, limit_s)
        stage, source = stage_of(failed)
        rows.append({"kind": "result", "model": model, "adapter": failed, "status": "error", "stage": stage,
                     "stage_source": source, "error": error, "exit_status": result.returncode})
        print(f"{model}: {failed} failed: {error}", file=sys.stderr, flush=True)
    return meta, rows


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(args: Any) -> int:
    settings = options(args)
    started = time.monotonic()
    load_before = load_average()
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zerosim-bench-peers-") as tmp:
        for model in settings["models"]:
            got_meta, got = measure_model(settings, model, Path(tmp))
            meta = meta or got_meta
            rows.extend(got)
    if not meta:
        meta = {"machine": environment(settings["device"])}
    report = build_report(rows, models=settings["models"], adapters=settings["adapters"], meta=meta,
                          settings=settings)
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["load_average"] = {"before": load_before, "after": load_average()}
    json_path, md_path = write_report(report, settings["out"])
    print_report(report)
    print(f"wall time {report['wall_s']:.1f}s; wrote {json_path} and {md_path}")
    if report["failed"]:
        names = ", ".join(f"{f['adapter']} ({f['model']})" for f in report["failed"])
        print(f"error: {len(report['failed'])} adapter run(s) failed: {names}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0
