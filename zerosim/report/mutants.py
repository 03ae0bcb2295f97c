"""The bug-detection matrix: every catalogued mutant run through the contract suite, and what caught it.

Each fault of :data:`zerosim.engine.fault_catalog.FAULTS` runs in the configuration where it acts
(its ``example``) on one backend: the in-process simulator by default, or ``mpi`` / ``torch`` (the
same ``zerosim simulate --backend ... --json`` a user would run, one launch per mutant). A mutant is
**killed** when at least one contract fails. For each one the matrix records, per contract, the first
step it failed at (``plan``: C-ZERO-001 stopped the run before training), the first contract to fail
(earliest step, then contract order), whether the failing contracts are exactly those the catalogue
claims, and whether that first contract's diagnostics at that step name what the fault touched (a
rank it broke and, where the fault breaks particular elements, an element range overlapping them).

Broken *trainers* join the same matrix (``--trainers MODULE``): a module whose ``MUTANTS`` maps
factory names to world sizes, each factory a deliberately broken version of a trainer, run through
``zerosim verify`` (:func:`run_trainer_mutant`). The repository's own eleven are
``tests.verify_trainers.broken``; a user writes the same for their trainer to see what the contracts
catch. Their rows leave ``names_touched`` empty (the module declares no touched ranges; the verify
tests check each location).

:func:`run_matrix` returns plain JSON data; :func:`write_report` writes ``mutants.json``, ``.md`` and
a heat map ``mutants.png`` (mutant x contract, coloured by the step of first detection).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.fault_catalog import FAULTS, Fault, Touched
from ..engine.run_result import CONTRACTS
from ..errors import ConfigError
from ..files.outputs import output_dir, save_figure, write_text
from ..processes.launching import run_process_group

BACKENDS = ("sim", "mpi", "torch")
PLAN_STAGE = "plan"  # the step column of a contract that failed on the plan, before training


def run_mutant(fault: Fault, backend: str = "sim", timeout_s: float = 300.0) -> dict[str, Any]:
    """Run one mutant in its example configuration; the matrix row (see the module docstring)."""
    from ..engine.config import RunConfig

    cfg = RunConfig(fault=fault.name, **fault.example)
    run = cfg.resolve()
    t0 = time.perf_counter()
    verdicts, error = _verdicts(fault, cfg, backend, timeout_s)
    row: dict[str, Any] = {
        "name": fault.name, "where": fault.where, "description": fault.description,
        "bug_class": fault.bug_class or None, "backend": backend,
        "config": f"zerosim simulate --fault {fault.name} {fault.example_flags()}",
        "expected_contracts": list(fault.catches), "wall_s": round(time.perf_counter() - t0, 3),
    }
    if error is not None:
        return {**row, "killed": False, "error": error, "contracts": {}, "first_contract": None,
                "first_step": None, "matches_catalogue": False, "names_touched": False, "diagnostic": None}
    first_by_contract: dict[str, int | str] = {}
    for cid in CONTRACTS:
        violations = verdicts.get(cid, {}).get("violations", [])
        if violations:
            first_by_contract[cid] = _first_stage(violations)
    failing = sorted(first_by_contract)
    first = min(failing, key=lambda c: (_order(first_by_contract[c]), CONTRACTS.index(c)), default=None)
    at_first: list[dict[str, Any]] = []
    if first is not None:
        at_first = [v for v in verdicts[first]["violations"]
                    if _stage_of(v) == first_by_contract[first]]
    touched = fault.touches(run)
    return {**row, "killed": bool(failing), "error": None, "contracts": first_by_contract,
            "first_contract": first, "first_step": first_by_contract.get(first) if first else None,
            "matches_catalogue": failing == sorted(fault.catches),
            "names_touched": names_touched(at_first, touched),
            "touched": {"ranks": list(touched.ranks) if touched.ranks is not None else "all",
                        "intervals": [list(iv) for iv in touched.intervals[:8]]
                        if touched.intervals is not None else "any"},
            "diagnostic": _line(at_first[0]) if at_first else None}


def trainer_mutants(module: str) -> list[tuple[str, int]]:
    """``(MODULE:FACTORY, world)`` for every entry of ``module.MUTANTS`` (bad module: ConfigError)."""
    import importlib
    import os

    from ..errors import ImplementationError

    if os.getcwd() not in sys.path:  # the user's module next to the command, as verify imports it
        sys.path.insert(0, os.getcwd())
    try:
        table = importlib.import_module(module).MUTANTS
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported as its own
        raise ImplementationError(f"trainers={module!r}: cannot read {module}.MUTANTS: "
                                  f"{type(e).__name__}: {e}") from None
    if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, int) and v > 0
                                              for k, v in table.items()):
        raise ConfigError("trainers", module, "MUTANTS must map factory names to world sizes")
    return [(f"{module}:{name}", world) for name, world in table.items()]


def run_trainer_mutant(target: str, world: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One broken trainer through ``zerosim verify``: the matrix row (contracts by first failing step)."""
    from ..errors import ZeroSimError
    from ..verify import verify

    t0 = time.perf_counter()
    row: dict[str, Any] = {"name": target, "where": "trainer", "description": "a broken trainer (verify)",
                           "bug_class": None, "backend": "torch",
                           "config": f"zerosim verify {target} --world {world}",
                           "expected_contracts": None, "touched": None}
    try:
        report = verify(target, world=world, timeout_s=min(timeout_s, 120.0))
    except ZeroSimError as e:
        return {**row, "wall_s": round(time.perf_counter() - t0, 3), "killed": False, "error": str(e),
                "contracts": {}, "first_contract": None, "first_step": None, "matches_catalogue": None,
                "names_touched": None, "diagnostic": None}
    firsts = {cid: min(v["step"] for v in c.violations) for cid, c in report.contracts.items()
              if c.status == "fail" and c.violations}
    first = min(firsts, key=lambda c: (firsts[c], CONTRACTS.index(c)), default=None)
    at_first = [v for v in report.contracts[first].violations if v["step"] == firsts[first]] if first else []
    return {**row, "wall_s": round(time.perf_counter() - t0, 3), "killed": report.verdict == "fail",
            "error": None, "contracts": firsts, "first_contract": first,
            "first_step": firsts.get(first) if first else None, "matches_catalogue": None,
            "names_touched": None,
            "diagnostic": _verify_line(first, at_first[0]) if first is not None and at_first else None}


