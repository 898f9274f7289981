"""Journal failures fail closed (SPEC 6): an outcome that cannot be recorded stays
unresolved and nothing more is dispatched."""

from __future__ import annotations

from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.journal import LmdbJournal
from boundloop.testing import FaultyJournal


def test_an_outcome_that_cannot_be_recorded_stays_unresolved(tmp_path: Path) -> None:
    ran: list[str] = []

    @bl.tool
    def send(to: str) -> str:
        ran.append(to)
        return f"sent to {to}"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "send", {"to": "ann"})]),
        bl.CallTools([bl.ToolCall("c2", "send", {"to": "bob"})]),
        bl.Final("done"),
    ])
    # Append 1 admits the run, 2 holds step 1's decision, 3 carries c1's outcome with
    # step 2's decision: it fails.
    journal = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=3, mode="raise")
    with bl.Runner(journal) as runner:
        result = runner.run(model=model, tools=[send], prompt="p", run_id="r")
        assert result.status == "journal_unavailable"
        assert ran == ["ann"]  # c2 was never dispatched
        assert [(u.call_id, u.phase) for u in result.unresolved] == [("c1", "dispatched")]
        assert result.completed == []
        recorded = list(runner.journal.events("r"))
    assert not any(isinstance(e, ev.RunFinished | ev.CallSucceeded) for e in recorded)
    journal.close()
    # Later, recovery finds c1 open and, as `send` is neither idempotent nor reconcilable,
    # hands it to a person instead of sending again.
    with bl.Runner(tmp_path / "j") as runner:
        [found] = runner.recover()
        assert [u.call_id for u in found.unresolved] == ["c1"]
        again = runner.resume("r", model=bl.ScriptedModel([bl.Final("x")]), tools=[send])
    assert again.status == "needs_review" and ran == ["ann"]


def test_closing_the_journal_mid_batch_stops_queued_calls_and_the_model(
        runner: bl.Runner) -> None:
    ran: list[int] = []

    @bl.tool
    def t(i: int) -> int:
        ran.append(i)
        if i == 1:
            runner.journal.close()
        return i

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "t", {"i": 1}), bl.ToolCall("b", "t", {"i": 2})]),
        bl.Final("x")])
    result = runner.run(model=model, tools=[t], prompt="p",
                        budget=bl.Budget(max_parallel=1))
    assert result.status == "journal_unavailable"
    assert ran == [1] and model.calls == 1
    assert [u.call_id for u in result.unresolved] == ["a"]


def test_values_the_journal_cannot_store_never_stall_the_runner(runner: bl.Runner) -> None:
    import math

    @bl.tool
    def calc(n: int) -> int:
        return math.factorial(n)

    @bl.tool
    def name() -> str:
        return "file-\udcff.txt"

    big = runner.run(model=bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "calc", {"n": 30}), bl.ToolCall("b", "name", {})]),
        bl.Final("x")]), tools=[calc, name], prompt="p", run_id="big")
    assert big.status == "final"
    assert [m.content for m in big.transcript if m.kind == "tool_result"] == [
        str(math.factorial(30)), "file-\ufffd.txt"]
    assert bl.replay(runner.journal.events("big")).transcript == big.transcript

    bad_final = runner.submit(model=bl.ScriptedModel([bl.Final("x\ud800")]), prompt="p")
    assert bad_final.result(timeout=10).status == "malformed_response"
    huge_usage = runner.submit(model=bl.ScriptedModel([bl.Final("x", usage=bl.Usage(2**70))]),
                               prompt="p")
    assert huge_usage.result(timeout=10).status == "malformed_response"
    with pytest.raises(bl.ConfigError):
        runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="bad \ud800")
    # The writer is still alive for everyone else.
    assert runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p").status == "final"


def test_a_hanging_reconcile_cannot_hang_resume(tmp_path: Path) -> None:
    import time

    @bl.tool(timeout_s=0.3)
    def book(room: str) -> str:
        return f"booked {room}"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "book", {"room": "r1"})]),
                              bl.CallTools([bl.ToolCall("c2", "book", {"room": "r2"})])])
    journal = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=3, mode="raise")
    with bl.Runner(journal) as runner:
        assert runner.run(model=model, tools=[book], prompt="p", run_id="r").status == \
            "journal_unavailable"
    journal.close()

    def stuck(key: str) -> str | None:
        time.sleep(30)
        return None

    hanging = bl.Tool("book", book.handler, timeout_s=0.3, reconcile=stuck)
    with bl.Runner(tmp_path / "j") as runner:
        runner.recover()
        started = time.monotonic()
        result = runner.resume("r", model=bl.ScriptedModel([bl.Final("x")]), tools=[hanging])
        assert time.monotonic() - started < 5
    assert result.status == "needs_review"
    assert [u.call_id for u in result.unresolved] == ["c1"]


