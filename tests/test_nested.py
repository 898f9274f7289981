"""Nested runs (SPEC 8): a child draws on its parent's budgets through one ledger."""

from __future__ import annotations

import threading
from typing import Any

import boundloop as bl
from boundloop import events as ev


def calls(*ids: str, name: str = "ping") -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(i, name, {}) for i in ids])


def child_events(runner: bl.Runner, parent_id: str) -> dict[str, list[ev.Event]]:
    out = {}
    for run_id in runner.journal.runs():
        events = list(runner.journal.events(run_id))
        admitted = events[0]
        assert isinstance(admitted, ev.RunAdmitted)
        if admitted.parent_run_id == parent_id:
            out[run_id] = events
    return out


def test_child_calls_and_usage_count_against_the_parent(runner: bl.Runner) -> None:
    pings: list[str] = []

    @bl.tool
    def ping() -> str:
        pings.append("x")
        return "pong"

    @bl.tool
    def delegate(task: str, ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls("k1"), calls("k2"), calls("k3"),
                                  bl.Final("child done", usage=bl.Usage(10, 5))])
        result = ctx.run_child(model=child, tools=[ping], prompt=task,
                               budget=bl.Budget(max_tool_calls=10))
        return f"{result.status}: {result.tool_calls} calls"

    parent = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("d1", "delegate", {"task": "ping thrice"})],
                     usage=bl.Usage(100, 1)),
        calls("p1", "p2"),  # 1 + 3 (the child's) + 2 > 5: refused as a whole
    ])
    result = runner.run(model=parent, tools=[delegate, ping], prompt="go",
                        budget=bl.Budget(max_tool_calls=5, max_model_steps=4),
                        run_id="parent")
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert result.tool_calls == 4 and len(pings) == 3
    assert result.usage.input_tokens >= 110 and result.usage.output_tokens >= 6
    [(child_id, events)] = child_events(runner, "parent").items()
    admitted = events[0]
    assert isinstance(admitted, ev.RunAdmitted)
    assert admitted.parent_step == 1 and admitted.parent_execution_id == "parent:1:0"
    assert admitted.budget.max_tool_calls == 4  # the smaller of 10 and what was left
    assert bl.replay(events).status == "final"
    charged = [e for e in runner.journal.events("parent") if isinstance(e, ev.ChildCharged)]
    assert {e.child_run_id for e in charged} == {child_id}
    assert sum(e.tool_calls for e in charged) == 3
    assert bl.replay(runner.journal.events("parent")).tool_calls == result.tool_calls


def test_a_child_never_gets_a_fresh_allowance(runner: bl.Runner) -> None:
    @bl.tool
    def ping() -> str:
        return "pong"

    seen: list[bl.RunResult] = []

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls("k1"), calls("k2"), calls("k3"), bl.Final("x")])
        seen.append(ctx.run_child(model=child, tools=[ping], prompt="go",
                                  budget=bl.Budget(max_tool_calls=50, max_model_steps=6)))
        return "ok"

    parent = bl.ScriptedModel([calls("d1", name="delegate"), bl.Final("done")])
    result = runner.run(model=parent, tools=[delegate, ping], prompt="go",
                        budget=bl.Budget(max_tool_calls=3))
    [child] = seen
    assert (child.status, child.exhausted_limit, child.tool_calls) == (
        "limit_exceeded", "tool_calls", 2)
    assert result.status == "final" and result.tool_calls == 3


def test_parallel_children_share_what_the_parent_has_left(runner: bl.Runner) -> None:
    barrier = threading.Barrier(2, timeout=10)
    results: list[bl.RunResult] = []
    lock = threading.Lock()

    @bl.tool
    def ping() -> str:
        return "pong"

    @bl.tool
    def delegate(name: str, ctx: bl.ToolContext) -> str:
        barrier.wait()  # both children run at once
        script: list[Any] = [calls(f"{name}{i}") for i in range(5)] + [bl.Final("x")]
        r = ctx.run_child(model=bl.ScriptedModel(script), tools=[ping], prompt=name,
                          budget=bl.Budget(max_tool_calls=10, max_model_steps=7))
        with lock:
            results.append(r)
        return r.status

    parent = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "delegate", {"name": "a"}),
                      bl.ToolCall("b", "delegate", {"name": "b"})]),
        bl.Final("done")])
    result = runner.run(model=parent, tools=[delegate, ping], prompt="go",
                        budget=bl.Budget(max_tool_calls=6, max_parallel=2))
    assert result.status == "final"
    child_calls = sum(r.tool_calls for r in results)
    assert child_calls == 4  # 6 - the two delegate calls, shared by both children
    assert result.tool_calls == 6
    assert all(r.status in ("final", "limit_exceeded") for r in results)


