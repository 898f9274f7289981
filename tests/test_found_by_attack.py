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
