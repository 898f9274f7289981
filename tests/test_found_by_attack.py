"""Failures an attacker pass found (SPEC 5 step 1, SPEC 9), each a test."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev


def test_the_secret_part_of_a_redacted_value_is_scrubbed_from_later_text(
        tmp_path: Path) -> None:
    token = "S3cr3tbearerZq9x7Vw"

    @bl.tool()
    def toks(headers: dict[str, str]) -> str:
        return "x"

    def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("g", "toks",
                                             {"headers": {"Authorization": "Bearer " + token}})])
        return bl.Final("ok")

    def permit(call: bl.ToolCall, tool: bl.Tool, ctx: bl.ModelContext) -> str:
        return "denied because the header has " + token

    where = tmp_path / "j"
    with bl.Runner(where) as runner:
        result = runner.run(model=model, tools=[toks], prompt="p", permit=permit, run_id="s")
        events = list(runner.journal.events("s"))
    assert result.status == "final"
    [decided] = [e for e in events if isinstance(e, ev.CallDecided)]
    assert decided.decision == "denied" and token not in decided.reason
    assert "hmac-sha256:" in decided.reason
    assert token.encode() not in (where / "data.mdb").read_bytes()


@pytest.mark.parametrize("estimate", [-10**9, bl.Usage(input_tokens=-5),
                                      bl.Usage(output_tokens=-1)])
def test_a_negative_estimate_is_refused(tmp_path: Path, estimate: Any) -> None:
    with bl.Runner(tmp_path / "j", estimator=lambda h, m: estimate) as runner:
        result = runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p",
                            budget=bl.Budget(max_input_tokens=100))
    assert (result.status, result.model_steps) == ("model_error", 0)
    assert "estimator" in result.explanation and result.usage.input_tokens >= 0


def test_an_estimator_still_running_at_the_deadline_is_the_deadline(tmp_path: Path) -> None:
    stop = threading.Event()

    def slow(history: list[bl.Message], model: Any) -> int:
        stop.wait(30)
        return 10

    try:
        with bl.Runner(tmp_path / "j", estimator=slow) as runner:
            result = runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p",
                                budget=bl.Budget(deadline_s=0.5))
    finally:
        stop.set()
    assert (result.status, result.exhausted_limit, result.model_steps) == \
        ("limit_exceeded", "deadline", 0)
    assert result.elapsed_s < 3


def test_a_persons_note_is_scrubbed_of_credentials(tmp_path: Path) -> None:
    # A resolve's note is text the run journals: a credential pasted into it is redacted.
    token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJvcGVyYXRvciJ9.c2lnbmF0dXJlLXZhbHVl"
    slow = threading.Event()

    @bl.tool(irreversible=True, timeout_s=0.2)
    def ship() -> str:
        slow.wait(5)
        return "shipped"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "ship", {})]), bl.Final("x")])
    where = tmp_path / "j"
    with bl.Runner(where) as runner:
        result = runner.run(model=model, tools=[ship], prompt="p", run_id="n")
        slow.set()
        assert result.status == "needs_review"
        [action] = result.unresolved
        runner.resolve("n", action.execution_id, "succeeded",
                       note=f"carrier confirmed; their API token was {token}")
        [resolved] = [e for e in runner.journal.events("n") if isinstance(e, ev.CallResolved)]
    assert token not in resolved.note and resolved.note.startswith("carrier confirmed")
    assert token.encode() not in (where / "data.mdb").read_bytes()


# -- found by an attacker pass on the supervisor's group commit -----------------------------
def test_a_journal_whose_submit_raises_ends_runs_not_the_supervisor(tmp_path: Path) -> None:
    from boundloop.journal.lmdb import LmdbJournal
    from boundloop.testing import FaultyJournal

    class RaisingJournal(FaultyJournal):
        def submit(self, run_id: str, expected_seq: int, events: Any, done: Any,
                   fence: Any = None) -> None:
            with self._lock:
                self.writes += 1
                n = self.writes
            if n == self.fail_at:
                raise RuntimeError("a bug in the journal")
            self.inner.submit(run_id, expected_seq, events, done, fence)

    def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
        return bl.CallTools([bl.ToolCall(f"c{ctx.step}", "t", {})]) if ctx.step < 3 \
            else bl.Final("x")

    t = bl.Tool("t", lambda: "ok", read_only=True)
    with bl.Runner(RaisingJournal(LmdbJournal(tmp_path / "j", sync=False), fail_at=3),
                   supervisors=1) as runner:
        first = runner.submit(model, [t], prompt="one").result(timeout=10)
        second = runner.submit(model, [t], prompt="two").result(timeout=10)
        assert runner._supervisors[0].is_alive()
    assert first.status == "journal_unavailable" and "a bug in the journal" in first.explanation
    assert second.status == "final"


_HOLD = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8, map_size=1 << 30)
txn = env.begin(write=True)
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
txn.abort()
"""


