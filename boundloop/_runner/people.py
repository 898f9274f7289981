"""A person's decisions: resolving an unresolved action, approving or denying a call."""

from __future__ import annotations

import getpass
import socket

from boundloop import events as ev
from boundloop._runner.base import MAX_NOTE, RunnerBase
from boundloop.core import kinds
from boundloop.core.replay import RunState, apply
from boundloop.errors import ApprovalError, ConfigError, LeaseLost, RecoveryError, SequenceConflict
from boundloop.policy.redact import journal_safe


class People(RunnerBase):
    """``resolve``, ``approve`` and ``deny``."""

    def resolve(self, run_id: str, execution_id: str, outcome: str, note: str = "", *,
                by: str | None = None, force: bool = False) -> RunState:
        """Record a person's decision on an unresolved action: ``succeeded`` (it took
        effect), ``failed`` (it did not) or ``abandoned`` (nobody can tell; it stays
        flagged). Returns the run's state after it; ``resume`` continues the run.

        An open run is claimed in the same append (so a runner that drove it and wakes up
        later is fenced). A run whose owner is alive, in any process, is refused unless
        ``force=True``: then the live owner is fenced and ``CallResolved.forced`` says so.

        Raises:
            ConfigError: ``outcome`` is not one of the three.
            UnknownRun: no such run.
            RecoveryError: no such action, its outcome is already known, the run is in
                flight here, or a live runner owns it (without ``force``).
        """
        if not isinstance(outcome, str) or outcome not in kinds.RESOLUTIONS:
            raise ConfigError(f"outcome must be succeeded, failed or abandoned, not {outcome!r}")
        self._here()
        with self._lock:
            if run_id in self._tokens:
                raise RecoveryError(f"run {run_id!r} is in flight; cancel it first")
        state, seq = self._load(run_id)
        record = state.calls.get(execution_id)
        if record is None:
            raise RecoveryError(f"run {run_id!r} has no action {execution_id!r}; "
                                f"`boundloop show {run_id}` lists them")
        if not record.open:
            raise RecoveryError(f"action {execution_id!r} is not unresolved (its result is "
                                f"{record.status})")
        forced = False
        batch: list[ev.Event] = []
        if not state.finished and state.owner != self.owner:
            if not self._owner_gone(state.owner, self._journal.owners()):
                if not force:
                    raise RecoveryError(
                        f"run {run_id!r} is owned by the live runner {state.owner!r}, whose "
                        "action may still be running; resolve it there, wait until that "
                        "runner is gone, or force it (force=True / --force), which fences "
                        "that runner first")
                forced = True
            batch.append(self._claim_event(state))
        # A person's note and name are text the run journals too (SPEC 9): the run's
        # secrets and text with the shape of a credential are redacted from them.
        scrubber = self._scrubber(run_id, state, keep=True)
        who = scrubber.text(journal_safe(by or f"{getpass.getuser()}@{socket.gethostname()}"))
        note = scrubber.text(journal_safe(str(note)))
        batch.append(ev.CallResolved(run_id=run_id, ts=self.clock.time(),
                                     elapsed_s=state.elapsed_s, execution_id=execution_id,
                                     outcome=outcome, note=note, by=who, forced=forced))
        try:
            self._journal.append(run_id, seq, batch)
        except (SequenceConflict, LeaseLost):
            raise RecoveryError(f"run {run_id!r} changed while resolving; try again") from None
        for event in batch:
            apply(state, event)
        return state

    def approve(self, run_id: str, execution_id: str, *, by: str | None = None,
                note: str = "") -> RunState:
        """Approve a call that waits for a person (SPEC 14): once every call the run waits
        for is decided, the run is queued again and any worker serving its agent (or a
        ``resume``) continues it, dispatching the call (its intent durable first).

        Raises:
            UnknownRun: no such run.
            ApprovalError: the call does not wait for a decision (decided already, the run
                moved on, no such call).
        """
        return self._decide_approval(run_id, execution_id, True, by, note)

    def deny(self, run_id: str, execution_id: str, *, by: str | None = None,
             note: str = "") -> RunState:
        """Deny a call that waits for a person: it is recorded ``denied`` (it counts against
        the call budget, as any denied call does) and the model sees it when the run goes
        on. Raises as ``approve`` does."""
        return self._decide_approval(run_id, execution_id, False, by, note)

    def _decide_approval(self, run_id: str, execution_id: str, approved: bool,
                         by: str | None, note: str) -> RunState:
        self._here()
        if not isinstance(note, str) or (by is not None and not isinstance(by, str)):
            raise ConfigError("note and by must be strings")
        if len(note) > MAX_NOTE or (by is not None and len(by) > 256):
            raise ConfigError(f"a note may be at most {MAX_NOTE} characters and a name 256; "
                              "keep the rest in your own records and refer to it")
        state, seq = self._load(run_id)
        record = state.calls.get(execution_id)
        if record is None or not kinds.awaits_decision(record.stage) \
                or not kinds.awaits_approval(state.status):
            what = "has no call" if record is None else "does not wait for a decision on"
            raise ApprovalError(
                f"run {run_id!r} {what} {execution_id!r} (the run is {state.status}"
                + ("" if record is None else f", the call {record.stage}") + "); "
                f"`boundloop show {run_id}` lists its calls and what they wait for")
        if state.owner and state.owner != self.owner \
                and not self._owner_gone(state.owner, self._journal.owners()):
            raise ApprovalError(f"run {run_id!r} is being resumed by the live runner "
                                f"{state.owner!r}; decide once it waits again (`boundloop "
                                f"show {run_id}`)")
        scrubber = self._scrubber(run_id, state, keep=True)
        who = scrubber.text(journal_safe(by or f"{getpass.getuser()}@{socket.gethostname()}"))
        now = self.clock.time()
        # The time waited is counted once, from waiting_since, when the run goes on.
        elapsed = state.elapsed_s
        batch: list[ev.Event] = [ev.ApprovalDecided(
            run_id=run_id, ts=now, elapsed_s=elapsed, execution_id=execution_id,
            approved=approved, by=who, note=scrubber.text(journal_safe(note)))]
        if len(state.awaiting) == 1:
            batch.append(ev.RunRequeued(run_id=run_id, ts=now, elapsed_s=elapsed))
        try:
            self._journal.append(run_id, seq, batch)
        except SequenceConflict:
            raise ApprovalError(f"run {run_id!r} changed while deciding; look again with "
                                f"`boundloop show {run_id}`") from None
        for event in batch:
            apply(state, event)
        return state
