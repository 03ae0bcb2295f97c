"""``torchrun --nproc-per-node N -m zerosim.verify TARGET [options]``: one rank of ``zerosim verify``.

``zerosim verify`` starts its ranks with ``--run-file FILE`` (the :class:`~zerosim.verify.run_value.VerifyRun`
it validated, as JSON); ranks a user starts give TARGET and options, parsed by
:func:`zerosim.cli.rank_commands.verify_rank_run` into the same value. The rank itself is
:func:`zerosim.verify.runner.rank_main`.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from zerogpu.rank import env_rank
    from zerosim.cli.rank_commands import verify_rank_run
    from zerosim.rank_logs import send_output_to_rank_log

    from .runner import rank_main

    send_output_to_rank_log(env_rank())  # this rank's own output (and its children's) goes to its log file
    rank_main(verify_rank_run(sys.argv[1:]))
