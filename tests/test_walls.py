"""SPEC 5 "The deadline is a wall", driven by a FakeClock: the runner's timers run on the
runner's clock, so these tests of time need no sleeps past a deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev


@pytest.fixture
def clock() -> bl.FakeClock:
    return bl.FakeClock()


@pytest.fixture
def timed(tmp_path: Path, clock: bl.FakeClock) -> Iterator[bl.Runner]:
    with bl.Runner(tmp_path / "j", clock=clock, model_threads=1, tool_threads=1) as r:
        yield r


def kinds(runner: bl.Runner, run_id: str) -> list[str]:
    return [type(e).__name__ for e in runner.journal.events(run_id)]


def blocked_model(entered: threading.Event, release: threading.Event,
                  answer: Any = None) -> Any:
    def model(history: list[Any], ctx: bl.ModelContext) -> Any:
        entered.set()
        release.wait(10)
        return answer if answer is not None else bl.Final("late")

    return model


def test_a_model_past_the_deadline_and_its_grace_is_abandoned(
        timed: bl.Runner, clock: bl.FakeClock) -> None:
    entered, release = threading.Event(), threading.Event()
    try:
        f = timed.submit(model=blocked_model(entered, release), prompt="p", run_id="m",
                         budget=bl.Budget(deadline_s=10))
        assert entered.wait(5)
        clock.advance(10.2)  # past the deadline, within the grace: still waiting
        with pytest.raises(TimeoutError):
            f.result(timeout=0.3)
        clock.advance(0.4)  # past the grace
        result = f.result(timeout=5)
    finally:
        release.set()
    assert (result.status, result.exhausted_limit, result.model_steps) == \
        ("limit_exceeded", "deadline", 1)
    assert "deadline" in result.explanation
    events = list(timed.journal.events("m"))
    failed = [e for e in events if isinstance(e, ev.ModelStepFailed)]
    assert [e.reason for e in failed] == ["deadline"]
    charged = [e for e in events if isinstance(e, ev.UsageCharged)]
    assert [e.estimated for e in charged] == [True]  # the reservation stands, estimated
    assert bl.replay(events).status == "limit_exceeded"
    # The abandoned model still holds the only model thread: the pool replaced it.
    again = timed.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p")
    assert again.status == "final"


def test_a_final_answer_within_the_grace_is_accepted(timed: bl.Runner,
                                                     clock: bl.FakeClock) -> None:
    entered, release = threading.Event(), threading.Event()
    f = timed.submit(model=blocked_model(entered, release, bl.Final("just in time")),
                     prompt="p", budget=bl.Budget(deadline_s=10))
    assert entered.wait(5)
    clock.advance(10.3)
    release.set()
    result = f.result(timeout=5)
    assert (result.status, result.model_steps) == ("final", 1)
    assert result.transcript[-1] == bl.FinalMessage("just in time")


def test_a_model_waiting_for_a_thread_ends_at_the_deadline_or_on_cancel(
        timed: bl.Runner, clock: bl.FakeClock) -> None:
    entered, release = threading.Event(), threading.Event()
    try:
        hog = timed.submit(model=blocked_model(entered, release), prompt="hog")
        assert entered.wait(5)  # the only model thread is taken
        late = timed.submit(model=bl.ScriptedModel([bl.Final("never")]), prompt="p",
                            run_id="late", budget=bl.Budget(deadline_s=5))
        cancelled = timed.submit(model=bl.ScriptedModel([bl.Final("never")]), prompt="p",
                                 run_id="cancelled")
        time.sleep(0.1)  # let it queue for the model thread (either way it must end now)
        timed.cancel("cancelled", "no longer wanted")
        result = cancelled.result(timeout=5)
        assert result.status == "cancelled" and result.model_steps in (0, 1)
        assert "no longer wanted" in result.explanation
        clock.advance(5)  # no grace for a call that never started
        result = late.result(timeout=5)
        assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
        assert "ModelStepFailed" in kinds(timed, "late")
    finally:
        release.set()
    assert hog.result(timeout=5).status == "final"


def test_a_handler_running_at_the_deadline_becomes_outcome_unknown(
        timed: bl.Runner, clock: bl.FakeClock) -> None:
    entered, release = threading.Event(), threading.Event()

    @bl.tool(timeout_s=None)
    def slow(ctx: bl.ToolContext) -> str:
        entered.set()
        release.wait(10)
        return "late"

    @bl.tool
    def quick() -> str:
        return "never runs"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "slow", {}), bl.ToolCall("b", "quick", {})]),
        bl.Final("x")])
    try:
        f = timed.submit(model=model, tools=[slow, quick], prompt="p", run_id="t",
                         budget=bl.Budget(deadline_s=10, max_parallel=1))
        assert entered.wait(5)
        clock.advance(10)
        result = f.result(timeout=5)
    finally:
        release.set()
    assert (result.status, result.exhausted_limit, result.tool_calls) == \
        ("limit_exceeded", "deadline", 2)
    assert [u.call_id for u in result.unresolved] == ["a"]
    events = list(timed.journal.events("t"))
    assert [e.reason for e in events if isinstance(e, ev.CallSkipped)] == ["deadline"]
    assert any(isinstance(e, ev.CallOutcomeUnknown) for e in events)
