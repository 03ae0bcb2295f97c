"""C-ZERO-002 ``update`` for the optimizers that step a tensor as a whole (torch.optim's Adafactor and
Muon), and the attribution of a replica disagreement to the rank whose own update departs.

Pure checks on torch's own optimizer steps (many steps, seeds and shapes: no alarm on a correct step;
a learning rate 3x at one step, a wrong momentum, a wrong statistic named by tensor and state entry),
C-ZERO-003's attribution on hand-made observations, a trace's samples read as untrusted input, and a
user's DDP loop at world 2 and 3 (tests/monitor_programs/matrix_update_faults.py) judged live and by
``zerosim check trace``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zerogpu.launch import run_ranks, torch_unavailable_reason
from zerosim.checks.identity import check_replica_identity
from zerosim.checks.update_formula import FORMULAS, recompute_update
from zerosim.errors import ConfigError
from zerosim.values.observation_fields import UPDATE_FORMULAS
from zerosim.values.observe import MonitorObservation

PROGRAM = str(Path(__file__).parent / "monitor_programs" / "matrix_update_faults.py")
STATE = ("momentum_buffer", "row_var", "col_var", "variance")


def _read(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> dict[str, list[float]]:
    state = opt.state.get(p, {})
    return {"param": p.detach().double().reshape(-1).tolist(),
            **{k: state[k].double().reshape(-1).tolist() for k in STATE if k in state}}


def _steps(kind: str, seed: int, shapes: list[tuple[int, ...]], steps: int,
           fault: tuple[int, str] | None = None, **kwargs) -> list[dict]:
    """Each step's finding of torch's ``kind`` stepping parameters of ``shapes``; ``fault`` = (step,
    what) changes that step: ``lr3`` (3x the learning rate), ``momentum`` (Muon's buffer blended with
    0.5), ``row_var`` (Adafactor's row statistic scaled by 1.01 after the step)."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    opt = getattr(torch.optim, kind)(params, **kwargs)
    rng = np.random.default_rng(seed)
    findings = []
    for t in range(steps):
        scale = 10 ** rng.uniform(-4, 1)  # gradients from tiny to large, step to step
        for p in params:
            p.grad = torch.randn_like(p) * scale
        samples = []
        for i, p in enumerate(params):
            hp = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "foreach")}
            samples.append({"tensor": f"w{i}", "hp": hp, "shape": list(p.shape),
                            "step": float(opt.state.get(p, {}).get("step", 0)),
                            "grad": p.grad.double().reshape(-1).tolist(), "pre": _read(opt, p)})
        what = fault[1] if fault is not None and fault[0] == t else None
        saved = {k: opt.param_groups[0][k] for k in ("lr", "momentum") if k in opt.param_groups[0]}
        if what == "lr3":
            opt.param_groups[0]["lr"] *= 3
        if what == "momentum":
            opt.param_groups[0]["momentum"] = 0.5
        opt.step()
        opt.param_groups[0].update(saved)
        if what == "row_var":
            opt.state[params[0]]["row_var"].mul_(1.01)
        for s, p in zip(samples, params, strict=True):
            s["post"] = _read(opt, p)
        findings.append(recompute_update(kind, samples))
    return findings


MUON_CASES = [
    dict(shapes=[(32, 64), (64, 16), (48, 48)], lr=0.02),
    dict(shapes=[(8, 128), (40, 24)], lr=0.05, nesterov=False, weight_decay=0.0),
    dict(shapes=[(64, 32), (24, 24)], lr=0.01, adjust_lr_fn="match_rms_adamw", momentum=0.9),
]


