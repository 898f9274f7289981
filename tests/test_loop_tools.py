"""SPEC 4 and 5 steps 9-11: tool results of every status, parallel dispatch, result size."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from loop_helpers import journal_of, plain, transcript

import boundloop as bl


def results_of(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["id"], m["status"]) for m in messages if m["kind"] == "tool_result"]


# -- denied, invalid_arguments, unknown_tool -----------------------------------------------
def test_refused_calls_count_and_the_model_sees_them(runner: bl.Runner) -> None:
    ran: list[str] = []
    permits: list[tuple[Any, Any, Any]] = []

    @bl.tool
    def act(target: str, times: int = 1) -> str:
        """Do something to target."""
        ran.append(target)
        return f"did {target} x{times}"

    def permit(call: bl.ToolCall, tool: bl.Tool, ctx: bl.ModelContext) -> Any:
        permits.append((call, tool, ctx))
        target = call.arguments.get("target")
        if target == "no":
            return False
        if target == "reason":
            return "production is frozen"
        if target == "boom":
            raise RuntimeError("policy service down")
        return True

    batch = bl.CallTools([
        bl.ToolCall("d1", "act", {"target": "no"}),
        bl.ToolCall("d2", "act", {"target": "reason"}),
        bl.ToolCall("d3", "act", {"target": "boom"}),
        bl.ToolCall("i1", "act", {"target": "yes", "times": "many"}),
        bl.ToolCall("i2", "act", {"times": 2}),
        bl.ToolCall("u1", "nosuch", {"target": "yes"}),
        bl.ToolCall("k1", "act", {"target": "yes"}),
    ])
    observed: list[list[dict[str, Any]]] = []

    def look(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        observed.append(plain(history))
        return bl.Final("understood")

    model = bl.ScriptedModel([batch, look])
    result = runner.run(model=model, tools=[act], prompt="go", permit=permit)

    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (2, 7)
    assert ran == ["yes"]
    t = transcript(result)
    assert [m["kind"] for m in t] == ["user"] + ["call", "tool_result"] * 7 + ["final"]
    assert [m["id"] for m in t if m["kind"] == "call"] == ["d1", "d2", "d3", "i1", "i2", "u1",
                                                           "k1"]
    assert results_of(t) == [("d1", "denied"), ("d2", "denied"), ("d3", "denied"),
                             ("i1", "invalid_arguments"), ("i2", "invalid_arguments"),
                             ("u1", "unknown_tool"), ("k1", "ok")]
    contents = {m["id"]: m["content"] for m in t if m["kind"] == "tool_result"}
    assert "production is frozen" in contents["d2"]
    assert contents["k1"] == "did yes x1"
    assert t[1] == {"kind": "call", "id": "d1", "name": "act", "arguments": {"target": "no"}}
    # The model's next step observed every one of them.
    assert observed == [t[:-1]]
    assert results_of(plain(model.seen[1])) == results_of(t)
    # permit got (ToolCall, Tool, ModelContext).
    for call, tool, ctx in permits:
        assert isinstance(call, bl.ToolCall) and isinstance(tool, bl.Tool)
        assert isinstance(ctx, bl.ModelContext) and ctx.step == 1
        assert tool.name == "act"
    assert {c.call_id: c.status for c in result.completed} == {
        "d1": "denied", "d2": "denied", "d3": "denied", "i1": "invalid_arguments",
        "i2": "invalid_arguments", "u1": "unknown_tool", "k1": "ok"}
    names, events = journal_of(runner, result)
    assert names.count("CallDecided") == 7
    assert names.count("CallDispatched") == 1


def test_read_only_runner_denies_tools_not_marked_read_only(journal_dir: Any) -> None:
    ran: list[str] = []

    @bl.tool(read_only=True)
    def peek(path: str) -> str:
        """Read."""
        ran.append("peek")
        return "contents"

    @bl.tool
    def write(path: str) -> str:
        """Write."""
        ran.append("write")
        return "written"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("w", "write", {"path": "/x"}),
                      bl.ToolCall("p", "peek", {"path": "/x"})]),
        bl.Final("ok")])
    with bl.Runner(journal_dir, read_only=True) as runner:
        result = runner.run(model=model, tools=[peek, write], prompt="go",
                            permit=lambda call, tool, ctx: True)
        assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 2)
        assert ran == ["peek"]
        t = transcript(result)
        assert results_of(t) == [("w", "denied"), ("p", "ok")]
        assert results_of(plain(model.seen[1])) == [("w", "denied"), ("p", "ok")]
        journal_of(runner, result)


def test_denied_calls_count_against_the_budget(runner: bl.Runner) -> None:
    @bl.tool
    def act(target: str) -> str:
        """Act."""
        raise AssertionError("must not run")

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "act", {"target": "x"})]),
        bl.CallTools([bl.ToolCall("b", "act", {"target": "x"})]),
        bl.Final("never")])
    result = runner.run(model=model, tools=[act], prompt="go",
                        budget=bl.Budget(max_tool_calls=1), permit=lambda *a: False)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert results_of(transcript(result)) == [("a", "denied")]
    journal_of(runner, result)


# -- parallel partial failure ----------------------------------------------------------------
def test_parallel_partial_failure_keeps_model_order(runner: bl.Runner) -> None:
    ran: list[str] = []
    lock = threading.Lock()
    others_done = threading.Semaphore(0)

    @bl.tool
    def work(name: str, wait: bool = False, fail: bool = False) -> str:
        """Work (the slow one waits for the other two to end); maybe fail."""
        if wait:
            for _ in range(2):
                others_done.acquire(timeout=2)
        with lock:
            ran.append(name)
        if not wait:
            others_done.release()
        if fail:
            raise ValueError(f"{name} exploded")
        return f"{name} done"

    batch = bl.CallTools([
        bl.ToolCall("slow", "work", {"name": "slow", "wait": True}),
        bl.ToolCall("bad", "work", {"name": "bad", "fail": True}),
        bl.ToolCall("fast", "work", {"name": "fast"}),
    ])
    model = bl.ScriptedModel([batch, bl.Final("partial")])
    result = runner.run(model=model, tools=[work], prompt="go")

    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 3)
    assert sorted(ran) == ["bad", "fast", "slow"]
    assert ran[-1] == "slow"  # they ran at once: the slow one finished last
    t = transcript(result)
    assert [m["id"] for m in t if m["kind"] == "call"] == ["slow", "bad", "fast"]
    assert results_of(t) == [("slow", "ok"), ("bad", "error"), ("fast", "ok")]
    contents = {m["id"]: m["content"] for m in t if m["kind"] == "tool_result"}
    assert contents["slow"] == "slow done" and contents["fast"] == "fast done"
    assert "bad exploded" in contents["bad"]
    assert results_of(plain(model.seen[1])) == results_of(t)
    assert {c.call_id: c.status for c in result.completed} == {
        "slow": "ok", "bad": "error", "fast": "ok"}
    names, _ = journal_of(runner, result)
    assert names.count("CallFailed") == 1 and names.count("CallSucceeded") == 2


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_max_parallel_is_reached_and_never_exceeded(runner: bl.Runner, limit: int) -> None:
    lock = threading.Lock()
    active = [0]
    peak = [0]
    reached = threading.Event()

    @bl.tool
    def busy(n: int) -> int:
        """Hold a slot for a moment."""
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            if active[0] >= limit:
                reached.set()
        reached.wait(2.0)
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return n

    n_calls = limit + 3
    batch = bl.CallTools([bl.ToolCall(f"c{i}", "busy", {"n": i}) for i in range(n_calls)])
    model = bl.ScriptedModel([batch, bl.Final("done")])
    result = runner.run(model=model, tools=[busy], prompt="go",
                        budget=bl.Budget(max_parallel=limit))
    assert peak[0] == limit
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, n_calls)
    t = transcript(result)
    assert [(m["id"], m["content"]) for m in t if m["kind"] == "tool_result"] == [
        (f"c{i}", i) for i in range(n_calls)]
    names, _ = journal_of(runner, result)
    assert names.count("CallDispatched") == n_calls


def test_without_max_parallel_a_batch_runs_at_once(runner: bl.Runner) -> None:
    barrier = threading.Barrier(4, timeout=3)

    @bl.tool
    def meet(n: int) -> int:
        """Wait for the other three."""
        barrier.wait()
        return n

    batch = bl.CallTools([bl.ToolCall(f"c{i}", "meet", {"n": i}) for i in range(4)])
    result = runner.run(model=bl.ScriptedModel([batch, bl.Final("ok")]), tools=[meet],
                        prompt="go")
    assert (result.status, result.tool_calls) == ("final", 4)
    assert results_of(transcript(result)) == [(f"c{i}", "ok") for i in range(4)]
    journal_of(runner, result)


# -- max_result_bytes ------------------------------------------------------------------------
def test_result_over_max_result_bytes_is_too_large(runner: bl.Runner) -> None:
    big = "x" * 5000

    @bl.tool
    def fetch(size: str) -> str:
        """Return a small or a big result."""
        return big if size == "big" else "tiny"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("b", "fetch", {"size": "big"}),
                      bl.ToolCall("s", "fetch", {"size": "small"})]),
        bl.Final("done")])
    result = runner.run(model=model, tools=[fetch], prompt="go",
                        budget=bl.Budget(max_result_bytes=100))
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 2)
    t = transcript(result)
    assert results_of(t) == [("b", "too_large"), ("s", "ok")]
    contents = {m["id"]: m["content"] for m in t if m["kind"] == "tool_result"}
    assert big not in str(contents["b"])
    assert contents["s"] == "tiny"
    assert results_of(plain(model.seen[1])) == [("b", "too_large"), ("s", "ok")]
    names, events = journal_of(runner, result)
    assert all(big not in str(plain(e)) for e in events)
    big_outcome = [e for e in events if type(e).__name__ == "CallSucceeded"
                   and e.execution_id == next(c.execution_id for c in events
                                              if type(c).__name__ == "CallDecided"
                                              and c.call_id == "b")]
    assert len(big_outcome) == 1
    assert big_outcome[0].size >= 5000
    assert big_outcome[0].digest


# -- retries (SPEC 4, 5 counters) ------------------------------------------------------------
def test_retries_count_and_share_execution_id_and_key(runner: bl.Runner) -> None:
    contexts: list[bl.ToolContext] = []

    @bl.tool(idempotent=True, retry=bl.RetryPolicy(max_attempts=3))
    def flaky(ctx: bl.ToolContext) -> str:
        """Fail twice, then work."""
        contexts.append(ctx)
        if ctx.attempt < 3:
            raise ConnectionError("try again")
        return "finally"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("f", "flaky", {})]), bl.Final("ok")])
    result = runner.run(model=model, tools=[flaky], prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 3)
    assert [c.attempt for c in contexts] == [1, 2, 3]
    assert len({c.execution_id for c in contexts}) == 1
    assert len({c.idempotency_key for c in contexts}) == 1
    assert {c.call_id for c in contexts} == {"f"}
    assert results_of(transcript(result)) == [("f", "ok")]
    assert [(c.call_id, c.status, c.attempts) for c in result.completed] == [("f", "ok", 3)]
    names, _ = journal_of(runner, result)
    assert names.count("CallDecided") == 1 and names.count("CallDispatched") == 3


def test_retries_stop_at_the_call_budget(runner: bl.Runner) -> None:
    attempts: list[int] = []

    @bl.tool(idempotent=True, retry=bl.RetryPolicy(max_attempts=10))
    def broken(ctx: bl.ToolContext) -> str:
        """Always fail."""
        attempts.append(ctx.attempt)
        raise ConnectionError("down")

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("f", "broken", {})]), bl.Final("ok")])
    result = runner.run(model=model, tools=[broken], prompt="go",
                        budget=bl.Budget(max_tool_calls=3))
    assert attempts == [1, 2, 3]
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 3)
    assert results_of(transcript(result)) == [("f", "error")]
    journal_of(runner, result)
