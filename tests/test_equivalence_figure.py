"""The equivalence-error figure keeps every curve visible: series whose errors nearly coincide (world 2
and world 8 of the example report, within 0.1%) are drawn beside each other, each with its own marker and
line style; series with identical errors are drawn once and named together."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zerosim.report.figures import draw_error_curves, plot_equivalence_error  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: the simulator's series of the committed example report: world 2 and world 8 nearly coincide
EXAMPLE = json.loads((ROOT / "reports" / "example" / "equivalence_error.json").read_text())
SIMULATOR = EXAMPLE["backends"]["simulator"]["series"]


def test_nearly_coinciding_curves_sit_apart_with_their_own_markers() -> None:
    fig, ax = plt.subplots()
    try:
        draw_error_curves(ax, SIMULATOR, bottom=1e-9)
        lines = ax.get_lines()
        assert len(lines) == len(SIMULATOR) == 4
        xs = [[float(x) for x in np.asarray(line.get_xdata())] for line in lines]
        ys = [[float(y) for y in np.asarray(line.get_ydata())] for line in lines]
        positions = [list(zip(x, y, strict=True)) for x, y in zip(xs, ys, strict=True)]
        for i in range(len(lines)):
            for j in range(i + 1, len(lines)):
                # no marker of one curve at the same place as another's, at any step
                assert all(a != b for a, b in zip(positions[i], positions[j], strict=True)), (i, j)
        assert len({str(line.get_marker()) for line in lines}) == 4
        assert len({str(line.get_linestyle()) for line in lines}) == 4
        sizes = [line.get_markersize() for line in lines]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4  # later markers sit inside
        for x in xs:  # every marker within half a step of its own step
            steps = [round(v) for v in x]
            assert steps == [1, 2, 3] and all(abs(v - s) < 0.5 for v, s in zip(x, steps, strict=True))
    finally:
        plt.close(fig)


def test_identical_series_are_drawn_once_and_named_together() -> None:
    fig, ax = plt.subplots()
    try:
        draw_error_curves(ax, EXAMPLE["backends"]["mpi"]["series"], bottom=1e-9)
        [line] = ax.get_lines()
        assert "(identical)" in str(line.get_label())
    finally:
        plt.close(fig)


def test_the_example_figure_renders(tmp_path: Path) -> None:
    out = plot_equivalence_error(EXAMPLE, tmp_path / "equivalence_error.png")
    assert out.stat().st_size > 10_000
