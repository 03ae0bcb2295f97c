"""``torchrun --nproc-per-node N -m zerosim.verify TARGET [options]``: one rank of ``zerosim verify``."""

from __future__ import annotations

import sys

from .runner import rank_main

if __name__ == "__main__":
    rank_main(sys.argv[1:])
