"""C-ZERO-002's step checks with their values staged to the host (``defer_reads``, the default on a CUDA
device), forced on the CPU:

- :class:`~zerosim.monitor.staged_reads.Staged` gives a nest's tensor values as ``.double().cpu().tolist()``
  gives them, as they were when staged;
- a probe that defers stages each check's observation (:meth:`StepProbe.stage`), whose fields are, once
  read, the fields the probe that reads at once gave at that same check, each naming its step;
- a monitored loop at world 1 that defers posts each check's row once its values have landed: no
  violation when correct, every line describing its own step; a learning rate 3x at one step is caught
  by the same finding at that step, and a fault at the last step is judged at ``close()``.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from zerosim.monitor.staged_reads import Staged, defers
from zerosim.monitor.step_probe import StepProbe


def test_staged_values_are_the_values_read_at_once_as_they_were_when_staged():
    grad = torch.tensor([0.5, -0.25, 3.0], dtype=torch.bfloat16)
    tree = {"grad": grad, "step": torch.tensor(4.0), "hp": {"lr": 0.1, "betas": [torch.tensor(0.5), 0.99]},
            "rows": [[math.nan, 1.0], torch.arange(4, dtype=torch.int64).reshape(2, 2)]}
    at_once = Staged(tree, defer=False).result()
    staged = Staged(tree, defer=True)
    grad.mul_(2)  # changed after staging: the staged values are those of the staging
    later = staged.result()
    assert staged.ready() and not staged.waited
    assert later["grad"] == at_once["grad"] == [0.5, -0.25, 3.0]
    assert later["step"] == at_once["step"] == 4.0 and isinstance(later["step"], float)
    assert later["hp"] == at_once["hp"] == {"lr": 0.1, "betas": [0.5, 0.99]}
    assert later["rows"][1] == at_once["rows"][1] == [0.0, 1.0, 2.0, 3.0]
    assert math.isnan(later["rows"][0][0]) and later["rows"][0][1] == 1.0
    assert defers("cuda:0") and not defers("cpu")


class _Odd(torch.optim.AdamW):
    """AdamW whose step number ``spike`` (counted from 0) uses 3x its learning rate."""

    def __init__(self, params, spike: int | None, **kwargs):
        super().__init__(params, **kwargs)
        self.spike, self.calls = spike, 0

    def step(self, closure=None):
        scale = 3.0 if self.calls == self.spike else 1.0
        self.calls += 1
        for g in self.param_groups:
            g["lr"] *= scale
        try:
            return super().step(closure)
        finally:
            for g in self.param_groups:
                g["lr"] /= scale


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _probe_run(kind: str, defer: bool, steps: int) -> tuple[list[dict], StepProbe]:
    """Each check's fields of a probe on a plain loop (``kind``: AdamW with 3x its learning rate at step
    5, or Adafactor, whose samples are whole tensors), every step checked; deferring, each check's
    staged observation read after the step (as the monitor reads it once the copy has landed)."""
    model = _model()
    if kind == "AdamW":
        opt: torch.optim.Optimizer = _Odd(model.parameters(), 5, lr=1e-2)
    else:
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    probe = StepProbe(model, opt, "ddp", every=1, replay_every=None, max_grad_norm=1.0, defer_reads=defer)
    gen = torch.Generator().manual_seed(1)
    taken = []
    for step in range(steps):
        probe.arm(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        fields = probe.take(step)
        observed = probe.stage(step)
        assert (observed is not None) == defer
        taken.append(copy.deepcopy({**fields, **(observed.fields() if observed is not None else {})}))
    return taken, probe


def _without_step(fields: dict) -> dict:
    return {k: ({kk: vv for kk, vv in v.items() if kk != "step"} if isinstance(v, dict) else v)
            for k, v in fields.items() if k != "step_checks_off"}


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN rows compare equal


@pytest.mark.parametrize("kind", ["AdamW", "Adafactor"])
def test_a_deferring_probe_stages_the_fields_the_probe_reading_at_once_gives(kind):
    steps = 7
    at_once, _ = _probe_run(kind, False, steps)
    deferred, probe = _probe_run(kind, True, steps)
    assert probe.defer and "accounting" in at_once[0] and "update" in at_once[0]
    for step in range(steps):
        fields = deferred[step]
        assert fields["accounting"]["step"] == fields["update"]["step"] == step, fields.keys()
        assert _same(_without_step(fields), _without_step(at_once[step])), step
        assert "step" not in at_once[step]["update"]  # reading at once: the row's step is the finding's
    if kind == "AdamW":  # the learning rate 3x at step 5 is found at step 5 either way
        assert at_once[5]["update"]["bad"] and deferred[5]["update"]["bad"]
        assert deferred[5]["update"]["tensor"] == at_once[5]["update"]["tensor"]
        assert not any(f["update"]["bad"] for t, f in enumerate(at_once) if t != 5)


def test_a_staged_finding_travels_in_the_row_with_its_step():
    deferred, probe = _probe_run("AdamW", True, 3)
    fields = deferred[2]
    section = probe.encode(fields, probe.length()).numpy()
    decoded = probe.decode(section)
    assert decoded["update"]["step"] == decoded["accounting"]["step"] == 2
    assert decoded["update"]["bad"] == fields["update"]["bad"]
    immediate = _probe_run("AdamW", False, 1)[1]
    plain = immediate.decode(immediate.encode(immediate.take(0), immediate.length()).numpy())
    assert "step" not in plain["update"] and "step" not in plain["accounting"]


def _monitored(tmp_path, monkeypatch, defer: bool, spike: int | None, steps: int = 10):
    """A monitored DDP loop at world 1 (every step checked, clip 1.0): the violations ``after_step``
    returned and ``close()`` listed, and the rank's file lines."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from zerosim.monitor import Monitor

    monkeypatch.setattr(StepProbe, "defer_reads", defer)
    out = tmp_path / f"out-{defer}-{spike}"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store-{defer}-{spike}'}", rank=0,
                            world_size=1)
    try:
        model = _model()
        ddp = DistributedDataParallel(model)
        opt = _Odd(model.parameters(), spike, lr=1e-2)
        monitor = Monitor(ddp, opt, every=1, out=out, max_grad_norm=1.0, log=lambda line: None)
        assert monitor._probe is not None and monitor._probe.defer is defer
        gen = torch.Generator().manual_seed(1)
        found = []
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            found += [(step, v) for v in monitor.after_step(step, loss=loss.detach(), grad_norm=norm)]
        summary = monitor.close()
    finally:
        dist.destroy_process_group()
    lines = [json.loads(line) for line in (out / "rank-00000.jsonl").read_text().splitlines()]
    return found, summary, lines, out


