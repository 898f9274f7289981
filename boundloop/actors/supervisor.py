"""Run supervision: drives runs' generators by performing the effects they ask for.

A supervisor never blocks: it starts an effect (a journal append, a model call, a batch of
tool calls) and goes back to its inbox; the effect's completion arrives as a message. A run
is a suspended generator, not a thread, so a few supervisors drive many runs.

Failure rules (DESIGN "Supervision"): whatever goes wrong while handling one run's message
ends that run, with a status and a RunFinished when the journal can still take one, and the
actor goes on serving the others. Deadlines and cancellation of model calls are timers the
supervisor owns: a model call waiting for a thread ends as soon as the run is cancelled or
its deadline passes, and one still running is abandoned 0.5 s past the deadline (SPEC 5).

A journal commit may hang in the kernel (a frozen or hung file system): no deadline can
interrupt it. A run with a deadline is looked at from ``HUNG_AFTER_S`` past the deadline on
(``watch`` in actors/hung_commits.py, on the timer thread): a run still waiting for a
commit that has taken ``COMMIT_PATIENCE_S`` is given up on, ending ``journal_unavailable``
with nothing more written and nothing started on that commit's strength; when this
supervisor's own thread is the one stuck inside the commit, the timer thread ends the run
itself (``_evict``), under a lock that keeps it and this thread apart.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError
from typing import Any, Literal

import msgspec
import pykka
from opentelemetry.context import Context as OtelContext

from boundloop import events as ev
from boundloop.actors._base import Actor
from boundloop.actors.budget import Settle
from boundloop.actors.executor import launch_alone
from boundloop.actors.hung_commits import (
    COMMIT_PATIENCE_S,
    GRACE_S,
    Shard,
    hung,
)
from boundloop.actors.messages import DispatchBatch, EffectDone, StartRun
from boundloop.actors.workers import RunLoop, Workers, outcome, tell
from boundloop.core.inputs import AttemptFailed, RetryReserved
from boundloop.errors import JournalError, JournalUnavailable
from boundloop.journal.base import Fence, Journal, Submission
from boundloop.loop import (
    Attempt,
    CallUser,
    Commit,
    Dispatch,
    Driver,
    Effect,
    InvokeModel,
    Ledger,
    ModelReply,
    Reconcile,
)
from boundloop.results import RunResult
from boundloop.telemetry import Telemetry

#: A supervisor commits its outbox once its inbox runs dry, or at this many appends.
OUTBOX_MAX = 256

_Wall = Literal["cancel", "deadline", "grace"]


class _Run(msgspec.Struct):
    driver: Driver
    gen: Generator[Effect, Any, RunResult]
    future: Future[RunResult]
    seq: int
    failed: bool = False
    generation: int = 0
    #: The events of the commit in flight, for telemetry once they are durable.
    committing: list[ev.Event] = msgspec.field(default_factory=list)
    #: The user call (model, estimator, permit) the run waits for, if any.
    call: _UserCall | None = None
    #: Where the run's async callables run (a loop of its own, or the caller's for arun).
    loop: RunLoop = msgspec.field(default_factory=RunLoop)
    #: time.monotonic() when the commit the run waits for was queued; 0.0 when it waits
    #: for none.
    commit_at: float = 0.0


class _UserCall(msgspec.Struct):
    token: int
    deadline: float | None = None
    future: Future[Any] | None = None
    started: float = 0.0  # perf_counter at its real start; 0 while it waits for a thread
    abandoned: bool = False
    gate: threading.Lock = msgspec.field(default_factory=threading.Lock)
    unwatch: Callable[[], None] | None = None


class _UserReturned(msgspec.Struct):
    run_id: str
    token: int
    reply: ModelReply


class _UserWall(msgspec.Struct):
    run_id: str
    token: int
    why: _Wall


class _CommitWall(msgspec.Struct):
    """The run is ``HUNG_AFTER_S`` past its deadline: give up on a commit that hangs."""

    run_id: str


class _RecordAttempt(msgspec.Struct):
    run_id: str
    execution_id: str
    attempt: int
    before: list[Attempt]
    done: Callable[[BaseException | None], None]


class _AskRetry(msgspec.Struct):
    run_id: str
    failed: AttemptFailed | RetryReserved
    done: Callable[[float | None], None]


class _AttemptRecorded(msgspec.Struct):
    run_id: str
    events: list[ev.Event]
    error: BaseException | None
    done: Callable[[BaseException | None], None]


class SupervisorActor(Actor):
    """Drives the runs given to it (``StartRun``) until each returns its RunResult."""

    def __init__(self, journal: Journal, executor: pykka.ActorRef[Any],
                 budget: pykka.ActorRef[Any], workers: Workers,
                 on_finished: Callable[[str], None], telemetry: Telemetry | None = None,
                 shard: Shard | None = None) -> None:
        super().__init__()
        self.telemetry = telemetry
        self.journal = journal
        self.executor = executor
        self.budget = budget
        self.workers = workers
        self.on_finished = on_finished
        self.shard = shard if shard is not None else Shard()
        self.runs = self.shard.runs
        self.shard.evict = self._evict
        self.shard.wall = self._tell_wall
        self._tokens = itertools.count(1)
        #: Generations are unique across this supervisor's runs: a late answer to a run that
        #: was given up on never matches a later run of the same id (a resume).
        self._generations = itertools.count(1)
        #: Appends waiting for the inbox to run dry, then committed together (see _flush).
        self._outbox: list[Submission] = []
        #: While _flush commits on this thread: the completions answered meanwhile, here,
        #: handled once the commit returns (see _completed).
        self._answered: list[EffectDone] | None = None
        self._ident = 0

    def on_start(self) -> None:
        """Note the actor's thread: a commit it answers itself needs no message."""
        self._ident = threading.get_ident()

    def on_receive(self, message: Any) -> Any:
        self._receive(message)
        while self._outbox and (len(self._outbox) >= OUTBOX_MAX or self.actor_inbox.empty()):
            self._flush()
        return None

    def _receive(self, message: Any) -> None:
        run_id = message.spec.run_id if isinstance(message, StartRun) else \
            getattr(message, "run_id", None)
        try:
            self._handle(message)
        except Exception as exc:  # noqa: BLE001 - the failure rule: end this run, keep serving
            failed = self.runs.get(run_id) if isinstance(run_id, str) else None
            if failed is not None and isinstance(run_id, str):
                try:
                    self._fail(run_id, failed, exc)
                except Exception as worse:  # noqa: BLE001 - ending it failed too
                    self._abandon(run_id, failed, worse)

    def _completed(self, message: EffectDone) -> None:
        """A commit's answer: handled after the commit when this thread answered it (in
        _flush), else a message like any other (the writer thread's, say)."""
        answered = self._answered
        if answered is not None and threading.get_ident() == self._ident:
            answered.append(message)
        else:
            tell(self.actor_ref, message)

    def _flush(self, handle: bool = True) -> None:
        """Group commit from the actor's own thread: every append of the messages handled
        since the inbox last ran dry, in one transaction, without the hand-offs to a writer
        thread and back (measured: two thread wake-ups per round less). The completions it
        answers are handled right after it, without a message through the inbox (those the
        writer thread answers come as messages). A journal that raises instead of answering
        fails every append of the batch not answered yet (each is answered once).
        ``handle=False`` (the actor stopping): what it answers is dropped, as a message to a
        stopped actor would be."""
        batch, self._outbox = self._outbox, []
        shard = self.shard
        with shard.lock:
            shard.committing = time.monotonic()
        answered = self._answered = []
        try:
            self.journal.submit_many(batch)
        except Exception as exc:  # noqa: BLE001 - the failure rule: fail the appends, serve on
            err = exc if isinstance(exc, JournalError) else JournalUnavailable(
                f"the journal failed to take an append ({type(exc).__name__}: {exc})")
            for submission in batch:
                submission[3](err)
        finally:
            self._answered = None
            # Past this (it may wait while the timer thread ends a run: _evict), the runs
            # are this thread's again.
            with shard.lock:
                shard.committing = 0.0
        if handle:
            for message in answered:
                self._receive(message)

    def _abandon(self, run_id: str, run: _Run, exc: BaseException) -> None:
        """The last resort when ending a run failed: forget it here and fail its Future;
        it stays open in the journal, for recovery."""
        if self.runs.get(run_id) is run:
            del self.runs[run_id]
        self.workers.loops.release(run.loop)
        with contextlib.suppress(Exception):
            self.on_finished(run_id)
        with contextlib.suppress(InvalidStateError):
            if not run.future.done():
                run.future.set_exception(exc)

    def on_stop(self) -> None:
        """Appends still waiting go out (or fail, if the journal is closed)."""
        if self._outbox:
            self._flush(handle=False)

    def _handle(self, message: Any) -> None:
        # The messages of a round first (a class pattern is an isinstance check).
        match message:
            case EffectDone(run_id=run_id, value=value, error=error, appended=appended,
                            generation=generation):
                waiting = self.runs.get(run_id)
                if waiting is not None and waiting.generation == generation:
                    waiting.commit_at = 0.0
                    if error is None:
                        waiting.seq += appended
                        if appended:
                            self._observe(run_id, waiting, waiting.committing)
                    waiting.committing = []
                    self._advance(run_id, waiting, value, error)
            case _UserReturned(run_id=run_id, token=token, reply=reply):
                asked = self.runs.get(run_id)
                if asked is not None and asked.call is not None and asked.call.token == token:
                    self._user_answered(run_id, asked, reply)
            case StartRun(spec=spec, future=future, seq=seq):
                if future.done() and self._dropped(spec.run_id):
                    return  # ended while this thread hung in a commit (see watch)
                driver = Driver(spec)
                run = _Run(driver, driver.run(), future, seq, loop=RunLoop(spec.loop),
                           generation=next(self._generations))
                # A fact the run reads as it decides (fail closed: no model call on a closed
                # journal; nor on a runner that fenced itself, which its spec's lease says).
                driver.journal = self.journal
                self.runs[spec.run_id] = run
                limits = getattr(self.journal, "wait_limits", None)
                if driver.deadline is not None and limits is not None:
                    # Its appends may not wait for a write lock that another process keeps
                    # (paused, stuck) past the deadline's grace: they fail, and it ends
                    # journal_unavailable in time (SPEC 1). Half the grace: the rest is for
                    # ending it.
                    left = max(driver.deadline - driver.clock.monotonic(), 0.0)
                    limits[spec.run_id] = time.monotonic() + left + GRACE_S / 2
                self._advance(spec.run_id, run, None, None)
            case _UserWall(run_id=run_id, token=token, why=why):
                asked = self.runs.get(run_id)
                if asked is not None and asked.call is not None and asked.call.token == token:
                    self._wall(run_id, asked, why)
            case _CommitWall(run_id=run_id):
                late = self.runs.get(run_id)
                if late is not None and late.commit_at and \
                        time.monotonic() - late.commit_at >= COMMIT_PATIENCE_S:
                    self._give_up_commit(run_id, late)
            case _RecordAttempt():
                self._record_attempt(message)
            case _AskRetry(run_id=run_id, failed=failed, done=answer):
                asking = self.runs.get(run_id)
                if asking is None:
                    answer(None)  # the run is no longer driven here: nothing more starts
                    return
                try:
                    delay = asking.driver.may_retry(failed)
                except Exception:
                    answer(None)  # the call ends; the run fails by the failure rule
                    raise
                if isinstance(delay, Ledger):  # the run tree reserves the retry first
                    me, again = self.actor_ref, failed.execution_id
                    self.budget.tell(Settle(delay, lambda reply: tell(me, _AskRetry(
                        run_id, RetryReserved(again, reply), answer))))
                    return
                answer(delay)
            case _AttemptRecorded(run_id=run_id, events=events, error=error, done=done):
                recording = self.runs.get(run_id)
                if recording is not None and error is not None:
                    recording.seq -= len(events)
                    recording.driver.lose(events)
                elif recording is not None:
                    # Before done(): the attempt (and any child run it starts) comes after.
                    self._observe(run_id, recording, events)
                done(error)

    # -- driving -----------------------------------------------------------------------
    def _advance(self, run_id: str, run: _Run, value: Any, error: BaseException | None) -> None:
        try:
            effect = run.gen.throw(error) if error is not None else run.gen.send(value)
        except StopIteration as stop:
            self._done(run_id, run, stop.value, None)
            return
        except Exception as exc:  # noqa: BLE001 - a driver bug fails its run, not the actor
            self._fail(run_id, run, exc)
            return
        try:
            self._perform(run_id, run, effect)
        except Exception as exc:  # noqa: BLE001 - the effect could not start: tell the run
            self._advance(run_id, run, None, exc)

    def _fail(self, run_id: str, run: _Run, exc: BaseException) -> None:
        """Driving the run failed: end it with a status and a RunFinished (once)."""
        if run.failed:
            self._done(run_id, run, None, exc)
            return
        run.failed = True
        run.call = None
        run.generation = next(self._generations)  # what the failed driving waits for is ignored
        run.gen = run.driver.fail(exc)
        self._advance(run_id, run, None, None)

    def _observe(self, run_id: str, run: _Run, events: list[ev.Event]) -> None:
        """Telemetry is a projection of the events just made durable (DESIGN)."""
        if self.telemetry is not None:
            self.telemetry.observe(run_id, events, model=run.driver.spec.model,
                                   state=run.driver.state)

    def _done(self, run_id: str, run: _Run, result: RunResult | None,
              exc: BaseException | None) -> None:
        limits = getattr(self.journal, "wait_limits", None)
        if limits is not None:
            limits.pop(run_id, None)
        if self.telemetry is not None:
            self.telemetry.release(run_id, result.status if result is not None else None)
        if self.runs.get(run_id) is run:
            del self.runs[run_id]
        self.workers.loops.release(run.loop)
        self.on_finished(run_id)
        future = run.future
        try:
            if future.done():
                return  # the caller cancelled it; the run ended cancelled all the same
            if exc is not None:
                future.set_exception(exc)
            else:
                assert result is not None
                future.set_result(result)
        except InvalidStateError:
            pass  # cancelled between the check and the set

    def _perform(self, run_id: str, run: _Run, effect: Effect) -> None:
        me, generation = self.actor_ref, run.generation
        # The effects of a round first (a class pattern is an isinstance check).
        match effect:
            case Commit(events=events):
                count = len(events)
                run.committing = events
                run.commit_at = time.monotonic()

                answer = self._completed

                def committed(err: BaseException | None) -> None:
                    answer(EffectDone(run_id, None, err, count, generation))

                self._outbox.append((run_id, run.seq, events, _once(committed),
                                     self._fence(run)))
            case InvokeModel(model=model, history=history, ctx=ctx):
                # The step's chat span is current in the model call (a provider SDK's spans
                # nest under it).
                otel = None if self.telemetry is None else \
                    self.telemetry.chat_context(run_id, ctx.step)
                self._call_user(run_id, run, model, (history, ctx), ctx.deadline, ctx.cancel,
                                otel)
            case Dispatch() | Reconcile():
                effect.loop = run.loop
                if isinstance(effect, Dispatch):
                    journal = self.journal
                    effect.recordable = lambda: not journal.closed
                    effect.leased = run.driver.spec.lease_ok
                    effect.record = lambda eid, attempt, before, done: tell(
                        me, _RecordAttempt(run_id, eid, attempt, before, done))
                    effect.retry = lambda failed, done: tell(
                        me, _AskRetry(run_id, failed, done))

                def completed(outcomes: Any, err: BaseException | None) -> None:
                    tell(me, EffectDone(run_id, outcomes, err, generation=generation))

                if not (isinstance(effect, Dispatch) and launch_alone(
                        self.executor, self.workers, self.telemetry, effect, completed)):
                    self.executor.tell(DispatchBatch(effect, completed))
            case CallUser(fn=fn, args=args, deadline=deadline, cancel=cancel):
                self._call_user(run_id, run, fn, args, deadline, cancel)
            case Ledger():
                def settled(reply: Any) -> None:
                    tell(me, EffectDone(run_id, reply, generation=generation))

                self.budget.tell(Settle(effect, settled))

    # -- commits that hang past the deadline --------------------------------------------
    def _tell_wall(self, run_id: str) -> None:
        tell(self.actor_ref, _CommitWall(run_id))

    def _dropped(self, run_id: str) -> bool:
        with self.shard.lock:
            if run_id in self.shard.dropped:
                self.shard.dropped.discard(run_id)
                return True
        return False

    def _give_up_commit(self, run_id: str, run: _Run) -> None:
        """The run waits for a commit that hangs past its deadline: end it now. Nothing the
        commit was for is started: its answer, should it ever come, is ignored."""
        took = time.monotonic() - run.commit_at
        run.generation = next(self._generations)
        run.commit_at = 0.0
        run.committing = []
        self._advance(run_id, run, None, hung(took))

    def _evict(self, run_id: str, run: _Run, took: float) -> None:
        """End ``run`` from the timer thread while this supervisor's own thread is stuck
        inside a journal commit (under the shard's lock, so that thread touches no run meanwhile):
        the run ends journal_unavailable with nothing more written, as the events it has
        not seen committed left it. Its messages that come later find no run and are
        ignored; nothing is started for it."""
        call = run.call
        if call is not None:
            with call.gate:
                call.abandoned = True
            if call.started and call.future is not None:
                self.workers.compensate(call.future)
            if call.unwatch is not None:
                call.unwatch()
            run.call = None
        run.generation = next(self._generations)
        run.driver.lose(run.committing)
        run.committing = []
        result = run.driver.unavailable(str(hung(took)))
        self._done(run_id, run, result, None)

    # -- user calls under the deadline wall -------------------------------------------
    def _call_user(self, run_id: str, run: _Run, fn: Callable[..., Any],
                   args: tuple[Any, ...], deadline: float | None, cancel: Any,
                   otel: OtelContext | None = None) -> None:
        me, token = self.actor_ref, next(self._tokens)
        call = _UserCall(token, deadline)

        def on_start() -> bool:
            with call.gate:
                if call.abandoned:
                    return False
                call.started = time.perf_counter()
                return True

        future = call.future = self.workers.start(self.workers.model_pool, fn, args, {},
                                                  on_start, loop=run.loop, context=otel)
        run.call = call

        def returned(f: Future[Any]) -> None:
            value, exc = outcome(f)
            latency = time.perf_counter() - call.started if call.started else 0.0
            reply = ModelReply(value, exc, latency)
            tell(me, _UserReturned(run_id, token, reply))

        future.add_done_callback(returned)
        if cancel is not None:
            call.unwatch = cancel.on_cancel(lambda: tell(me, _UserWall(run_id, token,
                                                                       "cancel")))
        if deadline is not None:
            self.workers.timer.at(deadline, lambda: tell(me, _UserWall(run_id, token,
                                                                       "deadline")))

    def _wall(self, run_id: str, run: _Run, why: _Wall) -> None:
        call = run.call
        assert call is not None
        with call.gate:
            waiting = call.started == 0.0
            if waiting or why == "grace":
                call.abandoned = True
        if why == "deadline" and not waiting:
            me, token = self.actor_ref, call.token
            assert call.deadline is not None
            self.workers.timer.at(call.deadline + GRACE_S,
                                  lambda: tell(me, _UserWall(run_id, token, "grace")))
            return
        if not call.abandoned:
            return  # cancelled while the model works: its answer is discarded (SPEC 5.4)
        if not waiting and call.future is not None:
            # It may never return: its thread is replaced so it holds up no other run.
            self.workers.compensate(call.future)
        latency = time.perf_counter() - call.started if call.started else 0.0
        self._user_answered(run_id, run, ModelReply(
            None, TimeoutError("abandoned at the run's deadline" if why != "cancel"
                               else "abandoned: the run was cancelled"),
            latency, abandoned="cancelled" if why == "cancel" else "deadline"))

    def _user_answered(self, run_id: str, run: _Run, reply: ModelReply) -> None:
        call = run.call
        run.call = None
        if call is not None and call.unwatch is not None:
            call.unwatch()
        self._advance(run_id, run, reply, None)

    # -- attempts that start mid-batch -------------------------------------------------
    def _record_attempt(self, m: _RecordAttempt) -> None:
        run = self.runs.get(m.run_id)
        if run is None:
            m.done(JournalUnavailable("the run is no longer driven here"))
            return
        try:
            events = run.driver.attempt_events(m.execution_id, m.attempt, m.before)
        except Exception as exc:
            m.done(exc)  # the attempt does not start; the run fails by the failure rule
            raise
        me = self.actor_ref

        def committed(err: BaseException | None) -> None:
            tell(me, _AttemptRecorded(m.run_id, events, err, m.done))

        seq = run.seq
        run.seq += len(events)
        self._outbox.append((m.run_id, seq, events, _once(committed), self._fence(run)))

    @staticmethod
    def _fence(run: _Run) -> Fence | None:
        """Every append of a run is fenced by its owner and epoch (SPEC 6); the admission
        has no owner to check yet (a run id taken meanwhile is a sequence conflict)."""
        if run.seq == 0:
            return None
        # A run that ends its turn awaiting approval gives up its ownership in the same
        # append (an OwnerClaimed with no owner, already folded): fenced at the epoch before.
        epoch = run.driver.state.epoch - (1 if run.driver.releasing else 0)
        return Fence(run.driver.spec.owner, epoch)



def _once(done: Callable[[BaseException | None], None]) -> Callable[[BaseException | None],
                                                                   None]:
    """``done``, answered at most once (whichever thread answers first)."""
    box = [done]

    def answer(err: BaseException | None) -> None:
        try:
            fn = box.pop()  # atomic: a second answer finds the box empty
        except IndexError:
            return
        fn(err)

    return answer
