"""zerosim.monitor inside real training loops under torchrun (gloo on the CPU).

One launch at world 2 runs every scenario of :data:`WORLD2` (tests/monitor_programs/monitor_run.py), one
at world 4 those of :data:`WORLD4` (a 2-D HSDP mesh and zerogpu's hybrid strategy):

- a fault-free run of every world-2 adapter, 200 steps checked at every one, gives zero violations, and the
  same parameters after 30 steps, bit for bit, as the same loop without the monitor (with the
  monitor's exchange overlapping the next step, its default, and without);
- every live fault (``ZEROSIM_FAULT`` bitflip, skip-step, grad, zero-state) is caught at the first check
  at or after the step it is injected at, naming the faulty rank (and the tensor, where the fault has
  one), with nothing reported before;
- ``zerosim check trace`` on the files the monitor wrote gives the live verdict again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason
from zerosim.cli import main as cli_main

PROGRAM = str(Path(__file__).parent / "monitor_programs" / "monitor_run.py")
BOUND_S = 240.0  # a launch of every scenario, on two shared cores
CLEAN_ADAPTERS = ("ddp", "zero-redundancy", "fsdp2", "zerogpu-zero2", "zerogpu-zero3")
STEPS, EVERY = 30, 1
SOAK_STEPS = 200  #: the fault-free monitored runs; compared bit for bit with the run without it at STEPS
FAULT_STEPS, FAULT_EVERY = 11, 5

#: name -> (adapter, fault kind, rank, step injected, tensor)
FAULTS = {
    "flip-ddp": ("ddp", "bitflip", 1, 7, "blocks.0.weight"),
    "flip-zr": ("zero-redundancy", "bitflip", 1, 10, "head.weight"),
    "flip-z2": ("zerogpu-zero2", "bitflip", 1, 10, "embed.weight"),
    "skip-ddp": ("ddp", "skip-step", 1, 7, None),
    "skip-zr": ("zero-redundancy", "skip-step", 1, 7, None),
    "skip-fsdp": ("fsdp2", "skip-step", 1, 7, None),
    "grad-ddp": ("ddp", "grad", 1, 10, "head.bias"),
    "grad-zr": ("zero-redundancy", "grad", 1, 10, "head.bias"),
    "zero-ddp": ("ddp", "zero-state", 1, 7, None),
    "zero-fsdp": ("fsdp2", "zero-state", 1, 7, None),
    "zero-z3": ("zerogpu-zero3", "zero-state", 1, 7, None),
}
#: the same, with the monitor judging each check within the call that observed it (overlap=False)
SYNC_ADAPTERS = ("ddp", "fsdp2")
SYNC_FAULTS = {"sync-flip-ddp": FAULTS["flip-ddp"], "sync-skip-fsdp": FAULTS["skip-fsdp"]}
#: DDP whose rank 1 drops its gradients before one check and holds them again at the next
LAYOUT_CHANGE, LAYOUT_CHANGE_STEPS = "ddp-layout-change", 9
FAULTS4 = {
    "flip-hsdp": ("hsdp", "bitflip", 3, 5, "blocks.1.weight"),
    "flip-zh": ("zerogpu-hybrid", "bitflip", 2, 5, "embed.weight"),
}


def _fault_spec(name: str, fault: tuple, monitor: str = "1") -> str:
    adapter, kind, rank, step, tensor = fault
    text = f"{kind};rank={rank};step={step}" + (f";tensor={tensor}" if tensor else "")
    return f"{name}={adapter},{FAULT_STEPS},{FAULT_EVERY},{monitor},{text}"


def _launch(tmp: Path, world: int, scenarios: list[str], device: str = "cpu") -> dict[str, dict]:
    """One launch of PROGRAM at ``world`` running ``scenarios`` on ``device``: name -> its record."""
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    results = tmp / "results.jsonl"
    run = run_ranks(world, [PROGRAM, str(results), str(tmp), *scenarios], BOUND_S,
                    env={"PYTHONWARNINGS": "ignore", "MONITOR_DEVICE": device,
                         "MONITOR_COMPARE_AFTER": str(STEPS)})
    assert not run.timed_out and run.returncode == 0, run.stderr[-3000:]
    return {r["name"]: r for r in map(json.loads, results.read_text().splitlines())}


def _clean(adapters: tuple[str, ...]) -> list[str]:
    """Each adapter's fault-free run with the monitor (``clean-``) and without it (``plain-``)."""
    return ([f"clean-{a}={a},{SOAK_STEPS},{EVERY},1" for a in adapters]
            + [f"plain-{a}={a},{STEPS},{EVERY},0" for a in adapters])


