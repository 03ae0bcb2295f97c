"""``Monitor``: C-ZERO-001, -002 (live clauses) and -003 checked inside a real training run, every N steps.

One call in the training loop, after the optimizer step::

    monitor = Monitor(model, optimizer, every=100, out="monitor/")
    ...
    monitor.after_step(step, loss=loss.detach(), grad_norm=norm)
    monitor.close()  # writes the JSON summary

At each check every rank reads its layout (:mod:`zerosim.monitor.layouts`), digests the pieces it holds
that another rank holds too where they live, in one fused pass per device (:mod:`zerosim.monitor.digest`),
summarises its optimizer state and gradient on its device (:mod:`zerosim.monitor.row`), and contributes
one small int64 row to the check's one all-gather over the monitor's own process group
(:mod:`zerosim.monitor.exchange`); the layout's keys are gathered again only when a layout changes. Every
rank then judges the same observations with the same checks (:mod:`zerosim.monitor.judge`), so with
``on_violation="raise"`` every rank raises at the same call. With ``overlap`` (the default) the
all-gather is posted without waiting and completed, and the check judged, at the next ``after_step``
call (or :meth:`Monitor.flush`, :meth:`Monitor.close`): no rank waits at the check for the others,
and the verdict still names the step observed. Each rank appends its own observation as
one JSON line to ``out/rank-NNNNN.jsonl`` (flushed and fsynced per line); rank 0 logs one line per
check and writes ``out/summary.json`` at :meth:`Monitor.close`.

Why one module of this length: a check is observed at one call and completed at the next, and both
ends read the same exchanged state (layout keys, fingerprints, the pieces shared); the check in flight
and its digest rule are :mod:`zerosim.monitor.pending`.

The monitor reads, never writes, the training state. Bad input (no process group, ``every`` or
``timeout`` out of range, an unknown ``on_violation``, a layout it cannot read) is one line and the
monitor turns itself off; so is any error of its own later (never raised into the loop); an ``out``
it cannot write is one line on the rank concerned and the checks go on without its file. A rank whose
rows are not of the others' step makes that check skipped and recorded, never waited on for long."""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..checks.judges import judge as judge_contract
from ..errors import ConfigError
from ..values.observe import MonitorObservation, ranges_from_json
from ..values.verdict import Verdict, Violation
from .deepspeed_layout import DeepSpeedReader, is_deepspeed_engine
from .digest import digest_text
from .exchange import (
    CHECK,
    CLOSING,
    FINGERPRINT,
    OFF,
    PHASE,
    STEP,
    SUMMARY,
    ExchangeFailed,
    Gather,
    comm_device,
    exchange_keys,
    float_bits,
    monitor_group,
    start_gather,
    summary_values,
)
from .judge import judge
from .layouts import LiveLayout, read_layout
from .pending import PendingCheck, PieceKey, StagedCheck, digest_rule, digested
from .records import SUMMARY_LISTED, RunRecords
from .row import RowBuilder, logged_number, to_device
from .step_probe import StepProbe, invalid_option
from .trace import rank_file, touch_regular, write_summary

ON_VIOLATION = ("log", "raise")
#: the seconds a call that is not a check step waits, once per check, for the rows of the check before
#: it (sent by then where the step synchronises the ranks; a rank that skipped it sends at its next check)
GRACE_S = 2.0
#: the default bound on any one wait for the other ranks' part of a monitor exchange (seconds)
DEFAULT_TIMEOUT_S = 120.0


