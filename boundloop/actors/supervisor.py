"""Run supervision: drives runs' generators by performing the effects they ask for.

A supervisor never blocks: it starts an effect (a journal append, a model call, a batch of
tool calls) and goes back to its inbox; the effect's completion arrives as an EffectDone
message. A run is a suspended generator, not a thread, so a few supervisors drive many runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

import msgspec
import pykka

from boundloop.actors.budget import Settle
from boundloop.actors.messages import DispatchBatch, EffectDone, StartRun
from boundloop.actors.workers import Workers, tell
from boundloop.errors import JournalUnavailable
from boundloop.journal.base import Journal
from boundloop.loop import (
    CallUser,
    Commit,
    Dispatch,
    Effect,
    InvokeModel,
    Ledger,
    ModelReply,
    Reconcile,
    drive,
)
from boundloop.results import RunResult


class _Run(msgspec.Struct):
    gen: Generator[Effect, Any, RunResult]
    future: Future[RunResult]
    seq: int


class SupervisorActor(pykka.ThreadingActor):
    """Drives the runs given to it (``StartRun``) until each returns its RunResult."""

    # Daemon threads: a runner that is never closed must not keep the process alive.
    use_daemon_thread = True

    def __init__(self, journal: Journal, executor: pykka.ActorRef[Any],
                 budget: pykka.ActorRef[Any], workers: Workers,
                 on_finished: Callable[[str], None]) -> None:
        super().__init__()
        self.journal = journal
        self.executor = executor
        self.budget = budget
        self.workers = workers
        self.on_finished = on_finished
        self.runs: dict[str, _Run] = {}

    def on_receive(self, message: Any) -> Any:
        match message:
            case StartRun(spec=spec, future=future, seq=seq):
                run = _Run(drive(spec), future, seq)
                self.runs[spec.run_id] = run
                self._advance(spec.run_id, run, None, None)
            case EffectDone(run_id=run_id, value=value, error=error, appended=appended):
                waiting = self.runs.get(run_id)
                if waiting is not None:
                    if error is None:
                        waiting.seq += appended
                    self._advance(run_id, waiting, value, error)
        return None

    def _advance(self, run_id: str, run: _Run, value: Any, error: BaseException | None) -> None:
        try:
            effect = run.gen.throw(error) if error is not None else run.gen.send(value)
        except StopIteration as stop:
            self._done(run_id, run, stop.value, None)
            return
        except BaseException as exc:  # noqa: BLE001 - a driver bug fails its run, not the actor
            self._done(run_id, run, None, exc)
            return
        self._perform(run_id, run, effect)

    def _done(self, run_id: str, run: _Run, result: RunResult | None,
              exc: BaseException | None) -> None:
        del self.runs[run_id]
        self.on_finished(run_id)
        if exc is not None:
            run.future.set_exception(exc)
        else:
            assert result is not None
            run.future.set_result(result)

    def _perform(self, run_id: str, run: _Run, effect: Effect) -> None:
        me = self.actor_ref
        match effect:
            case Commit(events=events):
                count = len(events)

                def committed(err: BaseException | None) -> None:
                    tell(me, EffectDone(run_id, None, err, count))

                self.journal.submit(run_id, run.seq, events, committed)
            case CallUser(fn=fn, args=args):
                started = time.perf_counter()
                call = self.workers.submit(self.workers.model_pool, fn, *args)

                def answered(f: Future[Any]) -> None:
                    exc = f.exception()
                    tell(me, EffectDone(run_id, ModelReply(
                        None if exc else f.result(), exc, time.perf_counter() - started)))

                call.add_done_callback(answered)
            case InvokeModel() if self.journal.closed:
                # Fail closed: no model step the journal could not record.
                self._advance(run_id, run, None, JournalUnavailable(
                    "the journal was closed; the model was not called"))
            case InvokeModel():
                started = time.perf_counter()
                future = self.workers.submit(self.workers.model_pool, effect.model,
                                             effect.history, effect.ctx)

                def responded(f: Future[Any]) -> None:
                    latency = time.perf_counter() - started
                    exc = f.exception()
                    reply = ModelReply(None, exc, latency) if exc is not None else \
                        ModelReply(f.result(), None, latency)
                    tell(me, EffectDone(run_id, reply))

                future.add_done_callback(responded)
            case Ledger():
                def settled(reply: Any) -> None:
                    tell(me, EffectDone(run_id, reply))

                self.budget.tell(Settle(effect, settled))
            case Dispatch() | Reconcile():
                if isinstance(effect, Dispatch):
                    journal = self.journal
                    effect.recordable = lambda: not journal.closed
                def completed(outcomes: Any, err: BaseException | None) -> None:
                    tell(me, EffectDone(run_id, outcomes, err))

                self.executor.tell(DispatchBatch(effect, completed))