@pytest.mark.parametrize("case", range(len(MUON_CASES)))
def test_muon_steps_never_alarm_and_a_threefold_learning_rate_is_named(case):
    spec = dict(MUON_CASES[case])
    shapes = spec.pop("shapes")
    worst = []
    for seed in range(2):
        findings = _steps("Muon", seed, shapes, 14, fault=(10, "lr3"), **spec)
        clean = [f for t, f in enumerate(findings) if t != 10]
        assert all(f["bad"] == 0 for f in clean), [f for f in clean if f["bad"]][:1]
        worst.append(max(f["worst_ratio"] for f in clean))
        wrong = findings[10]
        assert wrong["bad"] and wrong["tensor"] == "w0" and wrong["entry"] == "param", wrong
        # the estimated bound leaves a correct step at a fraction of it and puts the fault far outside
        assert wrong["worst_ratio"] > 4 and wrong["worst_ratio"] > 20 * max(worst), (wrong, worst)


def test_muon_wrong_momentum_is_named_on_the_momentum_buffer_by_the_elementwise_bound():
    wrong = _steps("Muon", 0, [(32, 64)], 6, fault=(4, "momentum"), lr=0.02)[4]
    assert wrong["bad"] and wrong["entry"] == "momentum_buffer", wrong
    assert wrong["worst_ratio"] > 1e4, wrong


ADAFACTOR_CASES = [
    dict(shapes=[(32, 64), (64,), (4, 8, 16)], lr=0.01, weight_decay=0.01),
    dict(shapes=[(16, 48), (7,)], lr=0.05, eps=(1e-30, 1e-3), d=2.0, beta2_decay=-0.5),
    dict(shapes=[(24, 24)], lr=0.01, maximize=True),
]


@pytest.mark.parametrize("case", range(len(ADAFACTOR_CASES)))
def test_adafactor_steps_stay_inside_the_derived_bound_and_a_threefold_learning_rate_is_named(case):
    spec = dict(ADAFACTOR_CASES[case])
    shapes = spec.pop("shapes")
    for seed in range(2):
        findings = _steps("Adafactor", seed, shapes, 14, fault=(10, "lr3"), **spec)
        clean = [f for t, f in enumerate(findings) if t != 10]
        assert all(f["bad"] == 0 and f["worst_ratio"] < 1 for f in clean), [f for f in clean if f["bad"]][:1]
        wrong = findings[10]
        assert wrong["bad"] and wrong["tensor"] == "w0" and wrong["entry"] == "param", wrong
        assert wrong["worst_ratio"] > 1e3, wrong


def test_adafactor_statistic_changed_after_the_step_is_named_by_its_entry():
    wrong = _steps("Adafactor", 1, [(16, 32)], 5, fault=(3, "row_var"), lr=0.01)[3]
    assert wrong["bad"] and wrong["tensor"] == "w0" and wrong["entry"] == "row_var", wrong


def test_the_trace_knows_every_formula():
    assert UPDATE_FORMULAS == FORMULAS


# ---- attribution (C-ZERO-003 with the update evidence) ---------------------------------------------------
def _obs(rank: int, world: int, digest: str, departs: bool) -> MonitorObservation:
    finding = {"optimizer": "AdamW", "checked": 8, "bad": int(departs), "tensor": "w" if departs else None,
               "entry": "param" if departs else None, "expected": 1.0 if departs else None,
               "got": 3.0 if departs else None, "bound": 1e-7 if departs else None,
               "worst_ratio": 2e7 if departs else 0.01}
    return MonitorObservation(rank=rank, world_size=world, step=8, adapter="ddp", held=[("w", 0, 64, digest)],
                              numels={"w": 64}, update=finding)


def _identical(rows: list[MonitorObservation]) -> list[str]:
    return [str(v) for v in check_replica_identity(rows).violations]


def test_world_2_names_the_rank_whose_update_departs():
    lines = _identical([_obs(0, 2, "aa", True), _obs(1, 2, "bb", False)])
    assert len(lines) == 1 and "rank=0 " in lines[0] and "departs" in lines[0], lines


def test_world_2_without_evidence_names_both_ranks():
    lines = _identical([_obs(0, 2, "aa", False), _obs(1, 2, "bb", False)])
    assert len(lines) == 1 and "rank=0,1" in lines[0] and "disagree" in lines[0], lines