def test_a_resumed_run_keeps_the_deadline_time_it_had_left(tmp_path: Path) -> None:
    clock = bl.FakeClock()

    @bl.tool
    def work() -> str:
        return "done"

    def slow_first_step(history: list[bl.Message], ctx: bl.ModelContext) -> bl.CallTools:
        clock.advance(4.0)  # the model works for 4 s of the run's 10
        return bl.CallTools([bl.ToolCall("c1", "work", {})])

    # Append 3 (c1's outcome with step 2's decision) fails: the run stays open.
    journal = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=3, mode="raise")
    with bl.Runner(journal, clock=clock) as runner:
        first = runner.run(model=bl.ScriptedModel([slow_first_step, slow_first_step]),
                           tools=[work], prompt="p", run_id="r",
                           budget=bl.Budget(deadline_s=10))
        assert first.status == "journal_unavailable"
    journal.close()

    clock.advance(3600)  # an hour passes while nobody drives the run
    seen: list[bl.ModelContext] = []

    def finish(history: list[bl.Message], ctx: bl.ModelContext) -> bl.Final:
        seen.append(ctx)
        return bl.Final("done")

    idempotent_work = bl.Tool("work", work.handler, idempotent=True)
    with bl.Runner(tmp_path / "j", clock=clock) as runner:
        runner.recover()
        result = runner.resume("r", model=finish, tools=[idempotent_work])
    assert result.status == "final"
    [ctx] = seen
    assert ctx.remaining.deadline_s == pytest.approx(6.0)
    assert ctx.deadline == pytest.approx(clock.monotonic() + 6.0)


def test_a_retry_whose_dispatch_cannot_be_recorded_ends_the_run(tmp_path: Path) -> None:
    """SPEC 6: the append that records a retry's CallDispatched (with the first attempt's
    outcome) fails: the run ends journal_unavailable before anything else is dispatched,
    its report counts what the journal holds, and a resume settles the call."""
    ran: list[int] = []

    @bl.tool(idempotent=True, retry=bl.RetryPolicy(max_attempts=3, backoff_s=0.0,
                                                   retry_on=(ValueError,)))
    def flaky(x: int) -> str:
        ran.append(x)
        if len(ran) == 1:
            raise ValueError("the first attempt fails")
        return "ok"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "flaky", {"x": 1})]),
                              bl.Final("done")])
    # Append 1 admits the run, 2 holds step 1's decision and dispatch, 3 the retry's.
    journal = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=3, mode="raise")
    with bl.Runner(journal) as runner:
        result = runner.run(model=model, tools=[flaky], prompt="p", run_id="r")
        recorded = bl.replay(list(runner.journal.events("r")))
    assert result.status == "journal_unavailable"
    assert ran == [1] and model.calls == 1  # neither the retry nor the model ran again
    assert result.tool_calls == recorded.tool_calls == 1
    assert [u.call_id for u in result.unresolved] == ["c1"]
    journal.close()
    with bl.Runner(tmp_path / "j") as runner:
        again = runner.resume("r", model=bl.ScriptedModel([bl.Final("x")]), tools=[flaky])
        assert again.status == "final"
        bl.replay(list(runner.journal.events("r")))
    assert ran == [1, 1]


def test_a_permit_that_raises_denies_with_its_reason(runner: bl.Runner) -> None:
    @bl.tool(read_only=True)
    def search(q: str) -> str:
        return "x"

    def permit(call: bl.ToolCall, tool: bl.Tool, ctx: object) -> bool:
        raise RuntimeError("policy db down")

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "search", {"q": "a"})]),
                              bl.Final("ok")])
    result = runner.run(model=model, tools=[search], prompt="p", permit=permit)
    [denied] = [m for m in result.transcript if m.kind == "tool_result"]
    assert denied.status == "denied"
    assert denied.content == "the permission check raised RuntimeError: policy db down"