def _verify_line(contract: str, v: Mapping[str, Any]) -> str:
    where = " ".join(f"{k}={v[k]}" for k in ("step", "rank", "tensor") if v.get(k) is not None)
    span = f" elements [{v['start']}, {v['stop']})" if v.get("start") is not None else ""
    return f"{contract} {where}{span}: {v.get('message', '')}"


#: how long a launched run has, once asked to stop, to stop its own ranks (zerogpu's launcher gives
#: them 5 s after SIGTERM, then 5 s after SIGKILL) and remove its temporary files, before SIGKILL
_RUN_STOP_GRACE_S = 20.0

def _verdicts(fault: Fault, cfg: Any, backend: str, timeout_s: float) -> tuple[dict[str, Any], str | None]:
    """Every contract's verdict as JSON data, or the error that ended the run instead."""
    if backend == "sim":
        from ..engine.spmd import run_simulated
        from ..errors import ZeroSimError

        try:
            return run_simulated(cfg).to_json()["verdicts"], None
        except ZeroSimError as e:
            return {}, f"the run failed: {e}"
    cmd = [sys.executable, "-m", "zerosim", "simulate", "--backend", backend, "--json", "--fault", fault.name,
           *fault.example_flags().split()]
    # in a session of its own, ended (SIGTERM, then SIGKILL after a grace) when this process is
    # interrupted: the run stops its ranks and removes its temporary files itself
    proc = run_process_group(cmd, timeout_s, dict(os.environ), capture=True, kill_grace_s=_RUN_STOP_GRACE_S)
    if proc.returncode is None:
        return {}, f"no result within {timeout_s:g} s"
    if proc.returncode not in (0, 1):
        tail = ((proc.stderr or "").strip().splitlines() or ["(no output)"])[-1]
        return {}, f"exit status {proc.returncode}: {tail}"
    try:
        return json.loads(proc.stdout or "")["verdicts"], None
    except (ValueError, KeyError):
        return {}, "the run printed no JSON result"


