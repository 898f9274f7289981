"""boundloop.integrations.openai_agents: an unmodified OpenAI Agents SDK agent run under
boundloop (issue #24). No network: the agents' models are fakes of ``agents.Model``.

Each test checks the run's status, its counters, the journal and the tools' real effects
together: the SDK must never run a tool itself, make one model request per step, and
leave every decision (budgets, intent before dispatch, recovery) to boundloop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

agents = pytest.importorskip("agents")

import pydantic  # noqa: E402
from agents.testing import assistant_message, function_call  # noqa: E402
from agents.tool_context import ToolContext  # noqa: E402

import boundloop as bl  # noqa: E402
from boundloop import events as ev  # noqa: E402
from boundloop.integrations import current_call  # noqa: E402
from boundloop.integrations.openai_agents import BoundloopAgent, to_input_items  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("oai_agents_worker.py")

Reply = list[Any] | Callable[[list[Any]], list[Any]]


class FakeModel(agents.Model):
    """An ``agents.Model`` that replies from a script (a list of output items, or a function
    of the input giving them), recording every request it receives."""

    def __init__(self, replies: list[Reply] | Callable[[list[Any]], list[Any]]) -> None:
        self.replies = replies
        self.inputs: list[list[Any]] = []
        self.settings: list[Any] = []

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any,
                           tools: Any, output_schema: Any, handoffs: Any, tracing: Any, *,
                           previous_response_id: Any = None, conversation_id: Any = None,
                           prompt: Any = None) -> agents.ModelResponse:
        items = [input] if isinstance(input, str) else list(input)
        self.inputs.append(json.loads(json.dumps(items, default=str)))
        self.settings.append(model_settings)
        if callable(self.replies):
            out = self.replies(items)
        else:
            if not self.replies:
                raise RuntimeError("the fake model has no reply left")
            reply = self.replies.pop(0)
            out = reply(items) if callable(reply) else reply
        usage = agents.Usage(requests=1, input_tokens=100, output_tokens=7,
                             input_tokens_details=agents.usage.InputTokensDetails(
                                 cached_tokens=40, cache_write_tokens=10))
        return agents.ModelResponse(output=out, usage=usage,
                                    response_id=f"resp_{len(self.inputs)}")

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def outputs(items: list[Any]) -> list[Any]:
    return [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]


def events_of(runner: bl.Runner, run_id: str) -> list[Any]:
    return list(runner.journal.events(run_id))


def intent_before_dispatch(events: list[Any]) -> None:
    """Every call's CallDecided (the durable intent) comes before its first CallDispatched."""
    decided = {e.execution_id: i for i, e in enumerate(events) if isinstance(e, ev.CallDecided)}
    dispatched = {}
    for i, e in enumerate(events):
        if isinstance(e, ev.CallDispatched):
            dispatched.setdefault(e.execution_id, i)
    assert decided and set(dispatched) <= set(decided)
    for execution, at in dispatched.items():
        assert decided[execution] < at


# --- 1. an unmodified agent, to its end --------------------------------------------------------

def calculator(log: list[Any], journal: list[bl.Runner] | None = None,
               ) -> tuple[Any, Callable[[], list[Reply]]]:
    """Two SDK tools logging each real effect; with ``journal`` (a runner, once there is
    one), each also logs what the journal holds of its call at the moment of its effect."""

    def effect(*entry: Any) -> None:
        call = current_call()
        log.append((*entry, call.idempotency_key if call else None,
                    call.call_id if call else None))
        if journal and call is not None:
            log.append([type(e).__name__ for e in journal[0].journal.events(call.run_id)
                        if getattr(e, "execution_id", None) == call.execution_id])

    @agents.function_tool
    def add(x: int, y: int) -> int:
        """Add two whole numbers."""
        effect("add", x, y)
        return x + y

    @agents.function_tool
    async def describe(n: int) -> dict[str, Any]:
        """Describe a number."""
        effect("describe", n, None)
        return {"n": n, "even": n % 2 == 0}

    def script() -> list[Reply]:
        return [
            [assistant_message("Let me add."),
             function_call("add", {"x": 1, "y": 2}, call_id="call_a"),
             function_call("add", {"x": 3, "y": 4}, call_id="call_b")],
            [function_call("describe", {"n": 10}, call_id="call_c")],
            [assistant_message("3, 7, and 10 is even")],
        ]

    return [add, describe], script


