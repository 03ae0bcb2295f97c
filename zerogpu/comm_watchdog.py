"""Bounded waits for one torch.distributed group: a collective whose peers never arrive ends the run.

Every collective the TorchCommunicator issues goes through :class:`GroupWatch`:

- ``init_process_group(timeout=timeout_s)``: gloo applies it to every operation of the group
  (its own I/O timeout); NCCL's watchdog applies it to every collective.
- Every collective is issued with ``async_op=True`` and waited with ``work.wait(timeout)``. On
  gloo that raises after ``timeout_s``; on NCCL it raises only with ``TORCH_NCCL_BLOCKING_WAIT=1``
  (which :func:`zerogpu.comm.init_distributed` sets unless the caller chose otherwise); otherwise
  NCCL's watchdog aborts the process after the process-group timeout and torchrun ends the job.
- On a timeout the rank reads its peers' progress from the job's store (:mod:`zerogpu.progress`)
  and raises :class:`~zerosim.errors.CollectiveTimeout` naming the ranks that never arrived. A peer
  that died makes gloo fail at once ("connection closed by peer"): that raises
  :class:`~zerosim.errors.CollectiveError` naming the failed peers. Either way the process group is
  unusable afterwards; the caller must end the job (:mod:`zerogpu.rank` does).

Each entry also ticks the test-only fault counter (``ZEROSIM_FAULT``) and counts the group's calls,
which name default split groups as the simulator does.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from zerosim.errors import CollectiveError, CollectiveTimeout
from zerosim.numerics.xp import divide_

from .comm_setup import Job

#: one backend call of a collective made of several: ``(fn, args, kwargs)``
Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


class UnsupportedCollective(CollectiveError):
    """The backend has no such operation (raised before any data moved)."""


def unsupported(e: BaseException) -> bool:
    """Did the backend refuse the operation itself (rather than fail while running it)?"""
    text = str(e).lower()
    return isinstance(e, NotImplementedError) or "not supported" in text or "does not support" in text \
        or "unsupported" in text


class GroupWatch:
    """Issues one group's collectives, waits for each at most ``timeout_s``, and turns a backend error
    into a CollectiveTimeout or CollectiveError naming the peers (the "distributed runs never hang;
    a failing rank ends the run naming it" rule)."""

    def __init__(self, job: Job, pg: Any, group_name: str, global_rank: int,
                 global_ranks: tuple[int, ...], timeout_s: float):
        self.job, self.pg, self.group_name = job, pg, group_name
        self.global_rank, self.global_ranks = global_rank, global_ranks
        self.timeout_s = float(timeout_s)
        self.timeout = timedelta(seconds=self.timeout_s)
        self.board_key = job.board.board_key(group_name, global_ranks)
        self.calls = 0  # collectives entered on this group

    def enter(self, collective: str) -> int:
        """Fault hook (tests), call count, progress board; returns this call's index on the group."""
        self.job.fault.tick(collective, self.group_name)
        call = self.calls
        self.calls += 1
        self.job.board.enter(self.board_key, collective, call)
        return call

    def leave(self) -> None:
        self.job.board.leave()

    def local(self, collective: str) -> int:
        """A collective over one rank: counted and ticked like any other, nothing moves."""
        call = self.enter(collective)
        self.leave()
        return call

    def issue(self, collective: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, group=..., async_op=True)`` and wait at most ``timeout_s`` for it."""
        call = self.enter(collective)
        try:
            work = fn(*args, group=self.pg, async_op=True, **kwargs)
            if work is not None:
                work.wait(timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
            if unsupported(e):  # refused before anything moved (the same on every rank): not a call
                self.calls -= 1
                raise UnsupportedCollective(f"{collective} on group {self.group_name}: {e}") from e
            raise self.error(collective, call, e) from e
        finally:
            self.leave()

    def issue_each(self, collective: str, calls: list[Call]) -> None:
        """One collective made of several backend calls: start every ``fn(*args, group=...,
        async_op=True, **kwargs)`` of ``calls``, then wait for all of them within one ``timeout_s``."""
        call = self.enter(collective)
        try:
            works = [fn(*args, group=self.pg, async_op=True, **kwargs) for fn, args, kwargs in calls]
            deadline = time.monotonic() + self.timeout_s
            for work in works:
                if work is not None:
                    work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
            raise self.error(collective, call, e) from e
        finally:
            self.leave()

    def start(self, collective: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        """Start ``fn(*args, group=..., async_op=True)`` without waiting: ``(work, call)`` for
        :class:`PendingCollective`."""
        call = self.enter(collective)
        try:
            return fn(*args, group=self.pg, async_op=True, **kwargs), call
        except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
            raise self.error(collective, call, e) from e
        finally:
            self.leave()

    def error(self, collective: str, call: int, e: Exception) -> CollectiveError:
        """A backend error as CollectiveTimeout (the peers that never arrived) or CollectiveError."""
        if isinstance(e, CollectiveError):
            return e
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        missing, notes = self.job.board.survey(self.board_key, call, self.global_ranks)
        detail = "; ".join(f"rank {m}: {notes[m]}" for m in missing if m in notes)
        # "timed out" (the wait's own), or gloo's "Application timeout caused pair closure" (a pair closed
        # by a timeout, which under load can fire before the wait's)
        timed_out = any(word in str(e).lower() for word in ("timed out", "timeout")) \
            or "timeout" in type(e).__name__.lower()
        if timed_out:
            err = CollectiveTimeout(collective, missing, self.timeout_s, self.group_name)
            err.args = (f"{err} ({detail})" if detail else str(err),)
            return err
        failed = [m for m in missing if notes.get(m) == "failed"]
        who = f"; failed peers: {failed}" if failed else (f"; peers: {detail}" if detail else "")
        return CollectiveError(f"{collective} on group {self.group_name}: {self.job.backend} error on rank "
                               f"{self.global_rank}: {text}{who}")


class PendingAllReduce:
    """An all-reduce started by :meth:`zerogpu.comm.TorchCommunicator.all_reduce_start`; :meth:`wait`
    completes it within the group's timeout."""

    def __init__(self, watch: GroupWatch, tensor: torch.Tensor, op: str, work: Any, call: int,
                 world_size: int):
        self._watch, self._tensor, self._op, self._work, self._call = watch, tensor, op, work, call
        self._world_size = world_size
        self._done = False

    def wait(self) -> torch.Tensor:
        """Wait at most the group's timeout (CollectiveTimeout naming the ranks that never arrived);
        returns the reduced tensor (the one given to ``all_reduce_start``)."""
        if not self._done:
            try:
                if self._work is not None:
                    self._work.wait(timeout=self._watch.timeout)
            except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
                raise self._watch.error("all_reduce", self._call, e) from e
            if self._op == "avg" and self._world_size > 1:
                divide_(self._tensor, self._world_size)
            self._done = True
        return self._tensor
