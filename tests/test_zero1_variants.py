"""ZeRO-1's two gradient reductions (``zero1_grad_reduce``): all-reduce (torch ZeroRedundancyOptimizer,
3(N-1)/N Psi) and reduce-scatter (DeepSpeed stage 1, the ZeRO paper's 2(N-1)/N Psi).

Both must pass C-ZERO-002..005 (bitwise against the same-order reference), move exactly the ring
model's bytes, keep ZeRO-1's memory layout (full gradient buffer, sharded optimizer state), and a
run of one variant checked against the other's model must fail C-ZERO-005 naming the collective.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from run_assertions import assert_all_pass

from zerosim.checks.traffic import check_communication
from zerosim.cli import main
from zerosim.cost.comm_model import comm_for_run, comm_per_step
from zerosim.engine.spmd import RunConfig, run_simulated, simulate_observations
from zerosim.errors import ConfigError

VARIANTS = ("all_reduce", "reduce_scatter")
PSI = 3 * 2**20 * 5  # divisible by every world size below: no padding


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("world", [2, 4, 5])
@pytest.mark.parametrize("variant", VARIANTS)
def test_both_variants_pass_every_step_contract_bitwise(variant, world, micro):
    result = run_simulated(RunConfig(strategy="zero1", world_size=world, micro_batches=micro, steps=2,
                                     max_grad_norm=0.5, zero1_grad_reduce=variant))
    assert_all_pass(result)
    assert result.verdicts["C-ZERO-002"].details["bitwise_required"] is True
    assert (
        result.steps[0]["clip_coef"] < 1.0
    )  # the global norm was needed (reduce_scatter: summed over shards)
    assert result.config["zero1_grad_reduce"] == variant
    assert result.comm.variant == variant
    if world == 5:
        assert result.comm.padding > 0  # the odd world really pads the flat buffer


@pytest.mark.parametrize("world", [2, 4, 5, 8])
def test_measured_data_traffic_per_rank_is_the_ring_formula(world):
    """M = 1, fp32: reduce_scatter sends 2(N-1)/N * P * 4 bytes, all_reduce
    2(N-1)/N * Psi * 4 + (N-1)/N * P * 4 (= 3(N-1)/N * P * 4 without padding); P = padded packed size
    from the engine's own unit plan."""
    sent = {}
    for variant in VARIANTS:
        run = RunConfig(strategy="zero1", world_size=world, steps=2, zero1_grad_reduce=variant).resolve()
        psi, packed = run.layout.total_numel, run.unit_plan.packed_numel
        f = Fraction(world - 1, world)
        want = 2 * f * packed * 4 if variant == "reduce_scatter" else 2 * f * psi * 4 + f * packed * 4
        grad_collective = "reduce_scatter" if variant == "reduce_scatter" else "all_reduce"
        for obs in simulate_observations(run):
            for so in obs.steps:
                got = so.traffic_by_collective()
                assert set(got) == {("world", grad_collective), ("world", "all_gather")}, got
                total = sum((v[1] for v in got.values()), Fraction(0))
                assert total == want, (variant, world, obs.rank, float(total), float(want))
                assert sum((v[2] for v in got.values()), Fraction(0)) == want  # ring: received == sent
                control = [t for t in so.traffic if t.channel == "control" and t.collective == "all_reduce"]
                assert control  # grad-norm scalar (and NaN flag, loss) stay on the control group
        sent[variant] = want
        if packed == psi:
            mult = 2 if variant == "reduce_scatter" else 3
            assert want == mult * f * psi * 4
    assert sent["reduce_scatter"] < sent["all_reduce"]


def test_memory_layout_is_the_same_for_both_variants():
    """ZeRO-1 shards only the optimizer state: the gradient buffer stays full in both variants."""
    holdings = {}
    for variant in VARIANTS:
        run = RunConfig(strategy="zero1", world_size=5, steps=1, zero1_grad_reduce=variant).resolve()
        obs = simulate_observations(run)
        holdings[variant] = [
            {k: (h.intervals, h.stored_numel, h.nbytes) for k, h in o.steps[0].holdings.items()} for o in obs
        ]
        assert all(h["grads"][1] == run.layout.total_numel for h in holdings[variant])
    assert holdings["all_reduce"] == holdings["reduce_scatter"]


