"""The Runner: starts and stops the actors; run, submit, cancel, recover, resolve, resume."""

from __future__ import annotations

import asyncio
import functools
import getpass
import os
import socket
import threading
import time
import uuid
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any, Literal

import pykka

from boundloop import events as ev
from boundloop import keys, pricing
from boundloop.actors.admission import AdmissionActor
from boundloop.actors.budget import BudgetActor, Close, Left, Open
from boundloop.actors.executor import ExecutorActor
from boundloop.actors.messages import Admit, Release, StartRun
from boundloop.actors.supervisor import Shard, SupervisorActor, hung, watch
from boundloop.actors.workers import MAX_THREADS, Workers, waiting
from boundloop.agent import Agent, check_labels
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.context import Model
from boundloop.core import rules as decide
from boundloop.core.budget import Budget, Price, Remaining, Usage, carve
from boundloop.core.kinds import RunStatus
from boundloop.core.replay import ReplayError, RunState, apply, replay
from boundloop.errors import (
    AdmissionError,
    ApprovalError,
    BoundloopError,
    ConfigError,
    JournalCorrupt,
    JournalError,
    LeaseLost,
    RecoveryError,
    RunnerClosed,
    SequenceConflict,
)
from boundloop.journal import lmdb as lmdb_journal
from boundloop.journal.base import Fence, Journal, OwnerRecord, check_run_id
from boundloop.journal.lmdb import LmdbJournal
from boundloop.loop import Driver, Estimator, ParentLink, Permit, RunSpec, run_deadline
from boundloop.messages import Message, UserMessage, to_history
from boundloop.owners import owner_alive, this_process
from boundloop.policy.redact import Scrubber, digests_in, journal_safe, storable
from boundloop.recovery import RecoveredRun
from boundloop.results import RunResult
from boundloop.telemetry import Telemetry
from boundloop.tools import Tool, ToolLike

#: Statuses a run ends with that ``resume`` continues (besides runs left open).
RESUMABLE = ("needs_review", "journal_unavailable", "awaiting_approval")
#: The longest note (and 256 for a name) a person's approve or deny may carry.
MAX_NOTE = 4096
#: How often ``resume`` claims a run again when an append of its gone owner landed first.
_CLAIM_TRIES = 5
#: How many resumable runs' scrubbers a runner keeps (the oldest go first).
KEPT_SCRUBBERS = 1024


async def _await_run(future: Future[RunResult], token: CancelToken) -> RunResult:
    """Await a run's Future; a cancelled task cancels the run and waits for it to end."""
    waiting = asyncio.wrap_future(future)
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        token.cancel("the task awaiting the run was cancelled")
        while not waiting.done():
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                continue  # cancelled again: the run is ending already; keep waiting
            except Exception:  # noqa: BLE001 - the run ended; the task is cancelled anyway
                break
        raise


def _settle(future: Future[RunResult], result: RunResult) -> None:
    try:
        if not future.done():
            future.set_result(result)
    except InvalidStateError:
        pass  # the caller cancelled it meanwhile


