"""An OpenAI Agents SDK agent (``agents.Agent``) run under boundloop's budgets and journal.

Install the extra: ``pip install 'boundloop[openai-agents]'``. ``import boundloop`` never
imports ``agents``; importing this module without it raises ``bl.ConfigError`` naming the
extra.

```python
import boundloop as bl
from agents import Agent
from boundloop.integrations.openai_agents import BoundloopAgent

bound = BoundloopAgent(Agent(name="support", instructions="...", tools=[lookup, refund]),
                       budget=bl.Budget(max_tool_calls=8),
                       tool_options={"refund": {"irreversible": True}})
with bl.Runner("journal") as runner:
    out = bound.run(runner, "where is my order?")      # out.status, out.output
```

How it runs: boundloop drives the run. Each model step starts the SDK afresh
(``agents.Runner.run``) from the run's recorded history, converted to the SDK's input items
(``message``, ``function_call``, ``function_call_output``), with the agent's model wrapped
(its public ``agents.Model`` / ``agents.ModelProvider`` extension points) so that exactly one
real request is made. A response with function calls becomes ``bl.CallTools`` and the SDK is
stopped there (it never runs a tool); boundloop then decides, journals and dispatches each
call, whose handler runs the SDK tool's own ``on_invoke_tool`` with the SDK's ``ToolContext``
built for it. A response without function calls goes back to the SDK, which finishes
(its ``final_output``, validated against ``output_type``, is ``GuestResult.output`` and the
run's final text) or refuses it (a malformed response, with the SDK's reason).

What is mapped, and what is refused (``bl.ConfigError`` when the ``BoundloopAgent`` is made):

- function tools (``@function_tool``, ``FunctionTool``) become boundloop tools; their
  ``timeout_seconds`` becomes the tool's ``timeout_s`` and ``needs_approval=True`` boundloop's
  ``needs_approval``, unless ``tool_options`` says otherwise. A tool whose
  ``is_enabled`` is False is left out. The SDK's failure handler still turns a tool's
  exception into the text the model sees (``ok`` in the journal); declare
  ``failure_error_function=None`` for boundloop to see the error (and retry it by ``retry``).
- refused: handoffs (delegate from a function tool with ``await other.arun_child(task)``
  instead: the child is a boundloop nested run, charged to this run's budgets), hosted and
  other non-function tools, MCP servers (use ``bl.mcp_tools``), agents as tools
  (``Agent.as_tool``), tool input/output guardrails, a callable ``needs_approval`` without a
  ``tool_options`` entry, and a ``tool_use_behavior`` other than ``"run_llm_again"``.
- input guardrails run on the run's first step only, before the request (never in parallel
  with it, so a tripwire stops the run before any tool call); a tripwire is a
  ``model_error``. An output guardrail's tripwire makes the answer malformed.
- the SDK's own tracing is off for these runs (``RunConfig(tracing_disabled=True)``): nothing
  is exported to OpenAI; boundloop's journal and telemetry record the run. Pass
  ``sdk_tracing=True`` to keep it. The SDK's runner-managed model retries
  (``ModelSettings.retry``) are turned off: one step is one request.
- usage: ``bl.Usage`` with ``input_tokens`` the input neither read from nor written to a
  cache (SPEC 7), ``cache_read_tokens`` the SDK's ``cached_tokens`` and
  ``cache_write_tokens`` its ``cache_write_tokens``; ``price`` (a ``bl.Price``, or
  ``"auto"`` for the genai-prices catalogue) gives each step its cost.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from boundloop.core import kinds
from boundloop.core.budget import Budget, Usage
from boundloop.errors import ConfigError
from boundloop.integrations._guest import Guest, GuestTool, OneRequest
from boundloop.messages import CallTools, Final, ToolCall
from boundloop.models._common import (
    AssistantText,
    OrphanResult,
    ToolStep,
    UserTurn,
    group_history,
    make_usage,
    parse_arguments,
    require_sdk,
    response_info,
    result_text,
)
from boundloop.models._openai_responses import step_items
from boundloop.pricing import PriceOption, check_price

if TYPE_CHECKING:
    import agents
    from agents import Model, ModelProvider, ModelResponse, ModelTracing, TResponseInputItem

__all__ = ["BoundloopAgent", "to_input_items"]

_EXTRA = "openai-agents"
_WHAT = "boundloop.integrations.openai_agents"

#: The output items of a step (its ``CallTools.content``) sent back with later steps; others
#: (another provider's blocks, in a history given to ``run``) are left out.
_ITEM_TYPES = frozenset({"message", "reasoning", "function_call", "compaction"})

#: The SDK's turns in one step: one real request, and one more that is never sent (the
#: SDK asking again shows it refused the answer).
_MAX_TURNS = 4


def _installed() -> bool:
    try:
        return importlib.util.find_spec("agents") is not None
    except (ImportError, ValueError):
        return False


if not _installed():
    # Said at import; the SDK itself is imported when an agent is wrapped (importing it
    # here would fail when boundloop/ is first on sys.path, where boundloop/mcp.py hides
    # the `mcp` package the SDK imports).
    raise ConfigError(f"{_WHAT} needs the `agents` package, which is not installed: "
                      f"pip install 'boundloop[{_EXTRA}]'")


class BoundloopAgent(Guest):
    """An ``agents.Agent`` whose every model request and tool call boundloop decides,
    journals and counts.

    Args:
        agent: the SDK agent, unmodified (its model: an ``agents.Model``, a model name, or
            None for the SDK's default, resolved by ``run_config.model_provider``).
        name: the boundloop agent name (default ``agent.name``).
        budget: each run's limits (default ``bl.Budget()``).
        version: recorded with each run.
        context: the SDK run context object its tools receive (``ToolContext.context``).
        tool_options: per tool name, options of ``bl.Tool.from_schema`` (``idempotent``,
            ``irreversible``, ``reconcile``, ``timeout_s``, ``retry``, ``needs_approval``,
            ...); they override what the SDK tool declares.
        run_config: an ``agents.RunConfig`` for each step (model provider, model settings,
            hooks, ...); its model is wrapped as the agent's is.
        price: each step's usage is priced with it (``bl.Usage.cost``); ``"auto"``: by the
            genai-prices catalogue, for the model each response reports.
        sdk_tracing: keep the SDK's own tracing (off by default: nothing is exported).
        permit: ``(call, tool, ctx) -> True | False | reason`` per call.
        max_running: as ``bl.Agent``'s.
        max_queued: as ``bl.Agent``'s.

    Raises:
        ConfigError: the agent uses something boundloop cannot drive (see the module).
    """

    def __init__(self, agent: agents.Agent[Any], *, name: str | None = None,
                 budget: Budget | None = None, version: str = "", context: Any = None,
                 tool_options: Mapping[str, Mapping[str, Any]] | None = None,
                 run_config: agents.RunConfig | None = None, price: PriceOption = None,
                 sdk_tracing: bool = False, permit: Callable[..., Any] | None = None,
                 max_running: int | None = None, max_queued: int = 100_000) -> None:
        require_sdk("agents", _EXTRA, what=_WHAT)
        import agents

        if not isinstance(agent, agents.Agent):
            raise ConfigError(f"BoundloopAgent takes an agents.Agent, got {agent!r}")
        if run_config is not None and not isinstance(run_config, agents.RunConfig):
            raise ConfigError(f"run_config must be an agents.RunConfig, got {run_config!r}")
        price = check_price(price, "BoundloopAgent")
        user_options = {str(k): dict(v) for k, v in (tool_options or {}).items()}
        self.function_tools = _function_tools(agent, user_options)
        options: dict[str, dict[str, Any]] = {}
        for tool in self.function_tools:
            options[tool.name] = {**_declared_options(tool), **user_options.get(tool.name, {})}
        for key, value in user_options.items():   # names no tool has: Guest says so
            options.setdefault(key, value)
        super().__init__(name or agent.name, budget=budget, version=version,
                         tool_options=options, permit=permit, max_running=max_running,
                         max_queued=max_queued)
        self.sdk_agent = agent
        self.context = context
        self.run_config = run_config
        self.price = price
        self.sdk_tracing = sdk_tracing
        # One provider for model names, kept across steps (its HTTP client with it).
        self._provider: ModelProvider = (run_config.model_provider if run_config is not None
                                         else agents.MultiProvider())

    # -- tools ---------------------------------------------------------------------------
    def guest_tools(self) -> list[GuestTool]:
        """The agent's function tools, run by boundloop through their ``on_invoke_tool``."""
        return [GuestTool(tool.name, tool.description or "",
                          dict(tool.params_json_schema or {"type": "object", "properties": {}}),
                          self._executor(tool))
                for tool in self.function_tools]

    def _executor(self, tool: agents.FunctionTool) -> Any:
        import agents
        from agents.tool_context import ToolContext as SdkToolContext
        from openai.types.responses import ResponseFunctionToolCall

        async def execute(arguments: dict[str, Any], call: Any) -> Any:
            raw = json.dumps(arguments, ensure_ascii=False)
            tool_call = ResponseFunctionToolCall(type="function_call", call_id=call.call_id,
                                                 name=tool.name, arguments=raw)
            tool_context: SdkToolContext[Any] = SdkToolContext(
                self.context, agents.Usage(), tool.name, call.call_id, raw, tool_call,
                agent=self.sdk_agent, run_config=self._base_run_config())
            output = await tool.on_invoke_tool(tool_context, raw)
            # What the SDK would send the model: text, or its structured output items.
            return _plain(agents.ItemHelpers.tool_call_output_item(tool_call, output)["output"])

        return execute

    # -- one model step ------------------------------------------------------------------
    async def step(self, history: list[Any], ctx: Any) -> Any:
        """One model step: the SDK run afresh from ``history`` up to its one request."""
        import agents

        items = to_input_items(history)
        turn: OneRequest[ModelResponse] = OneRequest()
        agent, run_config = self._for_step(turn, history, ctx)

        async def framework(_turn: OneRequest[ModelResponse]) -> Any:
            result = await agents.Runner.run(agent, input=items, context=self.context,
                                             run_config=run_config, max_turns=_MAX_TURNS)
            return result.final_output

        answer, output, finished = await turn.run(framework)
        if finished:
            self.keep_output(ctx.run_id, output)
        return answer

    def _base_run_config(self) -> agents.RunConfig:
        import agents

        run_config = self.run_config or agents.RunConfig()
        return dataclasses.replace(run_config, model_provider=self._provider,
                                   tracing_disabled=run_config.tracing_disabled
                                   or not self.sdk_tracing)

    def _for_step(self, turn: OneRequest[ModelResponse], history: list[Any],
                  ctx: Any) -> tuple[agents.Agent[Any], agents.RunConfig]:
        """The agent and run config of one step: the model wrapped, as the SDK would
        resolve it (the run config's model first, then the agent's, by name through the
        provider), guardrails and settings as the module says."""
        from agents import Model

        one_request_model, one_request_provider = _wrappers()
        sdk = self.sdk_agent
        used_tools = any(getattr(m, "kind", None) == "call" for m in history)

        def wrap(inner: Model, model_name: str | None) -> Model:
            model: Model = one_request_model(inner, turn, self, ctx, model_name, used_tools)
            return model

        run_config = self._base_run_config()
        agent_changes: dict[str, Any] = {}
        if isinstance(run_config.model, Model):
            run_config = dataclasses.replace(run_config, model=wrap(run_config.model, None))
        elif isinstance(run_config.model, str) or not isinstance(sdk.model, Model):
            run_config = dataclasses.replace(
                run_config, model_provider=one_request_provider(self._provider, wrap))
        else:
            agent_changes["model"] = wrap(sdk.model, None)
        if sdk.model_settings.retry is not None:
            agent_changes["model_settings"] = dataclasses.replace(sdk.model_settings,
                                                                  retry=None)
        if ctx.step == 1:
            # Before the request, never beside it: a tripwire must stop the run before
            # boundloop dispatches any call of the response.
            agent_changes["input_guardrails"] = [
                dataclasses.replace(g, run_in_parallel=False) for g in sdk.input_guardrails]
            run_config = dataclasses.replace(run_config, input_guardrails=[
                dataclasses.replace(g, run_in_parallel=False)
                for g in run_config.input_guardrails or []])
        else:
            agent_changes["input_guardrails"] = []
            run_config = dataclasses.replace(run_config, input_guardrails=None)
        if run_config.model_settings is not None and run_config.model_settings.retry:
            run_config = dataclasses.replace(run_config, model_settings=dataclasses.replace(
                run_config.model_settings, retry=None))
        return sdk.clone(**agent_changes), run_config

    # -- the response ----------------------------------------------------------------------
    def _convert(self, response: ModelResponse, model_name: str | None) -> Any:
        """The SDK's model response as a boundloop response: ``bl.CallTools`` when it
        calls function tools, else ``bl.Final`` (which the SDK then accepts or refuses)."""
        texts: list[str] = []
        calls: list[ToolCall] = []
        for item in response.output:
            kind = _get(item, "type")
            if kind == "message":
                for part in _get(item, "content") or []:
                    if _get(part, "type") == "output_text":
                        texts.append(str(_get(part, "text") or ""))
            elif kind == "function_call":
                calls.append(ToolCall(str(_get(item, "call_id") or ""),
                                      str(_get(item, "name") or ""),
                                      parse_arguments(_get(item, "arguments"))))
        usage = self._usage(response)
        text = "".join(texts)
        info = response_info(response.response_id, model_name,
                             "tool_calls" if calls else "stop")
        if calls:
            return CallTools(calls, usage=usage, text=text or None,
                             content=_plain(response.to_input_items()), info=info)
        return Final(text, usage=usage, info=info)

    def _usage(self, response: ModelResponse) -> Usage | None:
        usage = response.usage
        if usage is None:
            return None
        details = getattr(usage, "input_tokens_details", None)
        cached = _count(getattr(details, "cached_tokens", 0))
        written = _count(getattr(details, "cache_write_tokens", 0))
        total_in = _count(usage.input_tokens)
        return make_usage(max(total_in - cached - written, 0), usage.output_tokens, written,
                          cached, price=self.price)


@functools.cache
def _wrappers() -> tuple[type[Any], type[Any]]:
    """The SDK classes of the wrapping: made once the SDK is imported."""
    from agents import Model, ModelProvider

    class _OneRequestModel(Model):
        """The agent's model, wrapped: its one real request of the step goes through the
        step's ``OneRequest`` (a second one is never sent)."""

        def __init__(self, inner: Model, turn: OneRequest[ModelResponse], guest: BoundloopAgent,
                     ctx: Any, model_name: str | None, used_tools: bool) -> None:
            self.inner = inner
            self.turn = turn
            self.guest = guest
            self.ctx = ctx
            self.model_name = model_name or _model_name(inner)
            self.used_tools = used_tools

        async def get_response(self, system_instructions: str | None,
                               input: str | list[TResponseInputItem],
                               model_settings: agents.ModelSettings, tools: list[agents.Tool],
                               output_schema: agents.AgentOutputSchemaBase | None,
                               handoffs: list[agents.Handoff[Any, Any]], tracing: ModelTracing,
                               *, previous_response_id: str | None, conversation_id: str | None,
                               prompt: Any) -> ModelResponse:
            settings = model_settings
            if self.used_tools and self.guest.sdk_agent.reset_tool_choice and \
                    settings.tool_choice not in (None, "auto", "none"):
                # What the SDK does once the agent used tools (it cannot see that here).
                settings = dataclasses.replace(settings, tool_choice=None)
            if not self.ctx.tools_allowed and tools:
                settings = dataclasses.replace(settings, tool_choice="none")

            async def send() -> ModelResponse:
                return await self.inner.get_response(
                    system_instructions, input, settings, tools, output_schema, handoffs,
                    tracing, previous_response_id=previous_response_id,
                    conversation_id=conversation_id, prompt=prompt)

            return await self.turn.request(
                send, lambda response: self.guest._convert(response, self.model_name),
                retry_reason=_retry_reason(output_schema))

        async def stream_response(self, system_instructions: str | None,
                                  input: str | list[TResponseInputItem],
                                  model_settings: agents.ModelSettings, tools: list[agents.Tool],
                                  output_schema: agents.AgentOutputSchemaBase | None,
                                  handoffs: list[agents.Handoff[Any, Any]], tracing: ModelTracing,
                                  *, previous_response_id: str | None,
                                  conversation_id: str | None, prompt: Any,
                                  ) -> AsyncIterator[Any]:
            raise ConfigError("boundloop runs the agent with Runner.run, one request a step: "
                              "streaming is not supported")
            yield  # pragma: no cover - makes this an async generator, as the SDK expects

    class _OneRequestProvider(ModelProvider):
        """The step's model provider: the configured one, its models wrapped."""

        def __init__(self, inner: ModelProvider, wrap: Any) -> None:
            self.inner = inner
            self.wrap = wrap

        def get_model(self, model_name: str | None) -> Model:
            model: Model = self.wrap(self.inner.get_model(model_name), model_name)
            return model

    return _OneRequestModel, _OneRequestProvider


# --- history -> the SDK's input items -------------------------------------------------------

def to_input_items(history: Sequence[Any]) -> list[TResponseInputItem]:
    """Boundloop history as the SDK's input items: user and notice messages as user
    messages, final answers as assistant messages, each tool step as its recorded output
    items (reasoning and message items kept verbatim), its function calls and one
    ``function_call_output`` per call (a result that is not ``ok`` flagged as an error; a
    call without a result answered ``error (no_result)``)."""
    items: list[Any] = []
    for turn in group_history(list(history)):
        if isinstance(turn, UserTurn):
            items.append({"type": "message", "role": "user", "content": turn.text})
        elif isinstance(turn, AssistantText):
            items.append({"type": "message", "role": "assistant", "content": turn.text})
        elif isinstance(turn, OrphanResult):
            result = turn.result
            items.append({"type": "message", "role": "user", "content":
                          f"(the result of tool call {_get(result, 'id')}, whose call is not "
                          f"in this conversation) {result_text(_output(result))}"})
        elif isinstance(turn, ToolStep):
            items.extend(_step_items(turn))
    return items


def _step_items(turn: ToolStep) -> list[dict[str, Any]]:
    return step_items(turn, _ITEM_TYPES, str, _output)


def _output(result: Any) -> Any:
    """A tool result as a ``function_call_output``'s output."""
    if result is None:
        return "error (no_result): no result was recorded for this call"
    status = str(_get(result, "status") or "ok")
    content = _get(result, "content")
    if kinds.is_ok(status):
        return content if isinstance(content, str | list) else result_text(content)
    if kinds.is_error(status):
        return f"error: {result_text(content)}"
    return f"error ({status}): {result_text(content)}"


def _get(message: Any, name: str) -> Any:
    if isinstance(message, Mapping):
        return message.get(name)
    return getattr(message, name, None)


# --- helpers --------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """SDK data (pydantic models, TypedDicts) as plain JSON data, storable in the journal."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=_dump))


def _dump(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_none=True)
    return str(value)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _model_name(model: Any) -> str | None:
    name = getattr(model, "model", None)
    return name if isinstance(name, str) else None


def _retry_reason(output_schema: Any) -> str:
    if output_schema is not None and not output_schema.is_plain_text():
        return (f"the agent expects its answer as {output_schema.name()} (JSON matching its "
                "schema), and the model's answer gave none")
    return "the agent did not accept the model's answer and asked it again"


def _function_tools(agent: agents.Agent[Any],
                    options: Mapping[str, Mapping[str, Any]]) -> list[agents.FunctionTool]:
    """The agent's function tools, or ConfigError for what boundloop cannot drive."""
    import agents

    where = f"agent {agent.name!r}"
    if agent.handoffs:
        raise ConfigError(
            f"{where} has handoffs, which boundloop does not run: give the delegating agent "
            "a function tool that runs the other agent with `await "
            "BoundloopAgent(other).arun_child(task)` (a nested run on this run's budgets)")
    if agent.mcp_servers:
        raise ConfigError(f"{where} has MCP servers: give boundloop their tools with "
                          "bl.mcp_tools, or wrap them as function tools")
    if agent.tool_use_behavior != "run_llm_again":
        raise ConfigError(f"{where}: tool_use_behavior={agent.tool_use_behavior!r} is not "
                          "supported (boundloop runs the tools and asks the model again)")
    tools: list[agents.FunctionTool] = []
    for tool in agent.tools:
        name = getattr(tool, "name", type(tool).__name__)
        if not isinstance(tool, agents.FunctionTool):
            raise ConfigError(f"{where}: tool {name!r} ({type(tool).__name__}) is not a "
                              "function tool; only function tools run under boundloop")
        if getattr(tool, "_is_agent_tool", False):
            raise ConfigError(f"{where}: tool {name!r} is an agent as a tool, whose run "
                              "boundloop would not see: call `await BoundloopAgent(sub)."
                              "arun_child(task)` from a function tool instead")
        if tool.tool_input_guardrails or tool.tool_output_guardrails:
            raise ConfigError(f"{where}: tool {name!r} has tool guardrails, which boundloop "
                              "does not run; use permit= or the tool's own checks")
        if callable(tool.needs_approval) and "needs_approval" not in options.get(name, {}):
            raise ConfigError(f"{where}: tool {name!r} has a callable needs_approval; give "
                              "tool_options={name: {'needs_approval': rule}} with a boundloop "
                              "rule `(call, ctx) -> bool`")
        if tool.is_enabled is False:
            continue
        tools.append(tool)
    return tools


def _declared_options(tool: agents.FunctionTool) -> dict[str, Any]:
    """What the SDK tool declares that boundloop enforces itself."""
    options: dict[str, Any] = {}
    if tool.timeout_seconds is not None:
        options["timeout_s"] = float(tool.timeout_seconds)
    if tool.needs_approval is True:
        options["needs_approval"] = True
    return options