@pytest.mark.timeout(60)
def test_close_settles_every_future_while_another_process_holds_the_write_lock(
        tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    path = tmp_path / "j"
    runner = bl.Runner(path)
    runner.run(model=bl.ScriptedModel([bl.Final("warm")]), prompt="warm")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), "7"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "t", {})]), bl.Final("x")])
        future = runner.submit(model, [bl.Tool("t", lambda: "ok")], prompt="go")
        time.sleep(0.5)  # its supervisor now waits inside a commit, on the other process
        runner.close(timeout=1)  # returned: its supervisor did not stop in time
        assert future.done()
        with pytest.raises(bl.RunnerClosed):
            future.result(timeout=0)
        assert runner.journal.closed
    finally:
        holder.wait(timeout=30)


def test_is_async_asks_again_for_every_callable_object() -> None:
    import functools

    from boundloop.actors.workers import is_async

    class Model:
        async def __call__(self, history: Any, ctx: Any) -> Any:
            return None

    m = Model()
    assert is_async(m)
    Model.__call__ = lambda self, history, ctx: None  # type: ignore[method-assign,assignment]
    assert not is_async(m)  # its class changed its mind

    class P(functools.partial):  # type: ignore[type-arg]
        pass

    async def a() -> None:
        return None

    assert is_async(P(a)) and not is_async(P(lambda: None))


# -- found by an acceptance pass against SPEC 1 ------------------------------------------------
def _two_calls() -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "echo", {"text": "a"}),
                                           bl.ToolCall("c2", "echo", {"text": "b"})]),
                             bl.Final("done")])


def _echo() -> bl.Tool:
    def echo(text: str) -> str:
        return text

    return bl.Tool("echo", echo)


def test_an_async_permit_is_awaited_on_the_callers_loop(tmp_path: Path) -> None:
    """SPEC 1: the async def permits of a run started with arun run on the caller's loop
    (an async permit used to be called and never awaited: its coroutine denied every call)."""
    import asyncio

    seen: list[Any] = []

    async def permit(call: bl.ToolCall, tool: bl.Tool, ctx: Any) -> Any:
        seen.append((call.id, asyncio.get_running_loop()))
        await asyncio.sleep(0)
        return True if call.id == "c1" else "not b"

    async def main() -> tuple[bl.RunResult, Any]:
        async with bl.Runner(tmp_path / "j") as runner:
            return await runner.arun(model=_two_calls(), tools=[_echo()], prompt="p",
                                     permit=permit), asyncio.get_running_loop()

    result, loop = asyncio.run(main())
    assert result.status == "final"
    assert seen == [("c1", loop), ("c2", loop)]
    results = [(m.id, m.status, m.content) for m in result.transcript
               if m.kind == "tool_result"]
    assert results[0] == ("c1", "ok", "a")
    assert results[1][:2] == ("c2", "denied") and "not b" in str(results[1][2])


def test_an_async_permit_of_a_sync_run_is_awaited_too(tmp_path: Path) -> None:
    async def permit(call: bl.ToolCall, tool: bl.Tool, ctx: Any) -> bool:
        return call.id == "c2"

    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=_two_calls(), tools=[_echo()], prompt="p", permit=permit)
    assert [m.status for m in result.transcript if m.kind == "tool_result"] == \
        ["denied", "ok"]