def _fail(future: Future[RunResult], exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass  # the caller cancelled it meanwhile


def _check_new(spec: RunSpec, prompt: str | None, history: Sequence[Any] | None) -> None:
    """A run that starts needs something to start from."""
    if prompt is None and history is None:
        raise ConfigError(f"give the run a prompt= or a history= (no run {spec.run_id!r} "
                          "exists to return)")


def _chain(inner: Future[RunResult], out: Future[RunResult]) -> None:
    """Settle ``out`` as ``inner`` ended."""
    if inner.cancelled():
        _settle_closed(out)
    elif inner.exception() is not None:
        try:
            out.set_exception(inner.exception())
        except InvalidStateError:
            pass
    else:
        _settle(out, inner.result())


def _settle_closed(future: Future[RunResult]) -> None:
    try:
        if not future.done():
            future.set_exception(RunnerClosed(
                "the runner closed before the run ended; it stays open in the journal: "
                "recover() and resume() it from another runner"))
    except InvalidStateError:
        pass


def _tools(tools: Iterable[Any] | Tool | None) -> dict[str, Tool]:
    if tools is None:
        return {}
    if isinstance(tools, Tool) or (callable(tools) and not isinstance(tools, list | tuple)):
        tools = [tools]
    try:
        items = list(tools)
    except TypeError:
        raise ConfigError(f"tools must be a list of bl.Tool objects, got {tools!r}") from None
    out: dict[str, Tool] = {}
    for item in items:
        if isinstance(item, Tool):
            t = item
        elif callable(item):
            t = Tool(None, item)
        else:
            raise ConfigError(f"tools must be bl.Tool objects (or functions), got {item!r}")
        if t.name in out:
            raise ConfigError(f"two tools are named {t.name!r}; tool names must be unique")
        out[t.name] = t
    return out



def new_run_id() -> str:
    """A fresh run id: a UUIDv7 (RFC 9562) as 32 hex digits, time-ordered, so a new run's
    records land at the end of the journal's B-tree instead of all over it (pages fill
    instead of splitting in half)."""
    ms = time.time_ns() // 1_000_000 & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) & 0xFFF) << 64 | (0b10 << 62) \
        | (rand & ((1 << 62) - 1))
    return f"{value:032x}"

class Runner:
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
            self._journal: Journal = journal
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
        if hasattr(journal, "on_commit"):  # both backends time their commits
            journal.on_commit = self.telemetry.journal_commit
        if hasattr(journal, "before_sync"):  # and say when they wait for the disk
            journal.before_sync = self.telemetry.before_sync
        self._workers = Workers(model_threads, tool_threads, self.clock, max_threads)
        self._executor = ExecutorActor.start(self._workers, self.telemetry)
        self._budget = BudgetActor.start()
        self._admission = AdmissionActor.start(self._journal, max_in_flight)
        self._shards = [Shard() for _ in range(supervisors)]
        self._supervisors = [
            SupervisorActor.start(self._journal, self._executor, self._budget, self._workers,
                                  self._finished, self.telemetry, shard)
            for shard in self._shards]

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
                if state.owner != owner or (state.finished and state.status not in (
                        "needs_review", "awaiting_approval")):
                    break
        raise RecoveryError(f"run {run_id!r} was claimed by another runner")

    def _load(self, run_id: str) -> tuple[RunState, int]:
        self._journal.info(run_id)  # UnknownRun, said once for every caller
        pairs = list(self._journal.read(run_id))
        return replay(e for _, e in pairs), pairs[-1][0]

    # -- recovery ----------------------------------------------------------------------
    def recover(self, *, damaged: list[str] | None = None) -> list[RecoveredRun]:
        """Take ownership of every open run whose owner is gone, and report what each left
        unresolved. Executes nothing; ``resume`` resolves and continues a run.

        Two runners recovering at once never both take a run: a claim is an append at the
        run's last sequence number, and only one such append can succeed.

        Args:
            damaged: where to put the ids of open runs that cannot be read (they are left
                alone, and every other run is recovered). Without it such a run raises.

        Raises:
            JournalCorrupt, ReplayError: an open run cannot be read (and ``damaged`` was not
                given); nothing was claimed.
            RunnerClosed: this process is a child forked after the runner was made.
        """
        self._here()
        owners = self._journal.owners()
        # Every candidate is read before any is claimed: a run that cannot be read raises
        # here with nothing taken over (claimed runs the caller never hears of would be
        # stranded).
        loaded: list[tuple[str, RunState, int]] = []
        for run_id in self._journal.open_runs():
            with self._lock:
                if run_id in self._tokens:
                    continue
            info = self._journal.find(run_id)
            if info is None or not (info.owner == self.owner
                                    or self._owner_gone(info.owner, owners)):
                continue
            try:
                state, seq = self._load(run_id)
            except (JournalCorrupt, ReplayError):
                if damaged is None:
                    raise
                damaged.append(run_id)
                continue
            if not state.finished and not state.queued:  # queued runs are a worker's
                loaded.append((run_id, state, seq))
        out: list[RecoveredRun] = []
        for run_id, state, seq in loaded:
            if state.owner != self.owner:
                if not self._owner_gone(state.owner, owners):
                    continue  # claimed by a live runner since the index was read
                try:
                    state = self._claim(run_id, seq, state)
                except SequenceConflict:
                    continue  # another runner claimed it first, or its owner moved on
            out.append(RecoveredRun(run_id, state, state.open_actions))
        for owner, record in owners.items():
            # Owner records of gone runners are dropped: a run whose owner has no record is
            # judged gone all the same, and the table stays as small as the live fleet.
            if owner != self.owner and not owner_alive(record):
                try:
                    self._journal.remove_owner(owner)
                except JournalError:
                    break
        return out

    def resume(self, run_id: str, model: Model | Agent, tools: Sequence[ToolLike] = (),
               *,
               cancel: CancelToken | None = None, permit: Permit | None = None) -> RunResult:
        """Resolve what a recovered (or reviewed) run left open, then continue it with the
        budgets it had left; returns its RunResult (``needs_review`` when a person must
        resolve an action first, see ``resolve``).

        Raises:
            UnknownRun: no such run.
            RecoveryError: the run finished, or a live runner owns it.
        """
        return self.submit_resume(run_id, model, tools, cancel=cancel, permit=permit).result()

    def submit_resume(self, run_id: str, model: Model | Agent,
                      tools: Sequence[ToolLike] = (), *,
                      cancel: CancelToken | None = None,
                      permit: Permit | None = None) -> Future[RunResult]:
        """``resume``, returning a Future instead of waiting."""
        return self._submit_resume(run_id, model, tools, cancel, permit, None)[0]

    def _submit_resume(self, run_id: str, model: Any, tools: Sequence[Any],
                       cancel: CancelToken | None, permit: Permit | None,
                       loop: asyncio.AbstractEventLoop | None,
                       gate: Callable[[], bool] | None = None,
                       ) -> tuple[Future[RunResult], CancelToken]:
        self._here()
        with self._lock:
            if run_id in self._tokens:
                raise RecoveryError(f"run {run_id!r} is in flight on this runner")
        state, seq = self._load(run_id)
        if state.finished and state.status not in ("needs_review", "awaiting_approval"):
            raise RecoveryError(f"run {run_id!r} finished ({state.status}); only open runs and "
                                "runs that need review can be resumed")
        if isinstance(model, Agent):
            if model.name != state.agent:
                raise ConfigError(f"run {run_id!r} runs agent {state.agent!r}, not "
                                  f"{model.name!r}")
            tools = tools or model.tools
            permit = permit if permit is not None else model.permit
            model = model.model
        if state.owner != self.owner:
            if not state.finished and not self._owner_gone(state.owner,
                                                           self._journal.owners()):
                raise RecoveryError(f"run {run_id!r} is owned by the live runner "
                                    f"{state.owner!r}; resume it there")
            state, seq = self._claim_for_resume(run_id, seq, state)
            seq += 1
            if gate is not None and not gate():
                # Claimed, but it must not start here (a worker over an agent's limit):
                # it goes back to nobody, fenced at the epoch just claimed.
                self._journal.append(run_id, seq, [ev.OwnerClaimed(
                    run_id=run_id, ts=self.clock.time(), elapsed_s=state.elapsed_s,
                    owner="", epoch=state.epoch + 1)], Fence(self.owner, state.epoch))
                raise RecoveryError(f"run {run_id!r} was given back: it may not start here "
                                    "now")
        spec = self._spec(model, tools, None, None, state.budget, cancel, run_id, permit,
                          resume=state, loop=loop, scrubber=self._scrubber(run_id, state),
                          labels=state.labels, agent=state.agent,
                          agent_version=state.agent_version)
        return self._start(spec, seq, resuming=True), spec.cancel

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
        if outcome not in ("succeeded", "failed", "abandoned"):
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

    @property
    def journal(self) -> Journal:
        """The journal this runner records to."""
        return self._journal

    # -- runs --------------------------------------------------------------------------
    def run(self, model: Model | Agent, tools: Sequence[ToolLike] = (),
            prompt: str | None = None, *,
            history: Sequence[Any] | None = None, budget: Budget | None = None,
            cancel: CancelToken | None = None, run_id: str | None = None,
            permit: Permit | None = None,
            labels: dict[str, str] | None = None) -> RunResult:
        """Run to the end and return the RunResult (see ``submit`` for the arguments)."""
        return self.submit(model, tools, prompt, history=history, budget=budget,
                           cancel=cancel, run_id=run_id, permit=permit,
                           labels=labels).result()

    def submit(self, model: Model | Agent, tools: Sequence[ToolLike] = (),
               prompt: str | None = None, *,
               history: Sequence[Any] | None = None, budget: Budget | None = None,
               cancel: CancelToken | None = None, run_id: str | None = None,
               permit: Permit | None = None,
               labels: dict[str, str] | None = None) -> Future[RunResult]:
        """Start a run and return a Future of its RunResult.

        Args:
            model: ``(history, ctx) -> response`` (SPEC 2), sync or async; or a
                ``bl.Agent``, whose model, tools, budget and permit the run uses (those
                given here take their place).
            tools: the tools the model may call.
            prompt: the user's message (appended after ``history`` when both are given).
            history: earlier messages (message Structs or their dicts).
            budget: the run's limits (default ``bl.Budget()``).
            cancel: a CancelToken to stop the run from outside.
            run_id: the run's id (generated when None). An id the journal holds already
                starts nothing new: the Future is that run's (its result once it ends; a
                queued or orphaned run of the same agent is taken over and driven here).
            permit: ``(call, tool, ctx) -> True | False | reason`` per call.
            labels: ``{str: str}`` recorded with the run (``runs --label k=v``).

        Raises:
            ConfigError: an argument is invalid (nothing is journaled then).
            RunnerClosed: the runner is closed, or this process is a child forked after the
                runner was made (open a Runner in the child instead).
        """
        spec = self._spec(model, tools, prompt, history, budget, cancel, run_id, permit,
                          labels=labels)
        if run_id is None:
            return self._start(spec, 0)
        existing = self._existing(spec)
        if existing is not None:
            return existing
        _check_new(spec, prompt, history)
        return self._first(spec)

    def _first(self, spec: RunSpec) -> Future[RunResult]:
        """Start the run of a caller's id that the journal did not hold a moment ago; if
        another runner admitted that id meanwhile, this one follows that run instead of
        starting a second (SPEC 14)."""
        inner = self._start(spec, 0)
        out: Future[RunResult] = Future()

        def admitted(f: Future[RunResult]) -> None:
            if not f.cancelled() and f.exception() is None \
                    and f.result().status == "rejected" and f.result().model_steps == 0:
                try:
                    taken = self._journal.find(spec.run_id) is not None
                except JournalError:
                    taken = False
                if taken:
                    follower = self._existing(spec)
                    if follower is not None:
                        follower.add_done_callback(lambda g: _chain(g, out))
                        return
            _chain(f, out)

        inner.add_done_callback(admitted)
        out.add_done_callback(lambda f: spec.cancel.cancel("the caller cancelled the run's "
                                                           "Future") if f.cancelled() else None)
        return out

    # -- agents and the queue (SPEC 14) ------------------------------------------------
    def enqueue(self, agent: Agent, prompt: str | None = None, *,
                history: Sequence[Any] | None = None, run_id: str | None = None,
                labels: dict[str, str] | None = None, budget: Budget | None = None) -> str:
        """Put a run of ``agent`` in the journal's durable queue and return its id once the
        request is durable; any ``bl.Worker`` serving the agent (by name) starts it.

        An id the journal holds already is returned as it is: nothing is enqueued twice.

        Raises:
            ConfigError: an argument is invalid.
            AdmissionError: the queue holds ``agent.max_queued`` runs already.
            JournalError: the journal could not record the request (nothing is queued).
        """
        if not isinstance(agent, Agent):
            raise ConfigError(f"enqueue takes a bl.Agent (workers serve agents by name), got "
                              f"{agent!r}")
        spec = self._spec(agent, (), prompt, history, budget, None, run_id, None,
                          labels=labels)
        if run_id is not None and self._journal.find(spec.run_id) is not None:
            return spec.run_id
        _check_new(spec, prompt, history)
        waiting = self._queued(agent.name)
        if waiting >= agent.max_queued:
            raise AdmissionError(f"the queue of agent {agent.name!r} holds {waiting} runs, "
                                 f"its max_queued; retry later, or raise "
                                 f"bl.Agent(max_queued=...)")
        driver = Driver(spec)
        driver.admit("", queued=True)
        try:
            self._journal.append(spec.run_id, 0, driver.pending)
        except SequenceConflict:
            return spec.run_id  # enqueued (or started) by another just now: it is this id's
        with self._lock:
            if self._queue_seen is not None:
                counts = self._queue_seen[1]
                counts[agent.name] = counts.get(agent.name, 0) + 1
        return spec.run_id

    def _queued(self, agent: str) -> int:
        """How many runs of ``agent`` wait in the queue, as counted at most a second ago
        (counting reads every open run; a queue bound need not be exact to the run)."""
        now = time.monotonic()
        with self._lock:
            seen = self._queue_seen
        if seen is None or now - seen[0] > 1.0:
            counts: dict[str, int] = {}
            for run_id in self._journal.open_runs():
                info = self._journal.find(run_id)
                if info is not None and info.owner == "":
                    name = self.agent_of(run_id)
                    counts[name] = counts.get(name, 0) + 1
            seen = (now, counts)
            with self._lock:
                self._queue_seen = seen
        return seen[1].get(agent, 0)

    def agent_of(self, run_id: str) -> str:
        """The name of the agent a run runs ("" for a bare model); kept once read."""
        with self._lock:
            name = self._agents.get(run_id)
        if name is None:
            first = next(iter(self._journal.read(run_id)), None)
            name = first[1].agent if first is not None and isinstance(
                first[1], ev.RunAdmitted) else ""
            with self._lock:
                if len(self._agents) > 100_000:
                    self._agents.clear()
                self._agents[run_id] = name
        return name

    def _existing(self, spec: RunSpec) -> Future[RunResult] | None:
        """The Future of the run ``spec.run_id`` names when the journal holds it already
        (SPEC 14: a run never starts twice), else None."""
        with self._lock:
            future = self._futures.get(spec.run_id)
        if future is not None:
            return future
        try:
            if self._journal.find(spec.run_id) is None:
                return None
        except JournalError:
            return None  # admission says journal_unavailable
        out: Future[RunResult] = Future()
        with self._lock:
            if self._closed:
                raise RunnerClosed("this Runner is closed; create a new one")
            self._pending.add(out)
        threading.Thread(target=self._follow, args=(spec, out), daemon=True,
                         name=f"boundloop-follow-{spec.run_id[:16]}").start()
        return out

    def _follow(self, spec: RunSpec, out: Future[RunResult]) -> None:
        """Settle ``out`` with the result of the existing run ``spec.run_id``: at once when
        it ended (or waits for a person), else once it ends. A queued or orphaned run of
        the same agent is taken over and driven here."""
        # Never forever (SPEC 1): the caller's own deadline bounds the wait, and its cancel.
        limit = spec.budget.deadline_s
        until = None if limit is None else time.monotonic() + limit + 0.5
        try:
            while not self._closed and not out.done():
                if spec.cancel.cancelled or (until is not None and time.monotonic() > until):
                    why = "the caller cancelled" if spec.cancel.cancelled else \
                        f"it did not end within the caller's deadline_s={limit}"
                    _fail(out, AdmissionError(
                        f"run {spec.run_id!r} exists and was not started again; this call "
                        f"stopped waiting for it: {why}. It goes on as it is "
                        f"(`boundloop show {spec.run_id}`)"))
                    return
                state, _ = self._load(spec.run_id)
                if state.finished:
                    _settle(out, state.result())
                    return
                if state.agent == spec.agent and self._takeable(state):
                    try:
                        inner, _ = self._submit_resume(spec.run_id, spec.model,
                                                       list(spec.tools.values()), spec.cancel,
                                                       spec.permit, spec.loop)
                    except RecoveryError:
                        pass  # taken by another runner meanwhile: follow it there
                    else:
                        inner.add_done_callback(lambda f: _chain(f, out))
                        return
                time.sleep(0.1)
        except BoundloopError as exc:
            if not out.done():
                out.set_exception(exc)
        finally:
            with self._lock:
                self._pending.discard(out)
            if self._closed:
                _settle_closed(out)

    def _takeable(self, state: RunState) -> bool:
        """True when this runner may take the open run over: queued, or its owner gone."""
        return state.owner == "" or state.owner != self.owner and self._owner_gone(
            state.owner, self._journal.owners())

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
        if record is None or record.stage != "awaiting" \
                or state.status != "awaiting_approval":
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

    def _spec(self, model: Any, tools: Sequence[Any], prompt: str | None,
              history: Sequence[Any] | None, budget: Budget | None,
              cancel: CancelToken | None, run_id: str | None, permit: Permit | None,
              labels: dict[str, str] | None = None, **extra: Any) -> RunSpec:
        self._here()
        if self._closed:
            raise RunnerClosed("this Runner is closed; create a new one")
        extra["labels"] = check_labels(labels)
        if isinstance(model, Agent):
            agent = model
            model = agent.model
            tools = tools or agent.tools
            budget = budget if budget is not None else agent.budget
            permit = permit if permit is not None else agent.permit
            extra["agent"], extra["agent_version"] = agent.name, agent.version
        if not callable(model):
            raise ConfigError(f"model must be a callable (history, ctx) -> response, got {model!r}")
        if budget is None:
            budget = Budget()
        elif not isinstance(budget, Budget):
            raise ConfigError(f"budget must be a bl.Budget, got {budget!r}")
        if cancel is not None and not isinstance(cancel, CancelToken):
            raise ConfigError("cancel must be a bl.CancelToken")
        if permit is not None and not callable(permit):
            raise ConfigError("permit must be a callable (call, tool, ctx) -> bool | str")
        if prompt is None and history is None and "resume" not in extra and run_id is None:
            raise ConfigError("give the run a prompt= or a history=")
        if prompt is not None and not isinstance(prompt, str):
            raise ConfigError(f"prompt must be a string, got {type(prompt).__name__}")
        messages: list[Message] = to_history(list(history)) if history is not None else []
        if prompt is not None:
            messages.append(UserMessage(prompt))
        if not storable(messages):
            raise ConfigError("the prompt or history holds text that is not valid Unicode (a "
                              "lone surrogate) or an integer beyond 64 bits; the journal "
                              "cannot record it")
        extra.setdefault("scrubber", Scrubber(self._journal.secret_key))
        return RunSpec(
            run_id=check_run_id(run_id) if run_id is not None else new_run_id(),
            model=model, tools=_tools(tools), budget=budget, history=messages,
            cancel=cancel or CancelToken(), secret_key=self._journal.secret_key,
            clock=self.clock, owner=self.owner,
            lease_ok=functools.partial(self.lease_ok, self._lapses), permit=permit,
            read_only=self.read_only, price=self.price, unpriced=self.unpriced,
            estimator=self.estimator,
            run_child=self._run_child, **extra)

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

    def _start(self, spec: RunSpec, seq: int, resuming: bool = False) -> Future[RunResult]:
        self._here()
        future: Future[RunResult] = Future()
        with self._lock:
            # Under the lock that close() takes: a run is either refused here or known to
            # close(), which then settles its Future whatever happens below.
            if self._closed:
                raise RunnerClosed("this Runner is closed; create a new one")
            self._pending.add(future)
        try:
            try:
                reason = self._admission.ask(Admit(spec.run_id, resuming), block=True)
            except JournalError as exc:
                _settle(future, self._refused(spec, "journal_unavailable",
                                              f"It could not check the run's id ({exc})."))
                return future
            if reason is not None:
                _settle(future, self._refused(spec, "rejected", reason))
                return future
            with self._lock:
                self._tokens[spec.run_id] = spec.cancel
                self._futures[spec.run_id] = future
                if self._closed:
                    spec.cancel.cancel("the runner is closing")
            # Cancelling the Future cancels the run (SPEC 1); it still ends in the journal.
            token, scrubber = spec.cancel, spec.scrubber
            future.add_done_callback(
                lambda f: token.cancel("the caller cancelled the run's Future")
                if f.cancelled() else self._keep_scrubber(spec.run_id, scrubber, f))
            shard = zlib.crc32(spec.run_id.encode()) % len(self._supervisors)
            # Here, in the caller's thread or task: its current span is the run's parent.
            self.telemetry.link(spec.run_id, spec.parent_run_id)
            self._supervisors[shard].tell(StartRun(spec, future, seq))
            deadline = run_deadline(spec, self.clock.monotonic())
            if deadline is not None:
                # A commit that hangs (its supervisor's, even before it takes the run up)
                # cannot keep it past its deadline (SPEC 1).
                spec_ref, future_ref = weakref.ref(spec), weakref.ref(future)
                watch(self._shards[shard], self._workers.timer, spec.run_id, deadline,
                      future_ref, lambda took: self._dropped(spec_ref, future_ref, took))
        except pykka.ActorDeadError:
            self.telemetry.release(spec.run_id)
            _settle_closed(future)
        finally:
            with self._lock:
                self._pending.discard(future)
        return future

    def _run_child(self, link: ParentLink, execution_id: str, model: Any,
                   tools: Sequence[Any] = (), prompt: str | None = None, *,
                   history: Sequence[Any] | None = None, budget: Budget | None = None,
                   cancel: CancelToken | None = None, run_id: str | None = None,
                   permit: Permit | None = None) -> RunResult:
        """A nested run, from a handler of ``link``'s run (SPEC 8): its shared limits are the
        smaller of what it asks and what its parent (and every ancestor) has left."""
        asked = budget if budget is not None else Budget()
        if not isinstance(asked, Budget):
            raise ConfigError(f"budget must be a bl.Budget, got {asked!r}")
        self._budget.tell(Open(link.run_id, None, link.budget, link.tool_calls, link.usage,
                               link.tool_caps, link.tool_counts))
        left = self._budget.ask(Left(link.run_id), block=True)
        deadline_left = None if link.deadline is None else \
            max(link.deadline - self.clock.monotonic(), 0.0)
        carved = carve(Remaining(model_steps=asked.max_model_steps,
                                 tool_calls=left.tool_calls if left.tool_calls is not None
                                 else asked.max_tool_calls,
                                 deadline_s=deadline_left, input_tokens=left.input_tokens,
                                 output_tokens=left.output_tokens,
                                 total_tokens=left.total_tokens, cost=left.cost), asked)
        token = link.cancel.child(*([cancel] if cancel is not None else []))
        spec = self._spec(model, tools, prompt, history, carved, token, run_id, permit,
                          parent_run_id=link.run_id, parent_step=link.step,
                          parent_execution_id=execution_id, parent_deadline=link.deadline,
                          loop=link.loop, scrubber=Scrubber(self._journal.secret_key,
                                                            inherit=link.scrubber))
        self._budget.tell(Open(spec.run_id, link.run_id, carved, caps={
            name: t.max_calls for name, t in spec.tools.items() if t.max_calls is not None}))
        link.children.set()
        try:
            # A sync handler waiting here holds a pool thread: the pool adds one meanwhile,
            # so the child (and any number of waiting parents) can always proceed (SPEC 8).
            with waiting():
                return self._start(spec, 0).result()
        finally:
            self._budget.tell(Close(spec.run_id))  # a refused child never settled

    def _refused(self, spec: RunSpec, status: RunStatus, detail: str) -> RunResult:
        explanation = decide.explain(decide.Stop(status, detail=detail), spec.budget)
        return RunResult(spec.run_id, status, None, explanation, 0, 0, list(spec.history), [],
                         [], Usage(), 0.0)

    def _dropped(self, spec_ref: weakref.ref[RunSpec],
                 future_ref: weakref.ref[Future[RunResult]], took: float) -> bool:
        """The run was given up on before its supervisor, stuck in a commit, took it up:
        nothing of it ran or was written. (Both are alive: the supervisor's inbox holds
        the run's StartRun.)"""
        spec, future = spec_ref(), future_ref()
        if spec is None or future is None:
            return False
        _settle(future, self._refused(spec, "journal_unavailable",
                                      f"{hung(took)}; nothing ran."))
        self._finished(spec.run_id)
        return True

    def _finished(self, run_id: str) -> None:
        with self._lock:
            self._tokens.pop(run_id, None)
            self._futures.pop(run_id, None)
        self._admission.tell(Release(run_id))

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

    # -- asyncio -----------------------------------------------------------------------
    async def arun(self, model: Model | Agent, tools: Sequence[ToolLike] = (),
                   prompt: str | None = None, *,
                   history: Sequence[Any] | None = None, budget: Budget | None = None,
                   cancel: CancelToken | None = None, run_id: str | None = None,
                   permit: Permit | None = None,
                   labels: dict[str, str] | None = None) -> RunResult:
        """``run`` from asyncio code (SPEC 1): the run's ``async def`` models, tools,
        permits and reconcilers run on the calling task's event loop (so they may use the
        application's loop-bound clients and semaphores); sync ones on the runner's
        threads. Cancelling the awaiting task cancels the run: it ends ``cancelled`` in
        the journal, and this raises ``asyncio.CancelledError`` once it has ended."""
        spec = self._spec(model, tools, prompt, history, budget, cancel, run_id, permit,
                          labels=labels, loop=asyncio.get_running_loop())
        existing = self._existing(spec) if run_id is not None else None
        if existing is None:
            _check_new(spec, prompt, history)
        return await _await_run(existing or self._start(spec, 0), spec.cancel)

    async def aresume(self, run_id: str, model: Model | Agent,
                      tools: Sequence[ToolLike] = (), *,
                      cancel: CancelToken | None = None,
                      permit: Permit | None = None) -> RunResult:
        """``resume`` from asyncio code, on the calling task's event loop (see ``arun``)."""
        future, token = self._submit_resume(run_id, model, tools, cancel, permit,
                                            asyncio.get_running_loop())
        return await _await_run(future, token)

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Off the loop: closing waits for runs whose async callables need this very loop.
        await asyncio.to_thread(self.close)

