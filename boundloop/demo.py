"""The built-in scripted scenarios of ``boundloop demo``: one per status they can reach, and
the stories around them (an unknown outcome, a failed call, a person resolving an action, the
deadline, a token limit, a child run drawing on its parent's budget)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from boundloop.core import kinds
from boundloop.core.budget import Budget, Usage
from boundloop.messages import CallTools, Final, ToolCall
from boundloop.models.scripted import ScriptedModel
from boundloop.results import RunResult
from boundloop.runner import Runner
from boundloop.tools import Tool, ToolContext, tool


class Scenario(msgspec.Struct, frozen=True):
    """One demo scenario: its name, the run's report, what it shows, and the limit that
    stopped it with its value (``tool_calls=1``), if one did."""

    name: str
    result: RunResult
    story: str = ""
    limit: str | None = None
    parent_run_id: str | None = None


#: The Budget field behind each limit a run can exhaust.
LIMIT_FIELDS = {"model_steps": "max_model_steps", "tool_calls": "max_tool_calls",
                "deadline": "deadline_s", "input_tokens": "max_input_tokens",
                "output_tokens": "max_output_tokens", "total_tokens": "max_total_tokens",
                "cost": "max_cost"}


def limit_text(limit: str | None, budget: Budget) -> str | None:
    """``tool_calls=1`` for a run that exhausted ``tool_calls`` under a budget of
    ``max_tool_calls=1`` (``deadline=0.3s`` for the deadline)."""
    if limit is None:
        return None
    field = LIMIT_FIELDS.get(limit)
    value = None if field is None else getattr(budget, field, None)
    if value is None:
        return limit
    return f"{limit}={value:g}" + ("s" if kinds.is_deadline(limit) else "")


def completed_text(result: RunResult) -> str:
    """How many actions completed, and how many of them did not succeed: ``2`` when all are
    ok, else ``2 (1 error)``."""
    counts: dict[str, int] = {}
    for c in result.completed:
        if not kinds.is_ok(c.status):
            counts[c.status] = counts.get(c.status, 0) + 1
    others = ", ".join(f"{n} {status}" for status, n in counts.items())
    return f"{len(result.completed)} ({others})" if others else str(len(result.completed))


def _call(cid: str, tool_name: str, **arguments: Any) -> ToolCall:
    return ToolCall(cid, tool_name, arguments)


def _tools() -> list[Tool]:
    @tool(read_only=True, idempotent=True, timeout_s=5.0)
    def weather(city: str) -> dict[str, Any]:
        """Today's weather in a city."""
        return {"city": city, "sky": "sunny", "high_c": 21}

    @tool(irreversible=True, timeout_s=5.0)
    def deploy(service: str) -> str:
        """Deploy a service (fails for 'broken')."""
        if service == "broken":
            raise RuntimeError(f"deploy of {service} failed")
        return f"{service} deployed"

    @tool(timeout_s=0.2)
    def slow_report(name: str) -> str:
        """A report that takes longer than its timeout."""
        time.sleep(0.5)
        return f"report {name}"

    @tool(irreversible=True, timeout_s=0.2)
    def transfer(amount: int, to: str) -> str:
        """A bank transfer whose bank answers too late to tell whether it went through."""
        time.sleep(0.5)
        return f"sent {amount} to {to}"

    @tool(read_only=True, timeout_s=5.0)
    def crawl(site: str) -> str:
        """A crawl that takes longer than the run may."""
        time.sleep(1.0)
        return f"crawled {site}"

    return [weather, deploy, slow_report, transfer, crawl]


def _cancel_from_model(history: Any, ctx: Any) -> Any:
    ctx.cancel.cancel("the model callback asked to stop")
    return CallTools([_call("c1", "weather", city="Oslo")])


