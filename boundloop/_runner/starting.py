"""Starting a run: its RunSpec checked and built, admitted, handed to its supervisor; a
nested run's carved budget; a refused run's result; a run's end let go of."""

from __future__ import annotations

import functools
import os
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import pykka

from boundloop._runner.base import RunnerBase
from boundloop._runner.settle import _fail, _settle, _settle_closed
from boundloop.actors.budget import Close, Left, Open
from boundloop.actors.hung_commits import hung, watch
from boundloop.actors.messages import Admit, StartRun
from boundloop.actors.workers import waiting
from boundloop.agent import Agent, check_labels
from boundloop.cancel import CancelToken
from boundloop.core import rules as decide
from boundloop.core.budget import Budget, Remaining, Usage, carve
from boundloop.core.kinds import RunStatus
from boundloop.errors import ConfigError, JournalError, RunnerClosed
from boundloop.journal.base import check_run_id
from boundloop.loop import ParentLink, Permit, RunSpec, run_deadline
from boundloop.messages import Message, UserMessage, to_history
from boundloop.policy.redact import Scrubber, storable
from boundloop.results import RunResult
from boundloop.tools import Tool

#: How many runs one runner's callers may have waiting for admission before ``submit``
#: waits for it. Admission is told, not asked, so this is the callers' backpressure: a
#: caller submitting faster than admission decides waits as an ask did (with 8, a burst of
#: hundreds of submits started at once and the soak's runs went past their deadlines on 2
#: cores); one submitting at a slower pace (or one run at a time) never waits.
ADMIT_AHEAD = 1
#: How often a caller waiting for an admission slot looks whether the runner closed.
ADMIT_LOOK_S = 0.1


def _settled_quietly(future: Future[Any], settle: Callable[[], None]) -> bool:
    """``settle()`` here when ``future`` has no done-callbacks, so that no caller's code
    runs on this thread; False, settling nothing, when it has some (or they cannot be
    read). Checked and settled under the Future's lock, so none is added in between (its
    Condition's lock is re-entrant: ``set_result`` takes it again); one added later runs
    where it is added, the Future being done."""
    with future._condition:
        if getattr(future, "_done_callbacks", None) != []:
            return False
        settle()
        return True


def _check_new(spec: RunSpec, prompt: str | None, history: Sequence[Any] | None) -> None:
    """A run that starts needs something to start from."""
    if prompt is None and history is None:
        raise ConfigError(f"give the run a prompt= or a history= (no run {spec.run_id!r} "
                          "exists to return)")



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


