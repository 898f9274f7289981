"""SPEC 3 and 5: budget validation, admission (`rejected`), and failing closed on the journal."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pytest
from loop_helpers import journal_of

import boundloop as bl

# -- Budget validation -------------------------------------------------------------------------
INVALID = {
    "steps-zero": {"max_model_steps": 0},
    "steps-negative": {"max_model_steps": -1},
    "steps-none": {"max_model_steps": None},
    "steps-string": {"max_model_steps": "3"},
    "calls-negative": {"max_tool_calls": -1},
    "calls-none": {"max_tool_calls": None},
    "calls-string": {"max_tool_calls": "10"},
    "parallel-negative": {"max_parallel": -2},
    "parallel-string": {"max_parallel": "2"},
    "deadline-negative": {"deadline_s": -1.0},
    "deadline-string": {"deadline_s": "soon"},
    "input-negative": {"max_input_tokens": -5},
    "output-negative": {"max_output_tokens": -1},
    "total-negative": {"max_total_tokens": -1},
    "total-list": {"max_total_tokens": [100]},
    "cost-negative": {"max_cost": -0.01},
    "cost-string": {"max_cost": "1.0"},
    "result-bytes-negative": {"max_result_bytes": -1},
    "malformed-negative": {"malformed_retries": -1},
    "malformed-string": {"malformed_retries": "1"},
}


@pytest.mark.parametrize("kwargs", list(INVALID.values()), ids=list(INVALID))
def test_invalid_budget_raises_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(bl.ConfigError):
        bl.Budget(**kwargs)


def test_config_error_is_a_boundloop_error() -> None:
    assert issubclass(bl.ConfigError, bl.BoundloopError)


def test_budget_defaults() -> None:
    b = bl.Budget()
    assert (b.max_model_steps, b.max_tool_calls) == (6, 20)
    assert b.reserve_final_step is True
    assert b.malformed_retries == 0
    assert (b.max_parallel, b.deadline_s, b.max_input_tokens, b.max_output_tokens,
            b.max_total_tokens, b.max_cost, b.max_result_bytes) == (None,) * 7


def test_smallest_valid_budget_runs(runner: bl.Runner) -> None:
    budget = bl.Budget(max_model_steps=1, max_tool_calls=0)
    model = bl.ScriptedModel([bl.Final("ok")])
    result = runner.run(model=model, prompt="go", budget=budget)
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 1, 0)
    journal_of(runner, result)


# -- rejected ----------------------------------------------------------------------------------
def test_second_concurrent_run_over_max_in_flight_is_rejected(journal_dir: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def blocking(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        entered.set()
        gate.wait(5)
        return bl.Final("first")

    second = bl.ScriptedModel([bl.Final("second")])
    with bl.Runner(journal_dir, max_in_flight=1) as runner:
        try:
            first = runner.submit(model=blocking, prompt="one", run_id="first")
            assert entered.wait(5)
            rejected = runner.submit(model=second, prompt="two", run_id="second").result(5)
        finally:
            gate.set()
        result = first.result(5)

        assert (rejected.status, rejected.exhausted_limit) == ("rejected", None)
        assert rejected.run_id == "second"
        assert (rejected.model_steps, rejected.tool_calls) == (0, 0)
        assert rejected.explanation
        assert "max_in_flight=1" in rejected.explanation
        # A refused run leaves nothing of it in flight here.
        assert not runner.in_flight("second") and not runner.cancel("second")
        assert second.calls == 0
        if "second" in list(runner.journal.runs()):
            names = [type(e).__name__ for e in runner.journal.events("second")]
            assert "RunAdmitted" not in names and "ModelStepStarted" not in names

        assert (result.status, result.model_steps) == ("final", 1)
        journal_of(runner, result)

        # The slot is free again once the first run ended.
        third = runner.run(model=bl.ScriptedModel([bl.Final("third")]), prompt="three")
        assert third.status == "final"
        journal_of(runner, third)


def _admission_waits(runner: bl.Runner, gate: threading.Event, error: Exception | None = None,
                     ) -> None:
    """The journal's ``find``, when admission calls it, waits for ``gate`` (or raises
    ``error`` for the run ``boom``)."""
    find = runner.journal.find

    def find_slowly(run_id: str) -> Any:
        if threading.current_thread().name.startswith("AdmissionActor"):
            if error is not None and run_id == "boom":
                raise error
            assert gate.wait(10)
        return find(run_id)

    runner.journal.find = find_slowly  # type: ignore[method-assign]


def test_a_run_is_known_by_its_id_before_admission_has_decided(journal_dir: Path) -> None:
    """Admission is told, not asked (#21): submit returns before it has decided, and the
    run's id is known here at once all the same (in flight, cancellable, one run)."""
    gate = threading.Event()
    model = bl.ScriptedModel([bl.Final("never")])
    with bl.Runner(journal_dir) as runner:
        _admission_waits(runner, gate)
        later: list[Future[bl.RunResult]] = []
        try:
            future = runner.submit(model=model, prompt="p", run_id="early")
            assert not future.done()
            assert runner.in_flight("early")
            again = runner.submit(model=model, prompt="p", run_id="early")
            # Backpressure: another run's submit waits while a run waits for admission.
            second = threading.Thread(target=lambda: later.append(runner.submit(
                model=bl.ScriptedModel([bl.Final("later")]), prompt="p", run_id="later")))
            second.start()
            second.join(0.3)
            assert second.is_alive() and not later
            assert runner.cancel("early", "changed my mind")
        finally:
            gate.set()
        second.join(10)
        result = future.result(10)
        assert result.status == "cancelled", result
        assert again.result(10).status == "cancelled"  # that run's, not a second one's
        assert later[0].result(10).status == "final"
        assert model.calls == 0
        assert sorted(runner.journal.runs()) == ["early", "later"]
        assert not runner.in_flight("early")
        journal_of(runner, result)


def test_a_submit_waiting_for_admission_is_let_go_when_the_runner_closes(
        journal_dir: Path) -> None:
    """Nothing waits forever: a caller held back while admission is busy gets a Future
    settled with RunnerClosed once the runner closes."""
    gate = threading.Event()
    model = bl.ScriptedModel([bl.Final("never")])
    runner = bl.Runner(journal_dir)
    _admission_waits(runner, gate)
    waiting: list[Future[bl.RunResult]] = []
    first = runner.submit(model=model, prompt="p", run_id="first")
    held = threading.Thread(target=lambda: waiting.append(
        runner.submit(model=model, prompt="p", run_id="held")))
    held.start()
    held.join(0.3)
    assert held.is_alive()
    threading.Timer(1.0, gate.set).start()  # admission gets free while close() waits
    runner.close(timeout=2)
    held.join(5)
    assert not held.is_alive()
    with pytest.raises(bl.RunnerClosed):
        waiting[0].result(5)
    assert first.done()
    assert model.calls == 0
    with bl.Runner(journal_dir) as reopened:  # the held run never reached the journal
        assert "held" not in list(reopened.journal.runs())


def test_an_error_inside_admission_fails_that_run_and_admission_serves_on(
        journal_dir: Path) -> None:
    with bl.Runner(journal_dir, max_in_flight=1) as runner:
        opened = threading.Event()
        opened.set()
        _admission_waits(runner, opened, RuntimeError("find broke"))
        with pytest.raises(RuntimeError, match="find broke"):
            runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p", run_id="boom")
        assert not runner.in_flight("boom")
        # The slot was never taken: the next run is admitted.
        after = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p")
        assert after.status == "final"


def test_an_existing_run_id_returns_that_run_and_runs_nothing(runner: bl.Runner) -> None:
    ran: list[str] = []

    @bl.tool
    def act(x: str) -> str:
        """Act."""
        ran.append(x)
        return x

    first = runner.run(model=bl.ScriptedModel([bl.Final("done")]), prompt="go", run_id="dup")
    assert first.status == "final"
    before = [msgspec.to_builtins(e) for e in runner.journal.events("dup")]

    again = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "act", {"x": "a"})]),
                              bl.Final("second")])
    result = runner.run(model=again, tools=[act], prompt="again", run_id="dup")
    # SPEC 14: an id that exists returns that run (it never runs twice).
    assert (result.status, result.exhausted_limit) == ("final", None)
    assert result.run_id == "dup"
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert [m.kind for m in result.transcript] == ["user", "final"]
    assert result.transcript[-1].text == "done"
    assert again.calls == 0
    assert ran == []
    # The original run is untouched.
    assert [msgspec.to_builtins(e) for e in runner.journal.events("dup")] == before
    assert list(runner.journal.runs()) == ["dup"]
    journal_of(runner, first)


