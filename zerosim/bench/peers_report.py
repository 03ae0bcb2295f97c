"""The report of ``zerosim bench peers``: every adapter's rounds merged, its median and its two
ratios (over the fastest peer of its stage, over the fastest adapter), as JSON, markdown and a
printed table (the method it states: :mod:`zerosim.bench.peers_method`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..files.outputs import output_dir, write_text
from .peers_method import (
    MAX_GRAD_NORM,
    STAGE_ORDER,
    is_peer,
    merge_rounds,
    model_info,
    optim_config,
    stage_of,
)
from .peers_run import MAX_TIMED_STEPS

JSON_NAME = "bench_peers.json"
MD_NAME = "bench_peers.md"


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
                            STAGE_ORDER.get(r.get("stage"), len(STAGE_ORDER)),
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
    """The JSON report (its method in words: :mod:`zerosim.bench.peers`)."""
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

    from ..files.text_tables import print_table

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
