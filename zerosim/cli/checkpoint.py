"""``zerosim checkpoint``: inspect a sharded checkpoint, or reshard it offline for another world.

* ``zerosim checkpoint inspect PATH``: what it holds (world size, strategy, partitioner, dtype,
  optimizer and step, sizes per tensor, files), every file validated as a load validates it. Exit
  0 (``EXIT_OK``): a load would accept every file; 1 (``EXIT_CHECKPOINT_CORRUPT``): the index is
  valid but a file it names is missing, not a regular file, of the wrong size or header, or fails a
  block checksum (each named); 2 (``EXIT_BAD_INPUT``): PATH holds no readable, valid index.
* ``zerosim checkpoint reshard PATH OUT --world-size M --strategy S [--partitioner P]``: the
  checkpoint as ranks at world size M under S would have saved it, streamed (bounded memory). Exit
  0: OUT holds the new checkpoint; 2: bad options, a source a load would refuse, an OUT that holds
  anything (refused before anything is written), or a destination that cannot be written (full,
  read-only): one line, and nothing this run wrote is left in OUT.

``inspect`` prints a note on stderr when the directory holds leftovers of an interrupted write
(``.tmp-*`` temporaries, shard files no index names); it does not delete them. Everything printed
that comes from a file goes through :func:`printable`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..checkpoint.resharding import inspect_checkpoint, reshard
from ..cost.units import format_bytes
from ..errors import EXIT_CHECKPOINT_CORRUPT, EXIT_OK
from ..files.terminal_text import printable
from ._args import pipe_safe


def _note_leftovers(directory: str, names: list[str]) -> None:
    if names:
        shown = ", ".join(printable(n) for n in names[:8]) + (
            f" and {len(names) - 8} more" if len(names) > 8 else ""
        )
        print(
            f"note: {printable(directory)} holds {len(names)} file(s) no index names, left by an "
            f"interrupted or replaced write ({shown}); zerosim does not delete them",
            file=sys.stderr,
        )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect or reshard a sharded checkpoint of the engine's state",
        description="Inspect a sharded checkpoint (checksums verified) or reshard it offline.",
    )
    cmds = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    ins = cmds.add_parser(
        "inspect",
        help="what a checkpoint holds; verifies every file's sha256",
        description="What a checkpoint holds, every file verified against its sha256.",
    )
    ins.add_argument("path", metavar="PATH", help="the checkpoint directory (holds index.json)")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=run_inspect)
    rs = cmds.add_parser(
        "reshard",
        help="rewrite a checkpoint for another world size / strategy / partitioner",
        description="Rewrite a checkpoint as ranks at another world size, strategy and "
        "partitioner would have saved it (streamed: bounded memory).",
    )
    rs.add_argument("path", metavar="PATH", help="the checkpoint directory to read")
    rs.add_argument("out", metavar="OUT",
                    help="the directory to write (created, or an empty one; must not be PATH)")
    rs.add_argument("--world-size", "--world", dest="world_size",
                    type=int, required=True, metavar="M", help="the new world size")
    rs.add_argument(
        "--strategy",
        required=True,
        metavar="S",
        help="no_shard|zero1|zero2|zero3|hybrid_shard:K|hybrid_shard_zero2:K",
    )
    rs.add_argument("--partitioner", default=None, metavar="P", help="default: the checkpoint's own")
    rs.add_argument("--json", action="store_true", help="machine-readable output")
    rs.set_defaults(func=run_reshard)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


@pipe_safe
def run_inspect(args: argparse.Namespace) -> int:
    ins = inspect_checkpoint(args.path)
    data = ins.to_json()
    data["path"] = args.path
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
        _note_leftovers(args.path, ins.leftovers)
        return EXIT_OK if ins.ok else EXIT_CHECKPOINT_CORRUPT
    ix = ins.index
    p = printable
    print(
        f"checkpoint {p(args.path)}: step {ix.step}, saved at world size {ix.world_size} under "
        f"{p(ix.strategy)} (partitioner {p(ix.partitioner)}, shard group {ix.shard_group_size})"
    )
    print(
        f"  {ix.total_numel:,} parameters, precision {p(ix.precision)}, state dtype {ix.state_dtype}, "
        f"optimizer {p(ix.optimizer.get('name'))}: states {', '.join(ix.states)} "
        f"({format_bytes(data['bytes_per_state'])} each)"
    )
    print(f"  {len(ix.layout.tensors)} tensors:")
    for t in ix.layout.tensors:
        print(f"    {p(t.name):<40} {str(list(t.shape)):<20} {t.numel:>14,}")
    print(f"  {len(ix.files)} files:")
    for f in data["files"]:
        status = "sha256 ok" if f["verified"] else f"FAILED: {p(f['problem'])}"
        print(
            f"    {p(f['name'])}  rank {f['rank']}  {format_bytes(f['bytes'])}  {f['elements']:,} elements "
            f"in {f['ranges']} range(s)  {status}"
        )
    for name, why in ins.problems.items():
        print(f"error: checkpoint file {p(name)} {p(why)}", file=sys.stderr)
    _note_leftovers(args.path, ins.leftovers)
    return EXIT_OK if ins.ok else EXIT_CHECKPOINT_CORRUPT


@pipe_safe
def run_reshard(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    res = reshard(args.path, args.world_size, args.strategy, args.partitioner, args.out)
    dt = time.perf_counter() - t0
    ix = res.index
    if args.json:
        json.dump(
            {
                "out": args.out,
                "world_size": ix.world_size,
                "strategy": ix.strategy,
                "partitioner": ix.partitioner,
                "files": [f.name for f in ix.files],
                "seconds": dt,
                "reads": res.stats.to_json(),
            },
            sys.stdout,
            indent=2,
        )
        print()
        return EXIT_OK
    print(
        f"wrote {printable(args.out)}: world size {ix.world_size}, {ix.strategy}, "
        f"partitioner {printable(ix.partitioner)}, "
        f"{len(ix.files)} files, step {ix.step} ({res.stats.bytes_read:,} bytes read in {dt:.2f}s)"
    )
    return EXIT_OK