# -- journal_unavailable -------------------------------------------------------------------
def test_closed_journal_fails_closed(runner: bl.Runner) -> None:
    ran: list[str] = []

    @bl.tool
    def act(x: str) -> str:
        """Act."""
        ran.append(x)
        return x

    runner.journal.close()
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "act", {"x": "a"})]),
                              bl.Final("never")])
    result = runner.run(model=model, tools=[act], prompt="go")
    assert (result.status, result.exhausted_limit) == ("journal_unavailable", None)
    assert (result.model_steps, result.tool_calls) == (0, 0)
    assert model.calls == 0
    assert ran == []
    assert result.explanation


def test_journal_lost_before_the_intent_is_recorded_dispatches_nothing(
        runner: bl.Runner) -> None:
    ran: list[str] = []

    @bl.tool
    def act(x: str) -> str:
        """Act."""
        ran.append(x)
        return x

    def close_then_call(history: list[Any], ctx: bl.ModelContext) -> bl.CallTools:
        runner.journal.close()
        return bl.CallTools([bl.ToolCall("c1", "act", {"x": "a"})])

    model = bl.ScriptedModel([close_then_call, bl.Final("never")])
    result = runner.run(model=model, tools=[act], prompt="go")
    assert (result.status, result.exhausted_limit) == ("journal_unavailable", None)
    assert result.model_steps == 1
    assert model.calls == 1
    assert ran == []
    assert [m.kind for m in result.transcript] == ["user"]
    assert result.explanation


def test_a_failure_handing_an_admitted_run_on_fails_that_run_and_admission_serves_on(
        journal_dir: Path) -> None:
    """Admission hands an admitted run to its supervisor on its own thread (#21): what fails
    there fails that run's Future, and does not stop admission (pykka stops an actor that
    raises on a tell, and every later run would be refused)."""
    with bl.Runner(journal_dir) as runner:
        timer = runner._workers.timer
        at = timer.at

        def broken_at(when: float, fn: Any) -> None:
            if threading.current_thread().name.startswith("AdmissionActor"):
                raise RuntimeError("the timer broke")
            at(when, fn)

        timer.at = broken_at  # type: ignore[method-assign]
        try:
            first = runner.submit(model=bl.ScriptedModel([bl.Final("x")]), prompt="p",
                                  budget=bl.Budget(deadline_s=30), run_id="broken")
            with pytest.raises(RuntimeError, match="the timer broke"):
                first.result(10)
        finally:
            timer.at = at  # type: ignore[method-assign]
        after = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                           budget=bl.Budget(deadline_s=30))
        assert after.status == "final", after
        assert runner._admission.is_alive()
