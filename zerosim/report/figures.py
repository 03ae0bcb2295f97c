"""The report's figures: each function draws one PNG from the JSON-able data the report saves next to it.

Matplotlib with the Agg backend (no display). Every axis names its unit; every series says whether
it is *modelled* (closed form) or *measured* (a backend's own counters), so no plot mixes the two
silently.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..cost.units import UNITS, to_unit  # noqa: E402
from ..files.outputs import save_figure  # noqa: E402

CATEGORY_COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer_states": "#55A868",
    "transient": "#C9C9C9",
}
CATEGORY_LABELS = {"params": "parameters", "grads": "gradients", "optimizer_states": "optimizer states",
                   "transient": "transient (engine)"}
STRATEGY_SHORT = {
    "no_shard": "DDP",
    "shard_optimizer": "ZeRO-1",
    "shard_grad_op": "ZeRO-2",
    "full_shard": "ZeRO-3",
}
MARKERS = "os^Dvp*h"


def short_name(strategy: str) -> str:
    base, _, size = strategy.partition(":")
    if base == "hybrid_shard":
        return f"HSDP:{size}"
    if base == "hybrid_shard_zero2":
        return f"HSDP-Z2:{size}"
    return STRATEGY_SHORT.get(base, strategy)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def _unit_label(unit: str) -> str:
    """``GB = 10^9 B`` / ``GiB = 2^30 B``: the unit spelled out on every byte axis."""
    factor = UNITS[unit]
    if factor == 1:
        return "B"
    for base in (10, 2):
        exp = round(math.log(factor, base))
        if base**exp == factor:
            return f"{unit} = {base}$^{{{exp}}}$ B"
    return f"{unit} = {factor:,} B"  # pragma: no cover


def _modelled_measured_handles() -> list[Patch]:
    """Legend entries for the bar pairs: plain = modelled (left), hatched = measured (right)."""
    return [Patch(facecolor="white", edgecolor="black", label="left bar: MODELLED"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="right bar (hatched): MEASURED")]


def _title(ax: Any, text: str, width: int = 95) -> None:
    """A panel title wrapped so it never runs past the panel."""
    ax.set_title("\n".join(textwrap.wrap(text, width)), fontsize=9)


def _stacked(ax: Any, x: float, parts: dict[str, float], width: float, unit: str, hatch: str | None = None,
             labels: bool = False) -> float:
    bottom = 0.0
    for cat in ("params", "grads", "optimizer_states", "transient"):
        v = to_unit(parts.get(cat, 0), unit)
        if v <= 0:
            continue
        ax.bar(x, v, width, bottom=bottom, color=CATEGORY_COLORS[cat], hatch=hatch, edgecolor="black",
               linewidth=0.4, label=CATEGORY_LABELS[cat] if labels else None)
        bottom += v
    return bottom


def plot_memory_by_strategy(data: dict[str, Any], path: Path) -> Path:
    """Panel a: modelled per-rank stacked memory, large model. Panel b: small model, modelled vs measured."""
    large, small = data["large"], data["small"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    unit = large["unit"]
    names = list(large["strategies"])
    for i, name in enumerate(names):
        top = _stacked(ax, i, large["strategies"][name], 0.6, unit, labels=(i == 0))
        ax.text(i, top, f"{top:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [short_name(n) for n in names])
    ax.set_ylabel(f"persistent bytes per rank [{_unit_label(unit)}]")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    _title(ax, f"(a) MODELLED: {large['model']}, N_d={large['world_size']}, {large['settings']}")
    ax.legend(fontsize=8)
    ax = axes[1]
    unit = small["unit"]
    names = list(small["strategies"])
    for i, name in enumerate(names):
        entry = small["strategies"][name]
        _stacked(ax, i - 0.2, entry["model"], 0.38, unit)
        if entry.get("measured"):
            _stacked(ax, i + 0.2, entry["measured"], 0.38, unit, hatch="//")
    ax.set_xticks(range(len(names)), [short_name(n) for n in names])
    ax.set_ylabel(f"bytes per rank [{_unit_label(unit)}]")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom for the legend
    _title(ax, f"(b) {small['model']}, world {small['world_size']}: left bar MODELLED, right (hatched) "
               f"MEASURED ({small['backend']})")
    handles = [Patch(facecolor=CATEGORY_COLORS[c], edgecolor="black", label=CATEGORY_LABELS[c])
               for c in ("params", "grads", "optimizer_states", "transient")]
    ax.legend(handles=handles + _modelled_measured_handles(), fontsize=8, ncol=2, loc="upper left")
    return _save(fig, path)


def plot_memory_vs_dp(data: dict[str, Any], path: Path) -> Path:
    """Log-log persistent bytes per rank vs data-parallel degree; panel b adds measured points."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key in zip(axes, ("large", "small"), strict=True):
        d = data[key]
        ws = d["world_sizes"]
        for i, (name, ys) in enumerate(d["curves"].items()):
            line, = ax.plot(ws, [max(y, 1) for y in ys], marker=MARKERS[i % len(MARKERS)], markersize=3,
                            label=f"{short_name(name)} (model)")
            meas = d.get("measured", {}).get(name)
            if meas:
                mx = [int(w) for w in meas]
                ax.scatter(mx, [max(v, 1) for v in meas.values()], s=70, facecolors="none",
                           edgecolors=line.get_color(), linewidths=1.6,
                           label=f"{short_name(name)} (measured)")
        for pt in d.get("reference_points", {}).values():
            ax.scatter([pt["world_size"]], [pt["bytes"]], marker="x", color="black", s=40, zorder=5)
            ax.annotate(pt["label"], (pt["world_size"], pt["bytes"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel degree N_d (ranks)")
        ax.set_ylabel("persistent model-state bytes per rank [B]")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        _title(ax, d["title"])
    return _save(fig, path)


def plot_comm_volume(data: dict[str, Any], path: Path) -> Path:
    """Bytes each rank sends per step, by strategy, split intra-node / inter-node; modelled vs measured."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key in zip(axes, ("large", "small"), strict=True):
        d = data[key]
        unit = d["unit"]
        names = list(d["strategies"])
        for i, name in enumerate(names):
            e = d["strategies"][name]
            for off, src, hatch in ((-0.2, "model", None), (0.2, "measured", "//")):
                vals = e.get(src)
                if not vals:
                    continue
                intra, inter = to_unit(vals["intra"], unit), to_unit(vals["inter"], unit)
                w = 0.38 if e.get("measured") else 0.6
                x = i + off if e.get("measured") else i
                ax.bar(x, intra, w, color="#4C72B0", hatch=hatch, edgecolor="black", linewidth=0.4,
                       label="intra-node" if i == 0 and src == "model" else None)
                ax.bar(
                    x,
                    inter,
                    w,
                    bottom=intra,
                    color="#C44E52",
                    hatch=hatch,
                    edgecolor="black",
                    linewidth=0.4,
                    label="inter-node" if i == 0 and src == "model" else None,
                )
        ax.set_xticks(range(len(names)), [short_name(n) for n in names], fontsize=8)
        ax.set_ylabel(f"bytes sent per rank per step [{_unit_label(unit)}]")
        _title(ax, d["title"])
        handles = [Patch(facecolor="#4C72B0", edgecolor="black", label="intra-node"),
                   Patch(facecolor="#C44E52", edgecolor="black", label="inter-node")]
        if any(e.get("measured") for e in d["strategies"].values()):
            handles += _modelled_measured_handles()
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom for the legend
        ax.legend(handles=handles, fontsize=8, ncol=2, loc="upper left")
    return _save(fig, path)


def _shared_log_range(values: list[float], tolerance: float) -> tuple[float, float]:
    """One log range for every panel: from below the smallest non-zero error to above the tolerance."""
    nonzero = [v for v in values if v > 0]
    top = max([tolerance, *nonzero]) * 4
    bottom = min([tolerance, *nonzero]) / 4
    return bottom, top


#: how far apart, in steps, the markers of neighbouring curves sit at one step
DODGE = 0.07
LINESTYLES = ("-", "--", "-.", ":")


def draw_error_curves(ax: Any, series: dict[str, list[float]], bottom: float) -> None:
    """One curve per distinct error series on ``ax`` (series with identical errors drawn once, named
    together). Curves whose errors nearly coincide (world 2 and world 8 within 0.1%) would still hide
    each other, so each curve sits a little to the side of its step (``DODGE`` apart), with its own
    marker and line style, and each later curve's marker is smaller than the one before; an exact 0
    sits on the bottom edge with a hollow marker."""
    curves: dict[tuple[float, ...], list[str]] = {}
    for name, errors in series.items():
        curves.setdefault(tuple(errors), []).append(name if name.startswith("world ") else short_name(name))
    for i, (errs, names) in enumerate(curves.items()):
        label = ", ".join(names) + (" (identical)" if len(names) > 1 else "")
        shift = (i - (len(curves) - 1) / 2) * DODGE
        xs = [step + shift for step in range(1, len(errs) + 1)]
        line, = ax.plot(xs, [max(e, bottom) for e in errs], marker=MARKERS[i % len(MARKERS)],
                        markersize=max(9 - 1.2 * i, 4), alpha=0.85, linestyle=LINESTYLES[i % len(LINESTYLES)],
                        label="\n".join(textwrap.wrap(label, 44)))
        zeros = [x for x, e in zip(xs, errs, strict=True) if e == 0]
        if zeros:
            ax.scatter(zeros, [bottom] * len(zeros), s=90, facecolors="white",
                       edgecolors=line.get_color(), zorder=5)


def plot_equivalence_error(data: dict[str, Any], path: Path) -> Path:
    """C-ZERO-002's relative master error per step, per backend, on one shared log range with the verdict's
    tolerance drawn; an exact 0 (bit-identical) sits on the bottom edge with a hollow marker."""
    backends = [b for b, v in data["backends"].items() if v.get("series")]
    tolerance = float(data["tolerance"])
    values = [e for b in backends for errs in data["backends"][b]["series"].values() for e in errs]
    bottom, top = _shared_log_range(values, tolerance)
    panels = max(len(backends), 1)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False, sharey=True)
    for ax, backend in zip(axes[0], backends, strict=False):
        series = data["backends"][backend]["series"]
        steps_max = max((len(e) for e in series.values()), default=1)
        draw_error_curves(ax, series, bottom)
        ax.axhline(tolerance, color="black", linestyle="--", linewidth=1.2,
                   label=f"C-ZERO-002 tolerance ({data['precision']}): {tolerance:g}")
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_xticks(range(1, steps_max + 1))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("max |master - ground truth| / max |ground truth|")
        _title(ax, f"MEASURED on {backend}: {data['backends'][backend]['title']}", 60)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    notes = ["each curve's markers sit a little to the side of their step, so curves that coincide stay "
             "visible"]
    if any(e == 0 for e in values):
        notes.append("hollow marker on the bottom edge: 0 (bit-identical to the ground truth)")
    fig.text(0.01, 0.01, "; ".join(notes), fontsize=7)
    if not backends:
        axes[0][0].text(0.5, 0.5, "no backend produced measurements", ha="center")
    return _save(fig, path)


def plot_offload_timeline(data: dict[str, Any], path: Path) -> Path:
    """One panel per source (measured tracker timeline, modelled schedule): bytes after each event."""
    panels = data["panels"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.2 * len(panels)), squeeze=False)
    unit = data["unit"]
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        longest = max(panel["series"], key=lambda s: len(s["points"]))["points"]
        for series in panel["series"]:
            pts = series["points"]
            xs = list(range(len(pts)))
            ax.step(xs, [to_unit(p["device"], unit) for p in pts], where="post", linewidth=1.6,
                    linestyle=series.get("linestyle", "-"), label=series["label"])
            if series.get("show_host") and any(p.get("host") for p in pts):
                ax.step(
                    xs,
                    [to_unit(p["host"], unit) for p in pts],
                    where="post",
                    linestyle=":",
                    linewidth=1.2,
                    label=series.get("host_label", f"host, {series['label']}"),
                )
        step = max(1, len(longest) // 30)
        ax.set_xticks(
            range(0, len(longest), step),
            [longest[i]["event"][:40] for i in range(0, len(longest), step)],
            rotation=60,
            ha="right",
            fontsize=6,
        )
        ax.set_ylabel(f"bytes per rank [{_unit_label(unit)}]")
        ax.set_xlabel("allocation / free events of one step, in order")
        _title(ax, panel["title"], 140)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.45)  # headroom: the legend sits above the curves
        ax.legend(fontsize=7, ncol=2, loc="upper center")
    return _save(fig, path)