def test_child_deadline_is_what_the_parent_has_left(journal_dir: Any) -> None:
    clock = bl.FakeClock()
    with bl.Runner(journal_dir, clock=clock) as runner:
        seen: list[bl.RunResult] = []

        @bl.tool
        def delegate(ctx: bl.ToolContext) -> str:
            clock.advance(8)

            def slow(history: Any, mctx: bl.ModelContext) -> Any:
                clock.advance(5)  # past the parent's deadline while the child works
                return calls("k1", name="noop")

            @bl.tool
            def noop() -> str:
                return "ok"

            seen.append(ctx.run_child(model=slow, tools=[noop], prompt="go",
                                      budget=bl.Budget(deadline_s=100)))
            return "ok"

        parent = bl.ScriptedModel([calls("d1", name="delegate"), bl.Final("done")])
        result = runner.run(model=parent, tools=[delegate], prompt="go",
                            budget=bl.Budget(deadline_s=10))
        admitted = next(iter(child_events(runner, result.run_id).values()))[0]
    [child] = seen
    assert isinstance(admitted, ev.RunAdmitted)
    assert admitted.budget.deadline_s is not None and admitted.budget.deadline_s <= 2.0
    assert (child.status, child.exhausted_limit) == ("limit_exceeded", "deadline")
    # The parent's own deadline passed while its child worked: it stops before its next step.
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")


def test_replay_check_covers_a_child_run(runner: bl.Runner) -> None:
    from boundloop.ops import check

    @bl.tool
    def ping() -> str:
        return "pong"

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls("k1"), bl.Final("c")])
        return ctx.run_child(model=child, tools=[ping], prompt="t", run_id="kid").status

    runner.run(model=bl.ScriptedModel([calls("d", name="delegate"), bl.Final("p")]),
               tools=[delegate, ping], prompt="go")
    report = check(list(runner.journal.events("kid")))
    assert report.ok and report.decisions >= 3
    stricter = check(list(runner.journal.events("kid")), bl.Budget(max_tool_calls=0))
    assert not stricter.ok and stricter.divergence is not None


def test_a_parents_retry_is_reserved_with_the_run_tree(runner: bl.Runner) -> None:
    """SPEC 8: a parent's retry counts against the tree: after its handler's child spent
    two of the three calls, the retry is refused and the run stays within max_tool_calls."""
    @bl.tool(read_only=True)
    def leaf(x: int) -> str:
        return "leaf"

    tried: list[int] = []

    @bl.tool(idempotent=True, retry=bl.RetryPolicy(max_attempts=3, backoff_s=0.0,
                                                   retry_on=(ValueError,)))
    def boss(x: int, ctx: bl.ToolContext) -> str:
        tried.append(x)
        if len(tried) == 1:
            child = bl.ScriptedModel([bl.CallTools([bl.ToolCall("k1", "leaf", {"x": 1}),
                                                    bl.ToolCall("k2", "leaf", {"x": 2})]),
                                      bl.Final("child done")])
            got = ctx.run_child(model=child, tools=[leaf], prompt="sub",
                                budget=bl.Budget(max_model_steps=3, max_tool_calls=5))
            raise ValueError(f"child ended {got.status} with {got.tool_calls} calls")
        return "ok"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "boss", {"x": 1})]),
                              bl.Final("done")])
    result = runner.run(model=model, tools=[boss, leaf], prompt="go", run_id="p",
                        budget=bl.Budget(max_model_steps=4, max_tool_calls=3,
                                         reserve_final_step=False))
    journal = bl.replay(list(runner.journal.events("p")))
    assert tried == [1]  # the retry was refused
    assert result.status == "final" and result.tool_calls == journal.tool_calls == 3
    [failed] = [m for m in result.transcript if m.kind == "tool_result"]
    assert failed.status == "error" and "child ended final with 2 calls" in failed.content
