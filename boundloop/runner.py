"""The Runner: starts and stops the actors; run, submit, cancel, recover, resolve, resume.

Its jobs live in the private package ``boundloop._runner`` (one module each: starting a
run, recovering and resuming, a person's decisions, submitting); this module assembles
them and keeps the names programs import from it (``Runner``, ``new_run_id``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import pykka

from boundloop import keys, pricing
from boundloop._runner.base import KEPT_SCRUBBERS as KEPT_SCRUBBERS
from boundloop._runner.base import MAX_NOTE as MAX_NOTE
from boundloop._runner.base import RESUMABLE as RESUMABLE
from boundloop._runner.people import People
from boundloop._runner.settle import _settle_closed
from boundloop._runner.starting import ADMIT_AHEAD
from boundloop._runner.starting import new_run_id as new_run_id
from boundloop._runner.submitting import Submitting
from boundloop.actors.admission import AdmissionActor, InFlight
from boundloop.actors.budget import BudgetActor
from boundloop.actors.executor import ExecutorActor
from boundloop.actors.hung_commits import Shard
from boundloop.actors.supervisor import SupervisorActor
from boundloop.actors.workers import MAX_THREADS, Workers
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.core.budget import Price
from boundloop.errors import ConfigError, JournalError
from boundloop.journal import lmdb as lmdb_journal
from boundloop.journal.base import Journal
from boundloop.journal.lmdb import LmdbJournal
from boundloop.loop import Estimator
from boundloop.policy.redact import Scrubber
from boundloop.results import RunResult
from boundloop.telemetry import Telemetry


class Runner(Submitting, People):
    """Runs LLM tool loops under hard budgets, journaling every intent before its effect.

    Args:
        journal: a journal directory (LMDB, created ``0700`` if absent), a
            ``postgresql://`` URL (PostgreSQL, SPEC 12), or a Journal.
        read_only: deny every tool not marked ``read_only`` (a safe first rollout).
        max_in_flight: runs in flight at once; more are ``rejected``.
        supervisors: supervisor actors (runs are sharded across them by id).
        model_threads: size of the thread pool for sync models.
        tool_threads: size of the thread pool for sync tools.
        estimator: ``(history, model) -> Usage | int``, the reservation made before each
            step (an int is input tokens; default: ceil(history JSON bytes / 4) input
            tokens plus the model's ``max_output_tokens``).
        price: a price table for metering cost (``bl.Price``), or ``"auto"``: each step's
            cost from the genai-prices catalogue (``boundloop[prices]``) for the model its
            response reports, cache reads and writes at the catalogue's own prices (see
            ``boundloop.pricing``).
        unpriced: what a run priced by the catalogue does with a step it cannot price (an
            unknown model, none reported): ``"fail"`` (default) ends a run that has a
            ``max_cost`` ``limit_exceeded`` with ``exhausted_limit="cost"``, since its limit
            can no longer be enforced; ``"partial"`` lets it go on. Either way the step is
            counted in ``usage.unpriced_steps`` and the explanation says the cost is
            partial (a run without ``max_cost`` always goes on).
        sync: fsync every journal commit (ignored when a Journal is given).
        compress: store the journal's events compressed (ignored when a Journal is given):
            about half the pages per round; the journal becomes record format 3, which
            versions of boundloop without ``compress`` refuse, and its files no longer hold
            each event's msgpack bytes as they are (see the documentation's design record,
            "Integrity and secrets", "Journal size").
        clock: the clock (a FakeClock in tests of time).
        lease_s: how long this runner's ownership of its runs lasts without renewal.
        telemetry: spans and metrics of SPEC 11 through the OpenTelemetry API (default: a
            ``bl.Telemetry()`` on the global providers, next to free without an SDK).
        max_threads: the most threads each pool (models, tools) may grow to while
            compensating for handlers and models stuck past their timeout or deadline
            (SPEC 5); a handler waiting in ``run_child`` is replaced beyond it, always
            (SPEC 8). Also the most event-loop threads for the ``async def`` callables of
            runs started with ``run``/``submit``: a loop per run up to
            ``workers.LOOP_THREADS`` (16), more only while every loop is held by a
            coroutine of an ended run that blocks (see the documentation's design record,
            "Architecture", "Threads").
        redaction_key: the key redacted values are digested under (SPEC 9): its bytes, or
            the path of a file holding them (at least 32 bytes, not all zero; never inside
            the journal directory). Default: ``$BOUNDLOOP_REDACTION_KEY_FILE``, else the
            journal's own key in the user's state directory (see ``boundloop.keys``).
            Workers that share a journal need the same key: give each the same file when
            they run as other users or on other machines.

    Raises:
        ConfigError: an option is invalid, or the redaction key is refused or is not the
            journal's (the journal records its key's fingerprint).
    """

    def __init__(self, journal: str | os.PathLike[str] | Journal = ".boundloop", *,
                 read_only: bool = False, max_in_flight: int = 1000, supervisors: int = 2,
                 model_threads: int = 32, tool_threads: int = 32,
                 estimator: Estimator | None = None,
                 price: Price | Literal["auto"] | None = None,
                 sync: bool = True, clock: Clock | None = None, lease_s: float = 30.0,
                 telemetry: Telemetry | None = None,
                 max_threads: int = MAX_THREADS,
                 redaction_key: keys.KeySource | None = None, compress: bool = False,
                 unpriced: Literal["fail", "partial"] = "fail") -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) \
                or max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be a whole number >= 1, got {max_in_flight!r}")
        if supervisors < 1:
            raise ConfigError("supervisors must be at least 1")
        # Checked before a journal is opened (genai-prices loaded now for "auto").
        price = pricing.check_price(price, "Runner")
        self.unpriced = pricing.check_unpriced(unpriced)
        for flag, given in (("read_only", read_only), ("sync", sync), ("compress", compress)):
            if not isinstance(given, bool):
                raise ConfigError(f"{flag} must be True or False, got {given!r}")
        for name, value in (("model_threads", model_threads), ("tool_threads", tool_threads),
                            ("max_threads", max_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        self._owns_journal = not isinstance(journal, Journal)
        url: str | None = None
        if isinstance(journal, str) and "://" in journal:
            from boundloop.journal import postgres  # psycopg is imported only for a URL
            url = journal if postgres.url_scheme(journal) else None
        if not isinstance(journal, Journal):
            # A refused key creates no journal.
            keys.given_key(redaction_key, None if url else Path(journal))
        if isinstance(journal, Journal):
            self._journal = journal
        elif url is not None:
            # postgresql:// (SPEC 12); any other scheme is a ConfigError naming those.
            self._journal = postgres.open_url(url, sync=sync, lease_s=lease_s,
                                              compress=compress)
        else:
            self._journal = lmdb_journal.acquire(journal, sync=sync, compress=compress)
        try:
            keys.bind(self._journal, redaction_key)  # refused before anything is written
        except BaseException:
            if self._owns_journal and isinstance(self._journal, LmdbJournal):
                lmdb_journal.release(self._journal)
            elif self._owns_journal:
                self._journal.close()
            raise
        self.read_only = read_only
        self.estimator = estimator
        self.price = price
        self.clock = clock or Clock()
        if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) \
                or not 0.1 <= lease_s <= 86_400:
            raise ConfigError(f"lease_s must be a number of seconds from 0.1 to 86400, got "
                              f"{lease_s!r}")
        self.lease_s = float(lease_s)
        self._lease_until = 0.0  # the lease as last made durable
        # One more each time a renewal finds the lease had lost its margin: another runner
        # may have judged this one gone meanwhile, so runs started before never go on.
        self._lapses = 0
        self._draining = False
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._tokens: dict[str, CancelToken] = {}
        #: The scrubbers of runs that ended resumable here (needs_review, journal
        #: unavailable), newest last: a resume or resolve on this runner still knows
        #: every secret the run redacted (SPEC 9), spaces and all.
        self._scrubbers: OrderedDict[str, Scrubber] = OrderedDict()
        self._futures: dict[str, Future[RunResult]] = {}
        self._pending: set[Future[RunResult]] = set()  # futures being admitted
        #: Refused runs' Futures handed to the settle pool, and how each is settled (what the
        #: pool has not taken when the runner closes is settled by close()).
        self._settling: dict[Future[RunResult], Callable[[], None]] = {}
        #: Agent names of runs read so far (a run's agent never changes).
        self._agents: dict[str, str] = {}
        #: When the queue was last counted, and its depth by agent then.
        self._queue_seen: tuple[float, dict[str, int]] | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: The process the runner serves in: its threads and journal do not cross fork().
        self._pid = os.getpid()
        self._register()
        self._stop_renewing = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="boundloop-lease", daemon=True)
        self._renewer.start()
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise ConfigError(f"telemetry must be a bl.Telemetry, got {telemetry!r}")
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        journal = self._journal
        journal.on_commit = self.telemetry.journal_commit  # a backend times its commits
        journal.before_sync = self.telemetry.before_sync  # and says when it waits for the disk
        self._workers = Workers(model_threads, tool_threads, self.clock, max_threads)
        self._executor = ExecutorActor.start(self._workers, self.telemetry)
        self._budget = BudgetActor.start()
        self._in_flight = InFlight()
        self._admitting = threading.BoundedSemaphore(ADMIT_AHEAD)
        self._admission = AdmissionActor.start(self._journal, max_in_flight, self._in_flight)
        self._shards = [Shard() for _ in range(supervisors)]
        self._supervisors = [
            SupervisorActor.start(self._journal, self._executor, self._budget, self._workers,
                                  self._finished, self.telemetry, shard)
            for shard in self._shards]

    # -- lifecycle ---------------------------------------------------------------------
    def close(self, timeout: float = 10.0, *, drain: bool = False) -> None:
        """Cancel runs in flight, wait up to ``timeout`` for them, stop the actors and
        close the journal (when the runner opened it). With ``drain`` (a worker shutting
        down), runs in flight are not cancelled but left open as they are, for another
        runner to take over (their Futures get ``RunnerClosed``). In a child forked after
        the runner was made, it only marks the runner closed there: its runs, threads and
        journal are the parent's."""
        if os.getpid() != self._pid:
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            tokens = list(self._tokens.values())
            futures = [*self._futures.values(), *self._pending]
        self._stop_renewing.set()
        if drain:
            self._draining = True
            tokens, timeout = [], 0.0
        for token in tokens:
            token.cancel("the runner is closing")
        deadline = time.monotonic() + timeout
        for f in futures:
            try:
                f.exception(timeout=max(deadline - time.monotonic(), 0.01))
            except Exception:  # noqa: BLE001 - closing goes on whatever a run did
                pass
        refs: list[pykka.ActorRef[Any]] = [*self._supervisors, self._admission, self._executor,
                                           self._budget]
        for ref in refs:
            try:
                ref.stop(timeout=5)
            except pykka.ActorDeadError:
                pass
            except pykka.Timeout:
                # Still busy (a supervisor inside a commit that waits on another process's
                # write lock, say): its thread is a daemon and its runs stay open in the
                # journal; closing goes on, so every Future below is settled.
                pass
        with self._lock:
            futures.extend(self._pending)
            refused, self._settling = list(self._settling.values()), {}
        for settle in refused:
            settle()  # refused before admission stopped; the settle pool had not got to it
        for f in futures:
            # Runs still in flight stay open in the journal, for recover() to take over.
            _settle_closed(f)
        self._workers.close()
        self._renewer.join()
        self.telemetry.flush()
        try:
            if not self._journal.closed:
                self._journal.remove_owner(self.owner)
        except JournalError:
            pass
        if self._owns_journal and isinstance(self._journal, LmdbJournal):
            lmdb_journal.release(self._journal)
        elif self._owns_journal:
            self._journal.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Off the loop: closing waits for runs whose async callables need this very loop.
        await asyncio.to_thread(self.close)
