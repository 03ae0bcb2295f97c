"""The human-readable ``zerosim verify`` report: one row per contract, then the diagnosis."""

from __future__ import annotations

from .outcome import ContractOutcome, VerifyReport

MAX_FINDINGS_LISTED = 8


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
        err, tol, ratio = _figures(c)
        lines.append(f"{cid:<11} {c.status:<8} {_num(err):>9} {_num(tol):>9} {_num(ratio):>8}  {c.reason}")
    c2 = report.contracts.get("C-ZERO-002")
    if c2 is not None and c2.status == "pass" and c2.details.get("worst"):
        lines.append(
            f"C-ZERO-002: error and tolerance at the element closest to its bound ({c2.details['worst']}); "
            f"largest absolute error anywhere {_num(c2.details.get('max_abs_error'))}"
        )
    lines.append("")
    findings = report.findings
    count = f" ({len(findings)} finding{'s' if len(findings) != 1 else ''}" + (
        ", failing under --strict)" if report.strict else ")") if findings else ""
    lines.append(f"verdict: {report.verdict}{count}")
    if findings:
        lines.append(
            "findings (every value is right; traffic or memory differs from the declared strategy's model):"
        )
        for v in findings[:MAX_FINDINGS_LISTED]:
            lines.append(f"  {v.get('contract')} step {v.get('step')} ({v.get('phase')}): {v.get('message')}")
        if len(findings) > MAX_FINDINGS_LISTED:
            lines.append(f"  and {len(findings) - MAX_FINDINGS_LISTED} more (report.json lists every one)")
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


def _figures(c: ContractOutcome) -> tuple[object, object, object]:
    """(error, tolerance, error / tolerance) of a contract's row: for a failure, the first violation's
    (the figures its reason quotes), so a failure shows one error and its bound; else the closest
    approach to the bound over the run."""
    first = c.first_violation if c.status == "fail" else None
    if first is not None and isinstance(first.get("error"), (int, float)) and isinstance(
        first.get("tolerance"), (int, float)
    ) and first["tolerance"] > 0:
        return first["error"], first["tolerance"], first["error"] / first["tolerance"]
    return c.details.get("max_error"), c.details.get("tolerance"), c.details.get("error_over_tolerance")


def _num(x: object) -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)):
        return f"{x:.2e}" if x else "0"
    return str(x)