class Starting(RunnerBase):
    """How a run starts, whichever way it was asked for."""

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

    def _start(self, spec: RunSpec, seq: int, resuming: bool = False) -> Future[RunResult]:
        self._here()
        future: Future[RunResult] = Future()
        run_id = spec.run_id
        with self._lock:
            # Under the lock that close() takes: a run is either refused here or known to
            # close(), which then settles its Future whatever happens below. It stays in
            # _pending until admission has decided (close() may come meanwhile).
            if self._closed:
                raise RunnerClosed("this Runner is closed; create a new one")
            ahead = self._futures.get(run_id)
            if ahead is not None and not resuming and spec.parent_run_id is None:
                # A caller's id another caller started here since this one looked for it
                # (``_existing``): that run is this id's (SPEC 14), not a run to refuse.
                return ahead
            self._pending.add(future)
            # Known here at once (cancel, in_flight, resume, a second submit of the id),
            # unless another run of this id is (this is a child or a resume, the only
            # starts that get here then): admission then refuses this one (or, that
            # one gone meanwhile, admits it and registers it then: _admitted).
            mine = run_id not in self._tokens
            if mine:
                self._tokens[run_id] = spec.cancel
                self._futures[run_id] = future
        if mine:
            # Here, in the caller's thread or task: its current span is the run's parent.
            self.telemetry.link(run_id, spec.parent_run_id)
        slot = False
        try:
            # Backpressure (ADMIT_AHEAD): one slot per run, given back by _admitted. No
            # caller's code runs on admission's thread (_off_admission), so a submit never
            # waits there for the slot only that thread gives back.
            slot = self._admit_slot()
            # A tell, not an ask: this thread waits on the Future anyway, and admission
            # hands an admitted run to its supervisor itself (2 hand-offs per run less
            # than ask and tell from here: issue #21).
            self._admission.tell(Admit(run_id, functools.partial(
                self._admitted, spec, future, seq, mine, slot), resuming))
        except pykka.ActorDeadError:
            if slot:
                self._admitting.release()
            self._unstart(spec, future, mine)
            _settle_closed(future)
        except RunnerClosed:
            self._unstart(spec, future, mine)
            _settle_closed(future)
        except BaseException:
            # Interrupted (KeyboardInterrupt while it waited for a slot): the run never
            # reached admission. Its slot and its id go back, or every later submit would
            # wait for the slot, and a retry of the id would follow this Future, which
            # nothing settles; a caller that found it by its id meanwhile gets a refusal.
            if slot:
                self._admitting.release()
            self._unstart(spec, future, mine)
            _settle(future, self._refused(spec, "rejected",
                                          "the submit that started it was interrupted"))
            raise
        return future

    def _admit_slot(self) -> bool:
        """Wait for one of the ADMIT_AHEAD slots of runs waiting for admission, or raise
        RunnerClosed once the runner closes meanwhile. True when a slot was taken."""
        while not self._admitting.acquire(timeout=ADMIT_LOOK_S):
            if self._closed:
                raise RunnerClosed("this Runner closed while the run waited for admission")
        return True

    def _off_admission(self, future: Future[RunResult], settle: Callable[[], None]) -> None:
        """Settle, from admission's thread, a Future of a run it did not start: here when
        nothing waits on it but its callers (their ``result()`` returns), else on the
        runner's settle pool, so that no caller's callback runs on admission's thread (one
        that waits, for a run it submits say, would hold up every admission). The pool is
        the runner's own: a refusal never queues behind tool calls. What it has not taken
        when the runner closes, close() settles."""
        if _settled_quietly(future, settle):
            return
        with self._lock:
            self._settling[future] = settle
        self._workers.settle_pool.submit(self._settle_refused, future)

    def _settle_refused(self, future: Future[RunResult]) -> None:
        """On a settle pool thread: settle ``future`` unless close() did. Its callbacks may
        wait: meanwhile the pool has a thread more (``waiting``), so one callback that
        waits never holds up the next refusal."""
        with self._lock:
            settle = self._settling.pop(future, None)
        if settle is not None:
            with waiting():
                settle()

    def _admitted(self, spec: RunSpec, future: Future[RunResult], seq: int, mine: bool,
                  slot: bool, reason: str | None, error: BaseException | None) -> None:
        """Admission's answer, on its thread: refuse the run, or hand it to its supervisor.
        Nothing raised here may leave it: admission would stop (pykka stops an actor that
        raises on a tell), and with it every later run."""
        run_id = spec.run_id
        handed = False
        try:
            if slot:
                self._admitting.release()
            if error is not None or reason is not None:
                # Let go of the id first: the Future's callbacks (``_first``'s) look it up.
                self._unstart(spec, future, mine)
                if isinstance(error, JournalError):
                    settle = functools.partial(_settle, future, self._refused(
                        spec, "journal_unavailable", f"It could not check the run's id ({error})."))
                elif error is not None:
                    settle = functools.partial(_fail, future, error)
                else:
                    assert reason is not None
                    settle = functools.partial(_settle, future,
                                               self._refused(spec, "rejected", reason))
                self._off_admission(future, settle)
                return
            with self._lock:
                self._tokens[run_id] = spec.cancel
                self._futures[run_id] = future
                if self._closed:
                    spec.cancel.cancel("the runner is closing")
            # Cancelling the Future cancels the run (SPEC 1); it still ends in the journal.
            token, scrubber = spec.cancel, spec.scrubber
            future.add_done_callback(
                lambda f: token.cancel("the caller cancelled the run's Future")
                if f.cancelled() else self._keep_scrubber(run_id, scrubber, f))
            shard = zlib.crc32(run_id.encode()) % len(self._supervisors)
            self._supervisors[shard].tell(StartRun(spec, future, seq))
            handed = True  # from here, the run's end lets go of it (_finished)
            deadline = run_deadline(spec, self.clock.monotonic())
            if deadline is not None:
                # A commit that hangs (its supervisor's, even before it takes the run up)
                # cannot keep it past its deadline (SPEC 1).
                spec_ref, future_ref = weakref.ref(spec), weakref.ref(future)
                watch(self._shards[shard], self._workers.timer, run_id, deadline,
                      future_ref, lambda took: self._dropped(spec_ref, future_ref, took))
        except pykka.ActorDeadError:
            # Its supervisor is gone (stopped by close()): the run never started, and holds
            # neither its id nor its in-flight slot.
            self._finished(run_id)
            self.telemetry.release(run_id)
            self._off_admission(future, functools.partial(_settle_closed, future))
        except BaseException as exc:  # noqa: BLE001 - this run fails; admission serves on
            # BaseException too: pykka stops every actor in the process on a SystemExit.
            if not handed and reason is None and error is None:
                self._finished(run_id)  # admitted, never started: nothing else lets go
                self.telemetry.release(run_id)
            self._off_admission(future, functools.partial(_fail, future, exc))
        finally:
            with self._lock:
                self._pending.discard(future)

    def _unstart(self, spec: RunSpec, future: Future[RunResult], mine: bool) -> None:
        """A run that did not start: it no longer stands for its id here."""
        with self._lock:
            self._pending.discard(future)
            if not mine or self._futures.get(spec.run_id) is not future:
                return
            del self._tokens[spec.run_id], self._futures[spec.run_id]
        self.telemetry.release(spec.run_id)

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
        # Its slot is free before its Future is settled (no message to admission: #21).
        self._in_flight.discard(run_id)
