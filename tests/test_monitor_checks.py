"""zerosim.monitor's pieces without a launch: the digest, the checks its observations feed (each fails on
a deliberately wrong input, naming rank and tensor), the trace files and ``zerosim check trace``'s exit
codes, the live fault language, and the monitor's bad input in a one-rank world."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zerosim.checks.equivalence import check_step_equivalence
from zerosim.checks.identity import check_replica_identity
from zerosim.checks.live_state import norm_contributors
from zerosim.checks.partition import check_partition_plan
from zerosim.checks.tolerance import norm_accumulation, norm_relative_bound
from zerosim.cli import main as cli_main
from zerosim.comm.fault_plan import FaultPlan
from zerosim.errors import ConfigError
from zerosim.monitor.digest import CHUNKS, tensor_digest
from zerosim.monitor.trace import append_line, rank_file
from zerosim.monitor.trace_reader import read_trace
from zerosim.values.observe import MonitorObservation

NUMELS = {"w": 8, "b": 4}


def obs(rank: int, step: int = 10, **fields) -> MonitorObservation:
    """Rank ``rank`` of a 2-rank DDP-like run: everything held and owned, equal digests, step counter 11."""
    base = dict(rank=rank, world_size=2, step=step, adapter="ddp",
                held=[("w", 0, 8, "aa"), ("b", 0, 4, "bb")], owned={"w": [(0, 8)], "b": [(0, 4)]},
                numels=dict(NUMELS), step_counters=(11, 11, "w"), grad_sq=4.0, grad_numel=12, grad_norm=2.0)
    base.update(fields)
    return MonitorObservation(**base)


# ---- the digest ------------------------------------------------------------------------------------
def test_digest_changes_with_any_one_bit_and_not_with_where_the_bytes_sit():
    x = torch.randn(999)
    reference = tensor_digest(x)
    for position in (0, 1, 500, 998):
        for bit in (0, 13, 31):
            y = x.clone()
            y.view(torch.int32)[position] ^= 1 << bit
            assert not torch.equal(tensor_digest(y), reference), (position, bit)
    assert torch.equal(tensor_digest(x[1:]), tensor_digest(x[1:].clone()))  # unaligned view == aligned copy
    swapped = torch.cat([x[500:], x[:500]])  # the same bytes, moved
    assert not torch.equal(tensor_digest(swapped), reference)
    chunks = torch.randn(CHUNKS, 6, dtype=torch.float64)  # 64 chunks of 6 words each
    moved = chunks[[5, *range(1, 5), 0, *range(6, CHUNKS)]]  # chunks 0 and 5 swapped
    before, after = tensor_digest(chunks), tensor_digest(moved)
    assert before[0] == after[0] and before[1] != after[1]  # lane 0 sees the same words, lane 1 the move
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        z = torch.randn(37).to(dtype)
        assert torch.equal(tensor_digest(z), tensor_digest(z.clone()))


def _reference_digest(t: torch.Tensor) -> tuple[int, int]:
    """The module docstring's definition, word by word in Python integers."""
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    data += bytes(-len(data) % 8)
    words = [int.from_bytes(data[i: i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    m = max(1, -(-len(words) // CHUNKS))
    sums = [sum(words[j * m: (j + 1) * m]) for j in range(CHUNKS)]
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63  # noqa: E731
    return wrap(sum(sums)), wrap(sum((j + 1) * s for j, s in enumerate(sums)))


def test_digest_is_the_documented_chunk_sums():
    for t in (torch.randn(999), torch.randn(3, 5).to(torch.bfloat16), torch.tensor(3.0), torch.zeros(0),
              torch.randn(64 * 7 * 2 + 3), torch.arange(10**4, dtype=torch.int64) * (2**61 + 12345),
              # words splitting evenly into the 64 chunks (one row reduction), also strided and unaligned
              torch.randn(64 * 8 * 3), torch.randn(128, 64)[:, :32], torch.randn(1025)[1:]):
        assert tuple(tensor_digest(t).tolist()) == _reference_digest(t), t.shape


def test_pieces_digested_together_equal_each_digested_alone(monkeypatch):
    """The fused path (one buffer, one reduction) and the in-place path give every piece the same digest,
    whatever its dtype, shape, stride or size; a flipped bit in one piece changes that piece's only."""
    import zerosim.monitor.digest as digest

    pieces = [torch.randn(999), torch.randn(3, 5).to(torch.bfloat16), torch.randn(70000), torch.tensor(3.0),
              torch.randn(10, 10)[:, 2], torch.randn(1001)[1:], torch.ones(5, dtype=torch.bool),
              torch.randn(4, 4, dtype=torch.float64), torch.randn(512, 64)]
    alone = torch.stack([tensor_digest(p) for p in pieces])
    for in_place_bytes in (1 << 20, 1000, 1):  # all fused, the large ones in place, all in place
        monkeypatch.setattr(digest, "IN_PLACE_BYTES", in_place_bytes)
        together = digest.PieceDigests(pieces, torch.device("cpu"))
        assert torch.equal(together.compute(pieces), alone), in_place_bytes
        flipped = [p.clone() for p in pieces]
        flipped[5].view(torch.int32)[700] ^= 1 << 9
        changed = (together.compute(flipped) != alone).any(dim=1)
        assert changed.tolist() == [i == 5 for i in range(len(pieces))]
        assert together.fits(flipped) and not together.fits(pieces[:-1])


# ---- C-ZERO-003 on digests ------------------------------------------------------------------------------
def test_identity_names_the_rank_whose_copy_differs():
    rows = [obs(0), obs(1, held=[("w", 0, 8, "aa"), ("b", 0, 4, "XX")]), obs(2)]
    verdict = check_replica_identity(rows)
    assert [(v.ranks, v.tensor, v.interval, v.step) for v in verdict.violations] == [((1,), "b", (0, 4), 10)]
    assert verdict.checked == 2
    sharded = [obs(0, held=[("w", 0, 4, "p")]), obs(1, held=[("w", 4, 8, "q")])]
    assert check_replica_identity(sharded).passed and check_replica_identity(sharded).checked == 0


def test_two_ranks_that_differ_are_said_to_disagree_and_neither_is_named():
    """With no majority (two ranks, two copies) the judge cannot know which copy is wrong: one violation
    naming both ranks as disagreeing, never one rank as the odd one out."""
    pair = [obs(0), obs(1, held=[("w", 0, 8, "aa"), ("b", 0, 4, "XX")])]
    [v] = check_replica_identity(pair).violations
    assert v.ranks == (0, 1) and v.tensor == "b" and "ranks 0 and 1 disagree on b[0:4]" in v.message, v
    assert "differs bitwise from" not in v.message
    [v] = check_step_equivalence([obs(0), obs(1, step_counters=(10, 10, "w"))]).violations
    assert v.clause == "step_counter" and v.ranks == (0, 1) and "ranks 0, 1 disagree" in v.message, v
    # the logged norms disagree; the norm recomputed from the gradient (rank 0's slice holds it all
    # here) is the evidence that names rank 1
    disagree, named = check_step_equivalence([obs(0, grad_sq=6.25, grad_norm=2.5), obs(1, grad_sq=0.0)]
                                             ).violations
    assert disagree.ranks == (0, 1) and "ranks 0, 1 disagree on the logged gradient norm" in disagree.message
    assert named.ranks == (1,) and "recomputed from the shards" in named.message, named


# ---- C-ZERO-002's live clauses -----------------------------------------------------------------------
def test_live_state_passes_a_consistent_step_and_fails_each_wrong_one():
    assert check_step_equivalence([obs(0), obs(1)]).passed
    cases = {
        "state_present": [obs(0), obs(1, state_missing=(1, "b"))],
        "state_finite": [obs(0), obs(1, state_nonfinite=(2, "w"))],
        "step_counter": [obs(0), obs(1, step_counters=(10, 10, "w")), obs(2)],
        "grad_norm": [obs(0), obs(1, grad_norm=2.5), obs(2)],
    }
    for clause, rows in cases.items():
        verdict = check_step_equivalence(rows)
        assert {v.clause for v in verdict.violations} == {clause}, verdict.violations
        assert all(v.ranks == (1,) for v in verdict.violations), verdict.violations
    inside = check_step_equivalence([obs(0, step_counters=(11, 12, "b"))])
    assert [(v.clause, v.tensor) for v in inside.violations] == [("step_counter", "b")]


def test_a_rank_s_row_counts_each_state_tensor_that_is_not_finite_and_no_finite_one():
    """The row's state summary: a NaN or an infinity of either sign in any floating dtype is found and
    the first such tensor named; finite state whose reduction overflows (float32 near its largest
    value, float16 summing past 65,504) is confirmed finite, not reported; the gradient's sum of
    squares is its norms squared, summed."""
    from zerosim.monitor.exchange import summary_values
    from zerosim.monitor.layouts import LiveLayout, OwnedState
    from zerosim.monitor.row import RowBuilder

    big = torch.finfo(torch.float32).max
    states = {
        "ok": torch.randn(100),
        "sum_overflows": torch.tensor([big, big, 1.0]),
        "half_sum_overflows": torch.full((64,), 60000.0, dtype=torch.float16),
        "negative_inf": torch.tensor([1.0, -math.inf, 2.0]),
        "nan": torch.tensor([0.0, math.nan]),
        "bf16_inf": torch.tensor([math.inf, 1.0], dtype=torch.bfloat16),
        "complex_nan": torch.tensor([1 + 1j, complex(0, math.nan)], dtype=torch.complex64),
    }
    layout = LiveLayout("ddp", numels={n: t.numel() for n, t in states.items()},
                        states=[OwnedState(n, t.numel(), {"exp_avg": t, "step": torch.tensor(3.0)})
                                for n, t in states.items()],
                        grads=[torch.tensor([3.0, 4.0]), torch.tensor([12.0])])
    s = summary_values(RowBuilder(torch.device("cpu")).row(layout, 0, 3, 1, None, None), 0)
    assert s["nonfinite"] == 4
    assert list(states)[s["nonfinite_idx"]] == "negative_inf"
    assert s["grad_sq"] == 169.0 and s["grad_numel"] == 3
    assert (s["step_min"], s["step_max"]) == (3, 3)


def test_a_logged_loss_or_norm_given_as_a_tensor_enters_the_row_as_the_same_bits_as_a_number():
    """A loop may log ``loss.detach()`` and ``clip_grad_norm_``'s tensor as they are: the row copies their
    float64 bits where the tensor lives (no host read) and they equal the bits of the same value given
    as a Python number, for a float32 and a bfloat16 tensor alike."""
    from zerosim.monitor.exchange import summary_values
    from zerosim.monitor.layouts import LiveLayout
    from zerosim.monitor.row import RowBuilder

    layout = LiveLayout("ddp", numels={"w": 2}, grads=[torch.tensor([3.0, 4.0])])
    rows = RowBuilder(torch.device("cpu"))
    loss, norm = torch.tensor(0.1234567), torch.tensor([2.5], dtype=torch.bfloat16)
    from_tensors = rows.row(layout, 0, 7, 1, loss, norm)
    from_numbers = rows.row(layout, 0, 7, 1, float(loss), float(norm))
    assert torch.equal(from_tensors, from_numbers)
    s = summary_values(from_tensors, 0)
    assert (s["loss"], s["grad_norm"], s["has_loss"], s["has_norm"]) == (float(loss), 2.5, 1, 1)


def test_grad_norm_bound_is_the_rounding_of_a_blocked_reduction():
    u32 = 2.0 ** -24
    assert norm_relative_bound(12, "float32") == pytest.approx(20 * u32, rel=1e-4)  # gamma_20: 12 adds + 8
    assert norm_relative_bound(10**9, "float32") < 1e-4  # blocked: logarithmic in n, never vacuous
    ok = 2.0 * (1 + 0.5 * norm_relative_bound(12, "float32"))
    assert check_step_equivalence([obs(0, grad_norm=ok), obs(1, grad_norm=ok)]).passed
    off = 2.0 * (1 + 4 * norm_relative_bound(12, "float32"))
    assert not check_step_equivalence([obs(0, grad_norm=off), obs(1, grad_norm=off)]).passed
    # clipped at max_norm=1: the shards hold the clipped gradient, norm 1 (1 - 1e-6 / 2 ...)
    clipped = [obs(r, grad_sq=(1 / (2 + 1e-6) * 2) ** 2, grad_norm=2.0, max_norm=1.0) for r in (0, 1)]
    assert check_step_equivalence(clipped).passed
    unclipped = [obs(r, grad_sq=(1 / (2 + 1e-6) * 2) ** 2, grad_norm=2.0) for r in (0, 1)]
    assert not check_step_equivalence(unclipped).passed


def test_the_recomputed_norm_is_allowed_the_rounding_of_its_own_accumulation():
    """The ranks accumulate a float32 or narrower gradient's norm in float32 (a float64 one in float64):
    the bound is the logged norm's plus the recomputation's, and no wider."""
    assert norm_accumulation("bfloat16") == norm_accumulation("float16") == norm_accumulation("float32")
    assert norm_accumulation("float32") == "float32" and norm_accumulation("float64") == "float64"
    for dtype in ("float32", "float64"):
        bound = norm_relative_bound(12, dtype)
        within = 2.0 * (1 + 1.5 * bound)  # past the logged norm's own bound, inside the two together
        assert check_step_equivalence([obs(r, grad_norm=within, grad_dtype=dtype) for r in (0, 1)]).passed
        beyond = 2.0 * (1 + 3 * bound)
        assert not check_step_equivalence([obs(r, grad_norm=beyond, grad_dtype=dtype) for r in (0, 1)]).passed


def test_the_norm_counts_each_element_once():
    assert norm_contributors([obs(0), obs(1)]) == [0]  # replicas: one
    sharded = [obs(0, owned={"w": [(0, 4)]}), obs(1, owned={"w": [(4, 8)]})]
    assert norm_contributors(sharded) == [0, 1]
    hsdp = [obs(r, owned={"w": [(0, 4)] if r % 2 == 0 else [(4, 8)]}) for r in range(4)]
    assert norm_contributors(hsdp) == [0, 1]


def test_a_replicated_gradient_is_summed_in_slices_one_per_rank_and_a_wrong_slice_is_caught():
    """DDP: every rank holds the whole reduced gradient and owns every element, and sums the squares of
    its slice only (``grad_ranges``): every rank contributes, each element once, and the norm logged is
    compared with the slices' sum; a rank that sums a slice of the wrong size misses the bound."""
    from zerosim.monitor.layouts import _module_layout, gradient_slice

    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    layouts = [_module_layout(model, optimizer, rank, 3) for rank in range(3)]
    for name, p in model.named_parameters():
        slices = [lay.grad_ranges[name] for lay in layouts]
        covered = sorted(e for ranges in slices for a, b in ranges for e in range(a, b))
        assert covered == list(range(p.numel())), (name, slices)
        assert slices[1] == [gradient_slice(p.numel(), 1, 3)] or p.numel() < 3
    squares = [sum(float(g.double().square().sum()) for g in lay.grads) for lay in layouts]
    full = math.fsum(float(p.grad.double().square().sum()) for p in model.parameters())
    assert math.isclose(sum(squares), full, rel_tol=1e-12)
    assert [len(lay.held) for lay in layouts] == [8, 8, 8]  # the whole gradient is still digested
    numels = {n: p.numel() for n, p in model.named_parameters()}
    norm = math.sqrt(full)

    def ranked(rank: int, grad_sq: float) -> MonitorObservation:
        return MonitorObservation(rank=rank, world_size=3, step=1, adapter="ddp", numels=numels,
                                  owned={n: [(0, k)] for n, k in numels.items()},
                                  grad_ranges=layouts[rank].grad_ranges, grad_sq=grad_sq,
                                  grad_numel=sum(g.numel() for g in layouts[rank].grads), grad_norm=norm)

    split = [ranked(r, squares[r]) for r in range(3)]
    assert norm_contributors(split) == [0, 1, 2]
    assert check_step_equivalence(split).passed
    assert MonitorObservation.from_json(json.loads(json.dumps(split[1].to_json()))) == split[1]
    wrong = [ranked(r, squares[r] if r != 2 else 0.0) for r in range(3)]
    verdict = check_step_equivalence(wrong)
    assert not verdict.passed and {v.clause for v in verdict.violations} == {"grad_norm"}
    assert "shards of ranks [0, 1, 2]" in str(verdict.violations[0])


# ---- C-ZERO-001 on owned ranges ---------------------------------------------------------------------
def test_layout_finds_an_element_nobody_owns():
    good = [obs(0, owned={"w": [(0, 4)], "b": [(0, 4)]}), obs(1, owned={"w": [(4, 8)], "b": []})]
    assert check_partition_plan(good).passed
    gap = [obs(0, owned={"w": [(0, 3)], "b": [(0, 4)]}), obs(1, owned={"w": [(4, 8)], "b": []})]
    verdict = check_partition_plan(gap)
    assert [(v.clause, v.tensor, v.interval) for v in verdict.violations] == [("coverage", "w", (3, 4))]


# ---- the files and the command -------------------------------------------------------------------------
def _write(tmp_path, rows):
    for row in rows:
        append_line(rank_file(tmp_path, row.rank), row.to_json())


def test_check_trace_exit_codes(tmp_path, capsys):
    good = tmp_path / "good"
    good.mkdir()
    _write(good, [obs(0, step=s) for s in (0, 5)] + [obs(1, step=s) for s in (0, 5)])
    assert cli_main(["check", "trace", str(good)]) == 0
    assert "PASS 2 check(s)" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.mkdir()
    _write(bad, [obs(0), obs(1, held=[("w", 0, 8, "zz"), ("b", 0, 4, "bb")])])
    assert cli_main(["check", "trace", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "C-ZERO-003 identical step=10 rank=0,1 tensor=w range=[0, 8): ranks 0 and 1 disagree on w[0:8]" \
        in out
    with open(rank_file(bad, 1), "a") as f:
        f.write('{"rank": 1, "step"')  # a run killed while writing its last line
    assert cli_main(["check", "trace", str(bad)]) == 1
    assert "an unfinished last line was left out" in capsys.readouterr().out
    with open(rank_file(bad, 1), "a") as f:
        f.write("\n" + json.dumps(obs(1).to_json()) + "\n")  # ... then a malformed line in the middle
    assert cli_main(["check", "trace", str(bad)]) == 2
    assert "rank-00001.jsonl:2" in capsys.readouterr().err
    assert cli_main(["check", "trace", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no monitor observation file"):
        read_trace(tmp_path)


def test_observations_round_trip_through_json():
    row = obs(1, state_missing=(2, "w"), grad_norm=None, loss=math.inf)
    assert MonitorObservation.from_json(json.loads(json.dumps(row.to_json()))) == row


# ---- the live fault language -----------------------------------------------------------------------------
def test_live_faults_parse_and_refuse_what_they_cannot_apply():
    plan = FaultPlan.from_env("bitflip:rank=1:step=7:tensor=head.weight:bit=3")
    assert plan == FaultPlan("bitflip", 1, step=7, tensor="head.weight", bit=3)
    assert FaultPlan.from_env(plan.text) == plan
    assert FaultPlan.from_env("skip-step:rank=0:step=2").kind == "skip-step"
    with pytest.raises(ConfigError, match="needs tensor=NAME"):
        FaultPlan.from_env("grad:rank=1:step=3")
    with pytest.raises(ConfigError, match="unknown kind"):
        FaultPlan.from_env("flip:rank=1:step=3")


# ---- the monitor itself, one rank -----------------------------------------------------------------
def test_without_a_process_group_the_monitor_says_so_and_stays_off():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    from zerosim.monitor import Monitor

    lines: list[str] = []
    model = torch.nn.Linear(2, 2)
    monitor = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), every=1, log=lines.append)
    assert not monitor.enabled and monitor.after_step(0) == []
    assert lines == ["zerosim.monitor: off: no torch.distributed process group (call init_process_group, "
                     "e.g. under torchrun)"]


def _train(model, optimizer, monitor, steps):
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(torch.ones(3, 4)).pow(2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        optimizer.step()
        monitor.after_step(step, loss=loss, grad_norm=norm)


def test_bad_input_is_one_line_and_training_goes_on(world_of_one, tmp_path):
    from zerosim.monitor import Monitor, MonitorViolation

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for kwargs, expected in (({"every": 0}, "invalid every=0"), ({"every": "5"}, "invalid every='5'"),
                             ({"on_violation": "stop"}, "invalid on_violation='stop'")):
        lines: list[str] = []
        monitor = Monitor(model, optimizer, log=lines.append, **kwargs)
        assert not monitor.enabled and len(lines) == 1 and expected in lines[0], lines
    lines = []
    assert not Monitor(42, None, log=lines.append).enabled and "cannot read the layout of int" in lines[0]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    lines = []
    monitor = Monitor(model, optimizer, every=1, out=blocker / "sub", log=lines.append)
    assert monitor.enabled and monitor.out is None and "invalid out=" in lines[0]
    _train(model, optimizer, monitor, 3)
    assert monitor.checks == 2  # the third check's exchange is still under way (overlap)
    assert monitor.flush() == [] and monitor.checks == 3 and monitor.violation_count == 0
    # a state value gone non-finite: without overlap raised at the check that observed it, with overlap
    # at the next call (or close), naming the step observed, the rank and the tensor
    optimizer.state[model.bias]["exp_avg"][0] = float("nan")
    expected = "C-ZERO-002 state_finite step=0 rank=0 tensor=bias"
    monitor = Monitor(model, optimizer, every=1, out=tmp_path / "m", on_violation="raise", log=lambda _: None,
                      overlap=False)
    with pytest.raises(MonitorViolation, match=expected):
        monitor.after_step(0)
    assert (tmp_path / "m" / "rank-00000.jsonl").read_text().count("\n") == 1
    monitor = Monitor(model, optimizer, every=1, out=tmp_path / "o", on_violation="raise", log=lambda _: None)
    assert monitor.after_step(0) == [] and monitor.checks == 0
    with pytest.raises(MonitorViolation, match=expected):
        monitor.after_step(1)
    monitor = Monitor(model, optimizer, every=1, out=tmp_path / "c", on_violation="raise", log=lambda _: None)
    monitor.after_step(0)
    with pytest.raises(MonitorViolation, match=expected):
        monitor.close()
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["violation_count"] == 1


class _ZeroStage2Optimizer:
    """What the monitor reads of DeepSpeed 0.19's ZeRO-1/2 optimizer, at world 1: one group whose flat
    fp32 partition is padded (with values that must not count), a loss scale of 4, and a ``step`` that
    hands the loss-scaled gradient partition to ``unscale_and_clip_grads`` and frees it after."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.round_robin_bit16_groups = [params]
        numel = sum(p.numel() for p in params)
        self.partition_size = [numel + 3]
        self.single_partition_of_fp32_groups = [torch.zeros(numel + 3)]
        self.optimizer = type("Inner", (), {"state": {}})()
        self.loss_scale = 4.0

    def step(self) -> None:
        master = self.single_partition_of_fp32_groups[0]
        flat = [p.grad.reshape(-1) for p in self.round_robin_bit16_groups[0]] + [torch.full((3,), 99.0)]
        master.grad = torch.cat(flat) * self.loss_scale
        self.unscale_and_clip_grads([master.grad], None)
        master.grad = None

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
        grad_groups_flat[0].mul_(1.0 / self.loss_scale)


class _Engine:
    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.optimizer = _ZeroStage2Optimizer(list(module.parameters()))
        self.global_steps = 0

    def zero_optimization_stage(self) -> int:
        return 2


def test_a_dtensor_sharded_on_another_dimension_turns_the_monitor_off_in_one_line(world_of_one):
    """The monitor reads dim-0 shards and replicas; an FSDP2 model sharded on dim 1 is refused by name
    when the layout is first read (the ranges are cached only for placements it reads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from zerosim.monitor import Monitor

    model = torch.nn.Linear(4, 6)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    lines: list[str] = []
    monitor = Monitor(model, torch.optim.AdamW(model.parameters()), log=lines.append)
    assert not monitor.enabled and len(lines) == 1, lines
    assert "placements" in lines[0] and "dim-0 shards and replicas only" in lines[0], lines


def test_a_deepspeed_gradient_is_measured_inside_its_step_and_judged_against_the_logged_norm(world_of_one):
    from zerosim.monitor import Monitor

    engine = _Engine(torch.nn.Linear(4, 3))
    lines: list[str] = []
    monitor = Monitor(engine, every=2, log=lines.append, overlap=False)  # judged within each call
    assert monitor.enabled and monitor.adapter == "deepspeed-2", lines
    found = {}
    for step, factor in enumerate((1.0, 1.0, 1.0, 1.0, 1.01)):  # the last logged norm 1% too large
        engine.module.zero_grad()
        engine.module(torch.ones(2, 4) * (step + 1)).pow(2).mean().backward()
        norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in engine.module.parameters()]))
        engine.optimizer.step()
        engine.global_steps += 1
        found[step] = monitor.after_step(engine.global_steps - 1, grad_norm=float(norm) * factor)
    assert monitor.checks == 3 and not found[0] and not found[2] and monitor.notes == [], (found, lines)
    # the step checks DeepSpeed's step hides (its reduction and optimizer are internal) are named apart
    assert monitor.summary()["step_checks_off"].startswith("C-ZERO-002 step checks off for deepspeed-2: ")
    assert [(v.clause, v.step, v.ranks) for v in found[4]] == [("grad_norm", 4, (0,))], found[4]
    assert "recomputed from the shards" in found[4][0].message
    # a loop counting steps other than DeepSpeed does checks after a step DeepSpeed did not measure
    # (its step 5): the logged norm is compared with nothing, and a note says why, once
    engine.optimizer.step()
    engine.global_steps += 1
    assert monitor.after_step(6, grad_norm=1.0) == [] and "measured no gradient" in monitor.notes[0]
    monitor.close()
    assert "step" not in vars(engine.optimizer) and "unscale_and_clip_grads" not in vars(engine.optimizer)


def test_a_fifo_or_a_failing_write_is_one_line_on_its_rank_and_never_blocks(world_of_one, tmp_path):
    """A FIFO where the rank's file goes is refused at Monitor() without being opened (opening it for
    writing would block until a reader came); a rank file that stops being writable mid-run is reported
    once, on its rank, and the checks go on; summary.json is still written."""
    import os
    import time

    from zerosim.monitor import Monitor

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    out = tmp_path / "fifo"
    out.mkdir()
    os.mkfifo(out / "rank-00000.jsonl")
    lines: list[str] = []
    t0 = time.monotonic()
    monitor = Monitor(model, optimizer, every=1, out=out, log=lines.append)
    assert time.monotonic() - t0 < 30 and monitor.enabled, lines
    assert len(lines) == 1 and "is not a regular file" in lines[0] and "rank 0" in lines[0], lines
    _train(model, optimizer, monitor, 2)
    assert monitor.close()["checks"] == 2 and (out / "summary.json").is_file()
    lines = []
    monitor = Monitor(model, optimizer, every=1, out=tmp_path / "gone", log=lines.append)
    (tmp_path / "gone" / "rank-00000.jsonl").unlink()
    (tmp_path / "gone" / "rank-00000.jsonl").mkdir()  # no longer a file the rank can append to
    _train(model, optimizer, monitor, 4)
    summary = monitor.close()
    failures = [line for line in lines if "cannot append" in line]
    assert len(failures) == 1 and "rank 0" in failures[0], lines
    assert summary["checks"] == 4 and summary["passed"] and (tmp_path / "gone" / "summary.json").is_file()
