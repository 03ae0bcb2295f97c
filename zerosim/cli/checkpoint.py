"""``zerosim checkpoint``: inspect a sharded checkpoint, or reshard it offline for another world.

* ``zerosim checkpoint inspect PATH``: what it holds (world size, strategy, partitioner, dtype,
  optimizer and step, sizes per tensor, files) with every file's sha256 verified: exit 0; a file
  missing, truncated or corrupted: exit 1 naming it; no checkpoint at PATH: one line, exit 2.
* ``zerosim checkpoint reshard PATH --world-size M --strategy S [--partitioner P] OUT``: the
  checkpoint as ranks at world size M under S would have saved it, streamed (bounded memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..checkpoint.resharding import inspect_checkpoint, reshard
from ..cost.units import format_bytes
from ..errors import EXIT_CONTRACT_FAILED, EXIT_OK
from ._args import pipe_safe


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
    rs.add_argument("out", metavar="OUT", help="the directory to write (created; must not be PATH)")
    rs.add_argument("--world-size", type=int, required=True, metavar="M", help="the new world size")
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
        return EXIT_OK if ins.ok else EXIT_CONTRACT_FAILED
    ix = ins.index
    print(
        f"checkpoint {args.path}: step {ix.step}, saved at world size {ix.world_size} under {ix.strategy} "
        f"(partitioner {ix.partitioner}, shard group {ix.shard_group_size})"
    )
    print(
        f"  {ix.total_numel:,} parameters, precision {ix.precision}, state dtype {ix.state_dtype}, "
        f"optimizer {ix.optimizer.get('name')}: states {', '.join(ix.states)} "
        f"({format_bytes(data['bytes_per_state'])} each)"
    )
    print(f"  {len(ix.layout.tensors)} tensors:")
    for t in ix.layout.tensors:
        print(f"    {t.name:<40} {str(list(t.shape)):<20} {t.numel:>14,}")
    print(f"  {len(ix.files)} files:")
    for f in data["files"]:
        status = "sha256 ok" if f["verified"] else f"FAILED: {f['problem']}"
        print(
            f"    {f['name']}  rank {f['rank']}  {format_bytes(f['bytes'])}  {f['elements']:,} elements "
            f"in {f['ranges']} range(s)  {status}"
        )
    for name, why in ins.problems.items():
        print(f"error: checkpoint file {name} {why}", file=sys.stderr)
    return EXIT_OK if ins.ok else EXIT_CONTRACT_FAILED


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
        f"wrote {args.out}: world size {ix.world_size}, {ix.strategy}, partitioner {ix.partitioner}, "
        f"{len(ix.files)} files, step {ix.step} ({res.stats.bytes_read:,} bytes read in {dt:.2f}s)"
    )
    return EXIT_OK
