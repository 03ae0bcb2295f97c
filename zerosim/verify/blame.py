"""What the one failure line of a ``zerosim verify`` launch says: which rank, and what happened to it.

On a failing rank, :func:`failure_record` writes what that rank knows; after the launch,
:func:`blame_rank` weighs it with what the launcher knows. What is known after a launch that left
no report, from the most to the least telling:

* the failure records the ranks wrote (``failure-rank<R>.json``, :meth:`RankSession.record_failure`):
  a rank that raised names itself and the trainer call it raised in (a trainer that destroyed the
  process group is one of these);
* which ranks ended mid-run without a word: a rank that started (its log exists) but wrote no exit
  status (``$ZEROGPU_STATUS_DIR``), that the launcher did not stop and that no signal killed left on
  its own (``os._exit``, a C library's ``exit``), with the status it exited with
  (:class:`zerogpu.spawn.RankExits`);
* a rank killed by a signal the launcher did not send (:func:`zerogpu.spawn.diagnose_rank_death`);
* the records of ranks that waited for a peer: a collective that timed out, or a connection that the
  peer reset or closed; they name the peer they waited for;
* a ``rank R failed: ...`` line in a rank's log, then the last lines of the first log that has any
  (the launch's own output when no rank wrote a word: a rank that could not even start).

Every line names the folder of the ranks' own output (:mod:`zerosim.processes.rank_logs`). Serves the "a
failing rank ends the run non-zero naming it" rule: the line says what happened, not what it looks
like from the rank that noticed.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerosim.errors import CollectiveError
from zerosim.processes.rank_logs import failure_lines, log_tail, rank_log_path

_KIND_ORDER = {"raised": 0, "hang": 1, "peer": 2}


@dataclass(frozen=True)
class RankBlame:
    """The rank to blame (-1: none could be named) and what happened to it, in one line."""

    rank: int
    message: str


def left_mid_run(result: Any, world: int, log_dir: Path) -> dict[int, int]:
    """rank -> exit status of every rank that started and ended on its own before the run did (see the
    module docstring); empty when the launch timed out or every rank wrote its status."""
    if result.timed_out or result.launcher_returncode is None:
        return {}
    ended = result.exits.status()
    out: dict[int, int] = {}
    for rank in range(world):
        if rank in result.rank_status or not rank_log_path(log_dir, rank).exists():
            continue
        if rank in result.exits.stopped or rank not in ended:
            continue
        if ended[rank] >= 0:
            out[rank] = ended[rank]
    return out


def _where(record: dict[str, Any] | None, rank: int) -> str:
    last = (record or {}).get("last_in", {}).get(str(rank))
    return f" (it was last in {last})" if last else ""


def blame_rank(result: Any, world: int, log_dir: Path, records: list[dict[str, Any]],
                 launch_s: float) -> RankBlame:
    """The rank to blame for a launch that ended without a report (see the module docstring)."""
    from zerogpu.spawn import SUMMARY_HEADING, diagnose_rank_death

    logs = f"rank output: {log_dir}"
    if result.timed_out:
        return RankBlame(-1, f"the run did not finish within {launch_s:g}s; killed every rank ({logs})")
    records = sorted(records, key=lambda r: (_KIND_ORDER.get(str(r.get("kind")), 3), r.get("time", 0.0)))
    raised = [r for r in records if r.get("kind") == "raised"]
    if raised:
        return RankBlame(int(raised[0]["rank"]), f"{raised[0]['message']} ({logs})")
    witness = records[0] if records else None
    saw = f"; rank {witness['reporter']} then saw: {witness['saw']}" if witness and "saw" in witness else ""
    early = left_mid_run(result, world, log_dir)
    if early:
        rank, status = next(iter(early.items()))
        others = [r for r in early if r != rank]
        also = f" (so did rank {', '.join(map(str, others))})" if others else ""
        return RankBlame(rank, f"exited with status {status} mid-run without a message{_where(witness, rank)}"
                             f"{also}{saw} ({logs})")
    death = diagnose_rank_death(result.exits, said_why=bool(records))
    if death is not None and "killed by" in death:
        rank_text, _, how = death.partition(" failed: ")
        rank = int(rank_text.split()[1]) if rank_text.split()[1].isdigit() else -1
        return RankBlame(rank, f"{how}{_where(witness, rank)}{saw} ({logs})")
    if witness is not None:
        return RankBlame(int(witness["rank"]), f"{witness['message']} ({logs})")
    for rank in range(world):
        for line in failure_lines(rank_log_path(log_dir, rank)):
            rank_text = line.split()[1]
            return RankBlame(int(rank_text) if rank_text.isdigit() else -1,
                           f"{line.split(' failed: ', 1)[1]} ({logs})")
    tails = [(r, log_tail(rank_log_path(log_dir, r))) for r in range(world)]
    said = [(r, t) for r, t in tails if t]
    before_summary = (result.stderr or "").split(SUMMARY_HEADING)[0]  # what ranks wrote before their logs
    launcher = [ln for ln in before_summary.splitlines() if ln.strip()][-3:]
    tail = " | ".join(said[0][1] if said else launcher) or "no output"
    where = f"rank {said[0][0]}'s output ends: " if said else ("the launch's output ends: " * bool(launcher))
    return RankBlame(-1, f"the ranks ended with status {result.returncode} without a report "
                       f"({where}{tail}; {logs})")


# ---- on a failing rank: the record it leaves ---------------------------------------------------------------


def failure_record(error: BaseException, rank: int, where: str, arrivals: Any) -> dict[str, Any]:
    """What rank ``rank``, failing with ``error`` during the trainer call ``where``, writes to
    ``failure-rank<R>.json``: the rank to blame (``rank``), ``kind`` (``raised``: this rank's own error,
    a destroyed process group included; ``hang``: a collective timed out; ``peer``: a peer closed or
    reset its connection), the ``message``, what this rank ``saw`` and where each rank was last
    (``last_in``, from the :class:`zerosim.verify.arrival.ArrivalCounter` ``arrivals``)."""
    last_in: dict[str, str] = {}
    if _process_group_gone():
        culprit, kind = rank, "raised"
        message = (f"the trainer destroyed the process group (torch.distributed is no longer initialized) "
                   f"before the run ended; the next collective, during {where}, failed with "
                   f"{_one_line(error)}")
    elif isinstance(error, (CollectiveError, RuntimeError)) and _looks_like_peer_problem(error):
        hang = _is_timeout(error)
        found, detail = arrivals.laggard(failure="timed out in" if hang else "lost")
        kind = "hang" if hang else "peer"
        culprit = rank if found is None else found
        detail = "" if found is None else detail
        last_in = arrivals.last_places()
        what = "hung or failed" if hang else "dropped its connection"
        message = f"{what} while rank {rank} waited ({detail}); rank {rank} saw: {_one_line(error)}"
    else:
        culprit, kind = rank, "raised"
        message = f"{_one_line(error)} (during {where})"
        frames = traceback.extract_tb(error.__traceback__)
        if frames:
            message += f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}"
    return {"rank": culprit, "reporter": rank, "kind": kind, "message": message,
            "saw": f"{_peer_symptom(error)} during {where}", "last_in": last_in, "time": time.time()}


def _looks_like_peer_problem(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, CollectiveError) or any(
        s in text for s in ("timed out", "timeout", "connection closed", "connection reset", "peer")
    )


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _peer_symptom(error: BaseException) -> str:
    """What a failed collective says happened, in the words a user searches for."""
    text = str(error).lower()
    for symptom in ("connection reset by peer", "connection closed by peer", "broken pipe"):
        if symptom in text:
            return symptom
    if _is_timeout(error):
        return "a collective timed out"
    return _one_line(error)


def _process_group_gone() -> bool:
    """torch.distributed's default process group no longer exists (a trainer destroyed it)."""
    import torch.distributed as dist

    return dist.is_available() and not dist.is_initialized()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 400:
        text = text[:400] + "..."
    return f"{type(error).__name__}: {text}"
