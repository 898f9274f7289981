"""Edges a new user hits: option shapes, process exit, permissions, shared journals."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev


def one_call(name: str, **arguments: Any) -> list[Any]:
    return [bl.CallTools(calls=[bl.ToolCall("c1", name, arguments)]), bl.Final("done")]


def test_retry_on_accepts_a_list_and_a_failing_batch_never_stalls_the_runner(
        runner: bl.Runner) -> None:
    attempts: list[int] = []

    @bl.tool(retry=bl.RetryPolicy(2, 0.0, [ValueError]))
    def flaky(n: int, ctx: bl.ToolContext) -> int:
        attempts.append(ctx.attempt)
        raise ValueError("nope")

    result = runner.submit(model=bl.ScriptedModel(one_call("flaky", n=1)), tools=[flaky],
                           prompt="p").result(timeout=10)
    assert result.status == "final" and attempts == [1, 2] and result.tool_calls == 2
    again = runner.submit(model=bl.ScriptedModel([bl.Final("x")]), prompt="p")
    assert again.result(timeout=10).status == "final"
    with pytest.raises(bl.ConfigError):
        bl.RetryPolicy(2, 0.0, ["ValueError"])  # type: ignore[list-item]


def test_an_unclosed_runner_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys, time
        import boundloop as bl

        @bl.tool(timeout_s=0.1)
        def stuck() -> str:
            time.sleep(60)
            return "late"

        r = bl.Runner(sys.argv[1])
        res = r.run(model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("c", "stuck", {})]),
                                            bl.Final("x")]), tools=[stuck], prompt="p")
        print(res.status)
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "j")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "final", proc.stderr
    assert time.monotonic() - started < 10
    assert "Traceback" not in proc.stderr


def test_an_existing_directory_keeps_its_other_files_as_they_were(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    script = project / "script.sh"
    script.write_text("echo hi\n")
    os.chmod(script, 0o755)
    os.chmod(project / "sub", 0o755)
    with bl.Runner(project) as r:
        assert r.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p").status == "final"
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert stat.S_IMODE((project / "sub").stat().st_mode) == 0o755
    assert not (project / "redaction.key").exists()  # the key lives apart (SPEC 9)
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE((project / name).stat().st_mode) == 0o600


def test_a_timeout_then_a_failed_retry_stays_outcome_unknown(runner: bl.Runner) -> None:
    @bl.tool(idempotent=True, timeout_s=0.1,
             retry=bl.RetryPolicy(2, 0.0, (TimeoutError, ConnectionError)))
    def pay(n: int, ctx: bl.ToolContext) -> str:
        if ctx.attempt == 1:
            time.sleep(0.3)
            return "paid"
        raise ConnectionError("down")

    result = runner.run(model=bl.ScriptedModel(one_call("pay", n=1)), tools=[pay],
                        prompt="p")
    assert result.status == "final" and result.tool_calls == 2
    assert [m.status for m in result.transcript if m.kind == "tool_result"] == [
        "outcome_unknown"]
    assert [(u.call_id, u.attempt) for u in result.unresolved] == [("c1", 2)]
    assert result.completed == []


def test_an_irreversible_timeout_needs_review_then_resumes(runner: bl.Runner) -> None:
    @bl.tool(irreversible=True, timeout_s=0.05)
    def wire(amount: int) -> str:
        time.sleep(0.3)
        return "sent"

    model = bl.ScriptedModel(one_call("wire", amount=5))
    result = runner.run(model=model, tools=[wire], prompt="p", run_id="wire-1")
    assert result.status == "needs_review"
    [action] = result.unresolved
    assert action.tool == "wire" and action.phase == "dispatched" and not action.abandoned
    assert model.calls == 1  # the model did not go on past the unknown transfer
    assert [m.kind for m in result.transcript] == ["user"]
    runner.resolve("wire-1", action.execution_id, "abandoned", note="bank cannot tell")
    resumed = runner.resume("wire-1", model=bl.ScriptedModel([bl.Final("checked")]),
                            tools=[wire])
    assert resumed.status == "final"
    [flagged] = resumed.unresolved
    assert flagged.abandoned and flagged.phase == "dispatched"
    assert [(m.kind, getattr(m, "status", None)) for m in resumed.transcript] == [
        ("user", None), ("call", None), ("tool_result", "outcome_unknown"), ("final", None)]


def test_run_child_takes_positional_arguments_and_async_handlers_await_it(
        runner: bl.Runner) -> None:
    @bl.tool
    def sync_parent(ctx: bl.ToolContext) -> str:
        return ctx.run_child(bl.ScriptedModel([bl.Final("a")]), [], "task").status

    @bl.tool
    async def async_parent(ctx: bl.ToolContext) -> str:
        with pytest.raises(bl.ConfigError):
            ctx.run_child(model=bl.ScriptedModel([bl.Final("never")]), prompt="x")
        child = await ctx.arun_child(model=bl.ScriptedModel([bl.Final("b")]), prompt="t")
        await asyncio.sleep(0)
        return child.status

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("s", "sync_parent", {}),
                                            bl.ToolCall("a", "async_parent", {})]),
                              bl.Final("done")])
    result = runner.submit(model=model, tools=[sync_parent, async_parent],
                           prompt="p").result(timeout=20)
    assert result.status == "final"
    assert [m.content for m in result.transcript if m.kind == "tool_result"] == [
        "final", "final"]


def test_malformed_retries_none_means_unbounded(runner: bl.Runner) -> None:
    result = runner.run(model=bl.ScriptedModel(["bad", 1, {"kind": "?"}, bl.Final("ok")]),
                        prompt="p", budget=bl.Budget(malformed_retries=None))
    assert result.status == "final" and result.model_steps == 4
    assert [m.kind for m in result.transcript].count("notice") == 3


def test_tools_shapes_estimators_and_validated_intents(runner: bl.Runner) -> None:
    @bl.tool
    def search(query: str, limit: int = 5) -> list[str]:
        return [query] * min(limit, 1)

    r1 = runner.run(model=bl.ScriptedModel([bl.Final("x")]), tools=None, prompt="p")
    assert r1.status == "final"
    r2 = runner.run(model=bl.ScriptedModel(one_call("search", query="q")), tools=search,
                    prompt="p")
    decided = [e for e in runner.journal.events(r2.run_id) if isinstance(e, ev.CallDecided)]
    assert decided[0].arguments == {"query": "q"}
    assert decided[0].validated == {"query": "q", "limit": 5}

    with bl.Runner(runner.journal, estimator=lambda history, model: 10) as counting:
        r3 = counting.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p",
                          budget=bl.Budget(max_input_tokens=9))
        assert (r3.status, r3.exhausted_limit) == ("limit_exceeded", "input_tokens")
    with bl.Runner(runner.journal, estimator=lambda h, m: "lots") as bad:
        model = bl.ScriptedModel([bl.Final("x")])
        r4 = bad.run(model=model, prompt="p")
        # The run ends with a status (and a RunFinished), never half-open.
        assert r4.status == "model_error" and "estimator" in r4.explanation
        assert model.calls == 0
        assert bl.replay(bad.journal.events(r4.run_id)).status == "model_error"


def test_two_runners_on_one_directory_in_one_process(journal_dir: Path) -> None:
    with bl.Runner(journal_dir) as a, bl.Runner(journal_dir) as b:
        ra = a.run(model=bl.ScriptedModel([bl.Final("a")]), prompt="p")
        rb = b.run(model=bl.ScriptedModel([bl.Final("b")]), prompt="p")
        assert set(a.journal.runs()) == {ra.run_id, rb.run_id}
    with bl.Runner(journal_dir) as again:
        assert len(list(again.journal.runs())) == 2


def test_event_classes_are_public() -> None:
    assert bl.RunFinished is ev.RunFinished and bl.events is ev
    assert issubclass(bl.CallDecided, bl.Event)


def test_many_runs_waiting_on_async_models_and_tools_cost_no_thread_each(
        runner: bl.Runner) -> None:
    import threading

    peak = [0]

    async def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
        peak[0] = max(peak[0], threading.active_count())
        await asyncio.sleep(0.2)
        if any(m.kind == "tool_result" for m in history):
            return bl.Final("done")
        return bl.CallTools([bl.ToolCall("c1", "wait", {})])

    @bl.tool
    async def wait() -> str:
        await asyncio.sleep(0.2)
        return "waited"

    started = time.monotonic()
    futures = [runner.submit(model=model, tools=[wait], prompt="p") for _ in range(300)]
    results = [f.result(timeout=60) for f in futures]
    assert all(r.status == "final" and r.tool_calls == 1 for r in results)
    assert time.monotonic() - started < 15  # 300 runs x 0.6 s of waiting, overlapped
    assert peak[0] < 100  # a few pools and actors, not a thread per run


def test_a_call_waiting_for_a_free_thread_does_not_time_out_before_it_starts(
        journal_dir: Path) -> None:
    ran: list[str] = []

    @bl.tool(timeout_s=0.3)
    def slow(name: str) -> str:
        time.sleep(0.2)
        ran.append(name)
        return name

    with bl.Runner(journal_dir, tool_threads=1) as r:
        result = r.run(model=bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("a", "slow", {"name": "a"}),
                          bl.ToolCall("b", "slow", {"name": "b"})]), bl.Final("x")]),
            tools=[slow], prompt="p")
    assert ran == ["a", "b"]
    assert [m.status for m in result.transcript if m.kind == "tool_result"] == ["ok", "ok"]


def test_close_fails_runs_still_in_flight_and_leaves_them_for_recovery(
        journal_dir: Path) -> None:
    release = threading.Event()

    def stuck(history: Any, ctx: bl.ModelContext) -> Any:
        release.wait(5)
        return bl.Final("late")

    r = bl.Runner(journal_dir)
    future = r.submit(model=stuck, prompt="p", run_id="left")
    time.sleep(0.1)
    r.close(timeout=0.2)
    with pytest.raises(bl.RunnerClosed):
        future.result(timeout=10)
    release.set()
    with bl.Runner(journal_dir) as again:
        assert [x.run_id for x in again.recover()] == ["left"]


def test_two_runners_racing_on_one_run_id_run_it_once(journal_dir: Path) -> None:
    gate = threading.Barrier(2, timeout=10)

    calls: list[str] = []

    def model(history: Any, ctx: bl.ModelContext) -> Any:
        calls.append(ctx.run_id)
        return bl.Final("won")

    with bl.Runner(journal_dir) as a, bl.Runner(journal_dir) as b:
        results: list[bl.RunResult] = []

        def go(runner: bl.Runner) -> None:
            gate.wait()
            results.append(runner.run(model=model, prompt="p", run_id="same"))

        threads = [threading.Thread(target=go, args=(x,)) for x in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    # SPEC 14: the loser returns the winner's run; the model was called once.
    assert [r.status for r in results] == ["final", "final"]
    assert [r.transcript[-1].text for r in results] == ["won", "won"]
    assert calls == ["same"]


def test_a_slow_permit_does_not_stall_other_runs(journal_dir: Path) -> None:
    @bl.tool
    def act() -> str:
        return "done"

    def slow_permit(call: bl.ToolCall, tool: bl.Tool, ctx: bl.ModelContext) -> bool:
        time.sleep(1.0)
        return True

    with bl.Runner(journal_dir, supervisors=1) as r:
        slow = r.submit(model=bl.ScriptedModel(one_call("act")), tools=[act], prompt="p",
                        permit=slow_permit)
        time.sleep(0.1)
        started = time.monotonic()
        quick = r.run(model=bl.ScriptedModel(one_call("act")), tools=[act], prompt="p")
        assert quick.status == "final" and time.monotonic() - started < 0.6
        assert slow.result(timeout=10).status == "final"


def test_a_journal_open_in_this_process_is_not_opened_twice(journal_dir: Path) -> None:
    from boundloop.journal import LmdbJournal

    with bl.Runner(journal_dir) as r:
        with pytest.raises(bl.JournalUnavailable, match="already open in this process"):
            LmdbJournal(journal_dir)
        assert r.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p").status == "final"
    with LmdbJournal(journal_dir) as j:  # once closed, it opens again
        assert len(list(j.runs())) == 1


def test_a_slow_model_or_tool_in_one_run_does_not_stall_the_others(
        journal_dir: Path) -> None:
    def slow_model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
        time.sleep(1.0)
        return bl.Final("slow")

    @bl.tool
    def slow_tool() -> str:
        time.sleep(1.0)
        return "slow"

    @bl.tool
    def quick() -> str:
        return "quick"

    with bl.Runner(journal_dir, supervisors=1) as r:
        a = r.submit(model=slow_model, prompt="p")
        b = r.submit(model=bl.ScriptedModel(one_call("slow_tool")), tools=[slow_tool],
                     prompt="p")
        time.sleep(0.1)
        started = time.monotonic()
        for _ in range(5):
            fast = r.run(model=bl.ScriptedModel(one_call("quick")), tools=[quick], prompt="p")
            assert fast.status == "final"
        assert time.monotonic() - started < 0.8
        assert a.result(timeout=10).status == "final"
        assert b.result(timeout=10).status == "final"


def test_validated_arguments_keep_their_types_and_secrets_stay_digests_in_both(
        runner: bl.Runner) -> None:
    """The journal's ``validated`` is the validated value, not the model's arguments again
    (the intent reuses the redacted arguments only when both are byte for byte the same)."""
    @bl.tool
    def scale(x: float, password: str) -> float:
        return x

    r = runner.run(model=bl.ScriptedModel(one_call("scale", x=2, password="hunter2-secret")),
                   tools=scale, prompt="p")
    (decided,) = [e for e in runner.journal.events(r.run_id) if isinstance(e, ev.CallDecided)]
    assert decided.redacted
    assert decided.arguments["x"] == 2 and type(decided.arguments["x"]) is int
    assert decided.validated is not None
    assert decided.validated["x"] == 2.0 and type(decided.validated["x"]) is float
    for form in (decided.arguments, decided.validated):
        assert form["password"] != "hunter2-secret" and "hunter2" not in str(form)
    r2 = runner.run(model=bl.ScriptedModel(one_call("scale", x=2.5, password="hunter3-secret")),
                    tools=scale, prompt="p")
    (same,) = [e for e in runner.journal.events(r2.run_id) if isinstance(e, ev.CallDecided)]
    assert same.validated == same.arguments and "hunter3" not in str(same.validated)


def test_same_value_tells_types_apart_and_never_raises() -> None:
    from boundloop.policy.redact import same_value

    looped: dict[str, Any] = {}
    looped["self"] = looped
    assert same_value({"x": 1, "y": [1, "a"]}, {"x": 1, "y": [1, "a"]})
    assert not same_value({"x": 1}, {"x": 1.0}) and not same_value({"x": 1}, {"x": True})
    assert not same_value(looped, looped)  # unencodable: not the same, and no raise
    assert not same_value({"x": 1 << 70}, {"x": 1 << 70})