def test_world_3_majority_names_the_odd_rank_out_and_the_evidence_agrees():
    lines = _identical([_obs(0, 3, "aa", False), _obs(1, 3, "aa", False), _obs(2, 3, "bb", True)])
    assert len(lines) == 1 and "rank=2 " in lines[0] and "departs" in lines[0], lines
    lines = _identical([_obs(0, 3, "aa", False), _obs(1, 3, "aa", False), _obs(2, 3, "bb", False)])
    assert len(lines) == 1 and "rank=2 " in lines[0] and "differs bitwise from rank(s) 0,1" in lines[0], lines


def test_world_3_evidence_outranks_a_wrong_majority():
    # ranks 1 and 2 both applied a wrong update and agree with each other; rank 0 is the sound one
    lines = _identical([_obs(0, 3, "aa", False), _obs(1, 3, "bb", True), _obs(2, 3, "bb", True)])
    assert len(lines) == 2 and all("departs" in line for line in lines), lines
    named = {r for r in ("rank=0 ", "rank=1 ", "rank=2 ") if any(r in x for x in lines)}
    assert named == {"rank=1 ", "rank=2 "}, lines


def test_world_3_three_copies_one_departing_names_it_and_leaves_the_other_two_disagreeing():
    lines = _identical([_obs(0, 3, "aa", False), _obs(1, 3, "bb", False), _obs(2, 3, "cc", True)])
    assert any("rank=2 " in x and "departs" in x for x in lines), lines
    assert any("rank=0,1" in x and "disagree" in x for x in lines), lines


# ---- the trace's samples as untrusted input ----------------------------------------------------------------
def _line(optimizer: str, sample: dict) -> dict:
    obs = _obs(0, 1, "aa", False)
    data = obs.to_json()
    data["update"] = {**data["update"], "optimizer": optimizer}
    data["update_samples"] = [sample]
    return data


MUON_SAMPLE = {"tensor": "w", "hp": {"lr": 0.02, "momentum": 0.95, "nesterov": True, "eps": 1e-7,
                                     "ns_coefficients": [3.4445, -4.775, 2.0315], "ns_steps": 5,
                                     "weight_decay": 0.1, "adjust_lr_fn": None},
               "shape": [2, 3], "step": 0.0, "grad": [0.1] * 6, "pre": {"param": [1.0] * 6},
               "post": {"param": [1.0] * 6, "momentum_buffer": [0.0] * 6}, "ns_spread": 0.01}
ADAFACTOR_SAMPLE = {"tensor": "w", "hp": {"lr": 0.01, "beta2_decay": -0.8, "eps": [None, 1e-3], "d": 1.0,
                                          "weight_decay": 0.0, "maximize": False},
                    "shape": [2, 3], "step": 0.0, "grad": [0.1] * 6, "pre": {"param": [1.0] * 6},
                    "post": {"param": [1.0] * 6, "row_var": [0.0] * 2, "col_var": [0.0] * 3}}


def test_whole_tensor_samples_are_read_back_and_judged():
    for optimizer, sample in (("Muon", MUON_SAMPLE), ("Adafactor", ADAFACTOR_SAMPLE)):
        obs = MonitorObservation.from_json(_line(optimizer, sample))
        assert obs.update_samples is not None and obs.update_samples[0]["shape"] == [2, 3]
        assert recompute_update(optimizer, obs.update_samples)["checked"] == 6


