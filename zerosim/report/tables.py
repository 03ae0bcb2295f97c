"""The tables of ``zerosim report`` (written as JSON beside the figures and stated in index.md):
model against measured memory and traffic per run, every run's contract verdicts, and the launched
backends' runs.
"""

from __future__ import annotations

from typing import Any

from .config import ReportConfig


def model_vs_measured(cfg: ReportConfig, runs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per simulator run: each memory category and the traffic, measured beside the engine model and
    the paper's model, with their relative differences."""
    rows = []
    for key, v in runs.items():
        ws, name = key.split("/", 1)
        m = v["memory"]
        row: dict[str, Any] = {"world_size": int(ws), "strategy": name}
        for r in m["rows"]:
            row[r["category"]] = {
                "measured": r["measured_max_rank"],
                "model": r["model_engine"],
                "paper_model": r["model_paper"],
                "rel_diff": r["rel_diff_vs_engine_model"],
                "rel_diff_paper": r["rel_diff_vs_paper_model"],
                "explanation": r["explanation"],
            }
        row["activations_measured"] = m["activations_measured_max_rank"]
        row["traffic"] = {
            "measured": v["traffic"]["measured"]["sent_max_rank"],
            "model": v["traffic"]["model"]["sent"],
            "rel_diff": v["traffic"]["rel_diff"],
        }
        rows.append(row)
    return rows



def contracts_table(runs: dict[str, Any], *launched: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every measured run's contract verdicts: the simulator's, then each launcher's that ran."""
    rows = [v["contracts"] for v in runs.values()]
    for backend in launched:
        if backend is not None:
            rows.extend(v["contracts"] for v in backend["runs"].values())
    return rows


def launched_table(mpi: dict[str, Any] | None) -> dict[str, Any]:
    """A launched backend's runs (mpiexec or torchrun): per strategy its wall time, memory, traffic
    and ground-truth error; ``{"requested": False}`` when it was not asked for."""
    if mpi is None:
        return {"requested": False}
    rows = []
    for name, v in mpi["runs"].items():
        rows.append({"strategy": name, "world_size": mpi["world_size"], "wall_s": v["wall_s"],
                     "memory": [{k: r[k] for k in ("category", "measured_max_rank", "model_engine",
                                                   "rel_diff_vs_engine_model", "explanation")}
                                for r in v["memory"]["rows"]],
                     "traffic": {"measured": v["traffic"]["measured"]["sent_max_rank"],
                                 "model": v["traffic"]["model"]["sent"]},
                     "ground_truth_error": v["ground_truth_error"]})
    return {"requested": True, "world_size": mpi["world_size"], "error": mpi["error"], "rows": rows}