def _stage_of(violation: dict[str, Any]) -> int | str:
    """``plan`` for C-ZERO-001, else the violation's step (a clause about the whole run: step 0)."""
    if violation.get("contract") == "C-ZERO-001":
        return PLAN_STAGE
    step = violation.get("step")
    return 0 if step is None else int(step)


def _order(stage: int | str) -> int:
    return -2 if stage == PLAN_STAGE else int(stage)


def _first_stage(violations: Sequence[dict[str, Any]]) -> int | str:
    return min((_stage_of(v) for v in violations), key=_order)


def names_touched(violations: Sequence[dict[str, Any]], touched: Touched) -> bool:
    """Whether one of ``violations`` names a rank the fault touched and, when the fault breaks particular
    elements, an element range overlapping them (what a user needs to find the bug)."""
    for v in violations:
        ranks = set(v.get("ranks") or ())
        if not ranks or (touched.ranks is not None and not ranks & set(touched.ranks)):
            continue
        if touched.intervals is None:
            return True
        start, stop = v.get("start"), v.get("stop")
        if start is not None and stop is not None and any(
                start < e and s < stop for s, e in touched.intervals):
            return True
    return False


def _line(v: dict[str, Any]) -> str:
    where = [f"step={v['step']}" if v.get("step") is not None else "",
             "rank=" + ",".join(map(str, v.get("ranks") or ())) if v.get("ranks") else "",
             f"tensor={v['tensor']}" if v.get("tensor") else "",
             f"range=[{v['start']}, {v['stop']})" if v.get("start") is not None else ""]
    return " ".join([v["contract"], v["clause"], *[w for w in where if w]]) + f": {v['message']}"


def select(names: str | None) -> list[Fault]:
    """The catalogue, or the comma-separated ``names`` from it (unknown name: ConfigError)."""
    if not names:
        return list(FAULTS.values())
    out = []
    for name in (n.strip() for n in names.split(",")):
        if name not in FAULTS:
            raise ConfigError("only", name, f"unknown mutant; known: {', '.join(sorted(FAULTS))}")
        out.append(FAULTS[name])
    return out


def run_matrix(faults: Sequence[Fault], backend: str = "sim", timeout_s: float = 300.0,
               progress: Callable[[dict[str, Any]], None] | None = None,
               trainers: Sequence[tuple[str, int]] = ()) -> dict[str, Any]:
    """Every mutant in ``faults`` on ``backend``, then every broken trainer; summary counts and one row
    per mutant."""
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"known: {', '.join(BACKENDS)}")
    rows = []
    for fault in faults:
        rows.append(run_mutant(fault, backend, timeout_s))
        if progress is not None:
            progress(rows[-1])
    for target, world in trainers:
        rows.append(run_trainer_mutant(target, world, timeout_s))
        if progress is not None:
            progress(rows[-1])
    stepped = [r for r in rows if isinstance(r["first_step"], int)]
    steps = [r["first_step"] for r in stepped if r["where"] != "trainer"]
    trainer_steps = [r["first_step"] for r in stepped if r["where"] == "trainer"]
    return {
        "backend": backend,
        "contracts": list(CONTRACTS),
        "total": len(rows),
        "killed": sum(r["killed"] for r in rows),
        "survived": [r["name"] for r in rows if not r["killed"]],
        "mean_first_step": (sum(steps) / len(steps)) if steps else None,  # engine steps count from 0
        # verify counts steps from 1 over both optimizer phases
        "mean_first_step_trainers": (sum(trainer_steps) / len(trainer_steps)) if trainer_steps else None,
        "caught_on_plan": sum(r["first_step"] == PLAN_STAGE for r in rows),
        "mutants": rows,
    }


def exit_code(matrix: dict[str, Any]) -> int:
    """1 when any mutant survived (the harness missed a bug), else 0."""
    return 1 if matrix["survived"] else 0


# ---- report -----------------------------------------------------------------------------------------