#: name, what it shows, the model's script, the budget.
SCENARIOS: list[tuple[str, str, list[Any], Budget]] = [
    ("tool then final", "one weather call, then a final answer",
     [CallTools([_call("c1", "weather", city="Paris")]), Final("It is sunny in Paris.")],
     Budget()),
    ("call beyond budget", "the second call would pass max_tool_calls=1: refused, run stopped",
     [CallTools([_call("c1", "weather", city="Rome")]),
      CallTools([_call("c2", "weather", city="Oslo")])], Budget(max_tool_calls=1)),
    ("repeated call id", "the model reused call id c1: nothing in that batch ran",
     [CallTools([_call("c1", "weather", city="Rome")]),
      CallTools([_call("c1", "weather", city="Rome")])], Budget()),
    ("cancel from the model", "cancelled before its first call was dispatched",
     [_cancel_from_model], Budget()),
    ("malformed output", "the model asked for calls but listed none",
     [{"kind": "calls", "calls": []}], Budget()),
    ("model exception", "the model callback raised (a provider's 503)",
     [RuntimeError("provider returned 503")], Budget()),
    ("tools on the final-only step", "the last step may only answer; the model asked for a "
     "tool instead", [CallTools([_call("c1", "weather", city="Rome")]),
                      CallTools([_call("c2", "weather", city="Oslo")])],
     Budget(max_model_steps=2)),
    ("parallel partial failure", "deploy api succeeded, deploy broken raised; the model saw "
     "the error and answered", [CallTools([_call("c1", "deploy", service="api"),
                                           _call("c2", "deploy", service="broken")]),
                                Final("api deployed; broken failed.")], Budget(max_parallel=2)),
    ("timeout -> outcome unknown", "slow_report timed out: its outcome is unknown, the model "
     "was told so, and the action stays listed as unresolved",
     [CallTools([_call("c1", "slow_report", name="q3")]),
      Final("The report's outcome is unknown.")], Budget()),
    ("irreversible timeout", "a transfer timed out and cannot be retried or reconciled: the "
     "run waits for a person (needs_review)",
     [CallTools([_call("c1", "transfer", amount=120, to="ACME")]), Final("unreachable")],
     Budget()),
    ("deadline", "a crawl was still running when deadline_s=0.3 passed: the run stopped, the "
     "crawl's outcome unknown", [CallTools([_call("c1", "crawl", site="example.org")]),
                                 Final("unreachable")], Budget(deadline_s=0.3)),
    ("token limit", "1,600 tokens used of max_total_tokens=1500: the next step's calls were "
     "not dispatched",
     [CallTools([_call("c1", "weather", city="Lima")], usage=Usage(700, 100)),
      CallTools([_call("c2", "weather", city="Pune")], usage=Usage(700, 100)),
      Final("unreachable")], Budget(max_total_tokens=1500)),
]

_NESTED_STORY = ("a child run asked for 10 tool calls but got the 3 its parent had left; "
                 "its calls count against the parent's max_tool_calls=4")


def _run_id(tag: str, n: int, name: str) -> str:
    word = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").split("-")[0] or "run"
    return f"demo-{tag}-{word}-{n}"


def run_demo(runner: Runner, on_result: Callable[[Scenario], None] | None = None) -> list[Scenario]:
    """Run every scenario on ``runner`` and return their reports: one per scenario, then
    the needs_review run again once a person resolved its action and it resumed, and the
    nested run's parent and child."""
    tools = _tools()
    by_name = {t.name: t for t in tools}
    tag = uuid.uuid4().hex[:6]
    out: list[Scenario] = []

    def add(name: str, story: str, result: RunResult, parent: str | None = None) -> None:
        limit = limit_text(result.exhausted_limit, runner.state(result.run_id).budget)
        scenario = Scenario(name, result, story, limit, parent)
        out.append(scenario)
        if on_result is not None:
            on_result(scenario)

    for name, story, script, budget in SCENARIOS:
        result = runner.run(model=ScriptedModel(script), tools=tools, prompt=name,
                            budget=budget, run_id=_run_id(tag, len(out) + 1, name))
        add(name, story, result)
        if kinds.needs_review(result.status):
            [action] = result.unresolved
            runner.resolve(result.run_id, action.execution_id, "succeeded",
                           note="the bank statement shows the transfer", by="demo")
            resumed = runner.resume(result.run_id, tools=[by_name["transfer"]],
                                    model=ScriptedModel([Final("Paid ACME 120.")]))
            add("resolved, then resumed", "a person checked the bank and resolved the "
                "transfer as succeeded (`boundloop resolve`); the run resumed and finished",
                resumed)

    children: list[RunResult] = []

    @tool(timeout_s=10.0)
    def delegate(task: str, ctx: ToolContext) -> str:
        """Hand a task to a child run."""
        child = ScriptedModel([CallTools([_call(f"k{i}", "weather", city=city)])
                               for i, city in enumerate(("Oslo", "Rome", "Lima", "Pune"), 1)]
                              + [Final("four cities")])
        result = ctx.run_child(model=child, tools=[by_name["weather"]], prompt=task,
                               budget=Budget(max_tool_calls=10), run_id=f"{ctx.run_id}-child")
        children.append(result)
        return f"{result.status}: {result.tool_calls} calls"

    parent = ScriptedModel([CallTools([_call("d1", "delegate", task="weather in four cities")]),
                            Final("The child ran out of tool calls after three cities.")])
    result = runner.run(model=parent, tools=[delegate, by_name["weather"]], prompt="nested",
                        budget=Budget(max_tool_calls=4),
                        run_id=_run_id(tag, len(out) + 1, "nested"))
    add("nested: parent", _NESTED_STORY, result)
    for child_result in children:
        add("nested: child", "the child stopped at the 3 tool calls its parent had left",
            child_result, result.run_id)
    return out