def test_an_unmodified_agent_runs_to_final_with_boundloop_deciding_every_call(
        tmp_path: Path) -> None:
    native_log: list[Any] = []
    tools, script = calculator(native_log)
    native_model = FakeModel(script())
    native = asyncio.run(agents.Runner.run(
        agents.Agent(name="calc", instructions="Add.", tools=tools, model=native_model),
        "add 1+2 and 3+4, describe 10", run_config=agents.RunConfig(tracing_disabled=True)))

    log: list[Any] = []
    journal: list[bl.Runner] = []
    tools, script = calculator(log, journal)
    model = FakeModel(script())
    sdk_agent = agents.Agent(name="calc", instructions="Add.", tools=tools, model=model)
    bound = BoundloopAgent(sdk_agent, budget=bl.Budget(max_parallel=2))
    assert bound.name == "calc"
    with bl.Runner(tmp_path / "j") as runner:
        journal.append(runner)
        out = bound.run(runner, "add 1+2 and 3+4, describe 10")
        events = events_of(runner, out.run_id)
    # At each tool's effect, the journal already held its intent, then its dispatch.
    held = [entry for entry in log if isinstance(entry, list)]
    log = [entry for entry in log if isinstance(entry, tuple)]
    assert held == [["CallDecided", "CallDispatched"]] * 3

    # The same answer as the SDK alone, from the same model.
    assert out.status == "final" and out.output == native.final_output == "3, 7, and 10 is even"
    assert out.result.transcript[-1].text == native.final_output
    assert out.result.model_steps == 3 and out.result.tool_calls == 3
    assert len(model.inputs) == 3                       # one real request per step
    # The model saw what it sees under the SDK alone: the same calls and outputs, in order.
    def seen(items: list[Any]) -> list[Any]:
        return [(i.get("type"), i.get("call_id"), i.get("output"))
                for i in items if i.get("type") in ("function_call", "function_call_output")]
    assert [seen(i) for i in model.inputs] == [seen(i) for i in native_model.inputs]
    assert [(name, x, y) for name, x, y, _, _ in log] == \
        [(name, x, y) for name, x, y, _, _ in native_log]
    # Each tool ran once, by boundloop, under boundloop's call id and idempotency key.
    assert sorted(c for *_, c in log) == ["call_a", "call_b", "call_c"]
    decided = {e.call_id: e for e in events if isinstance(e, ev.CallDecided)}
    assert {c: d.idempotency_key for c, d in decided.items()} == {c: k for *_, k, c in log}
    intent_before_dispatch(events)
    assert isinstance(events[-1], ev.RunFinished) and events[-1].status == "final"
    # Usage by SPEC 7: input without the cached part; the provider's response id kept.
    assert out.result.usage.input_tokens == 3 * 50
    assert out.result.usage.cache_read_tokens == 3 * 40
    assert out.result.usage.cache_write_tokens == 3 * 10
    assert out.result.usage.output_tokens == 3 * 7
    infos = [e.response.info for e in events if isinstance(e, ev.ModelStepCompleted)]
    assert [i.id for i in infos if i] == ["resp_1", "resp_2", "resp_3"]
    # The text said alongside the calls, and results as the SDK gives them to the model.
    kinds = [m.kind for m in out.result.transcript]
    assert kinds[:2] == ["user", "assistant"] and out.result.transcript[1].text == "Let me add."
    results = {m.id: m.content for m in out.result.transcript if m.kind == "tool_result"}
    assert results == {"call_a": "3", "call_b": "7", "call_c": "{'n': 10, 'even': True}"}


# --- 2. budgets stop it ------------------------------------------------------------------------

def counting_agent(log: list[int], **options: Any) -> tuple[BoundloopAgent, FakeModel]:
    @agents.function_tool
    def count(n: int) -> int:
        """Count."""
        log.append(n)
        return n

    def again(items: list[Any]) -> list[Any]:
        n = len(outputs(items))
        return [function_call("count", {"n": n}, call_id=f"call_{n}")]

    model = FakeModel(again)
    return BoundloopAgent(agents.Agent(name="counter", tools=[count], model=model),
                          **options), model