class MonitorViolation(RuntimeError):
    """Raised (``on_violation="raise"``) at the first check that finds a violation; ``violations``: all
    of that check's."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        super().__init__(f"zerosim.monitor: {len(violations)} violation(s), first: {violations[0]}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Monitor(RunRecords):
    """Checks the contracts on a live run every ``every`` steps (see the module docstring).

    ``model``: the module being trained (plain, DDP or FSDP2), a ``zerogpu`` ``ZeroTrainer`` or a
    DeepSpeed engine of ZeRO stage 1-3 (:mod:`zerosim.monitor.deepspeed_layout`; ``after_step`` with
    DeepSpeed's step count, ``engine.global_steps - 1``); ``optimizer``: its torch.optim optimizer
    (``ZeroRedundancyOptimizer`` included; None for a ZeroTrainer or a DeepSpeed engine).
    ``max_grad_norm`` (or its older name ``max_norm``): the loop's clip threshold (None: no clip), for
    the consumed gradient (:mod:`zerosim.monitor.step_probe`) and the logged pre-clip norm (not for
    DeepSpeed, whose gradient is measured before it clips). ``replay_every``: replay a due step's
    backward (:meth:`replay_check`; None: never). ``log``: where the per-check lines go (default: rank
    0's stderr; a rank's own failures go to its own). ``overlap`` (default True): each check's
    all-gather completes, and the check is judged, at the next :meth:`after_step` call (or
    :meth:`flush`, :meth:`close`), so that no rank waits at a check for the others to reach it; False:
    judged within the call that observed it. ``timeout``: the seconds the monitor waits at most for
    the other ranks' part of one of its exchanges (its own process group's). Collective.
    """

    def __init__(self, model: Any, optimizer: Any = None, *, every: Any = 100, out: Any = None,
                 on_violation: str = "log", max_norm: float | None = None,
                 log: Callable[[str], None] | None = None,
                 layout_reader: Callable[[], LiveLayout] | None = None, overlap: bool = True,
                 timeout: Any = DEFAULT_TIMEOUT_S, max_grad_norm: Any = None, replay_every: Any = None):
        self.model = model
        self.overlap = bool(overlap)
        self._pending: PendingCheck | None = None
        self._staged: StagedCheck | None = None  # a check observed, its row not yet posted
        self.optimizer = optimizer
        deepspeed = layout_reader is None and is_deepspeed_engine(model)
        if deepspeed:  # DeepSpeed's gradient is measured inside its step, before it clips: none to undo
            layout_reader, max_norm = DeepSpeedReader(model, every), None
        # a loop that clips logs the pre-clip norm: its clip threshold undoes that
        self.max_norm = max_norm if max_norm is not None or deepspeed else max_grad_norm
        self.enabled = False
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._log = log if log is not None else (_stderr if self.rank == 0 else (lambda line: None))
        #: where this rank's own failures go: every rank reports its own, once
        self._own_log = log if log is not None else _stderr
        self._read = layout_reader or (lambda: read_layout(self.model, self.optimizer))
        self.every = every
        self.on_violation = on_violation
        self.timeout = timeout
        self.out: Path | None = None
        self._trace: Path | None = None
        self.checks = 0
        self.seconds = 0.0
        self.violations: list[Violation] = []
        self.violation_count = 0
        self.steps: list[int] = []
        self.skipped: list[dict[str, Any]] = []
        self.skipped_count = 0
        self.adapter = "?"
        self.notes: list[str] = []
        self.off_reason: str | None = None
        self._floor: int | None = None
        self._group: Any = None
        self._keys: list[dict[str, Any]] | None = None
        self._fingerprints: list[int] = []
        self._shared: frozenset[PieceKey] = frozenset()
        self._layout_verdict: Verdict | None = None
        self._farewell: Gather | None = None
        self._probe: StepProbe | None = None
        self._taken: dict[str, Any] = {}
        self.replay_every = replay_every
        self.max_grad_norm = max_grad_norm if max_grad_norm is not None else max_norm
        problem = invalid_option(every, on_violation, timeout, self.max_grad_norm, replay_every)
        if problem is not None:
            self._log(f"zerosim.monitor: off: {problem}")
            return
        self.device = comm_device()
        self.world = dist.get_world_size()
        self._rows = RowBuilder(self.device)
        try:
            self._group = monitor_group(float(timeout))
        except Exception as err:  # noqa: BLE001 - its own failure: logged, the monitor off
            self._log(f"zerosim.monitor: off: cannot make the monitor's process group: {err}")
            return
        keys: dict[str, Any]
        try:
            layout = self._read()
            self.adapter = layout.adapter
            keys, _ = self._rows.layout_keys(layout)
        except (ConfigError, AttributeError, KeyError, TypeError, RuntimeError) as err:
            keys = {"off": f"cannot read the layout of {type(self.model).__name__}: {err}"}
        if out is not None:
            self._open_out(out)
        if "off" not in keys:
            try:
                self._probe = StepProbe(model, optimizer, self.adapter, every, replay_every,
                                        self.max_grad_norm)
                keys = {**keys, "step_len": self._probe.length()}
            except Exception as err:  # noqa: BLE001 - the step checks' own failure: those checks off
                self._own_log(f"zerosim.monitor: the step checks are off on rank {self.rank}: {err}")
        try:
            everyone = exchange_keys(keys, self.device, self._group, float(timeout))
        except Exception as err:  # noqa: BLE001
            self._own_log(f"zerosim.monitor: off on rank {self.rank}: the layout exchange failed: {err}")
            return
        refused = [(r, k["off"]) for r, k in enumerate(everyone) if "off" in k]
        if refused:
            if "off" in keys:
                self._own_log(f"zerosim.monitor: off: {keys['off']}")
            if self.rank != refused[0][0]:
                self._log(f"zerosim.monitor: off: rank {refused[0][0]}: {refused[0][1]}")
            return
        self._step_len = max(int(k.get("step_len", 0)) for k in everyone)
        if self._probe is not None and self._probe.off:
            self.step_checks_off = f"C-ZERO-002 step checks off for {self.adapter}: {self._probe.off}"
        self._adopt(everyone, room_for_gradients=True)
        self.enabled = True

    def _open_out(self, out: Any) -> None:
        """Make ``out`` and this rank's (regular) file there; on failure one line on this rank."""
        try:
            self.out = Path(out)
            self.out.mkdir(parents=True, exist_ok=True)
            touch_regular(rank_file(self.out, self.rank))
            self._trace = rank_file(self.out, self.rank)
        except (OSError, ValueError) as err:
            self._own_log(f"zerosim.monitor: invalid out={str(out)!r} on rank {self.rank}: "
                          f"{getattr(err, 'strerror', None) or err}; checking without observation files")
            if self.out is not None and not self.out.is_dir():
                self.out = None

    # ---- the check ----------------------------------------------------------------------------------
    def after_step(self, step: int, loss: Any = None, grad_norm: Any = None) -> list[Violation]:
        """Observe this rank's state when ``step`` is a multiple of ``every``, and judge: the violations
        of the checks completed by this call (also logged; raised as :class:`MonitorViolation` with
        ``on_violation="raise"``, on every rank at this same call). Without ``overlap`` that is this
        step's check; with it, the check observed at the previous check step, whose exchange went on
        while this step trained (its violations name the step they were observed at). Nothing else is
        raised: an error of the monitor's own is logged once on its rank and turns the monitor off."""
        if not self.enabled:
            return []
        try:
            step = int(step)
            self._taken = self._probe.take(step) if self._probe is not None else {}
            found = self._after_step(step, loss, grad_norm)
            if self._probe is not None and self.enabled:
                self._probe.arm(step + 1)
            return found
        except MonitorViolation:
            self._probe.arm(step + 1) if self._probe is not None and self.enabled else None
            raise
        except Exception as err:  # noqa: BLE001 - the monitor's own failure never reaches the loop
            self._give_up(err)
            return []

    def replay_check(self, step: int, closure: Callable[[], Any]) -> None:
        """After ``loss.backward()``, before ``optimizer.step()``: on a step due for replay, ``closure()``
        (the same micro-batch's loss) and its backward again, unreduced, ``.grad`` untouched, compared
        with what this rank contributed (C-ZERO-002 ``replay``). Returns at once on other steps."""
        if not self.enabled or self._probe is None or self.replay_every is None:
            return
        try:
            self._probe.replay(int(step), closure)
        except Exception as err:  # noqa: BLE001
            self._give_up(err)

    def _after_step(self, step: int, loss: Any, grad_norm: Any) -> list[Violation]:
        checking = step % self.every == 0
        found: list[Violation] = []
        if self._pending is not None:
            # the rows of the check before: waited for GRACE_S at the first call after it, only asked
            # about at later ones (a rank that skipped it sends its row at its next check step)
            found = self._complete(0.0 if self._pending.waited else GRACE_S)
        if self._staged is not None and self._pending is None and self.enabled and self._staged.ready():
            self._post_staged()  # its step checks' values have reached the host: the row goes now
            if not self.overlap:
                found = found + self._complete(GRACE_S)
        if not checking or not self.enabled:
            return found
        if self._staged is not None:
            return found  # its values have not landed yet: this step's check skips
        if self._pending is not None and not (self._probe is not None and self._probe.defer):
            return found  # one exchange in flight at most: this step's row is not sent (that check skips)
        if self._floor is not None and step <= self._floor:
            return found  # another rank's row for this step was gathered already, and that check skipped
        self._floor = None
        self._post(step, loss, grad_norm)
        if not self.overlap and self._pending is not None and self._pending.step == step:
            found = found + self._complete(GRACE_S)
        return found

    def _post(self, step: int, loss: Any, grad_norm: Any) -> None:
        """Observe this rank's state at ``step`` and post its row's all-gather; where the step checks
        stage their values (an accelerator), keep the row until they land (:class:`StagedCheck`). One
        exchange in flight at most: a row that would be posted behind another is not (that check
        skips)."""
        t0 = time.perf_counter()
        layout = self._read()
        self.adapter = layout.adapter
        self._grad_dtype = layout.grad_dtype
        if grad_norm is not None and layout.grads is None and layout.grads_note:
            self._note(f"C-ZERO-002 grad_norm: the logged norm is compared across ranks only, not with "
                       f"a norm recomputed from the gradient ({layout.grads_note})")
        keys, fingerprint = self._rows.layout_keys(layout)
        values = (step, fingerprint, logged_number(loss), logged_number(grad_norm))
        observed = self._probe.stage(step) if self._probe is not None else None
        if observed is not None:  # its values are on their way to the host: the row goes once they land
            head = self._rows.row(layout, self._width, *values, digested=self._digested(layout, fingerprint))
            self._staged = StagedCheck(step, keys, self._width, head, observed, self._taken,
                                       time.perf_counter() - t0, self._shared, self._fingerprints)
            return
        if self._pending is not None:
            return
        row = self._row(layout, self._width, values, self._digested(layout, fingerprint))
        self._pending = PendingCheck(step, keys, self._width, start_gather(row, self._group),
                                 None if self.overlap else (layout, values),
                                 time.perf_counter() - t0, self._shared, self._fingerprints, self._taken)

    def _post_staged(self) -> None:  # the staged check's row goes (waits for its values at flush only)
        staged, self._staged = self._staged, None
        assert staged is not None
        self._pending = staged.post(self._section, self._group)

    def _row(self, layout: LiveLayout, width: int, values: tuple[int, int, Any, Any], digested: Any) -> Any:
        """This rank's row: the digests and summary (:class:`RowBuilder`), then the step checks'
        section (:meth:`StepProbe.encode`)."""
        step, fingerprint, loss, norm = values
        row = self._rows.row(layout, width, step, fingerprint, loss, norm, digested=digested)
        return torch.cat([row, self._section(self._taken)])

    def _section(self, fields: dict[str, Any]) -> Any:  # the row's step-check part
        nan = torch.full((self._step_len,), float_bits(float("nan")), dtype=torch.int64)
        return to_device(self._probe.encode(fields, self._step_len) if self._probe else nan, self.device)

    def _marker(self, phase: int) -> Any:  # a closing or off row, the same length as a check's
        return torch.cat([self._rows.marker(self._width, phase), self._section({})])

    def _give_up(self, err: BaseException) -> None:
        """Its own failure: one line on this rank, the monitor off; unless the exchange failed, a last
        ``OFF`` row makes every other rank stop at the same check instead of waiting for rows."""
        what = str(err) or type(err).__name__
        self.off_reason = f"{type(err).__name__}: {what}"
        self._own_log(f"zerosim.monitor: off on rank {self.rank}: {self.off_reason}; training goes on")
        self.enabled = False
        if not isinstance(err, ExchangeFailed) and hasattr(self, "_width") and self._group is not None:
            try:
                self._farewell = start_gather(self._marker(OFF), self._group)
            except Exception:  # noqa: BLE001 - the group itself is broken: the others time out
                self._farewell = None
    def _digested(self, layout: LiveLayout, fingerprint: int) -> list[bool] | None:
        """Which of its held pieces this rank digests (:func:`~zerosim.monitor.pending.digested`)."""
        return digested(layout, fingerprint, self._fingerprints[self.rank], self._shared)

    def flush(self) -> list[Violation]:
        """Complete the check still exchanging, waiting at most ``timeout``: its violations (raised as
        :class:`MonitorViolation` with ``on_violation="raise"``). :meth:`close` calls it."""
        if not self.enabled or (self._pending is None and self._staged is None):
            return []
        try:
            found: list[Violation] = []
            for _ in range(2):  # the check exchanging, then the check staged behind it
                if self._pending is None and self._staged is not None:
                    self._post_staged()
                if self._pending is None:
                    break
                found += self._complete(self.timeout)
                if self._pending is not None:
                    raise ExchangeFailed(f"the other ranks sent no row for the check of step "
                                         f"{self._pending.step} within {self.timeout:g} s")
            return found
        except MonitorViolation:
            raise
        except Exception as err:  # noqa: BLE001
            self._give_up(err)
            return []

    def _complete(self, bound: float) -> list[Violation]:
        """Judge the pending check if every rank's row arrives within ``bound`` s (else keep it pending):
        every observation judged, recorded and reported; rows not of one step's check are not judged."""
        pending = self._pending
        assert pending is not None
        t0 = time.perf_counter()
        width = pending.width
        table = pending.gather.wait(bound)
        if table is None:
            pending.waited = True
            return []
        self._pending = None
        if not self._agreed(table, width):
            return []
        fingerprints = table[:, width + FINGERPRINT].tolist()
        digested = digest_rule(fingerprints, pending.shared, pending.fingerprints)
        if fingerprints != self._fingerprints:  # a rank's layout changed: every rank sees it here
            self._exchange(pending.keys)
            if pending.now is not None:  # the state observed is still there: observe it again in full
                layout, values = pending.now
                width = self._width
                step, fingerprint, loss, norm = values
                row = self._row(layout, width, (step, fingerprint, loss, norm),
                                self._digested(layout, fingerprint))
                table = start_gather(row, self._group).wait(self.timeout)
                if table is None:
                    raise ExchangeFailed(f"the other ranks sent no row for step {step} within "
                                         f"{self.timeout:g} s")
                self._fingerprints = table[:, width + FINGERPRINT].tolist()
                digested = digest_rule(self._fingerprints, self._shared, self._fingerprints)
            else:
                self._fingerprints = fingerprints
                if self._width > width:
                    self._note(f"a layout changed at step {pending.step}: that check compared the pieces "
                               f"its row had room for, every check after it compares them all")
        assert self._keys is not None
        mismatched = self._mismatched_pieces(table, width, digested)
        observations = [self._observation(r, self._keys[r], table[r], width,
                                          r == self.rank and self._trace is not None, mismatched, digested,
                                          pending.taken)
                        for r in range(self.world)]
        if self._layout_verdict is None:
            self._layout_verdict = judge_contract("C-ZERO-001", observations)
        identity = judge_contract("C-ZERO-003", observations) if mismatched else \
            Verdict("C-ZERO-003", details={"violation_count": 0})
        identity.checked = self._compared
        verdicts = judge(observations, self._layout_verdict, identity)
        found = [v for verdict in verdicts for v in verdict.violations]
        elapsed = pending.seconds + time.perf_counter() - t0
        self.seconds += elapsed
        self.checks += 1
        self.steps.append(pending.step)
        self._record(observations[self.rank], elapsed)
        self._report(pending.step, verdicts, found, elapsed)
        if found and self.on_violation == "raise":
            raise MonitorViolation(found)
        return found

    def _agreed(self, table: np.ndarray, width: int) -> bool:
        """Whether ``table`` is every rank's row of one step's check; else an ``OFF`` row stops the
        monitor, other steps' or closing rows make the check skipped (:meth:`_skip`)."""
        phases = table[:, width + PHASE].tolist()
        if OFF in phases:
            off = phases.index(OFF)
            self.off_reason = f"rank {off}'s monitor turned itself off"
            self._log(f"zerosim.monitor: off: {self.off_reason}; every rank stops checking")
            self.enabled = False
            return False
        steps = table[:, width + STEP].tolist()
        if phases.count(CHECK) == len(phases) and len(set(steps)) == 1:
            return True
        self._skip([int(s) if p == CHECK else None for s, p in zip(steps, phases, strict=True)])
        return False

    def _skip(self, steps: list[int | None]) -> None:
        """Record a check not judged, its rows not of one step (``steps``: each rank's, None: closing);
        no row is sent for a step up to the latest here (gathered already): the rows come back in line."""
        checked = [s for s in steps if s is not None]
        if not checked:
            return
        self._floor = max([*checked, *([] if self._floor is None else [self._floor])])
        self.skipped_count += 1
        if len(self.skipped) < SUMMARY_LISTED:
            self.skipped.append({"steps": steps})
        where = ", ".join(f"rank {r}: " + ("closed" if s is None else f"step {s}")
                          for r, s in enumerate(steps))
        self._log(f"zerosim.monitor: a check skipped, not judged: the ranks' rows were not of one step "
                  f"({where})")

    def _exchange(self, keys: dict[str, Any]) -> None:
        self._adopt(exchange_keys(keys, self.device, self._group, float(self.timeout)))

    def _adopt(self, everyone: list[dict[str, Any]], room_for_gradients: bool = False) -> None:
        """Every rank's layout keys; ``room_for_gradients``: rows with room for a gradient piece beside
        each held one (the keys of ``Monitor()``, before any gradient, are replaced at the first check)."""
        self._keys = everyone
        self._width = 2 * max(len(k["held"]) for k in self._keys) * (2 if room_for_gradients else 1)
        # each rank's owned ranges and element counts, converted once per layout (shared by every check)
        self._owned = [ranges_from_json(keys["owned"]) for keys in self._keys]
        self._numels = [{k: int(v) for k, v in keys["numels"].items()} for keys in self._keys]
        self._grad_ranges = [ranges_from_json(keys["grad_ranges"]) if keys.get("grad_ranges") is not None
                             else None for keys in self._keys]
        holders: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        for rank, k in enumerate(self._keys):
            for i, (name, a, b) in enumerate(k["held"]):
                holders.setdefault((name, int(a), int(b)), []).append((rank, i))
        shared = [(key, members) for key, members in holders.items() if len(members) > 1]
        self._shared = frozenset(key for key, _ in shared)
        self._compared = len(shared)
        pairs = [(members[0], other, key) for key, members in shared for other in members[1:]]
        self._pair_base = np.array([[r, i] for (r, i), _, _ in pairs], dtype=np.int64).reshape(-1, 2)
        self._pair_other = np.array([[r, i] for _, (r, i), _ in pairs], dtype=np.int64).reshape(-1, 2)
        self._pair_key = [key for _, _, key in pairs]
        self._lanes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._fingerprints = [zlib.crc32(json.dumps(k, separators=(",", ":")).encode()) for k in self._keys]
        self._layout_verdict = None

    def _mismatched_pieces(self, table: np.ndarray, width: int,
                           digested: Callable[[int, PieceKey], bool]) -> set[PieceKey]:
        """The pieces (tensor, start, stop) whose holders' digest lanes differ somewhere: one vectorised
        comparison of every holder with the piece's first holder (C-ZERO-003's fast path), over the
        pieces the table's ``width`` lanes hold and both holders ``digested``."""
        if not len(self._pair_key):
            return set()
        flat = table.reshape(-1)
        base, other = self._pair_lanes(width, table.shape[1])
        differ = (flat[base] != flat[other]).reshape(-1, 2).any(axis=1)
        first, second = self._pair_base[:, 0], self._pair_other[:, 0]
        return {self._pair_key[i] for i in np.flatnonzero(differ)
                if digested(int(first[i]), self._pair_key[i]) and digested(int(second[i]), self._pair_key[i])}

    def _pair_lanes(self, width: int, row_length: int) -> tuple[np.ndarray, np.ndarray]:
        """Where, in the flattened table (rows of ``row_length`` with ``width`` digest lanes), each
        compared pair's two lanes sit: the first holder's and the other holder's, made once per table
        shape and layout. A piece beyond the row's ``width`` (a layout grew since the row was built)
        compares lane 0 of rank 0 with itself."""
        found = self._lanes.get((width, row_length))
        if found is None:
            room = (2 * self._pair_base[:, 1:2] + 1 < width) & (2 * self._pair_other[:, 1:2] + 1 < width)

            def lanes(pairs: np.ndarray) -> np.ndarray:
                at = pairs[:, 0:1] * row_length + 2 * pairs[:, 1:2] + np.arange(2)
                return np.where(room, at, 0).reshape(-1)

            found = self._lanes[(width, row_length)] = (lanes(self._pair_base), lanes(self._pair_other))
        return found

    def _observation(self, rank: int, keys: dict[str, Any], row: np.ndarray, width: int,
                     every_piece: bool | None, pieces: set[PieceKey],
                     digested: Callable[[int, PieceKey], bool], mine: dict[str, Any]) -> MonitorObservation:
        """Rank ``rank``'s observation from its keys and row (``width`` digest lanes): with the digests
        of every piece it holds (``every_piece``: this rank's own, for its file) or of those in
        ``pieces`` only; a piece it did not digest (no other rank holds it) has an empty digest."""
        s = summary_values(row, width)
        names = keys["names"]
        held = []
        if every_piece or pieces:
            lanes = row[:width].tolist()
            held = [(n, int(a), int(b), digest_text((lanes[2 * i], lanes[2 * i + 1]))
                     if digested(rank, (n, int(a), int(b))) else "")
                    for i, (n, a, b) in enumerate(keys["held"][: min(s["n_held"], width // 2)])
                    if every_piece or (n, int(a), int(b)) in pieces]
        return MonitorObservation(
            rank=rank, world_size=self.world, step=int(s["step"]), adapter=keys["adapter"], held=held,
            owned=self._owned[rank], numels=self._numels[rank],
            state_missing=(int(s["missing"]), names[s["missing_idx"]] if s["missing_idx"] >= 0 else None),
            state_nonfinite=(int(s["nonfinite"]),
                             names[s["nonfinite_idx"]] if s["nonfinite_idx"] >= 0 else None),
            step_counters=(int(s["step_min"]), int(s["step_max"]), names[s["step_min_idx"]])
            if s["has_counters"] else None,
            grad_sq=s["grad_sq"] if s["has_grad"] else None, grad_ranges=self._grad_ranges[rank],
            grad_numel=int(s["grad_numel"]),
            grad_norm=s["grad_norm"] if s["has_norm"] else None, grad_dtype=self._grad_dtype,
            max_norm=self.max_norm, loss=s["loss"] if s["has_loss"] else None,
            **(mine if rank == self.rank else self._probe.decode(row[width + len(SUMMARY):])
               if self._probe is not None else {}))

    def close(self) -> dict[str, Any]:
        """Complete the check still exchanging, close with every rank (:meth:`_close_exchange`), write
        ``out/summary.json`` (rank 0), return the summary; waits at most ``timeout`` for each table.
        Only a violation that check found is raised (``on_violation="raise"``), after the summary."""
        raised: MonitorViolation | None = None
        was_enabled = self.enabled
        try:
            self.flush()
        except MonitorViolation as err:
            raised = err
        if self.enabled:
            try:
                self._close_exchange()
            except Exception as err:  # noqa: BLE001
                self._give_up(err)
        summary = self.summary()
        if was_enabled and self.out is not None and self.rank == 0:
            try:
                write_summary(self.out, summary)
            except OSError as err:
                self._own_log(f"zerosim.monitor: rank {self.rank} cannot write "
                              f"{self.out / 'summary.json'}: {err.strerror or err}")
        self._probe.close() if self._probe is not None else None  # its hooks taken off
        if hasattr(self._read, "close"):
            try:
                self._read.close()  # a DeepSpeed reader takes its wrappers off the optimizer
            except Exception as err:  # noqa: BLE001
                self._own_log(f"zerosim.monitor: rank {self.rank} cannot restore the optimizer: {err}")
        if was_enabled:
            self._log(f"zerosim.monitor summary: {self.checks} check(s), "
                      f"{self.violation_count} violation(s), {self.skipped_count} skipped, "
                      f"{self.seconds:.3f} s in checks")
        self.enabled = False
        if raised is not None:
            raise raised
        return summary

    def _close_exchange(self) -> None:
        """Send ``CLOSING`` rows until a table holds nothing else (a check another rank sent meanwhile
        is recorded as skipped, on every rank)."""
        while self.enabled:
            gather = start_gather(self._marker(CLOSING), self._group)
            table = gather.wait(self.timeout)
            if table is None:
                raise ExchangeFailed(f"the other ranks did not close the monitor within {self.timeout:g} s")
            phases = table[:, self._width + PHASE].tolist()
            if phases.count(CLOSING) == len(phases):
                return
            self._agreed(table, self._width)  # the others' checks recorded as skipped, or an OFF seen