@pytest.mark.parametrize(("optimizer", "change", "field"), [
    ("Muon", {"shape": [3, 3]}, "update_samples[0].shape"),
    ("Muon", {"shape": [6]}, "update_samples[0].shape"),
    ("Muon", {"shape": [2, 0, 3]}, "update_samples[0].shape"),
    ("Muon", {"ns_spread": -1.0}, "update_samples[0].ns_spread"),
    ("Muon", {"hp": {**MUON_SAMPLE["hp"], "ns_steps": 1e9}}, "update_samples[0].hp.ns_steps"),
    ("Muon", {"hp": {**MUON_SAMPLE["hp"], "ns_coefficients": [1, 2]}},
     "update_samples[0].hp.ns_coefficients"),
    ("Muon", {"hp": {**MUON_SAMPLE["hp"], "adjust_lr_fn": 3}}, "update_samples[0].hp.adjust_lr_fn"),
    ("Adafactor", {"post": {"param": [1.0] * 6, "row_var": [0.0] * 3}}, "update_samples[0].post.row_var"),
    ("Adafactor", {"hp": {**ADAFACTOR_SAMPLE["hp"], "d": 0.0}}, "update_samples[0].hp.d"),
    ("Adafactor", {"hp": {**ADAFACTOR_SAMPLE["hp"], "beta2_decay": 2.0}}, "update_samples[0].hp.beta2_decay"),
    ("Adafactor", {"hp": {**ADAFACTOR_SAMPLE["hp"], "eps": [None, -1.0]}}, "update_samples[0].hp.eps"),
    ("Adafactor", {"shape": None}, "update_samples[0].shape"),
    ("Lion", {}, "update.optimizer"),
])
def test_a_bad_whole_tensor_sample_is_one_error_naming_its_field(optimizer, change, field):
    sample = {**(MUON_SAMPLE if optimizer == "Muon" else ADAFACTOR_SAMPLE), **change}
    with pytest.raises(ConfigError) as err:
        MonitorObservation.from_json(_line(optimizer, sample))
    assert field in str(err.value), str(err.value)


# ---- a user's DDP loop, live and offline ----------------------------------------------------------------
def _run(tmp: Path, kind: str, fault: str, world: int = 2) -> tuple[list[str], str, str]:
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp / f"{kind}-{fault}"
    run = run_ranks(world, [PROGRAM, kind, fault, str(out), "12"], 300.0, env={"PYTHONWARNINGS": "ignore"})
    assert not run.timed_out and run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("VIOL ")]
    summary = next(line for line in run.stdout.splitlines() if line.startswith("SUMMARY "))
    judged = subprocess.run([sys.executable, "-m", "zerosim", "check", "trace", str(out)],
                            capture_output=True, text=True, timeout=300)
    return lines, summary, judged.stdout


@pytest.mark.parametrize("kind", ["Muon", "Adafactor"])
def test_a_correct_matrix_optimizer_run_passes_live_and_offline(tmp_path, kind):
    lines, summary, offline = _run(tmp_path, kind, "none")
    assert lines == [] and summary == "SUMMARY 12 0 None", (lines, summary)
    assert offline.strip().splitlines()[-1].startswith("PASS"), offline


def test_muon_threefold_learning_rate_on_every_rank_is_named_by_the_update_clause(tmp_path):
    lines, _, offline = _run(tmp_path, "Muon", "lr3")
    update = [line for line in lines if "C-ZERO-002 update" in line]
    assert {line.split(" rank=")[1].split()[0] for line in update} == {"0", "1"}, lines
    assert all("step=8" in line and "param" in line for line in update), update
    assert not any("C-ZERO-003" in line for line in lines), lines  # the replicas agree on the wrong step
    assert "C-ZERO-002 update step=8 rank=0" in offline and "FAIL" in offline, offline


