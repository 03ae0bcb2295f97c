"""The zoo's report: ``zoo.json``, ``zoo.md`` and ``zoo.png`` (entries x {verify, monitor, twin}).

Written into the run's folder (``reports/zoo-<timestamp>/`` or ``--out``), each file next to its
target and renamed over it (:mod:`zerosim.files.outputs`). The markdown sets the figures beside the
published ones of TrainCheck (OSDI '25) and TTrace (arXiv 2506.09280), and lists every entry with
what each judge said of the bug and of its fixed twin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files.outputs import output_dir, save_figure, write_text
from .catalogue import CATCH, FINDING, MISS

#: the published figures the zoo's are set beside (each paper's own numbers, not re-measured here)
PUBLISHED = (
    ("TrainCheck (OSDI '25)", "18 of 20 reproduced silent errors (90%)", "0.99-1.73x",
     "1.2-31% depending on its training inputs"),
    ("TTrace (arXiv 2506.09280)", "11 known + 3 new bugs in Megatron-LM", "not compared here",
     "not compared here"),
)
COLUMNS = ("verify: bug", "monitor: bug", "twin")
_COLORS = {CATCH: "#2b8a3e", FINDING: "#74b816", MISS: "#e67700", "out of reach": "#dee2e6",
           "pass": "#2b8a3e", "false alarm": "#c92a2a", "error": "#c92a2a"}


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.0f}%"


def _twin(verdicts: dict[str, Any]) -> str:
    """One word for both judges on the twin: pass, false alarm, error, or out of reach."""
    words = [v["twin"] for v in verdicts.values() if v["expected"] is not None]
    if not words:
        return "out of reach"
    for word in ("error", "false alarm"):
        if word in words:
            return word
    return "pass"


def _cell(judge: dict[str, Any]) -> str:
    if judge["expected"] is None:
        return "out of reach"
    step = f" @ {judge['first_step']}" if judge["first_step"] is not None and judge["bug"] != MISS else ""
    mark = " (a known miss, now caught)" if judge.get("gained") else \
        "" if judge["holds"] else " **(expected " + str(judge["expected"]) + ")**"
    return f"{judge['bug']}{step}{mark}"


def render_markdown(matrix: dict[str, Any]) -> str:
    v, m = matrix["verify"], matrix["monitor"]
    lines = [
        "# zerosim zoo: reported silent-correctness bugs, reproduced",
        "",
        f"{matrix['total']} entries; wall time {matrix['wall_s']:.0f} s (world 2, every run on the CPU). "
        f"Expectations broken: {', '.join(matrix['expectations_broken']) or 'none'}. Known misses now "
        f"caught: {', '.join(matrix.get('catches_gained', [])) or 'none'}.",
        "",
        "| judge | in reach | caught | detection rate | false alarms on twins "
        "| first detection (median / max step) |",
        "|---|---|---|---|---|---|",
        f"| zerosim verify | {v['reach']} | {v['caught']} | {_pct(v['rate'])} | "
        f"{v['false_alarms']} of {v['twins']} | {v['first_step_median']} / {v['first_step_max']} |",
        f"| zerosim.monitor + check trace | {m['reach']} | {m['caught']} | {_pct(m['rate'])} | "
        f"{m['false_alarms']} of {m['twins']} | {m['first_step_median']} / {m['first_step_max']} |",
        "",
        "Published figures of other verifiers (their own bug sets, not re-run here):",
        "",
        "| tool | bugs caught | slowdown | false positives |",
        "|---|---|---|---|",
        *[f"| {name} | {caught} | {slow} | {fp} |" for name, caught, slow, fp in PUBLISHED],
        "",
        "| entry | report | verify: bug | monitor: bug | twin (both judges) |",
        "|---|---|---|---|---|",
    ]
    for row in matrix["entries"]:
        verdicts = row["verdicts"]
        lines.append(f"| {row['id']} | {row['report']} | {_cell(verdicts['verify'])} | "
                     f"{_cell(verdicts['monitor'])} | {_twin(verdicts)} |")
    lines += ["", "A cell: the judge's outcome on the bug (catch, finding: right values with traffic off "
              "the declared strategy, miss) and the step it first failed at; the twin must pass every judge "
              "that reaches it. Why each entry is out of reach or missed: docs/zoo.md.", ""]
    return "\n".join(lines)


def render_figure(matrix: dict[str, Any], path: Path) -> None:
    """Entries x {verify, monitor, twin}: one coloured cell per outcome, the first step written in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows = matrix["entries"]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.3 * len(rows)))
    for i, row in enumerate(rows):
        verdicts = row["verdicts"]
        cells = [(verdicts["verify"]["bug"], verdicts["verify"]),
                 (verdicts["monitor"]["bug"], verdicts["monitor"]), (_twin(verdicts), None)]
        for j, (word, judge) in enumerate(cells):
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=_COLORS.get(word, "#ffffff"), edgecolor="white"))
            text = word
            if judge is not None and judge["first_step"] is not None and word in (CATCH, FINDING):
                text += f" @{judge['first_step']}"
            if judge is not None and not judge["holds"]:
                text += " !"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=7,
                    color="white" if word in (CATCH, "pass", "false alarm", "error") else "black")
    ax.set_xlim(0, len(COLUMNS))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([j + 0.5 for j in range(len(COLUMNS))], COLUMNS)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(len(rows))], [r["id"] for r in rows], fontsize=7)
    v, m = matrix["verify"], matrix["monitor"]
    ax.set_title(f"zerosim zoo: verify {v['caught']}/{v['reach']}, monitor {m['caught']}/{m['reach']}, "
                 f"false alarms {v['false_alarms'] + m['false_alarms']}; '!' = not the expected outcome",
                 fontsize=8, pad=18)
    legend = [Patch(facecolor=_COLORS[k], label=k)
              for k in (CATCH, FINDING, MISS, "out of reach", "false alarm")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=5, fontsize=7,
              frameon=False)
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def write_report(matrix: dict[str, Any], out_dir: str | Path | None) -> dict[str, Path]:
    """``zoo.json``, ``zoo.md`` and ``zoo.png`` under ``out_dir`` (a fresh ``reports/zoo-<ts>/`` if None)."""
    out = output_dir(out_dir, "zoo")
    paths = {"json": out / "zoo.json", "md": out / "zoo.md", "png": out / "zoo.png"}
    write_text(paths["json"], json.dumps(matrix, indent=1) + "\n")
    write_text(paths["md"], render_markdown(matrix))
    render_figure(matrix, paths["png"])
    return paths
