"""The guest seam: another framework's agent as a boundloop model and boundloop tools.

Boundloop keeps authority: the run is a boundloop run, and the framework is asked for one
model step at a time. Each step the adapter starts the framework afresh from the run's
recorded history, with the framework's model wrapped so that it makes exactly one real
request; ``one_request`` stops the framework there when the response asks for tools, so the
framework never runs a tool itself. Its function tools are boundloop tools whose handlers call
the framework's own tool code. Nothing of a run lives in memory between steps, so a run that
a crash interrupted resumes from the journal like any other.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from boundloop.agent import Agent
from boundloop.cancel import CancelToken
from boundloop.core.budget import Budget
from boundloop.errors import ConfigError
from boundloop.messages import Final, Malformed
from boundloop.results import RunResult
from boundloop.tools import Tool, ToolContext

__all__ = ["Guest", "GuestResult", "GuestTool", "OneRequest", "current_call", "render_output"]

R = TypeVar("R")

#: Outputs kept for runs whose caller has not collected them (a worker's runs, say).
_KEPT_OUTPUTS = 1024

_CALL: contextvars.ContextVar[ToolContext | None] = contextvars.ContextVar(
    "boundloop_guest_call", default=None)


def current_call() -> ToolContext | None:
    """The ``bl.ToolContext`` of the boundloop tool call whose framework tool runs now
    (its ``idempotency_key``, ``epoch``, ``attempt``, ``deadline``), else None.

    A framework's tool function reads its idempotency key here, since the framework's own
    context knows nothing of boundloop."""
    return _CALL.get()


@dataclasses.dataclass(frozen=True)
class GuestTool:
    """A framework's function tool, as boundloop sees it.

    Attributes:
        name: the tool's name, as the model calls it.
        description: what the model is told the tool does.
        parameters: the JSON Schema of its arguments (an object schema).
        execute: ``await execute(arguments, ctx)`` runs the framework's own tool code with
            the validated arguments and returns its result; boundloop calls it for every
            attempt, retries and resumes included.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    execute: Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


@dataclasses.dataclass(frozen=True)
class GuestResult:
    """What a run of a framework's agent under boundloop gave.

    Attributes:
        result: boundloop's ``bl.RunResult`` (status, which limit ran out, counters,
            transcript, unresolved actions).
        output: the framework's own output (a validated object for a structured output)
            when the framework finished the run in this process, else None.
    """

    result: RunResult
    output: Any = None

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.result.run_id

    @property
    def status(self) -> str:
        """The run's status (``result.status``)."""
        return self.result.status


def render_output(output: Any) -> str:
    """A framework's output as the text of the run's final message: a string as it is,
    a pydantic model or dataclass or plain data as JSON."""
    if isinstance(output, str):
        return output
    dump = getattr(output, "model_dump_json", None)
    if callable(dump):
        return str(dump())
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = dataclasses.asdict(output)
    return json.dumps(output, default=str, ensure_ascii=False)


class _Stopped(Exception):
    """Raised in the framework's model call when a second request must not be sent."""


