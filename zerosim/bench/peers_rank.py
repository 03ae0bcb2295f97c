"""One rank of ``zerosim bench peers``: every adapter on every model, steps timed, rank 0 collects.

``zerosim bench peers`` starts this program itself (``torchrun --standalone -m zerosim.bench.peers_rank
--config FILE``: FILE holds the launch's settings as one value, :class:`zerosim.bench.peers_run.PeersRun`,
loaded and checked on every rank; rank 0 appends one JSON line per measured adapter to the value's
``results`` file and the launcher builds the report). Under an external launcher the same program,
given options instead of the file, hands them to the command line (``python -m zerosim.cli.ranks
peers``, the same process), which builds the same value; it runs the whole benchmark and rank 0
writes ``bench_peers.json`` and ``bench_peers.md`` under ``--out`` and prints the table::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m zerosim.bench.peers_rank --models gpt,gpt-50m --adapters ddp,fsdp2,zerogpu-3 --out reports

Add ``--device cuda`` on GPU nodes (NCCL, ``cuda:<LOCAL_RANK>``). There, an adapter that fails ends
the whole job (exit 3, ``rank R failed: ...``) instead of being recorded and skipped.

For each model the seeded weights are built once per rank. The adapters run ``--rounds`` times, the
list forwards then backwards (:func:`zerosim.bench.peers_method.sequence`); each time a fresh copy of the
weights goes to ``make_trainer(model, optim)``. Each step: a barrier, then
``trainer.step(inputs, targets)`` timed alone on this rank's micro-batch of that step (the same
batches for every adapter; on CUDA between two device synchronisations). ``--warmup`` steps are
discarded, then ``--steps`` are timed, then more until they add up to about ``--min-time`` seconds
(the ranks agree on the count: :func:`zerosim.bench.peers_method.timed_steps`). After each run of an adapter
rank 0 gathers every rank's times; a step's time is the slowest rank's. A watchdog ends the rank (exit 3,
one line) when a trainer's construction or a step outlives ``--timeout``; collectives are bounded by
the same timeout (the process group's). Exit status: 0 done, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from zerosim.errors import EXIT_RUN_FAILED, ConfigError, ZeroSimError

from . import peers, peers_method, peers_report
from .peers_run import PeersRun, read_peers_run


class CallTimeout(ZeroSimError):
    """A trainer call (construction or step) did not return within the time allowed."""


class CallWatchdog:
    """Ends this rank when the call inside :meth:`limit` outlives ``timeout_s``: prints the failure line
    once for the job (:func:`zerogpu.rank.report_failure`), records exit 3, leaves at once."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._what: str | None = None
        self._deadline: float | None = None
        threading.Thread(target=self._watch, name="zerosim-bench-watchdog", daemon=True).start()

    @contextmanager
    def limit(self, what: str) -> Iterator[None]:
        with self._cond:
            self._what, self._deadline = what, time.monotonic() + self.timeout_s
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._what, self._deadline = None, None
                self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self._expire(self._what or "a trainer call")

    def _expire(self, what: str) -> NoReturn:
        from zerogpu.rank import record_status, report_failure

        report_failure(CallTimeout(f"{what} did not finish within {self.timeout_s:g}s"))
        record_status(EXIT_RUN_FAILED)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(EXIT_RUN_FAILED)


def main(load: Callable[[], PeersRun]) -> NoReturn:
    """One rank of the benchmark: ``load()`` gives its settings
    (:func:`zerosim.bench.peers_run.read_peers_run` for ``--run FILE``; the command line's
    ``zerosim.cli.ranks peers`` builds the same value from options); bad input: one line, every rank
    exits 2."""
    from zerogpu.rank import fail_on_bad_input, run_rank

    try:
        if not os.environ.get("WORLD_SIZE"):
            raise ConfigError("launcher", "no WORLD_SIZE", "run under torchrun (torchrun --nproc-per-node N "
                              "-m zerosim.bench.peers_rank ...), or use zerosim bench peers")
        run = load()
    except ZeroSimError as e:
        fail_on_bad_input(e)
    run_rank(lambda: _body(run))