def test_the_explanation_counts_unresolved_actions(tmp_path: Path) -> None:
    """SPEC 1: the explanation says how many actions are left unresolved when any are, in
    the result and in the journal's RunFinished (so replay says the same)."""
    import time

    @bl.tool(timeout_s=0.2)
    def hang(x: int) -> int:
        time.sleep(1.0)
        return x

    two = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "hang", {"x": 1}),
                                          bl.ToolCall("c2", "hang", {"x": 2})]),
                            bl.Final("done")])
    one = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "hang", {"x": 1})]),
                            bl.Final("done")])
    with bl.Runner(tmp_path / "j") as runner:
        timed_out = runner.run(model=two, tools=[hang], prompt="p")
        walled = runner.run(model=one, tools=[hang], prompt="p",
                            budget=bl.Budget(deadline_s=0.1))
        clean = runner.run(model=bl.ScriptedModel([bl.Final("x")]), tools=[], prompt="p")
        replayed = bl.replay(list(runner.journal.events(timed_out.run_id)))
    assert timed_out.status == "final" and len(timed_out.unresolved) == 2
    assert timed_out.explanation == ("The model gave a final answer. The run leaves 2 actions "
                                     "unresolved.")
    assert replayed.explanation == timed_out.explanation
    assert walled.exhausted_limit == "deadline" and len(walled.unresolved) == 1
    assert walled.explanation.endswith("The run leaves 1 action unresolved.")
    assert clean.explanation == "The model gave a final answer."


# -- found by an acceptance pass against SPEC 8 ------------------------------------------------
def test_a_childs_deadline_is_never_later_than_its_parents(tmp_path: Path) -> None:
    """Its deadline used to be 'now + what the parent had left a moment ago': later by the
    moment, and more at each level."""
    seen: dict[str, float] = {}

    def grandchild(history: Any, ctx: Any) -> bl.Final:
        seen["grandchild"] = ctx.deadline
        return bl.Final("g")

    def child_first(history: Any, ctx: Any) -> Any:
        seen["child"] = ctx.deadline
        return bl.CallTools([bl.ToolCall("c", "spawn", {"depth": 2})])

    @bl.tool
    def spawn(depth: int, ctx: bl.ToolContext) -> str:
        model = bl.ScriptedModel([grandchild] if depth == 2 else [child_first, bl.Final("c")])
        return ctx.run_child(model=model, tools=[spawn], prompt="c",
                             budget=bl.Budget(deadline_s=100)).status

    def parent_first(history: Any, ctx: Any) -> Any:
        seen["parent"] = ctx.deadline
        return bl.CallTools([bl.ToolCall("p", "spawn", {"depth": 1})])

    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=bl.ScriptedModel([parent_first, bl.Final("x")]),
                            tools=[spawn], prompt="p", budget=bl.Budget(deadline_s=3))
    assert result.status == "final"
    assert seen["grandchild"] <= seen["child"] <= seen["parent"]


def test_parents_waiting_on_children_hold_no_thread_others_need(tmp_path: Path) -> None:
    """SPEC 8: a sync handler waiting in run_child holds no thread that other runs need, past
    any cap (max_threads bounds only what abandoned calls are owed)."""
    import asyncio

    go = threading.Event()
    started = threading.Semaphore(0)

    async def child_model(history: Any, ctx: Any) -> bl.Final:
        started.release()
        while not go.is_set():
            await asyncio.sleep(0.01)
        return bl.Final("ok")

    @bl.tool
    def spawn(x: int, ctx: bl.ToolContext) -> str:
        return ctx.run_child(model=child_model, prompt="c").status

    @bl.tool
    def quick(x: int) -> int:
        return x

    def spawning() -> bl.ScriptedModel:
        return bl.ScriptedModel([bl.CallTools([bl.ToolCall("p", "spawn", {"x": 1})]),
                                 bl.Final("x")])

    try:
        with bl.Runner(tmp_path / "j", tool_threads=1, model_threads=1,
                       max_threads=4) as runner:
            parents = [runner.submit(spawning(), [spawn], "p", budget=bl.Budget(deadline_s=20))
                       for _ in range(6)]  # more than the cap
            for _ in range(6):
                assert started.acquire(timeout=10)  # every child runs: its parent waits
            other = runner.run(model=bl.ScriptedModel(
                [bl.CallTools([bl.ToolCall("q", "quick", {"x": 1})]), bl.Final("x")]),
                tools=[quick], prompt="p", budget=bl.Budget(deadline_s=3))
            go.set()
            assert other.status == "final", other.explanation
            assert [m.status for m in other.transcript if m.kind == "tool_result"] == ["ok"]
            assert [f.result(timeout=20).status for f in parents] == ["final"] * 6
    finally:
        go.set()


