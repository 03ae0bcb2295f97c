"""``python -m zerogpu <command>``: the torch.distributed backend's entry points.

Under torchrun (one process per rank)::

    torchrun --nproc-per-node N -m zerogpu simulate --config FILE   (a run file: zerosim.engine.run_file)
    torchrun --nproc-per-node N -m zerogpu simulate [zerosim simulate options] [torch options]
    torchrun --nproc-per-node N -m zerogpu selftest-comm [--device cuda]
    torchrun --nproc-per-node N -m zerogpu equivalence [--strategies all] [--out FILE]

From an ordinary shell (starts torchrun itself)::

    python -m zerogpu report [--world-size N] [--out reports/gpu] [--cpu]   (alias: report-gpu)
    zerosim simulate --backend torch --world-size N [zerosim simulate options]

Exit status (every rank alike): 0 every contract holds, 1 a contract failed, 2 bad input,
3 a rank failed or a collective timed out. torchrun itself turns any non-zero worker into 1.

Options are parsed by :mod:`zerosim.cli` (this module is the command line of the backend); a rank
given ``--config FILE`` parses nothing and loads the run from the file.
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
        from zerosim.engine.run_file import config_path_argument, read_rank_run

        from .simulate import simulate_rank

        path = config_path_argument(rest)
        if path is not None:
            simulate_rank(lambda: read_rank_run(path, "torch"))
        from zerosim.cli.run_options import torch_rank_run, torch_simulate_parser

        from .rank import parse_once

        args = parse_once(torch_simulate_parser(), rest)
        simulate_rank(lambda: torch_rank_run(args))
    elif command == "selftest-comm":
        from zerosim.cli.gpu import selftest_parser

        from .rank import parse_once
        from .selftest import selftest_rank

        selftest_rank(parse_once(selftest_parser(), rest))
    elif command == "equivalence":
        from zerosim.cli.run_options import equivalence_parser, torch_rank_run

        from .equivalence import equivalence_rank
        from .rank import parse_once

        args = parse_once(equivalence_parser(), rest)
        equivalence_rank(args, lambda: torch_rank_run(args))
    elif command in ("report", "report-gpu"):
        from zerosim.cli.gpu import report_parser

        from .gpu_report import report

        sys.exit(report(report_parser().parse_args(rest)))
    elif command in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    print(USAGE, file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