class OneRequest(Generic[R]):
    """One model step of a framework: run it until its model is asked, make that one request.

    The adapter's wrapped model calls ``await turn.request(send, convert)``: ``send()``
    makes the real request and returns the framework's response, ``convert(response)``
    gives its boundloop form. A ``bl.Final`` (the framework may accept the answer) goes back
    to the framework, which then either finishes (the step's answer is its output) or asks
    its model again (its validation refused the answer: a ``bl.Malformed`` saying so). Any
    other response (tool calls) ends the framework there: it never runs a tool itself.
    """

    def __init__(self) -> None:
        self._answer: Any = None
        self._asked_again: str | None = None
        self._done = asyncio.Event()

    async def request(self, send: Callable[[], Awaitable[R]],
                      convert: Callable[[R], Any], *, retry_reason: str | None = None) -> R:
        """What the adapter's wrapped model calls instead of making its request.

        Args:
            send: makes the framework's real request, once.
            convert: the framework's response as a boundloop response.
            retry_reason: when the framework asks a second time in one step, a plain
                sentence saying why (its validation's message), for the run's notice.
        """
        if self._done.is_set() or self._answer is not None:
            # A second request in one step: the framework refused the final-looking answer.
            self._asked_again = retry_reason or ("the agent did not accept the model's "
                                                 "answer and asked it again")
            self._done.set()
            raise _Stopped("boundloop: one model request per step")
        response = await send()
        self._answer = convert(response)
        if not isinstance(self._answer, Final):
            self._done.set()
            await asyncio.Event().wait()  # cancelled by run(): the framework stops here
        return response

    async def run(self, framework: Callable[[OneRequest[R]], Awaitable[Any]],
                  ) -> tuple[Any, Any, bool]:
        """Run ``framework(turn)`` for one step.

        Returns:
            ``(answer, output, finished)``: the boundloop response for the step, the
            framework's output, and whether the framework finished (so ``output`` is its
            own). A framework that fails before its model answered raises here (the step
            is then a model error); one that fails after a final-looking answer gives a
            ``bl.Malformed`` naming what it said.
        """
        task = asyncio.ensure_future(framework(self))
        stopped = asyncio.ensure_future(self._done.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not self._done.is_set():
                return self._finished(task)
            if self._asked_again is not None:
                return self._refused(self._asked_again), None, False
            return self._answer, None, False
        finally:
            for pending in (task, stopped):
                if not pending.done():
                    pending.cancel()
            await asyncio.gather(task, stopped, return_exceptions=True)

    def _finished(self, task: asyncio.Future[Any]) -> tuple[Any, Any, bool]:
        exc = task.exception()
        if exc is not None:
            if self._answer is None:
                raise exc
            return self._refused(f"the agent could not accept the model's answer: {exc}"
                                 ), None, False
        output = task.result()
        usage = getattr(self._answer, "usage", None)
        info = getattr(self._answer, "info", None)
        return Final(text=render_output(output), usage=usage, info=info), output, True

    def _refused(self, reason: str) -> Malformed:
        usage = getattr(self._answer, "usage", None)
        return Malformed(reason=reason, usage=usage)


class Guest(abc.ABC):
    """A framework's agent run under boundloop: subclassed once per framework.

    An adapter implements ``guest_tools`` (the framework's function tools) and ``step``
    (one model step: the framework started afresh from ``history``, most easily with
    ``OneRequest``). Everything else is given: ``agent`` (a ``bl.Agent`` for workers and
    the queue), ``run``/``arun``, ``resume``/``aresume`` and ``arun_child``/``run_child``
    (a nested run drawing on the calling run's budgets, from inside a tool).

    Args:
        name: the boundloop agent name its runs record and workers serve it by.
        budget: each run's limits (default ``bl.Budget()``).
        version: recorded with each run.
        tool_options: per tool name, options of ``bl.Tool.from_schema`` (``idempotent``,
            ``irreversible``, ``reconcile``, ``timeout_s``, ``retry``, ``needs_approval``,
            ``read_only``, ``sensitive``, ...).
        permit: ``(call, tool, ctx) -> True | False | reason`` per call.
        max_running: as ``bl.Agent``'s.
        max_queued: as ``bl.Agent``'s.

    Raises:
        ConfigError: an argument is invalid (``tool_options`` naming a tool the framework's
            agent does not have, say) when ``agent`` is first built.
    """

    def __init__(self, name: str, *, budget: Budget | None = None, version: str = "",
                 tool_options: Mapping[str, Mapping[str, Any]] | None = None,
                 permit: Callable[..., Any] | None = None, max_running: int | None = None,
                 max_queued: int = 100_000) -> None:
        self.name = name
        self.budget = budget
        self.version = version
        self.tool_options = dict(tool_options or {})
        self.permit = permit
        self.max_running = max_running
        self.max_queued = max_queued
        self._agent: Agent | None = None
        self._lock = threading.Lock()
        self._outputs: OrderedDict[str, Any] = OrderedDict()

    # -- what an adapter implements ----------------------------------------------------
    @abc.abstractmethod
    def guest_tools(self) -> Sequence[GuestTool]:
        """The framework's function tools (called once, when ``agent`` is built)."""

    @abc.abstractmethod
    async def step(self, history: list[Any], ctx: Any) -> Any:
        """One model step: the framework run afresh from ``history`` (boundloop messages)
        up to its model's one request; returns the boundloop response (see ``OneRequest``),
        after ``keep_output`` when the framework finished."""

    # -- given ------------------------------------------------------------------------
    def keep_output(self, run_id: str, output: Any) -> None:
        """Keep the framework's output of ``run_id`` for ``run``/``arun`` to return."""
        with self._lock:
            self._outputs[run_id] = output
            while len(self._outputs) > _KEPT_OUTPUTS:
                self._outputs.popitem(last=False)

    def _result(self, result: RunResult) -> GuestResult:
        with self._lock:
            output = self._outputs.pop(result.run_id, None)
        return GuestResult(result=result, output=output)

    @property
    def agent(self) -> Agent:
        """This agent as a ``bl.Agent`` (its model is ``step``; its tools the framework's)."""
        with self._lock:
            if self._agent is None:
                self._agent = Agent(self.name, model=_GuestModel(self), tools=self._tools(),
                                    budget=self.budget, version=self.version,
                                    permit=self.permit, max_running=self.max_running,
                                    max_queued=self.max_queued)
            return self._agent

    def _tools(self) -> list[Tool]:
        tools = list(self.guest_tools())
        names = {tool.name for tool in tools}
        unknown = sorted(set(self.tool_options) - names)
        if unknown:
            raise ConfigError(f"{self.name}: tool_options names {unknown}, which the agent "
                              f"does not have (its tools: {sorted(names)})")
        return [_as_tool(tool, self.tool_options.get(tool.name, {})) for tool in tools]

    def run(self, runner: Any, prompt: str | None = None, *, history: Sequence[Any] | None = None,
            run_id: str | None = None, labels: dict[str, str] | None = None,
            budget: Budget | None = None, cancel: CancelToken | None = None) -> GuestResult:
        """Run the agent to its end on ``runner`` (a ``bl.Runner``); arguments as
        ``Runner.run``'s. Call it from code that is not on an event loop (else ``arun``)."""
        return self._result(runner.run(self.agent, prompt=prompt, history=history,
                                       budget=budget, cancel=cancel, run_id=run_id,
                                       labels=labels))

    async def arun(self, runner: Any, prompt: str | None = None, *,
                   history: Sequence[Any] | None = None, run_id: str | None = None,
                   labels: dict[str, str] | None = None, budget: Budget | None = None,
                   cancel: CancelToken | None = None) -> GuestResult:
        """``run`` from asyncio code: the framework runs on the calling task's loop."""
        return self._result(await runner.arun(self.agent, prompt=prompt, history=history,
                                              budget=budget, cancel=cancel, run_id=run_id,
                                              labels=labels))

    def resume(self, runner: Any, run_id: str, *,
               cancel: CancelToken | None = None) -> GuestResult:
        """Resume a recovered run of this agent (``Runner.resume``): unresolved actions are
        settled by the tools' own means, then the framework goes on from the journal."""
        return self._result(runner.resume(run_id, self.agent, cancel=cancel))

    async def aresume(self, runner: Any, run_id: str, *,
                      cancel: CancelToken | None = None) -> GuestResult:
        """``resume`` from asyncio code."""
        return self._result(await runner.aresume(run_id, self.agent, cancel=cancel))

    async def arun_child(self, prompt: str | None = None, *,
                         history: Sequence[Any] | None = None, budget: Budget | None = None,
                         cancel: CancelToken | None = None) -> GuestResult:
        """Run this agent as a nested run of the boundloop run whose tool calls this (SPEC
        8): it draws on that run's budgets (tool calls, tokens, cost, deadline) and is
        charged to it, so delegations in parallel share one limit.

        Raises:
            ConfigError: not called from inside a tool of a boundloop run.
        """
        call = self._calling("arun_child")
        result = await call.arun_child(self.agent, prompt=prompt, history=history,
                                       budget=budget or self.budget, cancel=cancel)
        return self._result(result)

    def run_child(self, prompt: str | None = None, *, history: Sequence[Any] | None = None,
                  budget: Budget | None = None,
                  cancel: CancelToken | None = None) -> GuestResult:
        """``arun_child`` for a sync tool function running on a thread."""
        call = self._calling("run_child")
        result = call.run_child(self.agent, prompt=prompt, history=history,
                                budget=budget or self.budget, cancel=cancel)
        return self._result(result)

    def _calling(self, what: str) -> ToolContext:
        call = current_call()
        if call is None:
            raise ConfigError(f"{what} starts a nested run from inside a tool of a boundloop "
                              "run; outside one, use run or arun")
        return call

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class _GuestModel:
    """A guest's ``step`` as the run's model callable, showing the guest's ``price`` the way
    a provider adapter does (so an agent's ``price="auto"`` prices its steps by the
    catalogue, for the model each response reports)."""

    def __init__(self, guest: Guest) -> None:
        self._guest = guest

    @property
    def price(self) -> Any:
        """The guest's ``price`` (a ``bl.Price``, ``"auto"`` or None)."""
        return getattr(self._guest, "price", None)

    async def __call__(self, history: list[Any], ctx: Any) -> Any:
        return await _unless_cancelled(self._guest.step(history, ctx),
                                       getattr(ctx, "cancel", None))

    def __repr__(self) -> str:
        return f"<step of {self._guest!r}>"


async def _unless_cancelled(step: Awaitable[Any], cancel: CancelToken | None) -> Any:
    """``await step``, stopped at once (the framework and its request cancelled) when the
    run's token is cancelled: the step then answers a malformed response, which the runner
    discards as it ends the run ``cancelled`` (SPEC 5, step 4). Without this a framework's
    slow request held the run until it answered."""
    running = asyncio.ensure_future(step)
    if cancel is None:
        return await running
    loop = asyncio.get_running_loop()

    def wake() -> None:
        loop.call_soon_threadsafe(running.cancel)

    stop = cancel.on_cancel(wake)
    try:
        return await running
    except asyncio.CancelledError:
        this = asyncio.current_task()
        if this is not None and this.cancelling():
            raise  # the step itself was cancelled (its deadline, its caller)
        return Malformed("the run was cancelled while its model was asked")
    finally:
        stop()


def _as_tool(tool: GuestTool, options: Mapping[str, Any]) -> Tool:
    """``tool`` as a ``bl.Tool`` whose handler runs the framework's tool code."""
    execute = tool.execute

    async def handle(_guest_arguments: dict[str, Any], _guest_call: ToolContext) -> Any:
        token = _CALL.set(_guest_call)
        try:
            return await execute(_guest_arguments, _guest_call)
        finally:
            _CALL.reset(token)

    try:
        return Tool.from_schema(tool.name, tool.parameters, handle,
                                description=tool.description, **dict(options))
    except TypeError as exc:
        raise ConfigError(f"tool {tool.name!r}: tool_options has an option bl.Tool does not "
                          f"take ({exc})") from None
