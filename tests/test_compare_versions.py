"""tools/compare_versions.py: the per-figure verdicts of a before/after comparison, and its bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "compare_versions.py"
spec = importlib.util.spec_from_file_location("compare_versions", TOOL)
assert spec is not None and spec.loader is not None
cv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cv)

KINDS = {"step (s)": "time", "peak_bytes": "exact"}


def runs(base: list[tuple[float, int]], new: list[tuple[float, int]]) -> list[dict]:
    return [{"round": i + 1,
             "base": {"figures": {"step (s)": b[0], "peak_bytes": b[1]}},
             "new": {"figures": {"step (s)": n[0], "peak_bytes": n[1]}}}
            for i, (b, n) in enumerate(zip(base, new, strict=True))]


def verdicts(rows: list[dict]) -> dict[str, str]:
    return {r["figure"]: r["verdict"] for r in rows}


def test_overlapping_times_and_equal_peaks_pass() -> None:
    rows = cv.summarise(runs([(1.0, 64), (1.2, 64), (1.1, 64)], [(1.15, 64), (1.3, 64), (0.9, 64)]), KINDS)
    assert verdicts(rows) == {"step (s)": "within noise", "peak_bytes": "equal"}
    step = rows[0]
    assert (step["base"]["median"], step["new"]["median"]) == (1.1, 1.15)
    assert step["ratio_new_over_base"] == 1.15 / 1.1


def test_disjoint_times_and_a_changed_peak_are_named() -> None:
    rows = cv.summarise(runs([(1.0, 64), (1.1, 64)], [(1.2, 72), (1.3, 72)]), KINDS)
    assert verdicts(rows) == {"step (s)": "slower beyond noise", "peak_bytes": "DIFFERS"}
    assert rows[1]["ratio_new_over_base"] == 72 / 64
    rows = cv.summarise(runs([(1.0, 64), (1.1, 64)], [(0.8, 64), (0.9, 65)]), KINDS)
    assert verdicts(rows) == {"step (s)": "faster beyond noise",
                              "peak_bytes": "DIFFERS, and varies run to run"}


def test_markdown_shows_spread_and_values() -> None:
    bench = {"command": ["bench", "sim", "--out", "{out}"], "rounds": 2, "rounds_asked": 3,
             "started_utc": "t", "runs": [], "checkouts": {v: {"commit": "0" * 40 + " msg", "dirty": False}
                                                            for v in ("base", "new")}}
    bench["runs"] = [{**r, **{v: {**r[v], "load_before": {"loadavg": [1.0]}, "load_after": {"loadavg": [2.5]}}
                              for v in ("base", "new")}}
                     for r in runs([(1.0, 64), (1.1, 64)], [(1.2, 72), (1.3, 72)])]
    bench["summary"] = cv.summarise(bench["runs"], KINDS)
    text = cv.render_markdown({"benchmarks": {"sim": bench}})
    assert "2 of 3 rounds (stopped)" in text and "load average 1.00-2.50" in text
    assert "| step (s) | 1.050 [1.000-1.100] | 1.250 [1.200-1.300] | 1.190 | slower beyond noise |" in text
    assert "| peak_bytes | 64 | 72 | 1.1250 | DIFFERS |" in text


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    out = [f"--json={tmp_path / 'c.json'}", f"--md={tmp_path / 'c.md'}"]
    assert cv.main([*out, "--base", str(tmp_path), "--new", ".", "--name", "x", "--", "bench", "sim",
                    "--out", "{out}"]) == 2
    assert capsys.readouterr().err.strip() == f"compare_versions: --base: {tmp_path} has no .venv/bin/python"
    assert cv.main([*out, "--base", ".", "--new", ".", "--name", "x", "--", "bench", "sim"]) == 2
    assert "no {out} placeholder" in capsys.readouterr().err
    assert cv.main([*out, "--base", ".", "--new", ".", "--name", "x", "--rounds", "0", "--", "{out}"]) == 2
    assert "--rounds: 0 must be >= 1" in capsys.readouterr().err
    assert cv.main(out) == 2  # nothing to render
    assert not list(tmp_path.iterdir())
