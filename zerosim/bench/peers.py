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

This module is the command (its options, the launches, the failed-adapter retries); the method it
follows (stages, peers, round order, timing rules) is :mod:`zerosim.bench.peers_method`, and the
report that states it :mod:`zerosim.bench.peers_report`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import EXIT_RUN_FAILED, ConfigError, require_positive_int
from ..files.outputs import output_dir
from ..values.dtypes import canonical_dtype
from .peers_method import default_world, environment, sequence, stage_of
from .peers_report import build_report, print_report, write_report
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
