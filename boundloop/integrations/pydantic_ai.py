"""A Pydantic AI agent run under boundloop's budgets and journal (``boundloop[pydantic-ai]``).

```python
from pydantic_ai import Agent
from boundloop.integrations.pydantic_ai import BoundloopAgent

agent = Agent("openai:gpt-4.1", name="support", tools=[lookup, refund])
bound = BoundloopAgent(agent, budget=bl.Budget(max_tool_calls=9),
                       tool_options={"refund": {"irreversible": True}})
with bl.Runner("journal") as runner:
    out = bound.run(runner, "Refund order 42")      # out.status, out.output, out.result
```

How it works (the guest seam of ``boundloop.integrations``): boundloop drives the run. Each
model step starts the Pydantic AI agent afresh from the run's recorded history (converted to
Pydantic AI messages), with its model wrapped so that exactly one real request is made; a
response that asks for function tools stops the agent there, so Pydantic AI never runs a
tool itself. Its function tools are boundloop tools: boundloop decides each call, journals
the intent, dispatches it (the tool function runs through the agent's own toolset, with a
``RunContext`` carrying ``deps``), times it out, retries it under one idempotency key and,
after a crash, settles it by the tool's own means. A response the agent may accept as its
output (text, or its output tool) is handed back to the agent: its output validation either
accepts it (the run ends ``final``; the validated output is ``GuestResult.output``) or asks
the model again, which ends the step as a malformed response (``Budget(malformed_retries=N)``
lets the run go on, the reason given to the model as a notice).

Inside a tool, ``boundloop.integrations.current_call()`` gives the call's ``bl.ToolContext``
(``idempotency_key``, ``epoch``, ``attempt``), and ``await other.arun_child(prompt)`` runs
another ``BoundloopAgent`` as a nested run charged to this run's budgets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from boundloop.core import kinds
from boundloop.core.budget import Budget, Usage
from boundloop.errors import ConfigError
from boundloop.messages import CallTools, Final, ToolCall
from boundloop.models._common import (
    AssistantText,
    OrphanResult,
    ToolStep,
    UserTurn,
    group_history,
    make_usage,
    parse_arguments,
    request_timeout,
    response_info,
    result_text,
)
from boundloop.pricing import PriceOption, check_price
from boundloop.tools import ToolContext

from ._guest import Guest, GuestTool, OneRequest

try:
    import pydantic_ai
    import pydantic_core
    from pydantic_ai import messages as pm
    from pydantic_ai.models import (
        CompletedStreamedResponse,
        Model,
        ModelRequestParameters,
        StreamedResponse,
        infer_model,
    )
    from pydantic_ai.models.wrapper import WrapperModel
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import RunContext
    from pydantic_ai.toolsets import FunctionToolset
    from pydantic_ai.usage import RequestUsage, RunUsage
except ImportError:  # pragma: no cover - exercised in a subprocess by the tests
    raise ConfigError(
        "boundloop.integrations.pydantic_ai needs the `pydantic_ai` package, which is not "
        "installed: pip install 'boundloop[pydantic-ai]'") from None

__all__ = ["BoundloopAgent"]

#: The key of the ``content`` a step's assistant message carries (the Pydantic AI response).
_CONTENT_KEY = "pydantic_ai"

#: How boundloop's tool result statuses reach the model, as Pydantic AI tool return outcomes.
_OUTCOMES: dict[str, str] = {
    "ok": "success",
    "error": "failed",
    "denied": "denied",
    "invalid_arguments": "retried",
    "unknown_tool": "retried",
    "outcome_unknown": "failed",
    "too_large": "failed",
}

#: How many runs' locks an agent with a sequential tool keeps (the oldest go first).
_SERIAL_RUNS = 1024

#: A tool that raised ``ModelRetry`` has the ``error`` content ``"ModelRetry: <message>"``.
_MODEL_RETRY = "ModelRetry: "


class BoundloopAgent(Guest):
    """A ``pydantic_ai.Agent`` as a boundloop agent: every model request and tool call of
    its runs is decided, journaled and counted by boundloop.

    Args:
        agent: the Pydantic AI agent, unmodified (its model, instructions, system prompts,
            function tools, output type and output validators are used as they are).
        name: the boundloop agent name (default ``agent.name``; one of them must be set).
        budget: each run's limits (default ``bl.Budget()``).
        version: recorded with each run.
        deps: the agent's dependencies, given to its tools and prompts in every step and
            every tool call.
        deps_factory: instead of ``deps``, ``deps_factory(run_id)`` (sync or async) makes
            them for each step and each tool call: for dependencies that must be built in
            the process that resumes a run (clients, connections).
        model: the Pydantic AI model to use instead of ``agent.model`` (a ``Model`` or a
            model name). An ``agent.override(model=...)`` around the run is not seen:
            give the model here.
        model_settings: Pydantic AI model settings for every request (merged over the
            agent's own, as ``Agent.run`` does).
        price: a ``bl.Price`` to compute each step's cost (for ``max_cost``), or
            ``"auto"``: the genai-prices catalogue prices each step by the model name its
            response reports (as ``Runner(price="auto")`` does for every run).
        tool_options: per tool name, options of ``bl.Tool.from_schema`` (``idempotent``,
            ``irreversible``, ``reconcile``, ``timeout_s``, ``retry``, ``needs_approval``,
            ``read_only``, ``sensitive``). A tool made with ``requires_approval=True``
            needs a person's approval (SPEC 14) unless ``needs_approval`` says otherwise;
            a tool's own ``timeout`` is its default ``timeout_s``.
        permit: ``(call, tool, ctx) -> True | False | reason`` per call, as ``bl.Agent``'s.
        max_running: as ``bl.Agent``'s.
        max_queued: as ``bl.Agent``'s.

    Raises:
        ConfigError: no name; ``deps`` and ``deps_factory`` both given; the agent has a
            toolset that is not a function toolset (MCP servers and other toolsets are
            not run under boundloop yet); ``tool_options`` names an unknown tool (when
            ``.agent`` is first built).
    """

    def __init__(self, agent: pydantic_ai.Agent[Any, Any], *, name: str | None = None,
                 budget: Budget | None = None, version: str = "", deps: Any = None,
                 deps_factory: Callable[[str], Any] | None = None,
                 model: Model | str | None = None,
                 model_settings: ModelSettings | None = None, price: PriceOption = None,
                 tool_options: Mapping[str, Mapping[str, Any]] | None = None,
                 permit: Callable[..., Any] | None = None, max_running: int | None = None,
                 max_queued: int = 100_000) -> None:
        if not isinstance(agent, pydantic_ai.Agent):
            raise ConfigError(f"BoundloopAgent wraps a pydantic_ai.Agent, not "
                              f"{type(agent).__name__}")
        name = name if name is not None else agent.name
        if not name:
            raise ConfigError("BoundloopAgent needs a name: give name=..., or create the "
                              "pydantic_ai.Agent with name=...")
        if deps is not None and deps_factory is not None:
            raise ConfigError("BoundloopAgent takes deps or deps_factory, not both")
        price = check_price(price, "BoundloopAgent")
        super().__init__(name, budget=budget, version=version, tool_options=tool_options,
                         permit=permit, max_running=max_running, max_queued=max_queued)
        self.pydantic_agent = agent
        self.deps = deps
        self.deps_factory = deps_factory
        self.model = model
        self.model_settings = model_settings
        self.price = price
        self._inferred: Model | None = None
        #: True when a tool of the agent is ``sequential``: then a run's calls run one at a
        #: time (Pydantic AI runs a step holding one such call one call at a time).
        self._serial = False
        self._serial_locks: OrderedDict[str, asyncio.Lock] = OrderedDict()

    # -- the framework's model and dependencies ------------------------------------------------
    def _framework_model(self) -> Model:
        """The agent's model (a model name made a ``Model`` once, so its client is kept)."""
        if self._inferred is None:
            chosen = self.model if self.model is not None else self.pydantic_agent.model
            if chosen is None:
                raise ConfigError(f"{self.name}: the pydantic_ai.Agent has no model: give "
                                  "BoundloopAgent(model=...) or create the agent with one")
            self._inferred = infer_model(chosen)
        return self._inferred

    async def _deps(self, run_id: str) -> Any:
        if self.deps_factory is None:
            return self.deps
        made = self.deps_factory(run_id)
        if inspect.isawaitable(made):
            made = await made
        return made

    # -- tools -----------------------------------------------------------------------------------
    def guest_tools(self) -> list[GuestTool]:
        """The agent's function tools (those registered on it and its function toolsets)."""
        tools: list[GuestTool] = []
        for toolset in self.pydantic_agent.toolsets:
            if not isinstance(toolset, FunctionToolset):
                raise ConfigError(
                    f"{self.name}: the agent has a toolset boundloop cannot run "
                    f"({type(toolset).__name__}); only function tools are run under "
                    "boundloop for now")
            for tool_name, tool in toolset.tools.items():
                definition = tool.tool_def
                if any(t.name == definition.name for t in tools):
                    raise ConfigError(f"{self.name}: two tools are named {definition.name!r}")
                tools.append(GuestTool(definition.name, definition.description or "",
                                       dict(definition.parameters_json_schema),
                                       self._executor(toolset, tool_name)))
                self._default_options(definition.name, tool.requires_approval,
                                      definition.timeout)
                self._serial = self._serial or bool(getattr(tool, "sequential", False))
        return tools

    def _serial_lock(self, run_id: str) -> asyncio.Lock:
        """The lock a run's calls take one at a time when the agent has a sequential tool
        (a run's tools all run on its one event loop)."""
        lock = self._serial_locks.get(run_id)
        if lock is None:
            lock = self._serial_locks[run_id] = asyncio.Lock()
            while len(self._serial_locks) > _SERIAL_RUNS:
                self._serial_locks.popitem(last=False)
        return lock

    def _default_options(self, name: str, requires_approval: bool,
                         timeout: float | None) -> None:
        """The tool's own Pydantic AI settings, as boundloop options it did not set."""
        options = dict(self.tool_options.get(name, {}))
        if requires_approval:
            options.setdefault("needs_approval", True)
        if timeout is not None:
            options.setdefault("timeout_s", float(timeout))
        if options:
            self.tool_options[name] = options

    def _executor(self, toolset: FunctionToolset[Any], name: str,
                  ) -> Callable[[dict[str, Any], ToolContext], Awaitable[Any]]:
        """``execute`` of the tool ``name``: its function run through the agent's toolset,
        with a ``RunContext`` carrying the deps, the call's id and its attempt."""

        async def execute(arguments: dict[str, Any], call: ToolContext) -> Any:
            if self._serial:
                async with self._serial_lock(call.run_id):
                    return await run(arguments, call)
            return await run(arguments, call)

        async def run(arguments: dict[str, Any], call: ToolContext) -> Any:
            ctx: RunContext[Any] = RunContext(
                deps=await self._deps(call.run_id), model=self._framework_model(),
                usage=RunUsage(), agent=self.pydantic_agent, run_id=call.run_id)
            found = await toolset.get_tools(ctx)
            tool = next((t for t in found.values()
                         if getattr(t, "original_name", None) == name), found.get(name))
            if tool is None:
                raise ConfigError(f"the agent's tool {name!r} is not available now (its "
                                  "prepare function withheld it)")
            ctx = dataclasses.replace(ctx, tool_name=tool.tool_def.name,
                                      tool_call_id=call.call_id, retry=call.attempt - 1,
                                      max_retries=tool.max_retries)
            try:
                args = tool.args_validator.validate_python(arguments)
            except pydantic_core.ValidationError as exc:
                # As Pydantic AI answers arguments its validator refuses: a retry.
                raise pydantic_ai.ModelRetry(_feedback_text(exc.errors())) from None
            if tool.args_validator_func is not None:
                checked = tool.args_validator_func(ctx, **args)
                if inspect.isawaitable(checked):
                    await checked
            return _storable(await toolset.call_tool(tool.tool_def.name, args, ctx, tool))

        return execute

    # -- one model step --------------------------------------------------------------------------
    async def step(self, history: list[Any], ctx: Any) -> Any:
        """One model step: the agent started afresh from ``history``, one real request."""
        messages, prompt = _to_messages(history)
        turn: OneRequest[pm.ModelResponse] = OneRequest()
        model = _StepModel(self._framework_model(), turn, self, ctx,
                           keep_system=not _has_system(messages),
                           replay=_pending_output(history))
        deps = await self._deps(ctx.run_id)
        agent = self.pydantic_agent
        settings = self._settings(getattr(ctx, "deadline", None))

        async def framework(_turn: OneRequest[pm.ModelResponse]) -> Any:
            with agent.override(model=model):
                result = await agent.run(prompt, message_history=messages or None, deps=deps,
                                         model_settings=settings)
            return result.output

        answer, output, finished = await turn.run(framework)
        if finished:
            self.keep_output(ctx.run_id, output)
        return answer

    def _settings(self, deadline: float | None) -> ModelSettings | None:
        """The model settings of a step: the request's ``timeout`` ends by the run's
        deadline (SPEC 13), so the HTTP call does not outlive the run."""
        settings = ModelSettings(**(self.model_settings or {}))
        given = settings.get("timeout")
        if deadline is None or not (given is None or isinstance(given, int | float)):
            return self.model_settings
        settings["timeout"] = request_timeout(deadline, given)
        return settings

    def convert(self, response: pm.ModelResponse, params: ModelRequestParameters,
                system: list[Any] | None) -> Any:
        """The framework's response as boundloop's: its function tool calls, else a final
        answer for the agent to accept (its text, or its output tool's call)."""
        output_tools = {tool.name for tool in params.output_tools}
        calls = [part for part in response.parts if isinstance(part, pm.ToolCallPart)]
        function_calls = [c for c in calls if c.tool_name not in output_tools]
        ends = any(c.tool_name in output_tools for c in calls)
        text = "".join(p.content for p in response.parts if isinstance(p, pm.TextPart))
        usage = self._usage(response.usage)
        info = response_info(response.provider_response_id, response.model_name,
                             response.finish_reason)
        if not function_calls or (ends and self.pydantic_agent.end_strategy == "early"):
            return Final(text, usage=usage, info=info)
        kept = [p for p in response.parts
                if not isinstance(p, pm.ToolCallPart) or p.tool_name not in output_tools]
        stored = dataclasses.replace(response, parts=kept)
        content: dict[str, Any] = {
            "response": pm.ModelMessagesTypeAdapter.dump_python([stored], mode="json")[0]}
        if system:
            content["system"] = system
        if ends:
            # The agent's strategy ('graceful', 'exhaustive') runs the function tools first,
            # then ends with this output: kept for the next step to hand back to the agent.
            pending = dataclasses.replace(response, parts=[
                p for p in calls if p.tool_name in output_tools], usage=RequestUsage())
            content["output"] = pm.ModelMessagesTypeAdapter.dump_python(
                [pending], mode="json")[0]
        return CallTools(
            [ToolCall(c.tool_call_id, c.tool_name, _arguments(c.args)) for c in function_calls],
            usage=usage, text=text or None, content={_CONTENT_KEY: content}, info=info)

    def _usage(self, usage: Any) -> Usage:
        read = int(getattr(usage, "cache_read_tokens", 0) or 0)
        write = int(getattr(usage, "cache_write_tokens", 0) or 0)
        total_input = int(getattr(usage, "input_tokens", 0) or 0)
        return make_usage(max(total_input - read - write, 0),
                          getattr(usage, "output_tokens", 0), write, read, price=self.price)


class _StepModel(WrapperModel):
    """The agent's model for one step: its one request goes through ``OneRequest``."""

    def __init__(self, wrapped: Model, turn: OneRequest[pm.ModelResponse],
                 guest: BoundloopAgent, ctx: Any, *, keep_system: bool,
                 replay: pm.ModelResponse | None = None) -> None:
        super().__init__(wrapped)
        self._turn = turn
        self._guest = guest
        self._ctx = ctx
        self._keep_system = keep_system
        self._replay = replay

    async def request(self, messages: list[pm.ModelMessage],
                      model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters,
                      ) -> pm.ModelResponse:
        params = model_request_parameters
        if not getattr(self._ctx, "tools_allowed", True):
            # The final-only step: the model is offered no function tool (SPEC 5, step 2).
            params = dataclasses.replace(params, function_tools=[])
        system = _system_parts(messages) if self._keep_system else None

        async def send() -> pm.ModelResponse:
            if self._replay is not None:
                # The output the model gave with the calls just run: no new request.
                return self._replay
            return await self.wrapped.request(messages, model_settings, params)

        return await self._turn.request(
            send, lambda response: self._guest.convert(response, params, system),
            retry_reason=_retry_reason(messages))

    @asynccontextmanager
    async def request_stream(self, messages: list[pm.ModelMessage],
                             model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None,
                             ) -> AsyncIterator[StreamedResponse]:
        """A streamed request (a capability of the agent may ask for one) is made as one
        whole request, then replayed as the stream's events."""
        response = await self.request(messages, model_settings, model_request_parameters)
        yield CompletedStreamedResponse(response,
                                        model_request_parameters=model_request_parameters,
                                        replay_events=True)


# --- history: boundloop messages -> Pydantic AI messages ---------------------------------------

def _to_messages(history: list[Any]) -> tuple[list[pm.ModelMessage], str | None]:
    """The history as Pydantic AI messages, and the prompt to run them with.

    A history of user text only (the first step, or one after malformed responses) becomes
    the prompt, so the agent adds its system prompts as it does for a new run; the system
    prompts it sent then are kept with the step's response and put back in later steps."""
    turns = group_history(history)
    if all(isinstance(t, UserTurn) for t in turns):
        return [], "\n\n".join(t.text for t in turns if isinstance(t, UserTurn))
    messages: list[pm.ModelMessage] = []
    pending: list[pm.ModelRequestPart] = []
    system: list[pm.SystemPromptPart] = []

    def flush() -> None:
        if pending:
            messages.append(pm.ModelRequest(parts=list(pending)))
            pending.clear()

    for turn in turns:
        if isinstance(turn, UserTurn):
            pending.append(pm.UserPromptPart(turn.text))
        elif isinstance(turn, OrphanResult):
            pending.append(pm.UserPromptPart(result_text(getattr(turn.result, "content", ""))))
        elif isinstance(turn, AssistantText):
            flush()
            messages.append(pm.ModelResponse(parts=[pm.TextPart(turn.text)]))
        elif isinstance(turn, ToolStep):
            flush()
            response, kept_system = _response_of(turn)
            if kept_system and not system:
                system = kept_system
            messages.append(response)
            for call, result in turn.paired():
                pending.append(_tool_return(call, result))
    flush()
    if system:
        first = messages[0] if messages else None
        if isinstance(first, pm.ModelRequest):
            messages[0] = dataclasses.replace(first, parts=[*system, *first.parts])
        else:
            messages.insert(0, pm.ModelRequest(parts=list(system)))
    return messages, None


def _pending_output(history: list[Any]) -> pm.ModelResponse | None:
    """The output the model gave alongside the function calls of the last step, when the
    history ends with that step and all its calls succeeded: the agent ends with it then
    (a tool's ModelRetry, or any failure, suppresses it, as in Pydantic AI)."""
    turns = group_history(history)
    last = turns[-1] if turns else None
    if not isinstance(last, ToolStep) or not isinstance(last.content, Mapping):
        return None
    content = last.content.get(_CONTENT_KEY)
    if not isinstance(content, Mapping) or not content.get("output"):
        return None
    if any(result is None or not kinds.is_ok(getattr(result, "status", None))
           for _, result in last.paired()):
        return None
    try:
        loaded = pm.ModelMessagesTypeAdapter.validate_python([content["output"]])[0]
    except Exception:  # noqa: BLE001 - unreadable: the model is asked again
        return None
    return loaded if isinstance(loaded, pm.ModelResponse) else None


def _response_of(step: ToolStep) -> tuple[pm.ModelResponse, list[pm.SystemPromptPart]]:
    """The step's Pydantic AI response: the one kept in its content when it matches its
    calls, else one rebuilt from its text and calls; and the system prompts kept with it."""
    ids = [str(getattr(call, "id", "")) for call in step.calls]
    content = step.content.get(_CONTENT_KEY) if isinstance(step.content, Mapping) else None
    system: list[pm.SystemPromptPart] = []
    if isinstance(content, Mapping):
        try:
            kept = pm.ModelMessagesTypeAdapter.validate_python([content["response"]])[0]
            if content.get("system"):
                loaded = pm.ModelMessagesTypeAdapter.validate_python(
                    [{"kind": "request", "parts": content["system"]}])[0]
                system = [p for p in loaded.parts if isinstance(p, pm.SystemPromptPart)]
        except Exception:  # noqa: BLE001 - an unreadable response is rebuilt from the calls
            kept = None
        if isinstance(kept, pm.ModelResponse) and [
                p.tool_call_id for p in kept.parts if isinstance(p, pm.ToolCallPart)] == ids:
            return kept, system
    parts: list[pm.ModelResponsePart] = []
    if step.text:
        parts.append(pm.TextPart(step.text))
    for call in step.calls:
        parts.append(pm.ToolCallPart(str(call.name), dict(call.arguments or {}),
                                     tool_call_id=str(call.id)))
    return pm.ModelResponse(parts=parts), system


def _tool_return(call: Any, result: Any) -> pm.ToolReturnPart:
    """A call's boundloop result as the tool return Pydantic AI sends its model."""
    if result is None:
        return pm.ToolReturnPart(str(call.name), pm.INTERRUPTED_TOOL_RETURN_CONTENT,
                                 tool_call_id=str(call.id), outcome="interrupted")
    status = str(getattr(result, "status", "ok"))
    content = getattr(result, "content", None)
    outcome = _OUTCOMES.get(status, "failed")
    if kinds.is_error(status) and isinstance(content, str) and content.startswith(_MODEL_RETRY):
        outcome, content = "retried", content[len(_MODEL_RETRY):]
    if outcome != "success":
        content = result_text(content)
    return pm.ToolReturnPart(str(call.name), content, tool_call_id=str(call.id),
                             outcome=outcome)  # type: ignore[arg-type]


def _storable(result: Any) -> Any:
    """A tool's return as the JSON data Pydantic AI would send its model (a pydantic model
    or dataclass as its fields, a datetime as ISO text); a ``ToolReturn``'s return value.
    So the journal keeps, and the model later sees, what it sees in a plain run."""
    if isinstance(result, pydantic_ai.ToolReturn):
        result = result.return_value
    if isinstance(result, str | int | float | bool | bytes) or result is None:
        return result
    # The tool has run: nothing here may turn its call into a failure (and a retry).
    try:
        return pydantic_core.to_jsonable_python(result, fallback=str)
    except Exception:  # noqa: BLE001 - bytes that are not UTF-8 inside a structure, say
        try:
            return pydantic_core.to_jsonable_python(result, fallback=str, bytes_mode="base64")
        except Exception:  # noqa: BLE001
            return repr(result)


def _arguments(args: Any) -> Any:
    """A call's arguments as a dict (JSON text decoded; text that is not JSON is left as
    it is, so boundloop reports the response malformed, naming the call)."""
    return dict(args) if isinstance(args, Mapping) else parse_arguments(args)


def _has_system(messages: list[pm.ModelMessage]) -> bool:
    return any(isinstance(part, pm.SystemPromptPart) for message in messages
               if isinstance(message, pm.ModelRequest) for part in message.parts)


def _system_parts(messages: list[pm.ModelMessage]) -> list[Any] | None:
    """The system prompts of the first request, as JSON data to keep with the response."""
    first = messages[0] if messages else None
    if not isinstance(first, pm.ModelRequest):
        return None
    parts = [p for p in first.parts if isinstance(p, pm.SystemPromptPart)]
    if not parts:
        return None
    dumped = pm.ModelMessagesTypeAdapter.dump_python(
        [pm.ModelRequest(parts=list(parts))], mode="json")[0]
    return list(dumped["parts"])


def _retry_reason(messages: list[pm.ModelMessage]) -> str | None:
    """What the agent told its model when it asked again (its output validation's word)."""
    last = messages[-1] if messages else None
    if not isinstance(last, pm.ModelRequest):
        return None
    for part in reversed(last.parts):
        retried = (isinstance(part, pm.RetryFeedbackPart | pm.RetryPromptPart)
                   or (isinstance(part, pm.ToolReturnPart) and part.outcome == "retried"))
        if retried:
            return ("the agent refused the model's answer: "
                    + _feedback_text(getattr(part, "content", None)))
    # An output validator's ModelRetry comes back as a user prompt of the new request (it
    # is asked for only when the agent asks its model a second time in one step).
    said = [part.content for part in last.parts
            if isinstance(part, pm.UserPromptPart) and isinstance(part.content, str)]
    if said:
        return "the agent refused the model's answer: " + said[-1]
    return None


def _feedback_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        said = []
        for error in content:
            if isinstance(error, Mapping):
                where = ".".join(str(x) for x in error.get("loc", ()) or ())
                message = str(error.get("msg", ""))
                said.append(f"{where}: {message}" if where else message)
        if said:
            return "; ".join(said)
    return result_text(content)