def render_markdown(matrix: dict[str, Any]) -> str:
    head = ["mutant", "where", *matrix["contracts"], "first", "names touched", "as catalogued"]
    lines = [f"# Bug-detection matrix ({matrix['backend']})", "",
             f"{matrix['killed']} of {matrix['total']} mutants killed; {matrix['caught_on_plan']} caught on "
             "the plan before training; mean step of first detection of the others: "
             + (f"{matrix['mean_first_step']:.2f}" if matrix["mean_first_step"] is not None else "n/a")
             + (f" (0-based); broken trainers: {matrix['mean_first_step_trainers']:.2f} (verify's steps, "
                "1-based)" if matrix.get("mean_first_step_trainers") is not None else "")
             + ". A cell is the first step a contract failed at (`plan`: before training).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in matrix["mutants"]:
        cells = [str(r["contracts"].get(c, "")) for c in matrix["contracts"]]
        first = r["error"] or (f"{r['first_contract']} @ {r['first_step']}" if r["killed"] else "SURVIVED")
        lines.append("| " + " | ".join([f"`{r['name']}`", r["where"], *cells, first,
                                         _yes_no(r["names_touched"]), _yes_no(r["matches_catalogue"])])
                     + " |")
    lines += ["", "Configurations:", ""]
    lines += [f"- `{r['config']}`: {r['description']}" for r in matrix["mutants"]]
    return "\n".join(lines) + "\n"


def _yes_no(flag: bool | None) -> str:
    return "n/a" if flag is None else "yes" if flag else "no"


def render_heatmap(matrix: dict[str, Any], path: Path) -> None:
    """Mutant x contract: the step of first detection (darker = earlier; the plan darkest), blank where
    the contract passed, a red frame where the first failing contract is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    rows, cols = matrix["mutants"], matrix["contracts"]
    values = np.full((len(rows), len(cols)), np.nan)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            stage = r["contracts"].get(c)
            if stage is not None:
                values[i, j] = -1 if stage == PLAN_STAGE else float(stage)
    vmax = max(2.0, float(np.nanmax(values)) if not np.isnan(values).all() else 2.0)
    fig, ax = plt.subplots(figsize=(2.5 + 1.3 * len(cols), 1.0 + 0.36 * len(rows)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#f4f4f4")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=-1, vmax=vmax, aspect="auto")
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            stage = r["contracts"].get(c)
            if stage is None:
                continue
            ax.text(j, i, "plan" if stage == PLAN_STAGE else f"step {stage}", ha="center", va="center",
                    fontsize=7, color="white" if values[i, j] < (vmax - 1) / 2 else "black")
            if c == r["first_contract"]:
                ax.add_patch(Rectangle((j - 0.47, i - 0.45), 0.94, 0.9, fill=False, edgecolor="#d00000",
                                       linewidth=1.8))
        if not r["killed"]:
            ax.text(len(cols) - 0.5, i, "  SURVIVED", ha="left", va="center", color="#d00000", fontsize=8)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.set_title(f"zerosim mutants ({matrix['backend']}): {matrix['killed']}/{matrix['total']} killed; "
                 "cell = first failing step, red frame = first contract", fontsize=9)
    bar = fig.colorbar(image, ax=ax, ticks=[-1, *range(0, math.ceil(vmax) + 1)])
    bar.ax.set_yticklabels(["plan", *map(str, range(0, math.ceil(vmax) + 1))])
    bar.set_label("step of first detection")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def write_report(matrix: dict[str, Any], out_dir: str | Path | None) -> dict[str, Path]:
    """``mutants.json``, ``.md`` and ``.png`` under ``out_dir`` (``mutants-<backend>.*`` when not sim), each
    written next to its target and renamed over it (:mod:`zerosim.files.outputs`): never a half-written
    report."""
    out = output_dir(out_dir, "mutants")
    stem = "mutants" if matrix["backend"] == "sim" else f"mutants-{matrix['backend']}"
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    write_text(paths["json"], json.dumps(matrix, indent=1) + "\n")
    write_text(paths["md"], render_markdown(matrix))
    render_heatmap(matrix, paths["png"])
    return paths
