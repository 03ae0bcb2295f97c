"""``torchrun --standalone --nproc-per-node N -m zerosim.report.torch_worker CONFIGS_JSON OUT``, or its ranks
started the same way by :func:`zerogpu.launch.run_ranks` (the report does that).

The report's torch.distributed measurement: every rank runs the engine's SPMD program
(:func:`zerosim.engine.spmd.rank_program`, torch arrays) on a gloo
:class:`zerogpu.comm.TorchCommunicator`, once per configuration in ``CONFIGS_JSON`` (a JSON list of
``RunConfig.to_json()`` values, each loaded by ``RunConfig.from_json``); rank 0 collects every
rank's observations and stores ``[[obs per rank] per config]`` in ``OUT`` (:mod:`zerosim.files.datafile`)
for :func:`zerosim.report.measure.run_under_torch`. A failing rank ends the whole job
(:func:`zerogpu.rank.run_rank`).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    from zerogpu.rank import run_rank

    specs, out_path = json.loads(argv[0]), argv[1]

    def body() -> int:
        import torch.distributed as dist

        from zerogpu.comm import init_distributed

        from ..engine.config import RunConfig
        from ..engine.spmd import rank_program

        timeout = float(max((s.get("timeout_s", 60.0) for s in specs), default=60.0))
        comm = init_distributed("gloo", "cpu", timeout_s=timeout)
        collected = []
        for spec in specs:
            observation = rank_program(comm, RunConfig.from_json(spec))
            gathered: list = [None] * comm.world_size
            dist.all_gather_object(gathered, observation)
            collected.append(gathered)
        if comm.rank == 0:
            from ..files import datafile

            datafile.save(out_path, collected)
        dist.barrier()
        return 0

    run_rank(body)


if __name__ == "__main__":
    main(sys.argv[1:])
