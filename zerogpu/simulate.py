"""The torch.distributed backend's one rank entry point for ``simulate``: load the run, check it, run it.

``torchrun --nproc-per-node N -m zerogpu simulate --config FILE`` (the run file
:mod:`zerosim.engine.run_file` describes; ``zerosim simulate --backend torch`` writes one and starts
that) or ``... simulate [options]`` (the options of ``zerosim simulate`` plus the torch ones,
:func:`zerosim.cli.run_options.torch_simulate_parser`). Every rank loads the same
:class:`~zerosim.engine.run_file.RankRun`, runs the engine's SPMD program on a
:class:`zerogpu.comm.TorchCommunicator` (NCCL on ``cuda:<LOCAL_RANK>``, gloo on the CPU) and sends its
observations to rank 0, which checks C-ZERO-002..005 and prints the same verdict table / JSON as the
in-process simulator. Exit status, the same on every rank: 0 every contract holds, 1 a contract
failed, 2 bad input (printed once, by rank 0, before any process group exists), 3 a rank failed or a
collective timed out (``rank R failed: ...`` printed once; torchrun then stops the other ranks).
torchrun's own exit status is 1 for any non-zero worker; ``zerosim simulate --backend torch``
(:mod:`zerogpu.launch`) recovers ours.

Torch settings (the run file's ``options``, or the options ``--device auto|cpu|cuda[:N]``,
``--dist-backend auto|gloo|nccl``, ``--reduce-scatter auto|native|reduce|all_reduce``, ``--all-gather
auto|native|broadcast``: how those two collectives travel, :mod:`zerogpu.comm`); the run's ``xp`` is
the engine's arrays (torch tensors on the device, or host numpy with only the collectives on the
device). The world size is the number of ranks torchrun started; the run's ``timeout_s`` is the
``init_process_group`` timeout and every collective's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from zerosim.engine.run_file import RankRun
from zerosim.errors import ZeroSimError
from zerosim.files import datafile


def resolve_setup(job: RankRun) -> tuple[Any, str, str]:
    """(validated RunConfig, device, dist backend) of ``job``; ConfigError on bad input.
    Deterministic, so every rank reaches the same verdict without talking to the others."""
    from .program import require_launcher

    require_launcher(job.run.world_size)
    from .comm import resolve_backend, resolve_device  # imports torch: only once we know we are a rank

    job.run.validate()
    device = resolve_device(job.option("device") or "auto")
    return job.run, device, resolve_backend(job.option("dist_backend") or "auto", device)


def simulate_rank(load: Callable[[], RankRun]) -> NoReturn:
    """Run one rank of ``simulate``; ``load()`` returns the run (a ConfigError on bad input: rank 0
    prints it, every rank exits 2)."""
    from .rank import fail_on_bad_input, run_rank

    try:
        job = load()
        cfg, device, backend = resolve_setup(job)
    except ZeroSimError as e:
        fail_on_bad_input(e)

    def body() -> int:
        from zerosim.engine.run_output import render
        from zerosim.engine.run_result import evaluate

        from .comm import init_distributed
        from .program import agree_on_exit, exact_float32_math, gather_observations, rank_program_on_device

        exact_float32_math(device)
        comm = init_distributed(backend, device, cfg.timeout_s, reduce_scatter=job.option("reduce_scatter"),
                                all_gather=job.option("all_gather"))
        run = cfg.resolve()
        observations = gather_observations(comm, rank_program_on_device(comm, run))
        code = None
        if comm.rank == 0:
            assert observations is not None
            if job.save_observations is not None:
                datafile.save(job.save_observations, observations)
            code = render(evaluate(run, observations), job.json_output)
        return agree_on_exit(comm, code)

    run_rank(body)
