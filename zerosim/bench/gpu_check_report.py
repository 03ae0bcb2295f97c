"""``zerosim gpu-check``'s folder in words and in one figure: ``gpu-check.md`` and ``gpu-check.png``,
both made from the ``gpu-check.json`` document alone (:mod:`zerosim.bench.gpu_check` writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATUS_COLOURS = {"pass": "#4c9a2a", "fail": "#c0392b", "skipped": "#999999", "timeout": "#e67e22"}


def write_markdown(path: Path, doc: dict[str, Any]) -> None:
    e = doc["environment"]
    verdict = "PASS" if doc["passed"] else "FAIL" if doc["failed"] else "TIMEOUT"
    lines = [
        "# zerosim gpu-check",
        "",
        f"- Device: **{e['device_name']}** (`{doc['device']}`, {e['device_count']} CUDA device(s) visible); "
        f"torch {e['torch']}, CUDA {e['cuda']}, cuDNN {e['cudnn']}, NCCL {e['nccl']}; Python {e['python']}.",
        f"- Started {doc['started_utc']}; {doc['wall_s']:.1f} s of the {doc['total_limit_s']:.0f} s limit.",
        f"- Overall: **{verdict}** (exit status {doc['exit_status']}).",
    ]
    if doc["perturbed"]:
        lines.append(f"- **A value of step `{doc['perturbed']}` was perturbed on purpose** "
                     "(the check's self-test): these results are not a device's.")
    lines += ["", "| step | what | status | wall s | limit s | host CPU s | result |",
              "|---|---|---|---|---|---|---|"]
    for s in doc["steps"]:
        status = s["status"] if s["status"] in ("pass", "skipped") else f"**{s['status'].upper()}**"
        lines.append(f"| {s['name']} | {s['title']} | {status} | {s['wall_s']:.1f} | {s['limit_s']:.0f} | "
                     f"{s['cpu_s']:.1f} | {s['reason'].replace('|', '/')} |")
    for s in doc["steps"]:
        if not s["figures"]:
            continue
        lines += ["", f"## {s['name']}: {s['title']}", ""]
        if s["artifact"]:
            lines.append(f"Full result: `{s['artifact']}`; log: `{s['log']}`.")
            lines.append("")
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_number(v)} |" for k, v in s["figures"].items()]
    lines += ["", "![gpu-check](gpu-check.png)", ""]
    path.write_text("\n".join(lines))


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _figures(doc: dict[str, Any], step: str) -> dict[str, Any]:
    return next(s["figures"] for s in doc["steps"] if s["name"] == step)


def _by_suffix(figures: dict[str, Any], suffix: str) -> dict[str, float]:
    return {k[: -len(suffix) - 1]: v for k, v in figures.items()
            if k.endswith("." + suffix) and isinstance(v, float)}


def write_figure(path: Path, doc: dict[str, Any]) -> None:
    """Four panels: step wall times against limits; the trainer's error / bound per strategy; offload's
    peak against budget, overlap and step-time ratio; each AdamW kernel's fraction of the copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    names = [s["name"] for s in doc["steps"]]
    ax.barh(names, [s["limit_s"] for s in doc["steps"]], color="#eeeeee", label="limit")
    ax.barh(names, [s["wall_s"] for s in doc["steps"]],
            color=[STATUS_COLOURS.get(s["status"], "black") for s in doc["steps"]], label="wall time")
    for i, s in enumerate(doc["steps"]):
        ax.text(s["wall_s"], i, f" {s['status']}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"steps on {doc['environment']['device_name']} ({doc['device']})")
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[0][1]
    trainer = _figures(doc, "trainer")
    between = _by_suffix(trainer, "error_over_bound")
    to_ref = _by_suffix(trainer, "device_vs_reference_over_bound")
    if between:
        xs = range(len(between))
        ax.bar([x - 0.2 for x in xs], list(between.values()), width=0.4, label="device vs CPU run")
        ax.bar([x + 0.2 for x in xs], [to_ref.get(k, 0.0) for k in between], width=0.4,
               label="device vs float64 reference")
        ax.set_xticks(list(xs), list(between), rotation=30, fontsize=8)
        ax.axhline(1.0, color="red", linewidth=1, label="bound")
        ax.legend(fontsize=8)
    _no_data(ax, between)
    ax.set_ylabel("max error / bound")
    ax.set_title("ZeroTrainer: device against the CPU")

    ax = axes[1][0]
    off = _figures(doc, "offload")
    if off:
        labels = ["peak / budget", "overlap of copy time", "step time with / without"]
        values = [off["peak_over_budget"], off["overlap_fraction"], off["offload_over_plain"]]
        ax.bar(labels, values, color=["#3b7dd8", "#8e44ad", "#16a085"])
        ax.axhline(1.0, color="red", linewidth=1)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    _no_data(ax, off)
    ax.set_title("ZeRO-3 offload")

    ax = axes[1][1]
    kernel = _figures(doc, "kernel")
    fractions = _by_suffix(kernel, "fraction_of_copy")
    if fractions:
        ax.bar(list(fractions), list(fractions.values()), color="#3b7dd8")
        ax.axhline(0.7, color="red", linewidth=1, label="goal 0.7")
        ax.legend(fontsize=8)
        ax.set_ylabel(f"fraction of copy bandwidth ({kernel['copy_bandwidth_gb_s']:.1f} GB/s)")
    _no_data(ax, fractions)
    ax.set_title("AdamW update against a copy of the same bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _no_data(ax: Any, data: Any) -> None:
    if not data:
        ax.text(0.5, 0.5, "no figures (step skipped, failed early or timed out)", ha="center", va="center",
                transform=ax.transAxes)