def _body(args: PeersRun) -> int:
    import torch

    from zerogpu.comm import init_distributed
    from zerogpu.program import agree_on_exit

    started = time.monotonic()
    load_before = peers.load_average()
    device = "cpu" if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    comm = init_distributed("gloo" if device == "cpu" else "nccl", device, args.timeout_s)
    watchdog = CallWatchdog(args.timeout_s)
    meta = {"kind": "meta", "machine": peers_method.environment(args.device), "world": comm.world_size,
            "backend": "gloo" if device == "cpu" else "nccl"}
    if comm.rank == 0:
        _emit(args, meta)
    rows: list[dict[str, Any]] = []

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    skip = set(args.skip)
    order = peers_method.sequence(list(args.adapters), args.rounds)
    for model_name in args.models:
        base = _build_base(model_name, args)
        for position, (round_index, adapter) in enumerate(order):
            if position < args.from_position or adapter in skip:
                continue
            row = _measure(comm, watchdog, base, model_name, adapter, device, args, sync)
            if comm.rank == 0:
                assert row is not None
                row.update(round=round_index, position=position)
                rows.append(row)
                _emit(args, row)
        del base
        gc.collect()
    if comm.rank == 0 and args.results is None:
        report = peers_report.build_report(rows, models=list(args.models), adapters=list(args.adapters),
                                           meta=meta, settings=args.settings(comm.world_size))
        report["wall_s"] = round(time.monotonic() - started, 1)
        report["load_average"] = {"before": load_before, "after": peers.load_average()}
        json_path, md_path = peers_report.write_report(report, None if args.out is None else Path(args.out))
        peers_report.print_report(report)
        print(f"wrote {json_path} and {md_path}", flush=True)
    return agree_on_exit(comm, 0)


def _build_base(model_name: str, args: PeersRun) -> Any:
    from zerosim.verify.model import build_model

    return build_model(model_name, args.dtype, args.seed)


def _measure(comm: Any, watchdog: CallWatchdog, base: Any, model_name: str, adapter: str, device: str,
             args: PeersRun, sync: Any) -> dict[str, Any] | None:
    """One adapter on one model; rank 0 returns its result row (None elsewhere). Raises on any failure."""
    from zerosim.verify.model import micro_batch
    from zerosim.verify.protocol import close_trainer
    from zerosim.verify.targets import resolve_factory

    factory = resolve_factory(adapter)
    model = copy.deepcopy(base).to(device)
    comm.barrier()
    with watchdog.limit(f"{adapter} on {model_name}: make_trainer"):
        t0 = time.perf_counter()
        trainer = factory(model, peers_method.optim_config(args.optimizer))
        sync()
        init_s = time.perf_counter() - t0
    declared = getattr(trainer, "declared_strategy", None)
    samples: list[float] = []
    warmup: list[float] = []
    loss = math.nan
    total, i = args.warmup + args.steps, 0
    while i < total:
        inputs, targets = (t.to(device) for t in micro_batch(comm.rank, i + 1, args.seed, model_name))
        sync()
        comm.barrier()
        with watchdog.limit(f"{adapter} on {model_name}: step {i + 1}"):
            t0 = time.perf_counter()
            loss = trainer.step(inputs, targets)
            sync()
            dt = time.perf_counter() - t0
        (warmup if i < args.warmup else samples).append(dt)
        i += 1
        if i == args.warmup + args.steps:
            total = args.warmup + _agreed_steps(comm, args, samples)
    mine = {"samples": samples, "warmup": warmup, "init_s": init_s,
            "loss": float(loss) if math.isfinite(float(loss)) else None,
            "declared": declared if isinstance(declared, str) else None}
    gathered = comm.gather_object(mine, root=0)
    with watchdog.limit(f"{adapter} on {model_name}: close"):
        close_trainer(trainer)
    del trainer, model
    gc.collect()
    if comm.rank != 0:
        return None
    assert gathered is not None
    stage, source = peers_method.stage_of(adapter, mine["declared"])
    return {
        "kind": "result",
        "model": model_name,
        "adapter": adapter,
        "status": "ok",
        "stage": stage,
        "stage_source": source,
        "declared_strategy": mine["declared"],
        "samples": [max(g["samples"][k] for g in gathered) for k in range(len(samples))],
        "warmup_samples": [max(g["warmup"][k] for g in gathered) for k in range(args.warmup)],
        "rank_samples": [g["samples"] for g in gathered],
        "init_s": max(g["init_s"] for g in gathered),
        "loss_last": [g["loss"] for g in gathered],
    }


def _agreed_steps(comm: Any, args: PeersRun, samples: list[float]) -> int:
    """The number of timed steps every rank runs: the largest any rank wants (outside the timing)."""
    import torch

    wanted = peers_method.timed_steps(args.steps, args.min_time_s, samples)
    if args.min_time_s <= 0:
        return wanted
    agreed = comm.all_reduce(torch.tensor([float(wanted)], dtype=torch.float64), "max")
    return int(agreed[0])


def _emit(args: PeersRun, record: dict[str, Any]) -> None:
    """Rank 0: one JSON line appended to ``results`` (the launcher reads it even if the job dies later)."""
    if args.results is None:
        return
    with open(args.results, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    from zerosim.engine.run_file import rank_run_path

    run_file = rank_run_path(sys.argv[1:], "peers")  # options: handed to zerosim.cli.ranks
    main(lambda: read_peers_run(run_file))
