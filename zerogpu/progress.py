"""Who never arrived? Each rank's collective progress, published to the job's key-value store.

torch.distributed can tell a rank that its collective timed out, not which peers are missing. So
every process keeps a :class:`ProgressBoard`: the data path only bumps integers (calls entered per
group, the collective it is in); a daemon thread copies that state into the job's store
(``TCPStore``, owned by the torchrun agent) at most every ``poll_s`` seconds, and only when it
changed. When a collective times out or fails, the rank reads its peers' entries
(:meth:`ProgressBoard.survey`) and names the ranks that never entered that call, with what each
was doing instead. The store is also where failing ranks agree who prints the error
(:meth:`ProgressBoard.claim_report`): the first to claim prints, the others stay quiet.

The publishing thread is stopped and joined before the interpreter finalizes (an ``atexit`` hook, or
:meth:`ProgressBoard.stop` earlier). A daemon thread still inside a store call when the interpreter
finalizes is ended by CPython (``pthread_exit``) as it takes the GIL back inside the store binding,
and that unwinding through the binding's C++ frames calls ``std::terminate``: the process aborts
(``terminate called without an active exception``, SIGABRT) after the program succeeded.

Serves the "a rank that never arrives raises CollectiveTimeout naming it" clause of the
Communicator contract (:mod:`zerosim.comm.base`) and the "a failing rank ends the run, reported
once" rule.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

_PREFIX = "zerogpu/progress/"
_FAILURES = "zerogpu/failures"
#: how long stopping waits for the thread's store call in flight (milliseconds on a live store; a store
#: that has not answered in this long is gone, and the process is leaving without it)
STOP_WAIT_S = 5.0
_RUNNING: weakref.WeakSet[ProgressBoard] = weakref.WeakSet()  # boards whose thread may be publishing


class ProgressBoard:
    """One process's collective progress. ``store`` is a ``torch.distributed.Store`` (or None: no survey).

    Groups are keyed by a ``board_key`` that every member of a group computes identically (name,
    members and how many same-named groups of those members came before), so two runs in one job
    that reuse a group name do not mix their counts.
    """

    def __init__(self, store: Any, rank: int, poll_s: float = 0.1, start_thread: bool = True):
        self.store = store
        self.rank = rank
        self.poll_s = poll_s
        self.entered: dict[str, int] = {}  # board key -> collectives entered on that group
        self.current: tuple[str, str, int] | None = None  # (board key, collective, call index) while inside
        self.failed = False
        self._version = 0
        self._published = -1
        self._generations: dict[tuple[str, tuple[int, ...]], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None and start_thread:
            self._thread = threading.Thread(target=self._run, name="zerogpu-progress", daemon=True)
            self._thread.start()
            _RUNNING.add(self)

    # -- the data path: integers only -------------------------------------------------------------
    def board_key(self, name: str, members: tuple[int, ...]) -> str:
        """A key for a new group, the same on every member (they create the same groups in order)."""
        gen = self._generations.get((name, members), 0)
        self._generations[(name, members)] = gen + 1
        return f"{name}@{','.join(map(str, members))}#{gen}"

    def enter(self, key: str, collective: str, call: int) -> None:
        self.entered[key] = call + 1
        self.current = (key, collective, call)
        self._version += 1

    def leave(self) -> None:
        self.current = None
        self._version += 1

    # -- publishing -------------------------------------------------------------------------------
    def _state(self) -> str:
        return json.dumps({"entered": self.entered, "current": self.current, "failed": self.failed,
                           "t": time.time()})

    def publish(self) -> None:
        if self.store is None:
            return
        with self._lock:
            version = self._version
            if version == self._published:
                return
            self.store.set(f"{_PREFIX}{self.rank}", self._state())
            self._published = version

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store is gone (job ending): nothing left to tell
                return

    def stop(self) -> None:
        """Stop publishing and wait (at most :data:`STOP_WAIT_S`) for the thread's store call in flight,
        so that no thread is inside the store binding when the interpreter finalizes."""
        self._stop.set()
        _RUNNING.discard(self)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT_S)

    @property
    def publishing(self) -> bool:
        """Is the publishing thread still running?"""
        return self._thread is not None and self._thread.is_alive()

    # -- the error path ---------------------------------------------------------------------------
    def peer_state(self, rank: int) -> dict[str, Any] | None:
        """What ``rank`` last published, or None when it never published (or the store is unreachable)."""
        if self.store is None:
            return None
        key = f"{_PREFIX}{rank}"
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001 - diagnostics must not raise
            return None

    def survey(self, key: str, call: int, members: tuple[int, ...], grace_s: float | None = None,
               ) -> tuple[list[int], dict[int, str]]:
        """(members that never entered call ``call`` of group ``key``, a note per such member).

        Waits ``grace_s`` (default two publishing periods) first, so the peers' latest state is in."""
        self._version += 1
        try:
            self.publish()
        except Exception:  # noqa: BLE001
            pass
        time.sleep(2.5 * self.poll_s if grace_s is None else grace_s)
        missing: list[int] = []
        notes: dict[int, str] = {}
        for m in members:
            if m == self.rank:
                continue
            state = self.peer_state(m)
            if state is None:
                missing.append(m)
                notes[m] = "never reported progress (not started, or the job's store is unreachable)"
                continue
            if int(state["entered"].get(key, 0)) > call:
                continue
            missing.append(m)
            cur = state.get("current")
            if state.get("failed"):
                notes[m] = "failed"
            elif cur is None:
                notes[m] = f"not in any collective ({state['entered'].get(key, 0)} entered on this group)"
            else:
                notes[m] = f"waiting in {cur[1]} #{cur[2]} on group {cur[0].split('@', 1)[0]}"
        return missing, notes

    def claim_report(self) -> bool:
        """This rank failed: mark it, and return True when it is the first failed rank (the one that prints).
        """
        self.failed = True
        self._version += 1
        if self.store is None:
            return True
        try:
            self.publish()
            return int(self.store.add(_FAILURES, 1)) == 1
        except Exception:  # noqa: BLE001 - when in doubt, report
            return True


def stop_all_boards() -> None:
    """Stop every board's publishing thread (registered with ``atexit``: the interpreter runs it
    before it finalizes, while the threads can still leave their store calls)."""
    for board in list(_RUNNING):
        board.stop()


atexit.register(stop_all_boards)


def store_timeout(store: Any, seconds: float) -> None:
    """Bound the store's blocking calls (best effort; not every store type supports it)."""
    try:
        store.set_timeout(timedelta(seconds=seconds))
    except Exception:  # noqa: BLE001
        pass