def test_a_correct_deferring_run_has_no_violation_and_each_line_describes_its_own_step(
        tmp_path, monkeypatch):
    from zerosim.cli import main as cli_main

    found, summary, lines, out = _monitored(tmp_path, monkeypatch, True, None)
    assert found == [] and summary["violation_count"] == 0, summary
    # each check staged at its call, posted at the next and judged at the one after; the last at close()
    assert [line["step"] for line in lines] == list(range(10)) and summary["checks"] == 10, summary
    assert all(line["update"]["step"] == line["accounting"]["step"] == line["step"] for line in lines)
    assert cli_main(["check", "trace", str(out)]) == 0


@pytest.mark.parametrize("spike", [6, 9])
def test_a_learning_rate_spike_is_caught_by_the_same_finding_at_its_step(tmp_path, monkeypatch, spike):
    """At step 6, judged two calls later; at step 9, the last step, judged at ``close()``: either way
    the violation names the step, the tensor and the values the monitor reading at once gives."""
    from zerosim.cli import main as cli_main

    at_once, plain_summary, plain, _ = _monitored(tmp_path, monkeypatch, False, spike)
    deferred, summary, lines, out = _monitored(tmp_path, monkeypatch, True, spike)
    before = [v for v in plain_summary["violations"] if v.get("clause") == "update"]
    after = [v for v in summary["violations"] if v.get("clause") == "update"]
    assert len(before) == 1 and before[0]["step"] == spike, plain_summary
    assert after == before, (after, before)
    # found by after_step two calls later (one call later reading at once); the last step's at close()
    assert [step for step, _ in deferred] == ([] if spike == 9 else [spike + 2]), deferred
    assert [step for step, _ in at_once] == ([] if spike == 9 else [spike + 1]), at_once
    spiked = next(line for line in lines if line["step"] == spike)["update"]
    assert spiked["step"] == spike and spiked["bad"] and spiked["tensor"] == before[0]["tensor"]
    assert plain[spike]["update"]["bad"] and "step" not in plain[spike]["update"]
    assert cli_main(["check", "trace", str(out)]) == 1  # judged offline as live