def _fault_free(results: dict[str, dict], adapter: str) -> None:
    """No violation in SOAK_STEPS steps, a check every EVERY steps, and after STEPS the training numbers
    of the run without the monitor."""
    clean, plain = results[f"clean-{adapter}"], results[f"plain-{adapter}"]
    assert clean["violations"] == [] and clean["summary"]["passed"], clean["violations"][:3]
    assert clean["summary"]["checks"] == SOAK_STEPS // EVERY
    assert clean["summary"]["steps_checked"] == [0, SOAK_STEPS - 1], clean["summary"]
    assert clean["params_after"] == plain["params"], "the monitor changed the training numbers"


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("monitor2")
    scenarios = _clean(CLEAN_ADAPTERS)
    scenarios += [f"sync-{a}={a},{STEPS},{EVERY},2" for a in SYNC_ADAPTERS]
    scenarios += [f"layout-change={LAYOUT_CHANGE},{LAYOUT_CHANGE_STEPS},1,1",
                  f"sync-layout-change={LAYOUT_CHANGE},{LAYOUT_CHANGE_STEPS},1,2"]
    scenarios += [_fault_spec(name, fault) for name, fault in FAULTS.items()]
    scenarios += [_fault_spec(name, fault, monitor="2") for name, fault in SYNC_FAULTS.items()]
    return tmp, _launch(tmp, 2, scenarios)


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("monitor4")
    scenarios = [_fault_spec(name, fault) for name, fault in FAULTS4.items()]
    return tmp, _launch(tmp, 4, scenarios)


@pytest.mark.parametrize("adapter", CLEAN_ADAPTERS)
def test_a_fault_free_run_has_no_violation_and_unchanged_parameters(world2, adapter):
    _, results = world2
    _fault_free(results, adapter)
    plain = results[f"plain-{adapter}"]
    if adapter in SYNC_ADAPTERS:
        sync = results[f"sync-{adapter}"]
        assert sync["violations"] == [] and sync["summary"]["checks"] == STEPS // EVERY
        assert sync["params"] == plain["params"], "the monitor without overlap changed the training numbers"


def _caught(record: dict, fault: tuple) -> None:
    _, kind, rank, step, tensor = fault
    expected = -(-step // FAULT_EVERY) * FAULT_EVERY  # the first check at or after the injection
    violations = record["violations"]
    assert violations, f"{kind} at step {step} on rank {rank} was not caught"
    first = min(v["step"] for v in violations)
    assert first == expected, violations[:3]
    at_first = [v for v in violations if v["step"] == first]
    # with a majority the faulty rank is named alone; where a piece has two holders (world 2, HSDP's
    # replica pairs) they are said to disagree, unless other evidence (a recomputed norm) names one
    pointed = [v for v in at_first
               if v["ranks"] == [rank] or (rank in v["ranks"] and "disagree" in v["text"])]
    assert pointed, at_first
    if tensor is not None:
        named = {v["tensor"] for v in pointed}
        assert named & {tensor, tensor + ".grad"}, named  # the copy itself, or its reduced gradient


@pytest.mark.parametrize("name", sorted({**FAULTS, **SYNC_FAULTS}))
def test_each_live_fault_is_caught_at_the_first_check_naming_rank_and_tensor(world2, name):
    _caught(world2[1][name], {**FAULTS, **SYNC_FAULTS}[name])


@pytest.mark.parametrize("name", ["layout-change", "sync-layout-change"])
def test_a_layout_that_changes_on_one_rank_is_exchanged_again_without_a_false_alarm(world2, name):
    """Rank 1 holds no gradient at one check and holds it again at the next: at each of those checks the
    ranks digested their pieces under layouts that no longer hold (rank 0 left the gradient it alone
    held undigested at the second), the keys are gathered again, and no check reports a violation."""
    record = world2[1][name]
    assert record["violations"] == [] and record["summary"]["passed"], record["violations"][:3]
    assert record["summary"]["checks"] == LAYOUT_CHANGE_STEPS


def test_hsdp_and_zerogpu_hybrid_at_world_4(world4):
    """A 2-D HSDP mesh (2 replicas x 2 shards) and zerogpu's hybrid strategy: the check before the fault
    finds nothing (``_caught``: no violation before the injection), the next one names rank and tensor."""
    tmp, results = world4
    for name, fault in FAULTS4.items():
        assert results[name]["summary"]["checks"] == 3
        _caught(results[name], fault)
    # HSDP: the two replicas of each shard split its gradient for the norm, so the four ranks' slices
    # cover every element of every tensor once and all four ranks contribute to the recomputed norm
    from zerosim.checks.live_state import norm_contributors
    from zerosim.values.observe import MonitorObservation

    first = [MonitorObservation.from_json(json.loads(
        (tmp / "flip-hsdp" / f"rank-{r:05d}.jsonl").read_text().splitlines()[0])) for r in range(4)]
    assert norm_contributors(first) == [0, 1, 2, 3]
    for name, numel in first[0].numels.items():
        summed = sorted(r for obs in first for r in (obs.grad_ranges or {})[name])
        assert [a for a, _ in summed] == [0] + [b for _, b in summed[:-1]] and summed[-1][1] == numel, summed


def test_check_trace_judges_the_files_again(world2, capsys):
    tmp, results = world2
    assert cli_main(["check", "trace", str(tmp / "clean-fsdp2")]) == 0
    assert f"PASS {SOAK_STEPS} check(s)" in capsys.readouterr().out
    assert cli_main(["check", "trace", str(tmp / "flip-ddp"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    offline = [(v["step"], v["contract"], v["clause"], v["ranks"], v["tensor"])
               for verdict in doc["verdicts"] for v in verdict["violations"]]
    live = [(v["step"], v["contract"], v["clause"], v["ranks"], v["tensor"])
            for v in results["flip-ddp"]["violations"]]
    assert sorted(offline) == sorted(live)
    summary = json.loads((tmp / "flip-ddp" / "summary.json").read_text())
    assert summary["violation_count"] == len(live) and not summary["passed"]
