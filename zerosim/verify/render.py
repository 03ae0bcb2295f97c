"""The human-readable ``zerosim verify`` report: one row per contract, then the diagnosis."""

from __future__ import annotations

from .outcome import VerifyReport


def _phases(report: VerifyReport) -> str:
    parts = []
    for p in report.phases:
        text = f"{p['name']} steps {p['first_step']}-{p['last_step']}"
        if p.get("status") == "skipped":
            text += " (skipped)"
        elif p.get("clip_binds_at") is not None:
            text += f", clip {p['optim'].get('max_grad_norm'):g} binds at step(s) " + (
                ",".join(map(str, p["clip_binds_at"])) or "none"
            )
        if p.get("master_dtype"):
            text += f", {p['master_dtype']} master weights detected"
        parts.append(text)
    return "; ".join(parts)


def _resumed(report: VerifyReport) -> str:
    r = report.extra.get("resume")
    if not r:
        return ""
    return (
        f"; resumed from a checkpoint after step {r['at_phase_step']} of each phase on "
        f"{r['world_after']} fresh rank(s)"
    )


def render_text(report: VerifyReport) -> str:
    lines = [
        f"zerosim verify {report.target}: world {report.world}, {report.steps} steps ({_phases(report)}), "
        f"{report.dtype}, model {report.model}, device {report.device}" + _resumed(report),
        "",
    ]
    lines.append(
        f"{'contract':<11} {'status':<8} {'error':>9} {'tolerance':>9} {'err/tol':>8}  first failure / reason"
    )
    for cid, c in report.contracts.items():
        err = c.details.get("max_error")
        tol = c.details.get("tolerance")
        ratio = c.details.get("error_over_tolerance")
        lines.append(f"{cid:<11} {c.status:<8} {_num(err):>9} {_num(tol):>9} {_num(ratio):>8}  {c.reason}")
    c2 = report.contracts.get("C-ZERO-002")
    if c2 is not None and c2.details.get("worst"):
        lines.append(
            f"C-ZERO-002: error and tolerance at the element closest to its bound ({c2.details['worst']}); "
            f"largest absolute error anywhere {_num(c2.details.get('max_abs_error'))}"
        )
    lines.append("")
    lines.append(f"verdict: {report.verdict}")
    for p in report.phases:
        if p.get("status") == "skipped":
            lines.append(
                f"skipped {p['name']}: {p.get('reason', '')}; not ruled out: {p.get('not_ruled_out', '')}"
            )
    if report.diagnosis:
        lines.append("diagnosis (most specific first):")
        for d in report.diagnosis:
            lines.append(f"  {d.bug_class}: {d.evidence}")
    return "\n".join(lines)


def _num(x: object) -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)):
        return f"{x:.2e}" if x else "0"
    return str(x)
