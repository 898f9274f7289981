"""The framework-neutral guest seam (boundloop/integrations/_guest.py), with a toy framework
that behaves as real ones do: it loops model -> its own tool calls -> model, and validates
its output. Under boundloop it must never run a tool itself, make one request per step,
and start afresh from boundloop's history each step."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop.integrations import Guest, GuestTool, OneRequest, current_call


class ToyModel:
    """The toy framework's model: a script of replies, ("tools", [(name, args)...]) or
    ("text", str); it records every request it receives."""

    def __init__(self, replies: list[tuple[str, Any]]) -> None:
        self.replies = list(replies)
        self.requests: list[list[Any]] = []

    async def request(self, messages: list[Any]) -> tuple[str, Any]:
        self.requests.append(list(messages))
        return self.replies.pop(0)


class ToyAgent:
    """The toy framework: its own loop, tools and output validation."""

    def __init__(self, model: ToyModel, tools: dict[str, Any], *, accept: Any = None) -> None:
        self.model = model
        self.tools = tools
        self.accept = accept or (lambda text: True)
        self.tool_runs_by_framework = 0

    async def run(self, messages: list[Any], request: Any) -> str:
        messages = list(messages)
        while True:
            kind, body = await request(messages)
            if kind == "text":
                if self.accept(body):
                    return f"OUT:{body}"
                messages.append(("retry", "say it in capitals"))
                continue
            for i, (name, args) in enumerate(body):
                self.tool_runs_by_framework += 1
                messages.append(("result", i, await self.tools[name](**args)))


class ToyGuest(Guest):
    """The adapter a framework would have: history -> toy messages, one request a step."""

    def __init__(self, toy: ToyAgent, **options: Any) -> None:
        super().__init__("toy", **options)
        self.toy = toy
        self.steps = 0

    def guest_tools(self) -> list[GuestTool]:
        def tool(name: str) -> GuestTool:
            async def execute(args: dict[str, Any], ctx: bl.ToolContext) -> Any:
                return await self.toy.tools[name](**args)

            return GuestTool(name, f"the {name} tool",
                             {"type": "object", "properties": {"x": {"type": "integer"}},
                              "required": ["x"]}, execute)

        return [tool(name) for name in self.toy.tools]

    async def step(self, history: list[Any], ctx: Any) -> Any:
        self.steps += 1
        messages = [(m.kind, getattr(m, "text", None) or getattr(m, "name", None))
                    for m in history]
        turn: OneRequest[tuple[str, Any]] = OneRequest()
        calls_seen: list[Any] = []

        def convert(reply: tuple[str, Any]) -> Any:
            kind, body = reply
            if kind == "text":
                return bl.Final(body, usage=bl.Usage(input_tokens=10, output_tokens=2))
            calls = [bl.ToolCall(f"s{ctx.step}c{i}", name, args)
                     for i, (name, args) in enumerate(body)]
            calls_seen.extend(calls)
            return bl.CallTools(calls, usage=bl.Usage(input_tokens=10, output_tokens=3))

        async def request(msgs: list[Any]) -> tuple[str, Any]:
            retry = next((m[1] for m in reversed(msgs) if m[0] == "retry"), None)
            return await turn.request(lambda: self.toy.model.request(msgs), convert,
                                      retry_reason=retry)

        answer, output, finished = await turn.run(
            lambda t: self.toy.run(messages, request))
        if finished:
            self.keep_output(ctx.run_id, output)
        return answer


def make(replies: list[tuple[str, Any]], **kw: Any) -> tuple[ToyGuest, list[Any]]:
    effects: list[Any] = []

    async def add(x: int) -> int:
        call = current_call()
        effects.append((x, call.idempotency_key if call else None))
        return x + 1

    toy = ToyAgent(ToyModel(replies), {"add": add}, accept=kw.pop("accept", None))
    return ToyGuest(toy, **kw), effects


def test_tools_run_by_boundloop_not_the_framework(tmp_path: Path) -> None:
    guest, effects = make([("tools", [("add", {"x": 1}), ("add", {"x": 2})]),
                           ("tools", [("add", {"x": 3})]), ("text", "done")])
    with bl.Runner(tmp_path / "j") as runner:
        out = guest.run(runner, "go", budget=bl.Budget(max_parallel=2))
        events = list(runner.journal.events(out.run_id))
    assert out.status == "final" and out.output == "OUT:done"
    assert out.result.transcript[-1].text == "OUT:done"
    assert out.result.model_steps == 3 and out.result.tool_calls == 3
    assert guest.toy.tool_runs_by_framework == 0          # the framework was stopped
    assert len(guest.toy.model.requests) == 3             # one real request per step
    assert sorted(x for x, _ in effects) == [1, 2, 3]
    assert all(key for _, key in effects)                 # the tool saw boundloop's key
    kinds = [type(e).__name__ for e in events]
    for x in (1, 2, 3):
        decided = next(i for i, e in enumerate(events)
                       if type(e).__name__ == "CallDecided" and e.arguments == {"x": x})
        dispatched = next(i for i, e in enumerate(events)
                          if type(e).__name__ == "CallDispatched"
                          and e.execution_id == events[decided].execution_id)
        assert decided < dispatched
    assert kinds[-1] == "RunFinished"
    # Each step started afresh from boundloop's history: the third request saw both steps.
    assert [m[0] for m in guest.toy.model.requests[2]].count("call") == 3


def test_budget_stops_the_framework(tmp_path: Path) -> None:
    guest, effects = make([("tools", [("add", {"x": i})]) for i in range(10)],
                          budget=bl.Budget(max_tool_calls=2, max_model_steps=10,
                                           reserve_final_step=False))
    with bl.Runner(tmp_path / "j") as runner:
        out = guest.run(runner, "go")
    assert out.status == "limit_exceeded" and out.result.exhausted_limit == "tool_calls"
    assert len(effects) == 2 and out.output is None and out.result.tool_calls == 2


def test_refused_answer_is_malformed_then_retried(tmp_path: Path) -> None:
    def accept(text: str) -> bool:
        return text.isupper()

    guest, _ = make([("text", "no"), ("text", "YES")], accept=accept)
    with bl.Runner(tmp_path / "j") as runner:
        out = guest.run(runner, "go", budget=bl.Budget(malformed_retries=1))
        strict = make([("text", "no")], accept=accept)[0].run(runner, "go")
    assert out.status == "final" and out.output == "OUT:YES"
    notices = [m.text for m in out.result.transcript if m.kind == "notice"]
    assert notices and "say it in capitals" in notices[0]
    assert strict.status == "malformed_response"
    assert "say it in capitals" in strict.result.explanation


def test_framework_failure_is_a_model_error(tmp_path: Path) -> None:
    guest, _ = make([])                                   # the toy model has no reply
    with bl.Runner(tmp_path / "j") as runner:
        out = guest.run(runner, "go")
    assert out.status == "model_error" and out.output is None


def test_arun_and_child_runs_share_the_budget(tmp_path: Path) -> None:
    child, child_effects = make([("tools", [("add", {"x": i})]) for i in range(20)],
                                budget=bl.Budget(max_tool_calls=20, max_model_steps=20))
    child.name = "child"

    async def delegate(x: int) -> str:
        result = await child.arun_child(f"task {x}")
        return result.status

    parent_toy = ToyAgent(ToyModel([("tools", [("delegate", {"x": i}) for i in range(3)]),
                                    ("text", "all done")]), {"delegate": delegate})
    parent = ToyGuest(parent_toy, budget=bl.Budget(max_tool_calls=9, max_parallel=3))

    async def main() -> Any:
        async with bl.Runner(tmp_path / "j") as runner:
            return await parent.arun(runner, "go")

    out = asyncio.run(main())
    # 3 delegations + their children's calls never pass 9 tool calls in all.
    assert 3 + len(child_effects) <= 9
    assert out.result.tool_calls <= 9
    assert out.status in {"final", "limit_exceeded"}


def test_bad_tool_options_and_child_outside_a_tool(tmp_path: Path) -> None:
    guest, _ = make([], tool_options={"nope": {"idempotent": True}})
    with pytest.raises(bl.ConfigError, match="nope"):
        _ = guest.agent
    with pytest.raises(bl.ConfigError, match="inside a tool"):
        asyncio.run(make([])[0].arun_child("x"))


def test_cancel_stops_a_framework_stuck_in_its_model_request(tmp_path: Path) -> None:
    """Every adapter's step is raced against the run's cancel token: a framework waiting on
    a slow request held a cancelled run until the request answered."""
    import threading
    import time

    class Slow(ToyModel):
        async def request(self, messages: list[Any]) -> tuple[str, Any]:
            await asyncio.sleep(30)
            return await super().request(messages)

    guest = ToyGuest(ToyAgent(Slow([("text", "late")]), {}))
    token = bl.CancelToken()
    with bl.Runner(tmp_path / "j") as runner:
        threading.Timer(0.5, token.cancel).start()
        started = time.monotonic()
        out = guest.run(runner, "go", cancel=token)
        took = time.monotonic() - started
        events = list(runner.journal.events(out.run_id))
    assert out.status == "cancelled" and out.output is None and took < 10
    assert type(events[-1]).__name__ == "RunFinished" and out.result.model_steps == 1