def test_max_tool_calls_stops_a_model_that_keeps_calling(tmp_path: Path) -> None:
    log: list[int] = []
    bound, model = counting_agent(log, budget=bl.Budget(max_tool_calls=2, max_model_steps=10))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "count")
        events = events_of(runner, out.run_id)
    assert (out.status, out.result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert "2" in out.result.explanation and out.output is None
    assert log == [0, 1] and out.result.tool_calls == 2
    assert len([e for e in events if isinstance(e, ev.CallDecided)]) == 2
    assert len(model.inputs) == out.result.model_steps == 3
    # Once the call budget is spent, the SDK's model is told no tool may be called.
    assert [s.tool_choice for s in model.settings] == [None, None, "none"]
    finished = events[-1]
    assert isinstance(finished, ev.RunFinished) and finished.exhausted_limit == "tool_calls"


def test_max_model_steps_stops_it_too(tmp_path: Path) -> None:
    log: list[int] = []
    bound, model = counting_agent(log, budget=bl.Budget(max_model_steps=3, max_tool_calls=50))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "count")
        events = events_of(runner, out.run_id)
    assert (out.status, out.result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert out.result.model_steps == 3 and len(model.inputs) == 3
    # Step 3 was the final-only step: its calls were refused, never run.
    assert log == [0, 1] and out.result.tool_calls == 2
    assert model.settings[-1].tool_choice == "none"
    assert len([e for e in events if isinstance(e, ev.CallDispatched)]) == 2


# --- 3. structured output ----------------------------------------------------------------------

class Weather(pydantic.BaseModel):
    city: str
    celsius: int


def weather_agent(replies: list[Reply]) -> tuple[BoundloopAgent, FakeModel, list[str]]:
    looked: list[str] = []

    @agents.function_tool
    def lookup(city: str) -> str:
        """Look the weather up."""
        looked.append(city)
        return "3 degrees"

    model = FakeModel(replies)
    sdk_agent = agents.Agent(name="weather", tools=[lookup], model=model, output_type=Weather)
    return BoundloopAgent(sdk_agent), model, looked


def test_output_type_gives_the_validated_object(tmp_path: Path) -> None:
    bound, model, looked = weather_agent([
        [function_call("lookup", {"city": "Oslo"}, call_id="c1")],
        [assistant_message('{"city": "Oslo", "celsius": 3}')]])
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "weather in Oslo?")
        events = events_of(runner, out.run_id)
    assert out.status == "final" and out.output == Weather(city="Oslo", celsius=3)
    assert json.loads(out.result.transcript[-1].text) == {"city": "Oslo", "celsius": 3}
    assert looked == ["Oslo"] and out.result.tool_calls == 1 and out.result.model_steps == 2
    assert events[-1].status == "final"


def test_an_answer_the_sdk_refuses_is_malformed_and_may_be_retried(tmp_path: Path) -> None:
    bound, model, _ = weather_agent([[assistant_message("it is cold")],
                                     [assistant_message('{"city": "Oslo", "celsius": -2}')]])
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "weather?", budget=bl.Budget(malformed_retries=1))
        strict = weather_agent([[assistant_message("it is cold")]])[0].run(runner, "weather?")
    assert out.status == "final" and out.output == Weather(city="Oslo", celsius=-2)
    notices = [m.text for m in out.result.transcript if m.kind == "notice"]
    assert len(notices) == 1 and "JSON" in notices[0]
    assert len(model.inputs) == 2                       # the refused answer was not re-sent
    # The retry's request carried boundloop's notice as a user message.
    assert any(i.get("role") == "user" and "JSON" in str(i.get("content"))
               for i in model.inputs[1])
    assert strict.status == "malformed_response" and strict.output is None
    assert "JSON" in strict.result.explanation


# --- 4. a real SIGKILL mid-call ----------------------------------------------------------------

