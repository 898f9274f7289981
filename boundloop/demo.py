"""The built-in scripted scenarios of ``boundloop demo``: one per status they can reach."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from boundloop.messages import CallTools, Final, ToolCall
from boundloop.models.scripted import ScriptedModel
from boundloop.policy.budget import Budget
from boundloop.results import RunResult
from boundloop.runner import Runner
from boundloop.tools import Tool, tool


class Scenario(msgspec.Struct, frozen=True):
    """One demo scenario: what it shows, and the run's report."""

    name: str
    result: RunResult


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

    return [weather, deploy, slow_report]


def _cancel_from_model(history: Any, ctx: Any) -> Any:
    ctx.cancel.cancel("the model callback asked to stop")
    return CallTools([_call("c1", "weather", city="Oslo")])


SCENARIOS: list[tuple[str, list[Any], Budget]] = [
    ("tool then final", [CallTools([_call("c1", "weather", city="Paris")]),
                         Final("It is sunny in Paris.")], Budget()),
    ("call beyond budget", [CallTools([_call("c1", "weather", city="Rome")]),
                            CallTools([_call("c2", "weather", city="Oslo")])],
     Budget(max_tool_calls=1)),
    ("repeated call id", [CallTools([_call("c1", "weather", city="Rome")]),
                          CallTools([_call("c1", "weather", city="Rome")])], Budget()),
    ("cancel from the model", [_cancel_from_model], Budget()),
    ("malformed output", [{"kind": "calls", "calls": []}], Budget()),
    ("model exception", [RuntimeError("provider returned 503")], Budget()),
    ("tools on the final-only step", [CallTools([_call("c1", "weather", city="Rome")]),
                                      CallTools([_call("c2", "weather", city="Oslo")])],
     Budget(max_model_steps=2)),
    ("parallel partial failure", [CallTools([_call("c1", "deploy", service="api"),
                                             _call("c2", "deploy", service="broken")]),
                                  Final("api deployed; broken failed.")], Budget(max_parallel=2)),
    ("timeout -> outcome unknown", [CallTools([_call("c1", "slow_report", name="q3")]),
                                    Final("The report's outcome is unknown.")], Budget()),
]


def run_demo(runner: Runner, on_result: Callable[[Scenario], None] | None = None) -> list[Scenario]:
    """Run every scenario on ``runner`` and return their reports."""
    tools = _tools()
    tag = uuid.uuid4().hex[:6]
    out: list[Scenario] = []
    for name, script, budget in SCENARIOS:
        run_id = f"demo-{tag}-{name.split()[0]}-{len(out) + 1}"
        result = runner.run(model=ScriptedModel(script), tools=tools, prompt=name,
                            budget=budget, run_id=run_id)
        scenario = Scenario(name, result)
        out.append(scenario)
        if on_result is not None:
            on_result(scenario)
    return out
