"""Submitting runs: now (run, submit, arun) or through the durable queue (enqueue), and
following a run of the same id that exists already (SPEC 14)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from boundloop import events as ev
from boundloop._runner.resuming import Resuming
from boundloop._runner.settle import _await_run, _chain, _fail, _settle, _settle_closed
from boundloop._runner.starting import _check_new
from boundloop.agent import Agent
from boundloop.cancel import CancelToken
from boundloop.context import Model
from boundloop.core import kinds
from boundloop.core.budget import Budget
from boundloop.core.replay import RunState
from boundloop.errors import (
    AdmissionError,
    BoundloopError,
    ConfigError,
    JournalError,
    RecoveryError,
    RunnerClosed,
    SequenceConflict,
)
from boundloop.loop import Driver, Permit, RunSpec
from boundloop.results import RunResult
from boundloop.tools import ToolLike


class Submitting(Resuming):
    """``run``, ``submit``, ``enqueue`` and their asyncio forms."""

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

        It returns without waiting for admission to decide, unless another run this caller
        (or any) submitted still waits for it: then it waits for that one first, so a burst
        of submits is paced by admission. A run admission refuses gets a Future settled
        ``rejected``.

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
            try:
                if not f.cancelled() and f.exception() is None \
                        and kinds.is_rejected(f.result().status) \
                        and f.result().model_steps == 0:
                    try:
                        taken = self._journal.find(spec.run_id) is not None
                    except JournalError:
                        taken = False
                    if taken:
                        follower = self._existing(spec)
                        if follower is not None:
                            follower.add_done_callback(lambda g: _chain(g, out))
                            return
            except Exception:  # noqa: BLE001 - a Future's callback: raised, it would be lost
                # The follow-up lookup failed: the refusal stands, rather than a Future
                # that nothing settles (it is no longer the runner's to settle at close()).
                pass
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