@pytest.mark.parametrize(
    ("ran", "model"), [("reduce_scatter", "all_reduce"), ("all_reduce", "reduce_scatter")]
)
def test_a_run_checked_against_the_other_variants_model_fails_naming_the_collective(ran, model):
    run = RunConfig(strategy="zero1", world_size=4, steps=1, zero1_grad_reduce=ran).resolve()
    wrong = comm_for_run(
        RunConfig(strategy="zero1", world_size=4, steps=1, zero1_grad_reduce=model).resolve()
    )
    obs = simulate_observations(run)
    v = check_communication(obs, wrong)
    assert not v.passed
    messages = {(x.clause, x.context["collective"], x.message.split(": traffic ")[1].split(" ")[0])
                for x in v.violations}
    assert ("ring_model", ran, "unexpected") in messages
    assert ("ring_model", model, "missing") in messages
    assert all(x.contract == "C-ZERO-005" for x in v.violations)
    assert check_communication(obs, comm_for_run(run)).passed  # and the matching model holds


def test_the_reduce_scatter_variant_still_catches_a_sum_instead_of_an_average():
    result = run_simulated(
        RunConfig(
            strategy="zero1",
            world_size=4,
            steps=1,
            zero1_grad_reduce="reduce_scatter",
            fault="sum-instead-of-avg",
        )
    )
    assert not result.verdicts["C-ZERO-002"].passed
    assert result.verdicts["C-ZERO-005"].passed  # same collectives, wrong op


@pytest.mark.parametrize("n", [2, 8, 1024])
def test_comm_model_variants_in_elements(n):
    f = Fraction(n - 1, n)
    ar = comm_per_step(PSI, "zero1", n)
    rs = comm_per_step(PSI, "zero1", n, zero1_grad_reduce="reduce_scatter")
    assert (ar.variant, rs.variant) == ("all_reduce", "reduce_scatter")
    assert ar.elements_sent == 3 * f * PSI
    assert rs.elements_sent == 2 * f * PSI == rs.paper_elements()
    assert [i.collective for i in rs.items] == ["reduce_scatter", "all_gather"]
    assert any("reduce_scatter" in note for note in rs.notes)
    # once per step, after accumulation: micro-batches do not multiply it
    assert (
        comm_per_step(PSI, "zero1", n, micro_batches=4, zero1_grad_reduce="reduce_scatter").elements_sent
        == 2 * f * PSI
    )
    # other strategies ignore the option
    for s in ("no_shard", "zero2", "zero3", "hybrid_shard_zero2:2"):
        a = comm_per_step(PSI, s, n)
        b = comm_per_step(PSI, s, n, zero1_grad_reduce="reduce_scatter")
        assert a.items == b.items and b.variant is None


@pytest.mark.parametrize("bad", ["reduce-scatter", "allreduce", "", None, 1])
def test_bad_variant_is_a_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError) as e:
        RunConfig(strategy="zero1", zero1_grad_reduce=bad).validate()
    assert e.value.field == "zero1_grad_reduce"
    with pytest.raises(ConfigError) as e:
        comm_per_step(PSI, "zero1", 4, zero1_grad_reduce=bad)
    assert e.value.field == "zero1_grad_reduce"