# -- found by a new user's walk through the README ------------------------------------------
def test_the_demo_on_postgresql_names_the_url_without_its_password(pg: Any) -> None:
    import subprocess
    import sys
    import uuid

    url = pg.create_database("db_" + uuid.uuid4().hex[:12]).replace(
        "postgresql://boundloop@", "postgresql://boundloop:s3cretpw@")  # trust: any password
    done = subprocess.run([sys.executable, "-m", "boundloop", "--journal", url, "demo"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "s3cretpw" not in done.stdout + done.stderr
    [journal_line] = [line for line in done.stdout.splitlines() if line.startswith("journal:")]
    assert journal_line.startswith("journal: postgresql://boundloop@127.0.0.1:"), journal_line
    assert "--journal postgresql://boundloop@127.0.0.1:" in done.stdout  # what to run next


def test_an_estimator_failure_says_the_model_was_not_called(tmp_path: Path) -> None:
    called: list[int] = []

    def model(history: Any, ctx: Any) -> bl.Final:
        called.append(1)
        return bl.Final("x")

    with bl.Runner(tmp_path / "j", estimator=lambda history, model: "nope") as runner:
        result = runner.run(model=model, tools=[], prompt="p")
    assert result.status == "model_error" and not called
    assert result.explanation.startswith("The model was not called: the runner's estimator")


# -- found by an acceptance pass against SPEC 12 -------------------------------------------
@pytest.mark.parametrize("runs_out", ["before_model", "before_dispatch"])
def test_a_self_fenced_run_counts_only_the_model_calls_made_and_says_why_plainly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs_out: str) -> None:
    """A runner whose lease ran out before a model step (or before a batch's dispatch)
    fences itself and does not call the model (or start the call): that step is not counted
    (SPEC 5: model steps count callback invocations), and the explanation says the lease ran
    out, in sentences, not that the journal failed (found again: a lease lost before the
    dispatch was explained as the journal's failing)."""
    from boundloop._runner.base import RunnerBase

    calls: list[int] = []
    ran: list[str] = []
    leased = RunnerBase.lease_ok

    def model(history: Any, ctx: Any) -> Any:
        calls.append(ctx.step)
        return bl.CallTools([bl.ToolCall(f"c{ctx.step}", "echo", {"text": "x"})])

    def echo(text: str) -> str:
        ran.append(text)
        return text

    def lease_runs_out(self: Any, since: int | None = None) -> bool:
        gone = ran if runs_out == "before_model" else calls
        return leased(self, since) and not gone

    monkeypatch.setattr(RunnerBase, "lease_ok", lease_runs_out)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, tools=[bl.Tool("echo", echo)], prompt="p")
        events = [e for _, e in runner.journal.read(result.run_id)]
    assert calls == [1] and result.model_steps == 1
    assert result.status == "journal_unavailable" and result.exhausted_limit is None
    assert ran == (["x"] if runs_out == "before_model" else [])
    assert result.explanation.startswith("This runner stopped starting work")
    assert "lease ran out" in result.explanation and "journal" not in result.explanation
    assert result.explanation.endswith(".")
    # It stops as a resume would find it: open in the journal, for another runner.
    assert not any(isinstance(e, bl.events.RunFinished) for e in events)
    succeeded = [e for e in events if isinstance(e, bl.events.CallSucceeded)]
    assert len(succeeded) == (1 if runs_out == "before_model" else 0)


