"""``torchrun --nproc-per-node N -m zerosim.verify TARGET [options]``: one rank of ``zerosim verify``.

The options are parsed by :func:`zerosim.cli.rank_commands.verify_rank_parser` (rank 0 prints usage
errors); the rank itself is :func:`zerosim.verify.runner.rank_main`.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from zerogpu.rank import env_rank, parse_once
    from zerosim.cli.rank_commands import verify_rank_parser
    from zerosim.rank_logs import send_output_to_rank_log

    from .runner import rank_main

    send_output_to_rank_log(env_rank())  # this rank's own output (and its children's) goes to its log file
    rank_main(parse_once(verify_rank_parser(), sys.argv[1:]))