@pytest.mark.parametrize(
    "command", [["simulate", "--strategy", "zero1"], ["comm", "--params", "1e6", "--world-size", "4"]]
)
def test_bad_variant_at_the_cli_exits_2_with_one_line(command, capsys):
    assert main([*command, "--zero1-reduce", "scatter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero1_grad_reduce='scatter'" in err[0] and err[0].startswith("error:")


def test_cli_comm_reports_the_variant(capsys):
    assert (
        main(
            [
                "comm",
                "--params",
                str(PSI),
                "--world-size",
                "8",
                "--strategy",
                "zero1",
                "--precision",
                "fp32",
                "--zero1-reduce",
                "reduce_scatter",
                "--json",
            ]
        )
        == 0
    )
    row = next(iter(json.loads(capsys.readouterr().out)["strategies"].values()))
    assert row["variant"] == "reduce_scatter"
    assert row["per_rank"]["elements_sent"] == pytest.approx(2 * 7 / 8 * PSI)


def test_cli_simulate_passes_the_variant_through(capsys):
    assert main(["simulate", "--strategy", "zero1", "--world-size", "3", "--steps", "1",
                 "--zero1-reduce", "reduce_scatter", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["zero1_grad_reduce"] == "reduce_scatter"
    assert [c["collective"] for c in data["comm_model"]["collectives"]] == ["reduce_scatter", "all_gather"]


def test_mpi_ships_the_variant():
    """``--backend mpi`` ships the run as one value: the variant survives the run file's round trip."""
    from zerosim.cli import build_parser
    from zerosim.cli.simulate import rank_run
    from zerosim.engine.run_file import RankRun

    args = build_parser().parse_args(["simulate", "--backend", "mpi", "--strategy", "zero1",
                                      "--zero1-reduce", "reduce_scatter"])
    shipped = RankRun.from_json(json.loads(json.dumps(rank_run(args).to_json())))
    assert shipped.run.zero1_grad_reduce == "reduce_scatter" and shipped.backend == "mpi"


def test_the_same_order_reference_follows_the_variants_norm_order():
    """Reduce-scatter ZeRO-1 sums squares shard by shard (then one scalar all-reduce); the all-reduce
    variant sums the full reduced gradient. The float64 norms can differ in the last bit, so the
    ordered reference must follow the variant to stay bitwise equal. Whether the two orders differ on
    a given step depends on the last bits of the gradients (the BLAS kernels of the processor), so
    only their closeness is asserted: two float64 sums of the same n non-negative squares are each
    within gamma_{n-1} of the exact sum, and the root halves that."""
    from zerosim.engine.reference import ordered_reference

    cfg = RunConfig(
        strategy="zero1", world_size=4, steps=3, micro_batches=2, zero1_grad_reduce="reduce_scatter"
    )
    result = run_simulated(cfg)
    assert_all_pass(result)
    refs = {v: ordered_reference(cfg.replace(zero1_grad_reduce=v).resolve()) for v in VARIANTS}
    norms = {v: [s.grad_norm for s in ref.steps] for v, ref in refs.items()}
    assert [s.grad_norm for s in result.observations[0].steps] == norms["reduce_scatter"]
    n = refs["all_reduce"].steps[0].master.size
    # each sum within gamma_{n-1} s of the exact one (2 gamma apart), the root halves that and rounds once
    bound = n * 2.0**-53 / (1 - n * 2.0**-53) + 2.0**-52
    for a, b in zip(norms["all_reduce"], norms["reduce_scatter"], strict=True):
        assert abs(a - b) <= bound * max(a, b), (a, b)


@pytest.mark.mpi
def test_mpi_backend_runs_the_reduce_scatter_variant():
    """``python -m zerosim.mpi simulate`` shares the run options: the variant reaches every rank."""
    from zerosim.mpi.launch import mpi_unavailable_reason, run_mpiexec

    reason = mpi_unavailable_reason()
    if reason is not None:
        pytest.skip(f"MPI unavailable: {reason}")
    argv = ["-m", "zerosim.mpi", "simulate", "--model", "tiny", "--steps", "1", "--micro-batches", "2",
            "--strategy", "zero1", "--zero1-reduce", "reduce_scatter", "--json"]
    result = run_mpiexec(3, argv, timeout_s=90)
    assert not result.timed_out and result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["config"]["zero1_grad_reduce"] == "reduce_scatter"
    assert data["verdicts"]["C-ZERO-005"]["passed"] is True
    assert [c["collective"] for c in data["comm_model"]["collectives"]] == ["reduce_scatter", "all_gather"]
