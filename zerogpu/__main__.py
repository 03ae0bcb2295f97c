"""``python -m zerogpu <command>``: the torch.distributed backend's entry points.

Under torchrun (one process per rank)::

    torchrun --nproc-per-node N -m zerogpu simulate --run FILE   (a run file: zerosim.engine.run_file)
    torchrun --nproc-per-node N -m zerogpu simulate [zerosim simulate options] [torch options]
    torchrun --nproc-per-node N -m zerogpu selftest-comm [--device cuda]
    torchrun --nproc-per-node N -m zerogpu equivalence [--strategies all] [--out FILE]

From an ordinary shell (starts torchrun itself)::

    python -m zerogpu report [--world-size N] [--out reports/gpu] [--cpu]   (alias: report-gpu)
    zerosim simulate --backend torch --world-size N [zerosim simulate options]

Exit status (every rank alike): 0 every contract holds, 1 a contract failed, 2 bad input,
3 a rank failed or a collective timed out. torchrun itself turns any non-zero worker into 1.

A rank given ``--run FILE`` (or ``--config FILE``) loads the run from the file. Given options, this
module parses nothing: the process becomes ``python -m zerosim.cli.ranks zerogpu-COMMAND [options]``
(:func:`zerosim.engine.run_file.rank_run_path`), the command line, which parses them once and runs the
same rank (``report`` is a launcher and always goes there).
"""

from __future__ import annotations

import sys
from typing import NoReturn

from zerosim.errors import EXIT_BAD_INPUT

USAGE = ("usage: torchrun --nproc-per-node N -m zerogpu {simulate,selftest-comm,equivalence} [options]\n"
         "       python -m zerogpu report [options]")


def main(argv: list[str] | None = None) -> NoReturn:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "simulate":
        from zerosim.engine.run_file import rank_run_path

        path = rank_run_path(rest, "zerogpu-simulate")
        from zerosim.engine.run_file import read_rank_run

        from .simulate import simulate_rank

        simulate_rank(lambda: read_rank_run(path, "torch"))
    elif command in ("selftest-comm", "equivalence", "report", "report-gpu"):
        from zerosim.engine.run_file import hand_to_command_line

        hand_to_command_line("zerogpu-" + command.removesuffix("-gpu"), rest)
    elif command in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    print(USAGE, file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
