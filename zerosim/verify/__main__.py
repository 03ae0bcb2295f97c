"""``torchrun --nproc-per-node N -m zerosim.verify --run FILE``: one rank of ``zerosim verify``.

The rank takes one argument, the :class:`~zerosim.verify.run_value.VerifyRun` its launcher wrote
(``zerosim verify`` writes it and starts its ranks with ``--run-file FILE``, the same argument). Ranks a
user starts with TARGET and options (``torchrun ... -m zerosim.verify gpt --steps 3``) hand them to the
command line (:mod:`zerosim.cli.ranks`), which builds the same value. The rank itself is
:func:`zerosim.verify.runner.rank_main` (C-ZERO-001..005 judged on rank 0).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from zerosim.engine.run_file import rank_run_path

    path = rank_run_path(sys.argv[1:], "verify")

    from zerogpu.rank import env_rank, fail_on_bad_input
    from zerosim.errors import ZeroSimError
    from zerosim.processes.rank_logs import send_output_to_rank_log

    from .run_value import read_verify_run
    from .runner import rank_main

    send_output_to_rank_log(env_rank())  # this rank's own output (and its children's) goes to its log file
    try:
        run = read_verify_run(path)
    except ZeroSimError as e:
        fail_on_bad_input(e)
    rank_main(run)
