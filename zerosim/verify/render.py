"""The human-readable ``zerosim verify`` report: one row per contract, then the diagnosis."""

from __future__ import annotations

from zerosim.values.verdict import Verdict

from .outcome import VerifyReport

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


def _numerics(report: VerifyReport) -> str:
    """The run's dtypes: ``float64``, or under a mixed-precision policy ``bf16 compute (bfloat16
    parameters and gradients), float32 master weights, gradients reduced in float32``."""
    mixed = report.extra.get("mixed_precision")
    if not mixed:
        return str(report.dtype)
    param = mixed.get("param_dtype", "?")
    short = {"bfloat16": "bf16", "float16": "fp16"}.get(param, param)
    scaled = ", dynamic loss scaling" if mixed.get("loss_scale") else ""
    return (f"{short} compute ({param} parameters and gradients), {report.dtype} master weights, "
            f"gradients reduced in {mixed.get('reduce_dtype', '?')}{scaled}")


def _layout(report: VerifyReport) -> str:
    """``, 3 micro-batches per step, mesh 4x1`` when the run was given --grad-accum or --mesh."""
    parts = []
    if report.extra.get("grad_accum", 1) > 1:
        parts.append(f"{report.extra['grad_accum']} micro-batches per step")
    mesh = report.extra.get("mesh")
    if mesh:
        parts.append(f"mesh {mesh[0]}x{mesh[1]} ({mesh[0]} replicas of {mesh[1]} shard rank"
                     f"{'s' if mesh[1] != 1 else ''})")
    return "".join(f", {p}" for p in parts)


def _closest_approach(c2: Verdict, mixed: bool) -> str:
    """The line under the table naming where C-ZERO-002 came closest to its bound: per element (and the
    largest absolute error anywhere) in full precision, per tensor (and the median update error) under
    a mixed-precision policy, whose bound is normwise."""
    where = c2.details["worst"]
    if mixed:
        median = c2.details.get("median_update_error")
        return (f"C-ZERO-002: normwise error and its estimated bound at the tensor closest to its bound "
                f"({where})" + ("" if median is None else f"; median update error {_num(median)}"))
    line = f"C-ZERO-002: error and tolerance at the element closest to its bound ({where})"
    largest = c2.details.get("max_abs_error")
    return line + ("" if largest is None else f"; largest absolute error anywhere {_num(largest)}")


def render_text(report: VerifyReport) -> str:
    lines = [
        f"zerosim verify {report.target}: world {report.world}{_layout(report)}, {report.steps} steps "
        f"({_phases(report)}), {_numerics(report)}, model {report.model}, device {report.device}"
        + _resumed(report),
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
        lines.append(_closest_approach(c2, bool(report.extra.get("mixed_precision"))))
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


def _figures(c: Verdict) -> tuple[object, object, object]:
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
