"""boundloop.integrations.pydantic_ai: an unmodified Pydantic AI agent run under boundloop.

Pydantic AI's own test models (TestModel, FunctionModel) stand in for a provider: no network.
Every test checks the run's status and counters, the journal, and what the tools really did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from pydantic import BaseModel  # noqa: E402
from pydantic_ai import Agent, ModelRetry, RunContext  # noqa: E402
from pydantic_ai.messages import (  # noqa: E402
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402
from pydantic_ai.models.test import TestModel  # noqa: E402

import boundloop as bl  # noqa: E402
from boundloop import events as ev  # noqa: E402
from boundloop.integrations import current_call  # noqa: E402
from boundloop.integrations.pydantic_ai import BoundloopAgent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("guest_crash_worker.py")


def kinds(events: list[Any]) -> list[str]:
    return [type(e).__name__ for e in events]


def returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [p for m in messages if isinstance(m, ModelRequest) for p in m.parts
            if isinstance(p, ToolReturnPart)]


# -- 1. an unmodified agent runs to final, every call decided and journaled first ------------
def test_unmodified_agent_runs_to_final_with_intent_before_every_effect(tmp_path: Path) -> None:
    effects: list[tuple[str, str, list[str]]] = []
    runner_box: list[bl.Runner] = []

    def journal_now() -> list[str]:
        call = current_call()
        if call is None or not runner_box:
            return []
        return [f"{type(e).__name__}:{getattr(e, 'execution_id', '')}"
                for e in runner_box[0].journal.events(call.run_id)]

    agent = Agent(TestModel(), name="calc", system_prompt="Be brief.", deps_type=int)

    @agent.tool
    def add(ctx: RunContext[int], x: int, y: int) -> int:
        """Add two numbers and the offset."""
        call = current_call()
        effects.append(("add", call.execution_id if call else "", journal_now()))
        return x + y + ctx.deps

    @agent.tool_plain
    async def echo(text: str) -> str:
        """Say it back."""
        call = current_call()
        effects.append(("echo", call.execution_id if call else "", journal_now()))
        return text.upper()

    alone = agent.run_sync("sum it", deps=5)
    effects.clear()
    bound = BoundloopAgent(agent, deps=5, budget=bl.Budget(max_parallel=2))
    with bl.Runner(tmp_path / "j") as runner:
        runner_box.append(runner)
        out = bound.run(runner, "sum it")
        events = list(runner.journal.events(out.run_id))
    assert out.status == "final" and out.result.exhausted_limit is None
    assert out.output == alone.output == '{"add":5,"echo":"A"}'
    assert out.result.transcript[-1].text == alone.output
    assert out.result.model_steps == 2 and out.result.tool_calls == 2
    assert sorted(name for name, _, _ in effects) == ["add", "echo"]
    # Each tool ran once, by boundloop, after its intent and its dispatch were durable.
    for _name, execution, seen in effects:
        assert f"CallDecided:{execution}" in seen
        assert f"CallDispatched:{execution}" in seen
        assert seen.index(f"CallDecided:{execution}") < seen.index(f"CallDispatched:{execution}")
        assert f"CallSucceeded:{execution}" not in seen
    decided = [e for e in events if isinstance(e, ev.CallDecided)]
    assert sorted(e.tool for e in decided) == ["add", "echo"]
    assert kinds(events)[0] == "RunAdmitted" and kinds(events)[-1] == "RunFinished"
    admitted = events[0]
    assert getattr(admitted, "agent", None) == "calc"
    assert out.result.usage.input_tokens > 0 and out.result.usage.output_tokens > 0


def test_each_step_starts_afresh_from_the_journal_history(tmp_path: Path) -> None:
    seen: list[list[ModelMessage]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(list(messages))
        done = len(returns(messages))
        if done < 2:
            return ModelResponse(parts=[TextPart(f"step {done}"), ToolCallPart(
                "lookup", {"key": f"k{done}"}, tool_call_id=f"call-{done}")], model_name="fn-1")
        return ModelResponse(parts=[TextPart("found both")], model_name="fn-1")

    agent = Agent(FunctionModel(model, model_name="fn-1"), name="finder",
                  system_prompt="You find things.")
    ran: list[str] = []

    @agent.tool_plain
    def lookup(key: str) -> str:
        """Look a key up."""
        ran.append(key)
        if key == "k1":
            raise ModelRetry("k1 is spelled K1")
        return f"value of {key}"

    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent).run(runner, "find k0 and k1")
        events = list(runner.journal.events(out.run_id))
    assert out.status == "final" and out.output == "found both"
    assert ran == ["k0", "k1"] and len(seen) == 3     # one real request per step
    assert out.result.model_steps == 3 and out.result.tool_calls == 2
    # Every request opened with the agent's system prompt, though steps 2 and 3 were
    # started from boundloop's history, not from Pydantic AI's memory.
    for messages in seen:
        first = messages[0]
        assert isinstance(first, ModelRequest)
        assert [p.content for p in first.parts if isinstance(p, SystemPromptPart)] == [
            "You find things."]
    # The third request saw both steps: the text and calls verbatim, the results with
    # Pydantic AI's outcomes (a ModelRetry from the tool is a retry for the model).
    last = seen[2]
    assert [p.tool_call_id for m in last if isinstance(m, ModelResponse) for p in m.parts
            if isinstance(p, ToolCallPart)] == ["call-0", "call-1"]
    assert [(r.outcome, r.content) for r in returns(last)] == [
        ("success", "value of k0"), ("retried", "k1 is spelled K1")]
    failed = [e for e in events if isinstance(e, ev.CallFailed)]
    assert [(e.error_category, e.content) for e in failed] == [
        ("ModelRetry", "ModelRetry: k1 is spelled K1")]
    completed = {(c.tool, c.status) for c in out.result.completed}
    assert completed == {("lookup", "ok"), ("lookup", "error")}
    # The response's model name is recorded with each step (bl.ResponseInfo).
    steps = [e for e in events if isinstance(e, ev.ModelStepCompleted)]
    assert [getattr(e.response.info, "model", None) for e in steps] == ["fn-1"] * 3


# -- 2. budgets stop it ----------------------------------------------------------------------
def keeps_calling(tool: str, seen: list[AgentInfo] | None = None) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if seen is not None:
            seen.append(info)
        return ModelResponse(parts=[ToolCallPart(tool, {"n": len(returns(messages))})])

    return FunctionModel(model)


def counting_agent(model: FunctionModel, ran: list[int]) -> Agent[None, str]:
    agent = Agent(model, name="looper")

    @agent.tool_plain
    def bump(n: int) -> int:
        """Count once."""
        ran.append(n)
        return n + 1

    return agent


def test_max_tool_calls_stops_an_agent_that_keeps_calling(tmp_path: Path) -> None:
    ran: list[int] = []
    bound = BoundloopAgent(counting_agent(keeps_calling("bump"), ran),
                           budget=bl.Budget(max_tool_calls=2, max_model_steps=10))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "count forever")
        events = list(runner.journal.events(out.run_id))
    assert out.status == "limit_exceeded" and out.result.exhausted_limit == "tool_calls"
    assert "max_tool_calls=2" in out.result.explanation
    assert ran == [0, 1] and out.result.tool_calls == 2 and out.output is None
    assert sum(isinstance(e, ev.CallDispatched) for e in events) == 2
    assert isinstance(events[-1], ev.RunFinished) and events[-1].status == "limit_exceeded"


def test_max_model_steps_stops_it_and_the_last_step_offers_no_tools(tmp_path: Path) -> None:
    ran: list[int] = []
    infos: list[AgentInfo] = []
    bound = BoundloopAgent(counting_agent(keeps_calling("bump", infos), ran),
                           budget=bl.Budget(max_model_steps=3, max_tool_calls=20,
                                            deadline_s=30))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "count forever")
    assert out.status == "limit_exceeded" and out.result.exhausted_limit == "model_steps"
    assert "max_model_steps=3" in out.result.explanation
    # Each request is bounded by the run's deadline (its `timeout` setting).
    timeouts = [(i.model_settings or {}).get("timeout") for i in infos]
    assert all(isinstance(t, float) and 0 < t <= 30 for t in timeouts), timeouts
    assert ran == [0, 1] and out.result.model_steps == 3 and out.result.tool_calls == 2
    # The final-only step (reserve_final_step) offered the model no function tool.
    assert [sorted(t.name for t in i.function_tools) for i in infos] == [["bump"], ["bump"], []]


# -- 3. structured output and output validation ---------------------------------------------
class Verdict(BaseModel):
    city: str
    sunny: bool


def test_structured_output_ends_final_with_the_validated_object(tmp_path: Path) -> None:
    agent = Agent(TestModel(custom_output_args={"city": "Paris", "sunny": True}),
                  name="weather", output_type=Verdict)
    ran: list[str] = []

    @agent.tool_plain
    def forecast(city: str) -> str:
        """The forecast for a city."""
        ran.append(city)
        return "sun"

    alone = agent.run_sync("weather in Paris?").output
    ran.clear()
    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent).run(runner, "weather in Paris?")
    assert out.status == "final"
    assert isinstance(out.output, Verdict) and out.output == alone == Verdict(
        city="Paris", sunny=True)
    assert out.result.transcript[-1].text == out.output.model_dump_json()
    assert ran == ["a"] and out.result.tool_calls == 1 and out.result.model_steps == 2


class Order(BaseModel):
    id: int
    placed: datetime.datetime


@dataclasses.dataclass
class Parcel:
    grams: int


def test_tool_results_reach_the_model_as_pydantic_ai_sends_them(tmp_path: Path) -> None:
    agent = Agent(TestModel(), name="shop")

    @agent.tool_plain
    def order(n: int) -> Order:
        """An order."""
        return Order(id=n, placed=datetime.datetime(2026, 1, 2, 3, 4))

    @agent.tool_plain
    def parcel(n: int) -> Parcel:
        """A parcel."""
        return Parcel(grams=n)

    alone = agent.run_sync("go").output
    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent).run(runner, "go")
    assert out.status == "final" and out.output == alone
    assert [m.content for m in out.result.transcript if m.kind == "tool_result"] == [
        {"id": 0, "placed": "2026-01-02T03:04:00"}, {"grams": 0}]


@pytest.mark.parametrize("strategy", ["graceful", "early"])
def test_output_given_with_function_calls_follows_the_agents_end_strategy(
        tmp_path: Path, strategy: str) -> None:
    requests: list[list[ModelMessage]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests.append(list(messages))
        return ModelResponse(parts=[
            ToolCallPart("forecast", {"city": "Oslo"}, tool_call_id="f1"),
            ToolCallPart(info.output_tools[0].name, {"city": "Oslo", "sunny": False},
                         tool_call_id="o1")])

    def make() -> tuple[Agent[None, Verdict], list[str]]:
        ran: list[str] = []
        agent = Agent(FunctionModel(model), name="both", output_type=Verdict,
                      end_strategy=strategy)  # type: ignore[arg-type]

        @agent.tool_plain
        def forecast(city: str) -> str:
            """The forecast."""
            ran.append(city)
            return "rain"

        return agent, ran

    agent, ran = make()
    alone = agent.run_sync("weather?").output
    alone_ran, alone_requests = list(ran), len(requests)
    requests.clear()
    agent, ran = make()
    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent).run(runner, "weather?")
    assert out.status == "final" and out.output == alone == Verdict(city="Oslo", sunny=False)
    assert ran == alone_ran and len(requests) == alone_requests == 1
    if strategy == "graceful":
        # The function tool ran (under boundloop), then the output given with it ended the
        # run: a second step, with no second request.
        assert ran == ["Oslo"] and out.result.tool_calls == 1 and out.result.model_steps == 2
    else:
        assert ran == [] and out.result.tool_calls == 0 and out.result.model_steps == 1


def picky_agent(rejections: int) -> tuple[Agent[None, Verdict], list[Verdict]]:
    checked: list[Verdict] = []
    agent = Agent(TestModel(custom_output_args={"city": "paris", "sunny": True}),
                  name="picky", output_type=Verdict)

    @agent.output_validator
    def capitalised(output: Verdict) -> Verdict:
        checked.append(output)
        if len(checked) <= rejections:
            raise ModelRetry("the city must be capitalised")
        return Verdict(city=output.city.title(), sunny=output.sunny)

    return agent, checked


def test_output_validator_rejecting_once_is_malformed_then_retried(tmp_path: Path) -> None:
    agent, checked = picky_agent(rejections=1)
    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent, budget=bl.Budget(malformed_retries=1)).run(runner, "go")
        events = list(runner.journal.events(out.run_id))
        strict_agent, _ = picky_agent(rejections=1)
        strict = BoundloopAgent(strict_agent).run(runner, "go")
    assert out.status == "final" and out.output == Verdict(city="Paris", sunny=True)
    assert len(checked) == 2 and out.result.model_steps == 2
    notices = [m.text for m in out.result.transcript if m.kind == "notice"]
    assert len(notices) == 1 and "the city must be capitalised" in notices[0]
    assert any(isinstance(e, ev.NoticeAdded) for e in events)
    # Without a malformed retry, the refusal ends the run, saying what was refused.
    assert strict.status == "malformed_response" and strict.output is None
    assert "the city must be capitalised" in strict.result.explanation
    assert strict.result.model_steps == 1


# -- 7. idempotency keys and tool options ----------------------------------------------------
def test_tools_see_their_idempotency_key_and_tool_options_apply(tmp_path: Path) -> None:
    attempts: list[tuple[str, int, int]] = []
    calls = iter(range(100))

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not returns(messages):
            return ModelResponse(parts=[ToolCallPart("pay", {"cents": 500},
                                                     tool_call_id=f"p{next(calls)}")])
        return ModelResponse(parts=[TextPart("paid")])

    agent = Agent(FunctionModel(model), name="payer", deps_type=dict)

    @agent.tool
    def pay(ctx: RunContext[dict[str, str]], cents: int) -> str:
        """Pay."""
        call = current_call()
        assert call is not None
        assert ctx.deps == {"for": call.run_id}      # made by deps_factory, per run
        assert ctx.tool_call_id == call.call_id and ctx.retry == call.attempt - 1
        attempts.append((call.idempotency_key, call.attempt, call.epoch))
        if call.attempt < 3:
            raise ConnectionError("gateway hiccup")
        return f"paid {cents}"

    bound = BoundloopAgent(agent, deps_factory=lambda run_id: {"for": run_id},
                           tool_options={"pay": {
        "idempotent": True, "retry": bl.RetryPolicy(max_attempts=3, backoff_s=0.0)}})
    tool = next(t for t in bound.agent.tools if t.name == "pay")
    assert tool.idempotent and not tool.irreversible
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "pay")
        events = list(runner.journal.events(out.run_id))
    assert out.status == "final" and out.output == "paid"
    keys = {key for key, _, _ in attempts}
    assert len(keys) == 1 and [a for _, a, _ in attempts] == [1, 2, 3]
    assert all(epoch >= 1 for _, _, epoch in attempts)
    decided = [e for e in events if isinstance(e, ev.CallDecided)]
    assert [e.idempotency_key for e in decided] == list(keys)
    assert out.result.tool_calls == 3     # every retry attempt counts
    assert [(c.tool, c.status, c.attempts) for c in out.result.completed] == [("pay", "ok", 3)]
    irreversible = BoundloopAgent(agent, name="payer2",
                                  tool_options={"pay": {"irreversible": True}})
    assert next(t for t in irreversible.agent.tools if t.name == "pay").irreversible
    with pytest.raises(bl.ConfigError, match="refund"):
        _ = BoundloopAgent(agent, name="x", tool_options={"refund": {"idempotent": True}}).agent


def test_a_failing_model_is_a_model_error_and_nothing_runs(tmp_path: Path) -> None:
    def broken(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise RuntimeError("provider unavailable")

    ran: list[int] = []
    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(counting_agent(FunctionModel(broken), ran)).run(runner, "go")
        events = list(runner.journal.events(out.run_id))
    assert out.status == "model_error" and out.output is None and ran == []
    assert "provider unavailable" in out.result.explanation
    assert out.result.model_steps == 1 and out.result.tool_calls == 0
    assert any(isinstance(e, ev.ModelStepFailed) for e in events)


def test_configuration_errors_and_the_missing_extra(tmp_path: Path) -> None:
    with pytest.raises(bl.ConfigError, match="name"):
        BoundloopAgent(Agent(TestModel()))
    with pytest.raises(bl.ConfigError, match="pydantic_ai.Agent"):
        BoundloopAgent(object(), name="x")  # type: ignore[arg-type]
    with pytest.raises(bl.ConfigError, match="not both"):
        BoundloopAgent(Agent(TestModel()), name="x", deps=1, deps_factory=lambda run: 2)
    from pydantic_ai.toolsets import FunctionToolset

    agent = Agent(TestModel(), name="x", toolsets=[FunctionToolset().prefixed("p")])
    with pytest.raises(bl.ConfigError, match="PrefixedToolset"):
        _ = BoundloopAgent(agent).agent
    with pytest.raises(bl.ConfigError, match="no model"):
        asyncio.run(BoundloopAgent(Agent(name="x")).step([], None))
    timed = Agent(TestModel(), name="timed")

    @timed.tool_plain(timeout=2.5)
    def slow() -> str:
        """Slow."""
        return "ok"

    (tool,) = BoundloopAgent(timed).agent.tools
    assert tool.timeout_s == 2.5 and not tool.idempotent
    code = ("import sys; sys.modules['pydantic_ai'] = None\n"
            "import boundloop, boundloop.integrations\n"
            "assert 'pydantic_ai' not in sys.modules or sys.modules['pydantic_ai'] is None\n"
            "try:\n"
            "    import boundloop.integrations.pydantic_ai\n"
            "except boundloop.ConfigError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "boundloop[pydantic-ai]" in done.stdout
    plain = subprocess.run([sys.executable, "-c", "import sys, boundloop; "
                            "boundloop.Runner; print('pydantic_ai' in sys.modules)"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert plain.stdout.strip() == "False", plain.stderr


# -- 4. SIGKILL mid-call: recovery never runs the tool again by itself -----------------------
def worker_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def crash(journal: Path, effects: Path, kind: str) -> None:
    proc = subprocess.run([sys.executable, str(WORKER), str(journal), str(effects), kind,
                           "--die"], capture_output=True, text=True, timeout=120,
                          env=worker_env())
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.parametrize("kind", ["plain", "irreversible"])
def test_sigkill_mid_call_leaves_a_non_idempotent_tool_to_a_person(tmp_path: Path,
                                                                   kind: str) -> None:
    from guest_crash_worker import RUN_ID, build, effect_lines

    journal, effects = tmp_path / "j", tmp_path / "effects"
    crash(journal, effects, kind)
    assert len(effect_lines(effects)) == 1          # the tool's effect happened, then death
    with bl.Runner(journal) as runner:
        recovered = runner.recover()
        assert [r.run_id for r in recovered] == [RUN_ID]
        (action,) = recovered[0].unresolved
        assert (action.tool, action.call_id, action.phase) == ("ship", "ship-1", "dispatched")
        assert action.idempotency_key == effect_lines(effects)[0]
        bound = build(effects, kind)
        out = bound.resume(runner, RUN_ID)
        # SPEC 6: a tool neither idempotent nor reconcilable is never re-run by recovery:
        # its outcome is unknown, so the run waits for a person.
        assert out.status == "needs_review" and out.output is None
        assert [u.execution_id for u in out.result.unresolved] == [action.execution_id]
        assert "ship" in out.result.explanation and "not idempotent" in out.result.explanation
        assert len(effect_lines(effects)) == 1
        # A person says it took effect; the agent then goes on from the journal alone.
        runner.resolve(RUN_ID, action.execution_id, "succeeded", note="the box left")
        done = build(effects, kind).resume(runner, RUN_ID)
        events = list(runner.journal.events(RUN_ID))
    assert done.status == "final" and done.output == "shipping: success"
    assert len(effect_lines(effects)) == 1          # never run twice
    assert sum(isinstance(e, ev.CallDispatched) for e in events) == 1
    assert [m.kind for m in done.result.transcript] == [
        "user", "assistant", "call", "tool_result", "final"]
    show = subprocess.run([sys.executable, "-m", "boundloop", "--journal", str(journal),
                           "show", RUN_ID], capture_output=True, text=True, timeout=60,
                          env=worker_env())
    assert show.returncode == 0, show.stderr
    for word in ("ship-1", "ship", "CallDecided", "CallDispatched", "CallResolved", "final",
                 "shipper"):
        assert word in show.stdout, word


def test_sigkill_mid_call_retries_an_idempotent_tool_under_the_same_key(tmp_path: Path) -> None:
    from guest_crash_worker import RUN_ID, build, effect_lines

    journal, effects = tmp_path / "j", tmp_path / "effects"
    crash(journal, effects, "idempotent")
    with bl.Runner(journal) as runner:
        (recovered,) = runner.recover()
        out = build(effects, "idempotent").resume(runner, RUN_ID)
    assert out.status == "final" and out.output == "shipping: success"
    keys = effect_lines(effects)
    assert len(keys) == 2 and keys[0] == keys[1] == recovered.unresolved[0].idempotency_key
    assert out.result.tool_calls == 2               # the retry attempt counts
    assert [(c.tool, c.status, c.attempts) for c in out.result.completed] == [("ship", "ok", 2)]


# -- 5. parallel delegation shares one limit (pydantic-ai-harness #696) ----------------------
def test_parallel_delegations_never_pass_the_parents_tool_call_limit(tmp_path: Path) -> None:
    executed: list[str] = []
    lock = threading.Lock()
    children: list[Any] = []

    def sub_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart("count", {"n": len(returns(messages))})])

    worker = Agent(FunctionModel(sub_model), name="researcher")

    @worker.tool_plain
    async def count(n: int) -> int:
        """Count one more thing (a counted side effect)."""
        with lock:
            executed.append(f"count {n}")
        await asyncio.sleep(0.01)
        return n + 1

    sub = BoundloopAgent(worker, budget=bl.Budget(max_tool_calls=50, max_model_steps=50))

    def boss_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not returns(messages):
            return ModelResponse(parts=[ToolCallPart("delegate", {"task": f"topic {i}"},
                                                     tool_call_id=f"d{i}") for i in range(4)])
        return ModelResponse(parts=[TextPart("summarised")])

    boss = Agent(FunctionModel(boss_model), name="boss")

    @boss.tool_plain
    async def delegate(task: str) -> str:
        """Hand a task to a researcher."""
        with lock:
            executed.append(f"delegate {task}")
        child = await sub.arun_child(task)
        children.append(child)
        return f"{child.status}: {child.result.explanation}"

    bound = BoundloopAgent(boss, budget=bl.Budget(max_tool_calls=9, max_parallel=4))

    async def main() -> Any:
        async with bl.Runner(tmp_path / "j") as runner:
            out = await bound.arun(runner, "research four topics")
            return out, list(runner.journal.events(out.run_id)), {
                c.run_id: list(runner.journal.events(c.run_id)) for c in children}

    out, events, child_events = asyncio.run(main())
    # Every tool call anyone made, parent and children together, stayed within 9.
    assert len(executed) <= 9
    assert sum(e.startswith("delegate") for e in executed) == 4
    assert out.result.tool_calls == len(executed)   # the journal counted every one
    assert len(children) == 4
    stopped = [c for c in children if c.status == "limit_exceeded"]
    assert stopped and all(c.result.exhausted_limit == "tool_calls" for c in stopped)
    assert all("max_tool_calls" in c.result.explanation for c in stopped)
    # Each child is a nested run of the parent, in the same journal.
    for run_events in child_events.values():
        admitted = run_events[0]
        assert isinstance(admitted, ev.RunAdmitted) and admitted.parent_run_id == out.run_id
        assert admitted.agent == "researcher"
    # The parent heard why its delegations stopped, and ended normally.
    assert out.status == "final" and out.output == "summarised"
    results = [m for m in out.result.transcript if m.kind == "tool_result"]
    assert any("max_tool_calls" in str(m.content) for m in results)


# -- 6. a worker serves the agent from the queue ---------------------------------------------
def test_a_worker_serves_queued_runs_of_the_agent(tmp_path: Path) -> None:
    ran: list[str] = []
    agent = Agent(TestModel(), name="queued")

    @agent.tool_plain
    def note(text: str) -> str:
        """Write a note."""
        call = current_call()
        ran.append(call.run_id if call else "?")
        return "noted"

    bound = BoundloopAgent(agent, version="7")
    journal = tmp_path / "j"
    with bl.Runner(journal) as runner:
        for run_id in ("q1", "q2"):
            assert runner.enqueue(bound.agent, prompt="take a note", run_id=run_id) == run_id
    worker = bl.Worker(journal, [bound.agent], poll_s=0.02)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    try:
        t0 = time.monotonic()
        while len(worker.finished) < 2 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.finished == {"q1": "final", "q2": "final"}
    assert sorted(ran) == ["q1", "q2"]
    with bl.Runner(journal) as runner:
        for run_id in ("q1", "q2"):
            events = list(runner.journal.events(run_id))
            admitted = events[0]
            assert isinstance(admitted, ev.RunAdmitted)
            assert (admitted.agent, admitted.agent_version) == ("queued", "7")
            finished = events[-1]
            assert isinstance(finished, ev.RunFinished) and finished.status == "final"
            state = bl.replay(events)
            assert state.tool_calls == 1 and state.transcript[-1].text == '{"note":"noted"}'


# -- what the model said, and what it cost --------------------------------------------------
def test_usage_text_and_odd_calls_are_converted_as_boundloop_counts_them(tmp_path: Path) -> None:
    from pydantic_ai.usage import RequestUsage

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        usage = RequestUsage(input_tokens=1000, cache_read_tokens=600, cache_write_tokens=100,
                             output_tokens=50)
        done = returns(messages)
        if not done:
            return ModelResponse(parts=[TextPart("Let me check."), ToolCallPart(
                "ghost", {"x": 1}, tool_call_id="g1")], usage=usage, model_name="m-1")
        if len(done) == 1:
            return ModelResponse(parts=[ToolCallPart("bump", '{"n": oops', tool_call_id="b1")],
                                 usage=usage, model_name="m-1")
        return ModelResponse(parts=[TextPart("done")], usage=usage, model_name="m-1")

    ran: list[int] = []
    seen: list[list[ModelMessage]] = []

    def recording(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(list(messages))
        return model(messages, info)

    bound = BoundloopAgent(counting_agent(FunctionModel(recording, model_name="m-1"), ran),
                           budget=bl.Budget(malformed_retries=1))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "go")
    assert out.status == "malformed_response" and ran == []
    # SPEC 7: input_tokens is the uncached input; cache reads and writes are apart.
    step_usage = bl.Usage(input_tokens=300, output_tokens=50, cache_write_tokens=100,
                          cache_read_tokens=600)
    assert out.result.usage.input_tokens == 3 * step_usage.input_tokens
    assert out.result.usage.cache_read_tokens == 3 * 600
    assert out.result.usage.cache_write_tokens == 3 * 100
    # The text said alongside the calls is kept, and sent back verbatim.
    assistant = [m for m in out.result.transcript if m.kind == "assistant"]
    assert [m.text for m in assistant] == ["Let me check."]
    # A call to a tool the agent does not have is an unknown_tool result the model sees as
    # a retry; arguments that are not JSON make the response malformed, naming the call.
    results = [m for m in out.result.transcript if m.kind == "tool_result"]
    assert [r.status for r in results] == ["unknown_tool"]
    assert [(r.outcome, r.tool_name) for r in returns(seen[1])] == [("retried", "ghost")]
    assert [p.content for p in seen[1][1].parts if isinstance(p, TextPart)] == ["Let me check."]
    assert "call 1 (`bump`)" in out.result.explanation
    assert "not valid JSON" in out.result.explanation and out.result.model_steps == 3


def test_steps_are_priced_by_a_table_or_by_the_runners_catalogue(tmp_path: Path) -> None:
    from pydantic_ai.usage import RequestUsage

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart("hi")], model_name="gpt-4.1",
                             usage=RequestUsage(input_tokens=1000, output_tokens=100))

    agent = Agent(FunctionModel(model, model_name="gpt-4.1"), name="priced")
    table = bl.Price(input_per_mtok=2.0, output_per_mtok=8.0)
    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent, price=table,
                             budget=bl.Budget(max_cost=1.0)).run(runner, "hi")
    assert out.status == "final" and out.result.usage.cost == pytest.approx(0.0028)
    with pytest.raises(bl.ConfigError, match="auto"):
        BoundloopAgent(agent, price="cheap")  # type: ignore[arg-type]
    pytest.importorskip("genai_prices")
    with bl.Runner(tmp_path / "k", price="auto") as runner:
        auto = BoundloopAgent(agent).run(runner, "hi")
    assert auto.status == "final" and auto.result.usage.cost is not None
    assert auto.result.usage.cost > 0
    # The agent's own price="auto" prices its steps as the Runner's does.
    with bl.Runner(tmp_path / "l") as runner:
        own = BoundloopAgent(agent, price="auto", budget=bl.Budget(max_cost=1.0)).run(
            runner, "hi")
    assert own.status == "final" and own.result.usage.cost == auto.result.usage.cost
    assert own.result.usage.unpriced_steps == 0


def test_a_tool_that_requires_approval_waits_for_a_person(tmp_path: Path) -> None:
    ran: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not returns(messages):
            return ModelResponse(parts=[ToolCallPart("wire", {"cents": 100}, tool_call_id="w1")])
        return ModelResponse(parts=[TextPart(f"wired: {returns(messages)[0].outcome}")])

    agent = Agent(FunctionModel(model), name="banker")

    @agent.tool_plain(requires_approval=True)
    def wire(cents: int) -> str:
        """Wire money."""
        ran.append(cents)
        return "sent"

    bound = BoundloopAgent(agent)
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "wire 1 dollar", run_id="wire-1")
        assert out.status == "awaiting_approval" and ran == []
        events = list(runner.journal.events("wire-1"))
        (asked,) = [e for e in events if isinstance(e, ev.ApprovalRequested)]
        runner.approve("wire-1", asked.execution_id, by="alice", note="ok")
        done = bound.resume(runner, "wire-1")
    assert done.status == "final" and done.output == "wired: success" and ran == [100]


def test_a_worker_takes_over_a_crashed_run_from_the_journal_alone(tmp_path: Path) -> None:
    from guest_crash_worker import RUN_ID, build, effect_lines

    journal, effects = tmp_path / "j", tmp_path / "effects"
    crash(journal, effects, "idempotent")
    bound = build(effects, "idempotent")             # a fresh process's agent: no memory
    worker = bl.Worker(journal, [bound.agent], poll_s=0.02)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    try:
        t0 = time.monotonic()
        while RUN_ID not in worker.finished and time.monotonic() - t0 < 60:
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.finished == {RUN_ID: "final"}
    keys = effect_lines(effects)
    assert len(keys) == 2 and keys[0] == keys[1]     # retried once, under the same key
    with bl.Runner(journal) as runner:
        events = list(runner.journal.events(RUN_ID))
    assert any(isinstance(e, ev.OwnerClaimed) for e in events)
    state = bl.replay(events)
    assert state.status == "final" and state.tool_calls == 2
    assert state.transcript[-1].text == "shipping: success"


def test_cancelling_a_run_stops_the_agent_mid_request(tmp_path: Path) -> None:
    started = threading.Event()

    async def slow(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        started.set()
        await asyncio.sleep(30)
        return ModelResponse(parts=[TextPart("too late")])

    ran: list[int] = []
    bound = BoundloopAgent(counting_agent(FunctionModel(slow), ran))
    token = bl.CancelToken()
    threading.Thread(target=lambda: (started.wait(10), token.cancel("stop"))).start()
    t0 = time.monotonic()
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "go", cancel=token)
        events = list(runner.journal.events(out.run_id))
    assert out.status == "cancelled" and time.monotonic() - t0 < 10   # not the 30 s request
    assert out.result.model_steps == 1 and "cancel" in out.result.explanation.lower()
    assert ran == [] and out.output is None and out.result.tool_calls == 0
    assert isinstance(events[-1], ev.RunFinished) and events[-1].status == "cancelled"


# --- found by an attacker session ------------------------------------------------------------

def test_a_tool_returning_bytes_that_are_not_utf8_succeeds_once(tmp_path: Path) -> None:
    """Its return could not be made JSON as text: it was recorded as an error, and a retry
    policy ran the (non-idempotent) tool three times."""
    charges: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not returns(messages):
            return ModelResponse(parts=[ToolCallPart("charge", {"cents": 5}, tool_call_id="c")])
        return ModelResponse(parts=[TextPart("charged")])

    agent = Agent(FunctionModel(model), name="biller")

    @agent.tool_plain
    def charge(cents: int) -> Any:
        charges.append(cents)
        return {"receipt": b"\x89receipt\xff", "cents": cents}

    bound = BoundloopAgent(agent, tool_options={"charge": {"retry": bl.RetryPolicy(3, 0.0)}})
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "charge me")
    assert out.status == "final" and charges == [5]
    assert [(c.tool, c.status, c.attempts) for c in out.result.completed] == [("charge", "ok", 1)]


def test_a_sequential_tool_never_runs_alongside_another_call(tmp_path: Path) -> None:
    running, most = [0], [0]

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not returns(messages):
            return ModelResponse(parts=[ToolCallPart("write", {"n": i}, tool_call_id=f"w{i}")
                                        for i in range(4)])
        return ModelResponse(parts=[TextPart("written")])

    agent = Agent(FunctionModel(model), name="ledger")

    @agent.tool_plain(sequential=True)
    async def write(n: int) -> int:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        return n

    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent, budget=bl.Budget(max_parallel=4)).run(runner, "go")
    assert out.status == "final" and out.result.tool_calls == 4 and most == [1]


def test_an_output_validators_reason_reaches_the_model(tmp_path: Path) -> None:
    seen: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(str(messages[-1].parts[-1].content))  # type: ignore[union-attr]
        return ModelResponse(parts=[TextPart(f"answer {len(seen)}")])

    agent = Agent(FunctionModel(model), name="strict")

    @agent.output_validator
    def check(text: str) -> str:
        if text != "answer 2":
            raise ModelRetry("say it twice")
        return text

    with bl.Runner(tmp_path / "j") as runner:
        out = BoundloopAgent(agent, budget=bl.Budget(malformed_retries=1)).run(runner, "go")
        strict = BoundloopAgent(agent).run(runner, "go")
    notices = [m.text for m in out.result.transcript if m.kind == "notice"]
    assert out.status == "final" and out.output == "answer 2"
    assert len(notices) == 1 and "say it twice" in notices[0] and "say it twice" in seen[1]
    assert strict.status == "malformed_response" and "say it twice" in strict.result.explanation
