"""What every part of the Runner shares: its state, the process and lease it serves under,
the claim of a run, the run's state as read back, and the scrubbers of resumable runs."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import pykka

from boundloop import events as ev
from boundloop.actors.admission import AdmissionActor, InFlight
from boundloop.actors.budget import BudgetActor
from boundloop.actors.executor import ExecutorActor
from boundloop.actors.hung_commits import Shard
from boundloop.actors.supervisor import SupervisorActor
from boundloop.actors.workers import Workers
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.core import kinds
from boundloop.core.replay import RunState, apply, replay
from boundloop.errors import JournalError, RecoveryError, RunnerClosed, SequenceConflict
from boundloop.journal.base import Journal, OwnerRecord
from boundloop.loop import Estimator
from boundloop.owners import owner_alive, this_process
from boundloop.policy.redact import Scrubber, digests_in
from boundloop.pricing import PriceOption
from boundloop.results import RunResult
from boundloop.telemetry import Telemetry

#: Statuses a run ends with that ``resume`` continues (besides runs left open).
RESUMABLE = kinds.RESUMABLE_STATUSES
#: The longest note (and 256 for a name) a person's approve or deny may carry.
MAX_NOTE = 4096
#: How often ``resume`` claims a run again when an append of its gone owner landed first.
_CLAIM_TRIES = 5
#: How many resumable runs' scrubbers a runner keeps (the oldest go first).
KEPT_SCRUBBERS = 1024



class RunnerBase:
    """The state a Runner's parts share (``Runner.__init__`` sets it) and the methods every
    part uses."""

    unpriced: str
    read_only: bool
    estimator: Estimator | None
    price: PriceOption
    clock: Clock
    lease_s: float
    owner: str
    telemetry: Telemetry
    _owns_journal: bool
    _journal: Journal
    _lease_until: float
    _lapses: int
    _draining: bool
    _tokens: dict[str, CancelToken]
    _scrubbers: OrderedDict[str, Scrubber]
    _futures: dict[str, Future[RunResult]]
    _pending: set[Future[RunResult]]
    _settling: dict[Future[RunResult], Callable[[], None]]
    _agents: dict[str, str]
    _queue_seen: tuple[float, dict[str, int]] | None
    _lock: threading.Lock
    _closed: bool
    _pid: int
    _stop_renewing: threading.Event
    _renewer: threading.Thread
    _workers: Workers
    _executor: pykka.ActorRef[ExecutorActor]
    _budget: pykka.ActorRef[BudgetActor]
    _admission: pykka.ActorRef[AdmissionActor]
    _in_flight: InFlight
    _admitting: threading.BoundedSemaphore
    _shards: list[Shard]
    _supervisors: list[pykka.ActorRef[SupervisorActor]]

    # -- the process --------------------------------------------------------------------
    def _here(self) -> None:
        """Refuse use from a child forked after this runner was made (a prefork server's
        worker, a 'fork' multiprocessing pool): its actors and lease thread stayed in the
        parent, so a run submitted here would wait forever (SPEC 1). Checked before any
        lock is taken: a lock another thread held at the fork stays locked in the child."""
        if os.getpid() != self._pid:
            raise RunnerClosed(
                f"this Runner was created in process {self._pid}, and this process "
                f"({os.getpid()}) is a child forked from it: a Runner cannot be used across "
                "fork() (its threads stayed in the parent). Open a Runner in the child on the "
                "same journal, e.g. bl.Runner(path) in the pool's initializer or the "
                "server's post-fork hook")

    # -- ownership ---------------------------------------------------------------------
    def _register(self) -> None:
        now = time.time()
        until = now + self.lease_s
        try:
            self._journal.put_owner(this_process(self.owner, until))
        except JournalError:
            return  # not renewed: once the margin is gone, this runner stops starting work
        if self._lease_until and now + self.lease_s / 3 > self._lease_until:
            self._lapses += 1
        self._lease_until = until

    def _renew(self) -> None:
        # Ownership across hosts rests on the lease: renew it well before it runs out.
        while not self._stop_renewing.wait(self.lease_s / 3):
            self._register()

    def lease_ok(self, since: int | None = None) -> bool:
        """True while this runner's lease has at least a third of ``lease_s`` left: it starts
        no model call and no attempt otherwise (a paused or partitioned runner fences
        itself: by the time another runner may judge it gone, it has stopped starting
        work). With ``since`` (the lapse count when a run started here), also False once
        the lease has lapsed since: a renewed lease does not give back runs that another
        runner may have claimed meanwhile."""
        if since is not None and since != self._lapses or self._draining:
            return False
        return time.time() + self.lease_s / 3 <= self._lease_until

    def drain(self) -> None:
        """Start no more model calls or attempts (a worker shutting down): attempts running
        now end and are recorded; each run then stops here as a resume would find it, open
        in the journal, for another runner to take over."""
        self._draining = True

    def in_flight(self, run_id: str) -> bool:
        """True while this runner drives the run."""
        with self._lock:
            return run_id in self._tokens

    def _owner_gone(self, owner: str, owners: dict[str, OwnerRecord]) -> bool:
        """True when ``owner`` can no longer drive its runs."""
        if owner == self.owner:
            return False
        # It may have registered since ``owners`` was read: then ask the journal again.
        record = owners.get(owner) or self._journal.owners().get(owner)
        return not owner_alive(record)

    def _claim_event(self, state: RunState) -> ev.OwnerClaimed:
        return ev.OwnerClaimed(run_id=state.run_id, ts=self.clock.time(),
                               elapsed_s=state.elapsed_s, owner=self.owner,
                               epoch=state.epoch + 1)

    def _claim(self, run_id: str, seq: int, state: RunState) -> RunState:
        """Take the run at its next epoch: from now on its old owner's appends are refused
        (LeaseLost). Of two runners claiming at once, one wins (SequenceConflict)."""
        event = self._claim_event(state)
        self._journal.append(run_id, seq, [event])
        return apply(state, event)

    def _claim_for_resume(self, run_id: str, seq: int, state: RunState,
                          ) -> tuple[RunState, int]:
        """Claim a run whose owner is gone, for ``resume``. An append that lands between the
        read and the claim without changing the owner (what a fenced runner records of its
        last attempts as it stops) is read and the claim made again; a claim by another
        runner is refused."""
        for _ in range(_CLAIM_TRIES):
            try:
                return self._claim(run_id, seq, state), seq
            except SequenceConflict:
                owner = state.owner
                state, seq = self._load(run_id)
                if state.owner != owner or (state.finished
                                            and state.status not in kinds.WAITING_STATUSES):
                    break
        raise RecoveryError(f"run {run_id!r} was claimed by another runner")

    def _load(self, run_id: str) -> tuple[RunState, int]:
        self._journal.info(run_id)  # UnknownRun, said once for every caller
        pairs = list(self._journal.read(run_id))
        return replay(e for _, e in pairs), pairs[-1][0]

    @property
    def journal(self) -> Journal:
        """The journal this runner records to."""
        return self._journal

    def _scrubber(self, run_id: str, state: RunState, keep: bool = False) -> Scrubber:
        """A scrubber for what is appended to a run from now on: it knows the secrets the
        run redacted on this runner, and learns again those whose digests its journal holds
        (a run redacted by another process)."""
        with self._lock:
            kept = self._scrubbers.get(run_id) if keep else self._scrubbers.pop(run_id, None)
        # The arguments of calls not yet in the transcript (waiting for a person) too.
        return Scrubber(self._journal.secret_key, inherit=kept,
                        digests=digests_in([state.transcript,
                                            [r.arguments for r in state.calls.values()]]))

    def _keep_scrubber(self, run_id: str, scrubber: Scrubber | None,
                       future: Future[RunResult]) -> None:
        if scrubber is None or not scrubber.remembered or future.cancelled():
            return
        if future.exception() is None and future.result().status not in RESUMABLE:
            return
        with self._lock:
            self._scrubbers[run_id] = scrubber
            self._scrubbers.move_to_end(run_id)
            while len(self._scrubbers) > KEPT_SCRUBBERS:
                self._scrubbers.popitem(last=False)

    def cancel(self, run_id: str, reason: str = "") -> bool:
        """Ask a run in flight to stop; False when it is not in flight here."""
        self._here()
        with self._lock:
            token = self._tokens.get(run_id)
        if token is None:
            return False
        token.cancel(reason)
        return True

    def state(self, run_id: str) -> RunState:
        """The run's state rebuilt from its journal (raises UnknownRun)."""
        self._here()
        return self._load(run_id)[0]
