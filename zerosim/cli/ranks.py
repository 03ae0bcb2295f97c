"""The command line of ranks a user starts by hand: ``python -m zerosim.cli.ranks COMMAND [options]``.

A rank entry point (``python -m zerogpu``, ``python -m zerosim.mpi``, ``python -m zerosim.verify``,
``python -m zerosim.bench.peers_rank``) takes one argument, ``--run FILE``: the run value its
launcher wrote. Given options instead (``torchrun ... -m zerogpu simulate --model tiny``, as the
documented hand-started commands do), it parses nothing: it replaces itself with this module
(:func:`zerosim.engine.run_file.rank_run_path`, same process, same environment), which parses the
options once, builds the same frozen run value a launcher writes and runs the rank on it. Usage
errors and bad values: rank 0 prints one line, every rank exits 2.

COMMAND is ``zerogpu-simulate``, ``zerogpu-equivalence``, ``zerogpu-selftest-comm``,
``zerogpu-report`` (a launcher, not a rank: ``python -m zerogpu report``), ``mpi-simulate``,
``verify`` or ``peers``. Serves C-ZERO-001..005 only by starting the runs that check them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from ..errors import EXIT_BAD_INPUT, ConfigError


def _zerogpu_simulate(argv: list[str]) -> NoReturn:
    from zerogpu.rank import parse_once
    from zerogpu.simulate import simulate_rank

    from .run_options import torch_rank_run, torch_simulate_parser

    args = parse_once(torch_simulate_parser(), argv)
    simulate_rank(lambda: torch_rank_run(args))  # a bad value: rank 0 prints one line, every rank exits 2


def _zerogpu_equivalence(argv: list[str]) -> NoReturn:
    from zerogpu.equivalence import equivalence_rank
    from zerogpu.rank import parse_once

    from .run_options import equivalence_parser, torch_rank_run

    args = parse_once(equivalence_parser(), argv)
    equivalence_rank(args, lambda: torch_rank_run(args))


def _zerogpu_selftest(argv: list[str]) -> None:  # run_rank ends the process
    from zerogpu.rank import parse_once
    from zerogpu.selftest import selftest_rank

    from .gpu import selftest_parser

    selftest_rank(parse_once(selftest_parser(), argv))


def _zerogpu_report(argv: list[str]) -> NoReturn:
    from zerogpu.gpu_report import report

    from .gpu import report_parser

    sys.exit(report(report_parser().parse_args(argv)))


def _mpi_simulate(argv: list[str]) -> NoReturn:
    from mpi4py import MPI

    from ..mpi.simulate import simulate_rank
    from ..processes.rank_messages import parse_args_on_rank
    from .run_options import mpi_rank_run, mpi_simulate_parser

    try:
        args = parse_args_on_rank(mpi_simulate_parser(), argv, MPI.COMM_WORLD.Get_rank())
    except SystemExit as e:  # the same on every rank: nothing started, nobody waits
        sys.exit(e.code)
    simulate_rank(lambda size: mpi_rank_run(args, size))


def _verify(argv: list[str]) -> NoReturn:
    from zerogpu.rank import env_rank

    from ..processes.rank_logs import send_output_to_rank_log
    from ..verify.runner import rank_main
    from .rank_commands import verify_rank_run

    send_output_to_rank_log(env_rank())  # this rank's own output (and its children's) goes to its log file
    rank_main(verify_rank_run(argv))


def _peers(argv: list[str]) -> NoReturn:
    from zerogpu.rank import parse_once

    from ..bench.peers_rank import main as peers_main
    from .rank_commands import peers_rank_parser, peers_rank_run

    options = parse_once(peers_rank_parser(), argv)
    peers_main(lambda: peers_rank_run(options))


#: COMMAND -> the function that parses its options and runs it
COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "zerogpu-simulate": _zerogpu_simulate, "zerogpu-equivalence": _zerogpu_equivalence,
    "zerogpu-selftest-comm": _zerogpu_selftest, "zerogpu-report": _zerogpu_report,
    "mpi-simulate": _mpi_simulate, "verify": _verify, "peers": _peers,
}


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the rank COMMAND names on its options (a hand-started rank; see the module's text)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command is None:
        problem = ConfigError("command", argv[0] if argv else None, f"not a rank command; known: "
                              f"{', '.join(COMMANDS)}")
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    command(argv[1:])
    sys.exit(0)  # every rank command ends its process itself


if __name__ == "__main__":
    main()
