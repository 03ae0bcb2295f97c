"""C-ZERO-002's logged-norm clause on a loop that clips while the Monitor was not given ``max_norm``: the
verdict is the same failure as before, and the violation says the likely cause (the logged norm is the
pre-clip norm, the gradient the clipped one) and the argument that removes it; figures that do not fit
that cause get no such hint."""

from __future__ import annotations

from tests.test_monitor_checks import obs
from zerosim.checks.equivalence import check_step_equivalence
from zerosim.checks.live_state import CLIP_EPS

HINT = "pass the threshold as Monitor(..., max_grad_norm=...)"
MAX_NORM, PRE_CLIP = 0.1, 0.45
#: the squared norm of the gradient clip_grad_norm_(max_norm=0.1) leaves of one whose norm was 0.45
CLIPPED_SQ = (PRE_CLIP * MAX_NORM / (PRE_CLIP + CLIP_EPS)) ** 2


def test_a_clipping_loop_without_max_norm_fails_with_the_cause_named() -> None:
    verdict = check_step_equivalence([obs(r, grad_sq=CLIPPED_SQ, grad_norm=PRE_CLIP) for r in (0, 1)])
    assert not verdict.passed
    messages = [v.message for v in verdict.violations if v.clause == "grad_norm"]
    assert len(messages) == 2, verdict.violations
    for message in messages:
        assert "logged gradient norm 0.45" in message and "pre-clip norm" in message and HINT in message
        assert "clip_grad_norm_ to about 0.1)" in message, message


def test_the_same_loop_told_the_threshold_passes() -> None:
    rows = [obs(r, grad_sq=CLIPPED_SQ, grad_norm=PRE_CLIP, max_norm=MAX_NORM) for r in (0, 1)]
    assert check_step_equivalence(rows).passed


def test_no_hint_where_the_logged_norm_is_the_smaller_or_the_threshold_was_given() -> None:
    too_low = check_step_equivalence([obs(r, grad_sq=1.0, grad_norm=0.5) for r in (0, 1)])
    wrong_with_clip = check_step_equivalence([obs(r, grad_sq=CLIPPED_SQ / 4, grad_norm=PRE_CLIP,
                                                  max_norm=MAX_NORM) for r in (0, 1)])
    for verdict in (too_low, wrong_with_clip):
        norms = [v for v in verdict.violations if v.clause == "grad_norm"]
        assert norms and not any(HINT in v.message for v in norms), verdict.violations