def killed_mid_call(journal: Path, ledger: Path, *extra: str) -> list[str]:
    """Run the worker in a real process and SIGKILL it while its tool call is running
    (its effect done, its outcome not recorded); the ledger's lines."""
    proc = subprocess.Popen([sys.executable, str(WORKER), str(journal), str(ledger), *extra],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while not (ledger.exists() and ledger.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < end, "the tool never ran"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)                # mid-call: the effect is done
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    effects = ledger.read_text().splitlines()
    assert len(effects) == 1
    return effects


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_sigkill_inside_a_non_idempotent_tool_needs_review_and_never_reruns(
        tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from oai_agents_worker import RUN_ID, make_agent

    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    env = child_env()
    effects = killed_mid_call(journal, ledger)

    bound = make_agent(ledger, wait=False)
    with bl.Runner(journal) as runner:
        recovered = runner.recover()
        assert [r.run_id for r in recovered] == [RUN_ID]
        unresolved = recovered[0].unresolved
        assert [(u.tool, u.call_id, u.phase) for u in unresolved] == \
            [("ship", "call_ship", "dispatched")]
        assert unresolved[0].idempotency_key == effects[0].split()[0]
        out = bound.resume(runner, RUN_ID)
        events = events_of(runner, RUN_ID)
    # SPEC 6: an irreversible action whose outcome is unknown goes to a person.
    assert out.status == "needs_review" and out.output is None
    assert [u.execution_id for u in out.result.unresolved] == [unresolved[0].execution_id]
    assert ledger.read_text().splitlines() == effects      # never run again
    assert len([e for e in events if isinstance(e, ev.CallDispatched)]) == 1
    intent_before_dispatch(events)

    shown = subprocess.run([sys.executable, "-m", "boundloop", "--journal", str(journal),
                            "show", RUN_ID], env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "status: needs_review" in shown.stdout and "agent: shipper" in shown.stdout
    assert "call_ship" in shown.stdout and "CallDispatched" in shown.stdout

    # A person says it took effect: the run finishes, the SDK answering from the journal.
    with bl.Runner(journal) as runner:
        runner.resolve(RUN_ID, unresolved[0].execution_id, "succeeded", note="box left")
        done = bound.resume(runner, RUN_ID)
    assert done.status == "final" and done.output == "shipped: resolved by a person: box left"
    assert ledger.read_text().splitlines() == effects


def test_sigkill_inside_an_idempotent_tool_retries_it_under_the_same_key(
        tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from oai_agents_worker import RUN_ID, make_agent

    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    effects = killed_mid_call(journal, ledger, "--idempotent")
    with bl.Runner(journal) as runner:
        [recovered] = runner.recover()
        out = make_agent(ledger, wait=False, idempotent=True).resume(runner, RUN_ID)
        events = events_of(runner, RUN_ID)
    assert out.status == "final" and out.output == "shipped: box shipped"
    again = ledger.read_text().splitlines()
    assert len(again) == 2 and again[0] == again[1] == effects[0]   # the same key, twice
    assert out.result.tool_calls == 2                                # the retry counts
    assert [(c.tool, c.status, c.attempts) for c in out.result.completed] == \
        [("ship", "ok", 2)]
    attempts = [e.attempt for e in events if isinstance(e, ev.CallDispatched)]
    assert attempts == [1, 2]
    intent_before_dispatch(events)


# --- 5. parallel delegation shares one limit (pydantic-ai-harness #696) ------------------------

def test_parallel_delegations_never_pass_the_parents_tool_call_limit(tmp_path: Path) -> None:
    counted: list[str] = []

    @agents.function_tool
    async def count(n: int) -> int:
        """Count one more."""
        counted.append(f"count {n}")
        await asyncio.sleep(0.01)
        return n

    def sub_model(items: list[Any]) -> list[Any]:
        n = len(outputs(items))
        return [function_call("count", {"n": n}, call_id=f"sub_{n}")]

    sub = BoundloopAgent(agents.Agent(name="worker", tools=[count], model=FakeModel(sub_model)),
                         budget=bl.Budget(max_tool_calls=20, max_model_steps=20))

    @agents.function_tool
    async def delegate(task: str) -> str:
        """Hand a task to a worker agent."""
        counted.append(f"delegate {task}")
        result = await sub.arun_child(task)
        return f"{result.status} ({result.result.exhausted_limit})"

    def parent_model(items: list[Any]) -> list[Any]:
        n = len(outputs(items))
        return [function_call("delegate", {"task": f"t{n + i}"}, call_id=f"del_{n + i}")
                for i in range(3)]

    parent = BoundloopAgent(
        agents.Agent(name="boss", tools=[delegate], model=FakeModel(parent_model)),
        budget=bl.Budget(max_tool_calls=9, max_parallel=3, max_model_steps=5))

    async def main() -> Any:
        async with bl.Runner(tmp_path / "j") as runner:
            out = await parent.arun(runner, "split the work")
            children = [r for r in runner.journal.runs() if r != out.run_id]
            return out, {r: events_of(runner, r) for r in children}

    out, children = asyncio.run(main())
    # Handler invocations across the parent and its children never pass 9.
    assert len(counted) <= 9
    assert len([c for c in counted if c.startswith("delegate")]) == 3
    assert len(children) == 3
    assert (out.status, out.result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert "9" in out.result.explanation
    child_ends = [evs[-1] for evs in children.values()]
    assert all(isinstance(e, ev.RunFinished) for e in child_ends)
    assert {(e.status, e.exhausted_limit) for e in child_ends} <= {
        ("limit_exceeded", "tool_calls"), ("final", None)}
    results = [m.content for m in out.result.transcript if m.kind == "tool_result"]
    assert results and all("tool_calls" in str(r) for r in results)
    # The parent is charged for its children's calls.
    assert out.result.tool_calls == 9


# --- 6. keys, tool options, approvals, a worker ------------------------------------------------

def test_idempotency_key_and_tool_options(tmp_path: Path) -> None:
    keys: list[tuple[str, int, int]] = []
    seen: list[tuple[Any, ...]] = []

    @agents.function_tool(timeout=7.5)
    async def charge(ctx: ToolContext[dict[str, str]], cents: int) -> str:
        """Charge a card."""
        call = current_call()
        assert call is not None
        keys.append((call.idempotency_key, call.attempt, call.epoch))
        seen.append((ctx.context["shop"], ctx.tool_name, ctx.tool_call_id, ctx.tool_arguments,
                     ctx.agent.name if ctx.agent else None))
        return "charged"

    model = FakeModel([[function_call("charge", {"cents": 500}, call_id="c1")],
                       [assistant_message("charged 5")]])
    bound = BoundloopAgent(agents.Agent(name="till", tools=[charge], model=model),
                           context={"shop": "corner"}, tool_options={"charge": {"idempotent": True,
                                                    "retry": bl.RetryPolicy(max_attempts=2)}})
    tool = bound.agent.tools[0]
    assert (tool.name, tool.idempotent, tool.timeout_s) == ("charge", True, 7.5)
    assert tool.retry is not None and tool.retry.max_attempts == 2
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "charge 5")
        decided = [e for e in events_of(runner, out.run_id) if isinstance(e, ev.CallDecided)]
    assert out.status == "final"
    assert keys == [(decided[0].idempotency_key, 1, 1)]
    # The SDK's own ToolContext: the run context object, the call, the agent.
    assert seen == [("corner", "charge", "c1", '{"cents": 500}', "till")]

    with pytest.raises(bl.ConfigError, match="nope"):
        _ = BoundloopAgent(agents.Agent(name="x", tools=[charge]),
                           tool_options={"nope": {"idempotent": True}}).agent


def test_an_sdk_tool_that_needs_approval_waits_for_a_person(tmp_path: Path) -> None:
    refunded: list[str] = []

    @agents.function_tool(needs_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        refunded.append(order)
        return "refunded"

    def replies(items: list[Any]) -> list[Any]:
        if outputs(items):
            return [assistant_message(f"done: {outputs(items)[-1]['output']}")]
        return [function_call("refund", {"order": "o-1"}, call_id="r1")]

    bound = BoundloopAgent(agents.Agent(name="refunds", tools=[refund],
                                        model=FakeModel(replies)))
    with bl.Runner(tmp_path / "j") as runner:
        waiting = bound.run(runner, "refund o-1", run_id="refund-1")
        assert waiting.status == "awaiting_approval" and refunded == []
        asked = [e for e in events_of(runner, "refund-1")
                 if isinstance(e, ev.ApprovalRequested)]
        runner.approve("refund-1", asked[0].execution_id, by="alice")
        done = bound.resume(runner, "refund-1")
    assert done.status == "final" and done.output == "done: refunded"
    assert refunded == ["o-1"]


def test_a_worker_serves_the_agent_from_the_queue(tmp_path: Path) -> None:
    log: list[Any] = []
    tools, script = calculator(log)
    model = FakeModel(lambda items: script()[{0: 0, 2: 1, 3: 2}[len(outputs(items))]])
    bound = BoundloopAgent(agents.Agent(name="calc", tools=tools, model=model),
                           budget=bl.Budget(max_parallel=2))
    with bl.Runner(tmp_path / "j") as runner:
        run_id = runner.enqueue(bound.agent, "add", run_id="queued-1")
    worker = bl.Worker(tmp_path / "j", [bound.agent], poll_s=0.05)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    try:
        assert worker.wait_ready(10)
        end = time.monotonic() + 30
        while "queued-1" not in worker.finished and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.finished.get(run_id) == "final"
    assert [name for name, *_ in log] == ["add", "add", "describe"]
    with bl.Runner(tmp_path / "j") as runner:
        state = runner.state(run_id)
    assert state.status == "final" and state.transcript[-1].text == "3, 7, and 10 is even"


# --- what is refused, and imports ----------------------------------------------------------------

def test_what_boundloop_cannot_drive_is_refused_clearly() -> None:
    @agents.function_tool
    def ping() -> str:
        """Ping."""
        return "pong"

    other = agents.Agent(name="other")
    with pytest.raises(bl.ConfigError, match="handoffs.*arun_child"):
        BoundloopAgent(agents.Agent(name="a", handoffs=[other]))
    with pytest.raises(bl.ConfigError, match="not a function tool"):
        BoundloopAgent(agents.Agent(name="a", tools=[agents.WebSearchTool()]))
    with pytest.raises(bl.ConfigError, match="agent as a tool"):
        BoundloopAgent(agents.Agent(name="a", tools=[other.as_tool("o", "other")]))
    with pytest.raises(bl.ConfigError, match="tool_use_behavior"):
        BoundloopAgent(agents.Agent(name="a", tools=[ping],
                                    tool_use_behavior="stop_on_first_tool"))
    with pytest.raises(bl.ConfigError, match="agents.Agent"):
        BoundloopAgent("not an agent")  # type: ignore[arg-type]


def test_history_converts_to_the_sdks_input_items() -> None:
    history = [bl.UserMessage("hi"),
               bl.CallMessage("c1", "add", {"x": 1}, step=1),
               bl.CallMessage("c2", "add", {"x": 2}, step=1),
               bl.ToolResultMessage("c1", "ok", 2),
               bl.ToolResultMessage("c2", "outcome_unknown", "timed out"),
               bl.NoticeMessage("say it plainly"),
               bl.FinalMessage("done")]
    assert to_input_items(history) == [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"x": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
        {"type": "function_call_output", "call_id": "c2",
         "output": "error (outcome_unknown): timed out"},
        {"type": "message", "role": "user", "content": "say it plainly"},
        {"type": "message", "role": "assistant", "content": "done"},
    ]


def test_imports_need_the_extra_and_boundloop_never_imports_the_sdk() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = ("import sys, boundloop, boundloop.integrations\n"
            "assert 'agents' not in sys.modules, 'boundloop imported agents'\n"
            "sys.modules['agents'] = None\n"
            "try:\n"
            "    import boundloop.integrations.openai_agents\n"
            "except boundloop.ConfigError as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "boundloop[openai-agents]" in done.stdout


# --- the model by name, guardrails ---------------------------------------------------------------

def test_a_model_named_through_the_run_configs_provider(tmp_path: Path) -> None:
    log: list[Any] = []
    tools, script = calculator(log)
    model = FakeModel(script())
    asked: list[str | None] = []

    class Provider(agents.ModelProvider):
        def get_model(self, model_name: str | None) -> agents.Model:
            asked.append(model_name)
            return model

    sdk_agent = agents.Agent(name="calc", tools=tools, model="fake-model-1",
                             model_settings=agents.ModelSettings(tool_choice="required"))
    bound = BoundloopAgent(sdk_agent, run_config=agents.RunConfig(model_provider=Provider()),
                           budget=bl.Budget(max_parallel=2))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "add")
        events = events_of(runner, out.run_id)
    assert out.status == "final" and out.output == "3, 7, and 10 is even"
    assert asked == ["fake-model-1"] * 3 and len(log) == 3
    infos = [e.response.info for e in events if isinstance(e, ev.ModelStepCompleted)]
    assert {i.model for i in infos if i} == {"fake-model-1"}
    # As the SDK does once the agent has used tools: tool_choice="required" is reset.
    assert [s.tool_choice for s in model.settings] == ["required", None, None]


def test_input_guardrails_run_once_before_the_request_and_a_tripwire_stops_all(
        tmp_path: Path) -> None:
    checked: list[str] = []

    @agents.input_guardrail
    def no_secrets(ctx: Any, agent: Any, input: Any) -> agents.GuardrailFunctionOutput:
        text = json.dumps(input, default=str)
        checked.append(text)
        return agents.GuardrailFunctionOutput(output_info=None,
                                              tripwire_triggered="password" in text)

    def agent_with(replies: list[Reply]) -> tuple[BoundloopAgent, FakeModel, list[Any]]:
        log: list[Any] = []
        tools, _ = calculator(log)
        model = FakeModel(replies)
        return BoundloopAgent(agents.Agent(name="calc", tools=tools, model=model,
                                           input_guardrails=[no_secrets])), model, log

    ok, ok_model, ok_log = agent_with([[function_call("add", {"x": 1, "y": 1}, call_id="a")],
                                       [assistant_message("2")]])
    tripped, tripped_model, tripped_log = agent_with(
        [[function_call("add", {"x": 1, "y": 1}, call_id="a")]])
    with bl.Runner(tmp_path / "j") as runner:
        good = ok.run(runner, "add 1 and 1")
        assert len(checked) == 1                      # the first step only
        bad = tripped.run(runner, "my password is hunter2")
        events = events_of(runner, bad.run_id)
    assert good.status == "final" and ok_log and len(ok_model.inputs) == 2
    # The tripwire fired before the request: no model request, no call decided, none run.
    assert bad.status == "model_error" and "Guardrail" in bad.result.explanation
    assert tripped_model.inputs == [] and tripped_log == []
    assert not [e for e in events if isinstance(e, ev.CallDecided)]


NO_NETWORK = '''
import asyncio, socket, sys, tempfile
attempts = []
def guard(*args, **kwargs):
    attempts.append(args)
    raise OSError("the network is blocked by the test")
socket.getaddrinfo = socket.create_connection = guard
socket.socket.connect = socket.socket.connect_ex = guard
sys.path.insert(0, TESTS)
import agents
import boundloop as bl
from agents.testing import assistant_message, function_call
from agents.tracing import get_trace_provider
from agents.tracing.processors import default_exporter
from test_integration_openai_agents import FakeModel
from boundloop.integrations.openai_agents import BoundloopAgent

@agents.function_tool
def ping() -> str:
    """Ping."""
    return "pong"

def sdk_agent():
    replies = [[function_call("ping", {}, call_id="p1")], [assistant_message("pong!")]]
    return agents.Agent(name="p", tools=[ping], model=FakeModel(replies))

default_exporter().base_delay = default_exporter().max_delay = 0.01   # a quick control
with bl.Runner(tempfile.mkdtemp()) as runner:
    print(BoundloopAgent(sdk_agent()).run(runner, "ping").status)
get_trace_provider().force_flush()
print(len(attempts))
print(asyncio.run(agents.Runner.run(sdk_agent(), "ping")).final_output)
get_trace_provider().force_flush()
get_trace_provider().shutdown()
print(len(attempts))
'''


def test_the_sdks_tracing_never_reaches_the_network(tmp_path: Path) -> None:
    """With an API key set, the SDK alone exports its traces to OpenAI (the control: the
    blocked socket sees it try); under boundloop its tracing is off and nothing is tried."""
    script = tmp_path / "no_network.py"
    script.write_text(f"TESTS = {str(Path(__file__).parent)!r}\n{NO_NETWORK}")
    env = {**os.environ, "OPENAI_API_KEY": "sk-test-not-a-key",
           "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("OPENAI_AGENTS_DISABLE_TRACING", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status, under_boundloop, output, in_all = done.stdout.split()
    assert (status, under_boundloop) == ("final", "0")
    assert output == "pong!" and int(in_all) > 0          # the SDK alone tried to export


def test_reasoning_items_go_back_verbatim_from_the_journal(tmp_path: Path) -> None:
    """A step's output items (reasoning with its encrypted content) are kept in the
    journal and sent back in order with the next steps, as the SDK itself would."""
    from openai.types.responses import ResponseReasoningItem

    log: list[Any] = []
    tools, _ = calculator(log)
    reasoning = ResponseReasoningItem(id="rs_1", type="reasoning", summary=[],
                                      encrypted_content="opaque-bytes")
    model = FakeModel([[reasoning, function_call("add", {"x": 2, "y": 2}, call_id="c1")],
                       [assistant_message("4")]])
    bound = BoundloopAgent(agents.Agent(name="calc", tools=tools, model=model))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "2+2")
        state = runner.state(out.run_id)
    assert out.status == "final" and out.output == "4" and len(log) == 1
    second = model.inputs[1]
    assert [i.get("type") for i in second] == ["message", "reasoning", "function_call",
                                              "function_call_output"]
    assert second[1]["id"] == "rs_1" and second[1]["encrypted_content"] == "opaque-bytes"
    # Rebuilt from the journal alone (as after a crash): the same items.
    assert to_input_items(state.transcript)[:3] == second[:3]


def test_the_sdks_own_model_retries_are_off_one_step_is_one_request(tmp_path: Path) -> None:
    from agents.retry import ModelRetrySettings

    def fail(items: list[Any]) -> list[Any]:
        raise ConnectionError("the provider dropped the connection")

    model = FakeModel([fail, [assistant_message("late")]])
    settings = agents.ModelSettings(retry=ModelRetrySettings(
        max_retries=3, policy=lambda *args, **kwargs: True))
    bound = BoundloopAgent(agents.Agent(name="flaky", model=model, model_settings=settings))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "hi")
    assert out.status == "model_error" and "dropped the connection" in out.result.explanation
    assert len(model.inputs) == 1 and out.result.model_steps == 1
    assert bound.sdk_agent.model_settings.retry is settings.retry    # the agent is unchanged


def test_arguments_that_are_not_json_make_the_response_malformed(tmp_path: Path) -> None:
    from openai.types.responses import ResponseFunctionToolCall

    log: list[Any] = []
    tools, _ = calculator(log)
    broken = ResponseFunctionToolCall(type="function_call", call_id="c1", name="add",
                                      arguments='{"x": 1, "y": ')
    model = FakeModel([[broken]])
    bound = BoundloopAgent(agents.Agent(name="calc", tools=tools, model=model))
    with bl.Runner(tmp_path / "j") as runner:
        out = bound.run(runner, "add")
        events = events_of(runner, out.run_id)
    assert out.status == "malformed_response" and log == []
    assert "add" in out.result.explanation and out.result.tool_calls == 0
    assert not [e for e in events if isinstance(e, ev.CallDecided)]


def test_steps_are_priced_by_the_catalogue_for_the_model_the_sdk_names(tmp_path: Path) -> None:
    """price="auto" on the agent (or on the Runner) prices each step by the catalogue, for
    the model name the step's request went to; the cost equals the catalogue's figures."""
    genai_prices = pytest.importorskip("genai_prices")

    class Named(FakeModel):
        model = "gpt-4.1"

    def agent_priced(price: Any) -> BoundloopAgent:
        agent = agents.Agent(name="priced", model=Named([[assistant_message("hi")]]))
        return BoundloopAgent(agent, price=price, budget=bl.Budget(max_cost=1.0))

    with bl.Runner(tmp_path / "j") as runner:
        own = agent_priced("auto").run(runner, "hi")
    with bl.Runner(tmp_path / "k", price="auto") as runner:
        by_runner = agent_priced(None).run(runner, "hi")
    # By hand: 100 input tokens of which 40 read from the cache and 10 written to it.
    quote = genai_prices.calc_price(genai_prices.Usage(input_tokens=100, output_tokens=7,
                                                       cache_read_tokens=40,
                                                       cache_write_tokens=10),
                                    model_ref="gpt-4.1", provider_id="openai")
    assert own.status == by_runner.status == "final"
    assert own.result.usage.unpriced_steps == 0
    assert own.result.usage.cost == pytest.approx(float(quote.total_price))
    assert by_runner.result.usage.cost == pytest.approx(float(quote.total_price))
    with pytest.raises(bl.ConfigError, match="auto"):
        BoundloopAgent(agents.Agent(name="x", model=Named([])), price="cheap")