# -- found by a hostile-input pass --------------------------------------------------------------
def test_an_async_tool_raising_cancelled_error_itself_is_an_error_not_a_skip(
        tmp_path: Path) -> None:
    """It ran: journaling it CallSkipped ("not run") would hide a possible side effect."""
    import asyncio

    async def flaky(text: str) -> str:
        raise asyncio.CancelledError()

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "flaky", {"text": "x"})]),
                              bl.Final("done")])

    async def main() -> bl.RunResult:
        async with bl.Runner(tmp_path / "j") as runner:
            return await runner.arun(model=model, tools=[bl.Tool("flaky", flaky)], prompt="p")

    result = asyncio.run(main())
    assert result.status == "final"
    [answer] = [m for m in result.transcript if m.kind == "tool_result"]
    assert answer.status == "error" and "CancelledError" in str(answer.content)
    with bl.Runner(tmp_path / "j") as runner:
        kinds = [type(e).__name__ for e in runner.journal.events(result.run_id)]
    assert "CallFailed" in kinds and "CallSkipped" not in kinds


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_async_user_code_raising_a_base_exception_ends_its_call_not_the_app(
        tmp_path: Path, raised: type[BaseException]) -> None:
    import asyncio

    async def model(history: Any, ctx: Any) -> Any:
        raise raised()

    async def main() -> tuple[bl.RunResult, bl.RunResult]:
        async with bl.Runner(tmp_path / "j") as runner:
            first = await runner.arun(model=model, tools=[], prompt="p")
            second = await runner.arun(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                                       prompt="p")
            return first, second

    first, second = asyncio.run(main())  # the application's loop was not stopped
    assert first.status == "model_error" and raised.__name__ in first.explanation
    assert second.status == "final"


def test_a_journal_whose_table_names_are_damaged_is_refused_not_started_afresh(
        tmp_path: Path) -> None:
    """A damaged table name used to make a writer create an empty table in its place: its runs
    vanished and new ones were written into the damaged file."""
    import lmdb

    path = tmp_path / "j"
    with bl.Runner(path) as runner:
        runner.run(model=bl.ScriptedModel([bl.Final("x")]), tools=[], prompt="p")
    env = lmdb.open(str(path), max_dbs=16, subdir=True)
    with env.begin(write=True) as txn:  # the name of "events" with one letter changed
        env.open_db(b"evemts", txn=txn)
        txn.drop(env.open_db(b"events", txn=txn), delete=True)
    env.close()
    with pytest.raises(bl.JournalCorrupt, match="table names are not boundloop's"):
        bl.Runner(path)


def test_a_response_holding_itself_is_malformed_not_a_failure_of_boundloop(
        tmp_path: Path) -> None:
    looped: dict[str, Any] = {}
    looped["a"] = looped
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=lambda h, c: bl.CallTools([bl.ToolCall("1", "echo", {})],
                                                            content=looped),
                            tools=[_echo()], prompt="p")
    assert result.status == "malformed_response"
    assert "holding itself" in result.explanation and result.unresolved == []


def test_a_failure_of_boundloop_itself_does_not_claim_an_unknown_outcome(
        tmp_path: Path) -> None:
    class EvilStr(str):
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("eq boom")

        __hash__ = str.__hash__

    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=lambda h, c: {"kind": EvilStr("final"), "text": "x"},
                            tools=[], prompt="p")
    assert result.status in ("needs_review", "malformed_response")
    if result.status == "needs_review":
        assert result.explanation.startswith("Boundloop failed while driving the run")
        assert "outcome is unknown" not in result.explanation


def test_handlers_hanging_with_no_timeout_do_not_keep_other_runs_waiting(
        tmp_path: Path) -> None:
    """SPEC 1: a tool that hangs stops at most its own run. With timeout_s=None it is never
    abandoned, so the pool adds a thread once calls have waited STARVED_S with every thread
    busy."""
    import time

    block = threading.Event()

    @bl.tool(timeout_s=None)
    def hang(x: int) -> str:
        block.wait(30)
        return "late"

    @bl.tool
    def quick(x: int) -> str:
        return "q"

    def calling(name: str) -> bl.ScriptedModel:
        return bl.ScriptedModel([bl.CallTools([bl.ToolCall("c", name, {"x": 1})]),
                                 bl.Final("f")])

    try:
        with bl.Runner(tmp_path / "j", tool_threads=2) as runner:
            hung = [runner.submit(calling("hang"), [hang], "p") for _ in range(2)]
            time.sleep(0.5)
            started = time.monotonic()
            other = runner.run(model=calling("quick"), tools=[quick], prompt="p")
            assert other.status == "final" and time.monotonic() - started < 5
            assert [m.status for m in other.transcript if m.kind == "tool_result"] == ["ok"]
            block.set()
            assert [f.result(timeout=20).status for f in hung] == ["final", "final"]
    finally:
        block.set()
