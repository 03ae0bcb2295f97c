"""C-ZERO-002's step checks reading their values one check later (``defer_reads``, the default on a CUDA
device), forced on the CPU:

- :class:`~zerosim.monitor.staged_reads.Staged` gives a nest's tensor values as ``.double().cpu().tolist()``
  gives them, as they were when staged;
- a probe that defers gives, at each check, the fields the probe that reads at once gave at the check
  before, each finding naming the step it belongs to, and the last check's fields at :meth:`drain`;
- a monitored loop at world 1 that defers has no violation when correct; a learning rate 3x at one
  step is caught, by the same finding, at the next check, and the rank's file says which step it was.
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
    5, or Adafactor, whose samples are whole tensors), every step checked."""
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
        taken.append(copy.deepcopy(probe.take(step)))
    return taken, probe


def _without_step(fields: dict) -> dict:
    return {k: ({kk: vv for kk, vv in v.items() if kk != "step"} if isinstance(v, dict) else v)
            for k, v in fields.items() if k != "step_checks_off"}


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN rows compare equal


@pytest.mark.parametrize("kind", ["AdamW", "Adafactor"])
def test_a_deferring_probe_gives_each_checks_fields_at_the_next_check_and_the_last_at_drain(kind):
    steps = 7
    at_once, _ = _probe_run(kind, False, steps)
    deferred, probe = _probe_run(kind, True, steps)
    assert probe.defer and "accounting" in at_once[0] and "update" in at_once[0]
    assert _without_step(deferred[0]) == {}  # nothing read back at the first check
    for step in range(1, steps):
        fields = deferred[step]
        assert fields["accounting"]["step"] == fields["update"]["step"] == step - 1, fields.keys()
        assert _same(_without_step(fields), _without_step(at_once[step - 1])), step
        assert "step" not in at_once[step - 1]["update"]  # reading at once: the row's step is the finding's
    last = probe.drain()
    assert last["update"]["step"] == steps - 1 and _same(_without_step(last), _without_step(at_once[-1]))
    assert probe.drain() == {}  # drained once
    if kind == "AdamW":  # the learning rate 3x at step 5 is found by the same finding, one check later
        assert at_once[5]["update"]["bad"] and deferred[6]["update"]["bad"]
        assert deferred[6]["update"]["tensor"] == at_once[5]["update"]["tensor"]
        assert not any(f["update"]["bad"] for t, f in enumerate(at_once) if t != 5)


def test_a_deferred_finding_travels_in_the_row_with_its_step():
    _, probe = _probe_run("AdamW", True, 3)
    fields = probe.take(3)  # the probe was not armed for step 3: the fields of step 2, nothing staged
    assert fields["update"]["step"] == fields["accounting"]["step"] == 2
    section = probe.encode(fields, probe.length()).numpy()
    decoded = probe.decode(section)
    assert decoded["update"]["step"] == decoded["accounting"]["step"] == 2
    assert decoded["update"]["bad"] == fields["update"]["bad"] and probe.drain() == {}
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


def test_a_correct_deferring_run_has_no_violation_and_each_line_names_its_findings_step(
        tmp_path, monkeypatch):
    from zerosim.cli import main as cli_main

    found, summary, lines, out = _monitored(tmp_path, monkeypatch, True, None)
    assert found == [] and summary["violation_count"] == 0 and summary["checks"] == 10, summary
    assert "update" not in lines[0] and "accounting" not in lines[0]
    assert all(line["update"]["step"] == line["accounting"]["step"] == line["step"] - 1 for line in lines[1:])
    assert cli_main(["check", "trace", str(out)]) == 0  # the trace reader takes the findings' steps


def test_a_learning_rate_spike_is_caught_by_the_same_finding_one_check_later(tmp_path, monkeypatch):
    from zerosim.cli import main as cli_main

    at_once, _, plain, _ = _monitored(tmp_path, monkeypatch, False, 6)
    deferred, _, lines, out = _monitored(tmp_path, monkeypatch, True, 6)
    before = [v for _, v in at_once if v.clause == "update"]
    after = [v for _, v in deferred if v.clause == "update"]
    assert len(before) == len(after) == 1, (at_once, deferred)
    assert before[0].step == 6 and after[0].step == 7  # the row of the check after the spike carries it
    assert (after[0].tensor, after[0].expected, after[0].got) == (before[0].tensor, before[0].expected,
                                                                  before[0].got)
    spiked = next(line for line in lines if line["step"] == 7)["update"]
    assert spiked["step"] == 6 and spiked["bad"] and spiked["tensor"] == before[0].tensor
    assert plain[6]["update"]["bad"] and "step" not in plain[6]["update"]
    assert cli_main(["check", "trace", str(out)]) == 1  # judged offline as live