@pytest.mark.parametrize(("kind", "fault", "world", "rank"), [
    ("Adafactor", "lr3-rank0", 2, "0"),
    ("Muon", "lr3-rank2", 3, "2"),
])
def test_one_ranks_wrong_step_is_attributed_to_that_rank(tmp_path, kind, fault, world, rank):
    lines, _, offline = _run(tmp_path, kind, fault, world)
    # at the step it happened, the rank's own update is the evidence; later, the replicas still differ
    identical = [line for line in lines if "C-ZERO-003 identical step=8 " in line]
    assert identical and all(f"rank={rank} " in line and "departs" in line for line in identical), lines
    later = [line for line in lines if "C-ZERO-003 identical step=9 " in line]
    if world == 2:  # no evidence and no majority: both ranks
        assert later and all("rank=0,1 " in line and "disagree" in line for line in later), lines
    else:  # a majority names the odd rank out
        assert later and all(f"rank={rank} " in line for line in later), lines
    assert any(f"C-ZERO-002 update step=8 rank={rank} " in line for line in lines), lines
    assert f"C-ZERO-003 identical step=8 rank={rank} " in offline, offline


# ---- the probe: hooks, whole tensors in turn, what is off and why ----------------------------------------
def test_the_probe_takes_whole_tensors_in_turn_and_finds_a_wrong_step_through_the_hooks(monkeypatch):
    from zerosim.monitor import update_probe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False),
                                torch.nn.Linear(16, 4, bias=False))
    class Odd(torch.optim.Muon):  # 3x its learning rate inside its 4th step, after the pre-hook has read it
        calls = 0

        def step(self, closure=None):
            Odd.calls += 1
            scale = 3.0 if Odd.calls == 4 else 1.0
            self.param_groups[0]["lr"] *= scale
            super().step(closure)
            self.param_groups[0]["lr"] /= scale

    # an instance of the base class hooks its step too: the hooks then run nested, outside Odd's change
    # and inside it; the probe observes the outer call, the step the loop made
    torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    opt = Odd(model.parameters(), lr=0.02)
    monkeypatch.setattr(update_probe, "WHOLE_BUDGET", 512)  # room for one 32x16 tensor a check
    probe = update_probe.UpdateProbe(model, opt)
    assert probe.off is None, probe.off  # every tensor fits
    taken = []
    for step in range(4):
        probe.arm(True)
        for p in model.parameters():  # full-rank gradients: bfloat16's Newton-Schulz is well conditioned
            p.grad = torch.randn_like(p)
        opt.step()
        assert probe.update is not None and probe.update_samples is not None
        taken.append([s["tensor"] for s in probe.update_samples])
        if step < 3:
            assert probe.update["bad"] == 0, probe.update
    assert taken[:3] == [["0.weight"], ["1.weight"], ["2.weight"]], taken  # each check the next tensor
    assert probe.update["bad"] and probe.update["tensor"] == "0.weight", probe.update
    probe.arm(False)  # a step that is not due is not observed
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert probe.update is None
    probe.close()


@pytest.mark.parametrize(("adapter", "needle"), [
    ("deepspeed-2", "DeepSpeed steps its own optimizer"),
    ("zerogpu-zero3", "a ZeroTrainer steps its optimizer"),
])
def test_the_probe_says_why_the_update_is_off_where_the_framework_steps_its_own_optimizer(adapter, needle):
    from zerosim.monitor.update_probe import UpdateProbe

    probe = UpdateProbe(torch.nn.Linear(2, 2), None, adapter)
    assert probe.off is not None and needle in probe.off, probe.off


def test_the_probe_names_an_optimizer_it_has_no_formula_for():
    from zerosim.monitor.update_probe import UpdateProbe

    model = torch.nn.Linear(2, 2)
    probe = UpdateProbe(model, torch.optim.Adagrad(model.parameters()))
    assert probe.off is not None and "Adagrad" in probe.off and probe.formula is None, probe.off


def test_factored_state_covers_its_matrix_and_a_missing_factor_does_not():
    from zerosim.monitor.row import _covers

    rows, cols = torch.zeros(4, 1), torch.zeros(1, 8)
    assert _covers([], 32) and _covers([rows, cols], 32)
    assert not _covers([rows], 32)  # Adafactor's column statistic gone: state missing for the matrix
    assert not _covers([torch.zeros(5)], 32) and not _covers([torch.zeros(4, 2), cols], 32)
