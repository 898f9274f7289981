"""Embedding safety: nothing a caller or user code does stops the Runner (SPEC 1, 5, 6, 8).

Each test ends by checking that the same Runner still completes 20 further quick runs.

- test_cancelling_submit_futures_cancels_the_run_and_the_runner_keeps_serving: ``f.cancel()``
  on ~50 submit Futures (right away or a moment later, both supervisor shards) and the asyncio
  ``wait_for(wrap_future(f), 0.01)`` timeout: each run ends ``cancelled`` with a RunFinished,
  the others ``final``, and ``close()`` returns in < 3 s (SPEC 1).
- test_a_model_with_the_wrong_signature_ends_its_run_model_error: ``async def model(history)``,
  ``async def model(a, b, c)``, ``def model()``, ``def model(history)`` each end their run
  ``model_error`` (one step counted) with a RunFinished, and the Future settles (SPEC 1, 5.3).
- test_33_parents_waiting_on_children_at_once_all_complete: 33 parents whose sync handlers sit
  in ``ctx.run_child`` (32 of them held there at once: every default tool thread) all end
  ``final``, each child too, with the parent's run id in its RunAdmitted (SPEC 8).
- test_a_nested_run_completes_on_a_runner_with_one_tool_thread: ``tool_threads=1``, one
  parent whose child calls a tool (SPEC 8).
- test_a_depth_3_chain_of_nested_runs_completes_on_two_tool_threads: root -> child ->
  grandchild, each level a sync handler waiting in ``run_child``, ``tool_threads=2`` (SPEC 8).
- test_handlers_stuck_past_their_timeout_do_not_keep_new_runs_from_their_deadline_or_cancel:
  32 timed-out handlers still hold the 32 tool threads; a new run with ``deadline_s=1`` settles
  within 3 s, and a new run cancelled 0.2 s after submission ends ``cancelled`` within 2 s
  (SPEC 5, "The deadline is a wall").
- test_models_blocked_past_the_deadline_are_abandoned_after_the_grace: ``model_threads=2``
  held by models blocked in runs with ``deadline_s=0.3``: those runs end
  ``limit_exceeded(deadline)`` by deadline + 0.5 s grace (+ slack), and a new run with
  ``deadline_s=1`` ends by ~1.5 s (SPEC 5).
- test_submit_racing_close_always_settles: 20 runners, each closed while 4 threads submit in
  a loop: every submit raises RunnerClosed or returns a Future that settles (a result or
  RunnerClosed) within a few seconds (SPEC 1, "close() settles every Future").
- test_unstorable_arguments_results_and_errors_end_the_run_with_a_status: tool arguments
  1,000 deep and cyclic, tool results 1,000 deep, cyclic and with a raising ``__repr__``, a
  tool exception and a model exception whose ``__str__`` raises: each run ends with a status
  and a RunFinished, never an exception out of ``run`` (SPEC 1): unstorable arguments end it
  ``malformed_response`` with nothing run (or ``final`` if their intent was recorded first),
  results and tool errors give the model an ``ok``/``error`` result and the run ends ``final``,
  the model's exception ends it ``model_error`` after one step.
- test_values_the_journal_cannot_store_are_refused_at_the_call: a run id with a lone
  surrogate and a 2**70 int in ``history=`` raise ConfigError at the call, nothing journaled;
  ``Budget(max_tool_calls=2**70)`` is refused or its run does not end journal_unavailable
  (README "Values the journal cannot store", "Run ids").
- test_a_retry_attempt_is_recorded_before_it_starts: inside the handler, the journal already
  holds the CallDispatched of the current ``ctx.attempt`` for attempts 1 and 2 (SPEC 6).
- test_calls_queued_behind_max_parallel_are_recorded_before_they_start: with
  ``max_parallel=1`` and 3 calls in a batch, each call's CallDispatched (attempt 1) is in the
  journal when its handler starts, and is recorded exactly once (SPEC 6).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev


# -- helpers -------------------------------------------------------------------------------
def events_of(runner: bl.Runner, run_id: str) -> list[ev.Event]:
    return list(runner.journal.events(run_id))


def finished_event(runner: bl.Runner, run_id: str) -> ev.RunFinished:
    """The run's RunFinished, which must be its last event."""
    events = events_of(runner, run_id)
    assert events and isinstance(events[-1], ev.RunFinished), \
        f"run {run_id!r} has no RunFinished: {[type(e).__name__ for e in events]}"
    return events[-1]


def check_finished(runner: bl.Runner, result: bl.RunResult) -> ev.RunFinished:
    """The run's RunFinished agrees with its RunResult."""
    fin = finished_event(runner, result.run_id)
    assert (fin.status, fin.exhausted_limit, fin.model_steps, fin.tool_calls) == (
        result.status, result.exhausted_limit, result.model_steps, result.tool_calls)
    return fin


def wait_finished(runner: bl.Runner, run_id: str, timeout: float) -> ev.RunFinished:
    """Poll the journal until the run has its RunFinished (for runs whose Future was
    cancelled, so cannot be waited on)."""
    end = time.monotonic() + timeout
    while True:
        try:
            events = events_of(runner, run_id)
        except bl.UnknownRun:
            events = []
        if events and isinstance(events[-1], ev.RunFinished):
            return events[-1]
        if time.monotonic() > end:
            raise AssertionError(f"run {run_id!r} did not finish within {timeout}s: "
                                 f"{[type(e).__name__ for e in events]}")
        time.sleep(0.02)


def still_serves(runner: bl.Runner, n: int = 20) -> None:
    """The same Runner completes ``n`` further quick runs (ids land on every shard)."""
    futures = [runner.submit(model=bl.ScriptedModel([bl.Final("ok")]), prompt="again")
               for _ in range(n)]
    for f in futures:
        result = f.result(timeout=10)
        assert result.status == "final", result.explanation


def one_call(name: str, **arguments: Any) -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", name, arguments)]),
                             bl.Final("done")])


def nested(depth: int) -> Any:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# -- 1. cancelling the Future of submit ----------------------------------------------------
@pytest.mark.timeout(30)
def test_cancelling_submit_futures_cancels_the_run_and_the_runner_keeps_serving(
        tmp_path: Path) -> None:
    def slow(history: Any, ctx: bl.ModelContext) -> Any:
        ctx.cancel.wait(0.3)
        return bl.Final("late")

    rng = random.Random(7)
    runner = bl.Runner(tmp_path / "journal")
    try:
        cancelled: list[str] = []
        kept: list[tuple[str, Future[bl.RunResult]]] = []
        for i in range(50):
            run_id = f"cancel-{i}"  # fixed ids: both supervisor shards are hit
            f = runner.submit(model=slow, prompt="p", run_id=run_id)
            choice = rng.random()
            if choice < 0.5:
                if choice < 0.25:
                    time.sleep(rng.random() * 0.02)  # the model may be running by now
                assert f.cancel(), "a Future whose run cannot have ended refused to cancel"
                cancelled.append(run_id)
            else:
                kept.append((run_id, f))

        async def abandon(n: int) -> list[Future[bl.RunResult]]:
            out = []
            for i in range(n):
                f = runner.submit(model=slow, prompt="p", run_id=f"aio-{i}")
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.wrap_future(f), 0.01)
                out.append(f)
            return out

        abandoned = asyncio.run(abandon(6))
        assert all(f.cancelled() for f in abandoned)
        cancelled += [f"aio-{i}" for i in range(6)]
        assert cancelled and kept

        for run_id, f in kept:
            result = f.result(timeout=10)
            assert (result.run_id, result.status) == (run_id, "final")
            check_finished(runner, result)
        for run_id in cancelled:
            fin = wait_finished(runner, run_id, timeout=5)
            assert fin.status == "cancelled", (run_id, fin.explanation)
            assert fin.model_steps <= 1 and fin.tool_calls == 0
        still_serves(runner)
    finally:
        started = time.monotonic()
        runner.close()
        closing = time.monotonic() - started
    assert closing < 3, f"close() took {closing:.1f}s"


# -- 2. a model with the wrong signature ---------------------------------------------------
@pytest.mark.timeout(30)
def test_a_model_with_the_wrong_signature_ends_its_run_model_error(runner: bl.Runner) -> None:
    async def async_one(history: Any) -> Any:
        return bl.Final("never")

    async def async_three(a: Any, b: Any, c: Any) -> Any:
        return bl.Final("never")

    def sync_none() -> Any:
        return bl.Final("never")

    def sync_one(history: Any) -> Any:
        return bl.Final("never")

    models = [async_one, async_three, sync_none, sync_one]
    futures = [(m.__name__, runner.submit(model=m, prompt="p"))
               for m in models for _ in range(3)]  # 12 random ids: both shards
    for name, f in futures:
        result = f.result(timeout=10)
        assert (result.status, result.model_steps, result.tool_calls) == (
            "model_error", 1, 0), (name, result.explanation)
        check_finished(runner, result)
        assert any(isinstance(e, ev.ModelStepFailed) and e.reason == "error"
                   for e in events_of(runner, result.run_id)), name
    still_serves(runner)


# -- 3. nested runs never starve the tool threads ------------------------------------------
def _child_model() -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall("k1", "leaf", {})]),
                             bl.Final("child done")])


def _leaf(ran: list[str]) -> bl.Tool:
    @bl.tool
    def leaf(ctx: bl.ToolContext) -> str:
        ran.append(ctx.run_id)
        return "leaf"

    return leaf


def _parent_of(runner: bl.Runner, run_id: str) -> str | None:
    admitted = events_of(runner, run_id)[0]
    assert isinstance(admitted, ev.RunAdmitted)
    return admitted.parent_run_id


@pytest.mark.timeout(40)
def test_33_parents_waiting_on_children_at_once_all_complete(runner: bl.Runner) -> None:
    ran: list[str] = []
    children: dict[str, bl.RunResult] = {}
    leaf = _leaf(ran)
    entered = [0]
    lock = threading.Lock()
    all_in = threading.Event()

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        # Hold back until 32 parents sit in their handlers (every default tool thread), so
        # no child's call can slip in first (bounded: it goes on after 5 s regardless).
        with lock:
            entered[0] += 1
            if entered[0] >= 32:
                all_in.set()
        all_in.wait(5)
        child = ctx.run_child(model=_child_model(), tools=[leaf], prompt="x")
        children[ctx.run_id] = child
        return child.status

    futures = {f"parent-{i}": runner.submit(
        model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("d", "delegate", {})]),
                                bl.Final("parent done")]),
        tools=[delegate], prompt="p", run_id=f"parent-{i}") for i in range(33)}
    for run_id, f in futures.items():
        result = f.result(timeout=20)
        assert (result.run_id, result.status) == (run_id, "final"), result.explanation
        assert [m.content for m in result.transcript if m.kind == "tool_result"] == ["final"]
        check_finished(runner, result)
    assert sorted(children) == sorted(futures)
    for parent_id, child in children.items():
        assert child.status == "final" and child.tool_calls == 1
        assert finished_event(runner, child.run_id).status == "final"
        assert _parent_of(runner, child.run_id) == parent_id
    assert sorted(ran) == sorted(c.run_id for c in children.values())
    still_serves(runner)


@pytest.mark.timeout(30)
def test_a_nested_run_completes_on_a_runner_with_one_tool_thread(tmp_path: Path) -> None:
    ran: list[str] = []
    leaf = _leaf(ran)
    children: list[bl.RunResult] = []

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        children.append(ctx.run_child(model=_child_model(), tools=[leaf], prompt="x"))
        return children[-1].status

    with bl.Runner(tmp_path / "journal", tool_threads=1) as runner:
        result = runner.submit(
            model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("d", "delegate", {})]),
                                    bl.Final("parent done")]),
            tools=[delegate], prompt="p", run_id="parent").result(timeout=10)
        assert result.status == "final", result.explanation
        check_finished(runner, result)
        [child] = children
        assert child.status == "final" and ran == [child.run_id]
        assert _parent_of(runner, child.run_id) == "parent"
        still_serves(runner)


@pytest.mark.timeout(30)
def test_a_depth_3_chain_of_nested_runs_completes_on_two_tool_threads(tmp_path: Path) -> None:
    ran: list[str] = []
    leaf = _leaf(ran)
    chain: list[bl.RunResult] = []

    @bl.tool
    def middle(ctx: bl.ToolContext) -> str:
        grandchild = ctx.run_child(model=_child_model(), tools=[leaf], prompt="x")
        chain.append(grandchild)
        return grandchild.status

    @bl.tool
    def top(ctx: bl.ToolContext) -> str:
        child = ctx.run_child(
            model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("m", "middle", {})]),
                                    bl.Final("child done")]),
            tools=[middle], prompt="x")
        chain.append(child)
        return child.status

    with bl.Runner(tmp_path / "journal", tool_threads=2) as runner:
        result = runner.submit(
            model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("t", "top", {})]),
                                    bl.Final("root done")]),
            tools=[top], prompt="p", run_id="root").result(timeout=15)
        assert result.status == "final", result.explanation
        check_finished(runner, result)
        grandchild, child = chain
        assert child.status == "final" and grandchild.status == "final"
        assert _parent_of(runner, child.run_id) == "root"
        assert _parent_of(runner, grandchild.run_id) == child.run_id
        assert ran == [grandchild.run_id]
        still_serves(runner)


# -- 4. stuck handlers and models never hold other runs past their deadline ----------------
@pytest.mark.timeout(40)
def test_handlers_stuck_past_their_timeout_do_not_keep_new_runs_from_their_deadline_or_cancel(
        runner: bl.Runner) -> None:
    gate = threading.Event()
    stuck_started = threading.Semaphore(0)
    fine_ran: list[str] = []

    @bl.tool(timeout_s=0.05)
    def stuck(i: int) -> str:
        stuck_started.release()
        gate.wait(30)
        return "late"

    @bl.tool
    def fine(ctx: bl.ToolContext) -> str:
        fine_ran.append(ctx.run_id)
        return "fine"

    @bl.tool
    def waits(ctx: bl.ToolContext) -> str:
        ctx.cancel.wait(5)
        return "stopped"

    try:
        # 32 calls in one batch fill the 32 tool threads (Runner's default) and time out.
        clog = runner.submit(
            model=bl.ScriptedModel([bl.CallTools([bl.ToolCall(f"s{i}", "stuck", {"i": i})
                                                  for i in range(32)]), bl.Final("x")]),
            tools=[stuck], prompt="p", budget=bl.Budget(max_tool_calls=32))
        for _ in range(32):
            assert stuck_started.acquire(timeout=5)
        clogged = clog.result(timeout=10)
        assert clogged.status == "final" and clogged.tool_calls == 32
        assert len(clogged.unresolved) == 32  # timed out: outcome unknown

        started = time.monotonic()
        late = runner.submit(model=one_call("fine"), tools=[fine], prompt="p",
                             budget=bl.Budget(deadline_s=1), run_id="deadline-1")
        result = late.result(timeout=3)
        assert time.monotonic() - started < 3
        check_finished(runner, result)
        if result.status == "final":
            assert fine_ran == ["deadline-1"] and result.tool_calls == 1
        else:
            assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
            assert fine_ran == []

        cancelled = runner.submit(model=one_call("waits"), tools=[waits], prompt="p",
                                  run_id="cancel-me")
        time.sleep(0.2)
        assert runner.cancel("cancel-me", "the user left")
        started = time.monotonic()
        result = cancelled.result(timeout=2)
        assert time.monotonic() - started < 2
        assert result.status == "cancelled", result.explanation
        check_finished(runner, result)
        still_serves(runner)
    finally:
        gate.set()


@pytest.mark.timeout(30)
def test_models_blocked_past_the_deadline_are_abandoned_after_the_grace(
        tmp_path: Path) -> None:
    gate = threading.Event()
    blocked_started = threading.Semaphore(0)

    def blocked(history: Any, ctx: bl.ModelContext) -> Any:
        blocked_started.release()
        gate.wait(30)
        return bl.Final("late")

    runner = bl.Runner(tmp_path / "journal", model_threads=2)
    try:
        submitted = time.monotonic()
        stuck = [runner.submit(model=blocked, prompt="p", budget=bl.Budget(deadline_s=0.3))
                 for _ in range(2)]
        for _ in range(2):
            assert blocked_started.acquire(timeout=5)
        started = time.monotonic()
        late = runner.submit(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                             budget=bl.Budget(deadline_s=1))

        for f in stuck:
            # deadline 0.3 s + grace 0.5 s, and a little slack for a loaded machine
            result = f.result(timeout=max(submitted + 1.3 - time.monotonic(), 0.01))
            assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
            assert result.model_steps == 1
            check_finished(runner, result)
            names = [type(e).__name__ for e in events_of(runner, result.run_id)]
            assert "ModelStepStarted" in names and "ModelStepCompleted" not in names
        assert time.monotonic() - submitted < 1.3

        result = late.result(timeout=max(started + 2.0 - time.monotonic(), 0.01))
        assert time.monotonic() - started < 2.0  # deadline 1 s + grace 0.5 s + slack
        check_finished(runner, result)
        assert result.status == "final" or (result.status, result.exhausted_limit) == (
            "limit_exceeded", "deadline"), result.explanation
        gate.set()  # the rest need model threads again
        still_serves(runner)
    finally:
        gate.set()
        runner.close()


# -- 5. submit racing close ----------------------------------------------------------------
def _submit_until_closed(runner: bl.Runner, model: Any, out: list[Future[bl.RunResult]],
                         errors: list[BaseException]) -> None:
    while True:
        try:
            out.append(runner.submit(model=model, prompt="p"))
        except bl.RunnerClosed:
            return
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            return


@pytest.mark.timeout(90)
def test_submit_racing_close_always_settles(tmp_path: Path) -> None:
    def waiting(history: Any, ctx: bl.ModelContext) -> Any:
        ctx.cancel.wait(0.2)
        return bl.Final("ok")

    path = tmp_path / "journal"
    total = 0
    for round_ in range(20):
        runner = bl.Runner(path, model_threads=8, tool_threads=1)
        futures: list[Future[bl.RunResult]] = []
        raised: list[BaseException] = []
        threads = [threading.Thread(target=_submit_until_closed,
                                    args=(runner, waiting, futures, raised), daemon=True)
                   for _ in range(4)]
        for t in threads:
            t.start()
        end = time.monotonic() + 0.5
        while len(futures) < 40 and time.monotonic() < end:
            time.sleep(0.002)
        runner.close()
        for t in threads:
            t.join(timeout=5)
            assert not t.is_alive(), f"round {round_}: a submit racing close() never returned"
        assert not raised, f"round {round_}: submit raised {raised[0]!r}, not RunnerClosed"
        total += len(futures)
        _, not_done = wait_futures(futures, timeout=5)
        assert not not_done, \
            f"round {round_}: {len(not_done)} of {len(futures)} Futures never settled"
        wrong = [f.exception() for f in futures
                 if f.exception() is not None and not isinstance(f.exception(), bl.RunnerClosed)]
        assert not wrong, f"round {round_}: a Future failed with {wrong[0]!r}"
    assert total >= 20 * 4  # the threads did race close()
    with bl.Runner(path) as runner:
        still_serves(runner)


# -- 6. bad input --------------------------------------------------------------------------
class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


@pytest.mark.timeout(40)
def test_unstorable_arguments_results_and_errors_end_the_run_with_a_status(
        runner: bl.Runner) -> None:
    ran: list[str] = []
    cyclic_args: dict[str, Any] = {}
    cyclic_args["self"] = cyclic_args

    def cyclic_result() -> Any:
        value: dict[str, Any] = {}
        value["self"] = value
        return value

    def bad_error() -> Any:
        raise BadStr()

    def make(kind: str) -> Any:
        return {"deep": lambda: nested(1000), "cyclic": cyclic_result,
                "repr": BadRepr, "error": bad_error}[kind]

    @bl.tool
    def take(x: Any = None) -> str:
        ran.append("take")
        return "took"

    @bl.tool
    def give(kind: str) -> Any:
        ran.append(kind)
        return make(kind)()

    # Arguments the journal cannot hold: the intent cannot be recorded, so nothing runs.
    for arguments in ({"x": nested(1000)}, {"x": cyclic_args}):
        f = runner.submit(model=bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("c1", "take", arguments)]), bl.Final("done")]),
            tools=[take], prompt="p")
        result = f.result(timeout=10)
        assert result.status in {"malformed_response", "final"}, result.explanation
        check_finished(runner, result)
        decided = [e for e in events_of(runner, result.run_id) if isinstance(e, ev.CallDecided)]
        if result.status == "malformed_response":
            assert ran == [] and decided == [] and result.tool_calls == 0
        elif ran:
            assert decided  # it ran only once its intent was recorded (SPEC 5.9)
        ran.clear()

    # Results and errors a handler gives back: the call has an outcome, the run goes on.
    for kind in ("deep", "cyclic", "repr", "error"):
        result = runner.submit(model=one_call("give", kind=kind), tools=[give],
                               prompt="p").result(timeout=10)
        assert (result.status, result.tool_calls) == ("final", 1), (kind, result.explanation)
        check_finished(runner, result)
        assert ran[-1] == kind
        [tool_result] = [m for m in result.transcript if m.kind == "tool_result"]
        assert tool_result.status in {"ok", "error"}

    result = runner.submit(model=bl.ScriptedModel([BadStr()]), prompt="p").result(timeout=10)
    assert (result.status, result.model_steps) == ("model_error", 1), result.explanation
    check_finished(runner, result)
    still_serves(runner)


@pytest.mark.timeout(30)
def test_values_the_journal_cannot_store_are_refused_at_the_call(runner: bl.Runner) -> None:
    model = bl.ScriptedModel([bl.Final("ok")])
    with pytest.raises(bl.ConfigError):
        runner.submit(model=model, prompt="p", run_id="a\ud800")
    history = [{"kind": "user", "text": "p"},
               {"kind": "call", "id": "c0", "name": "t", "arguments": {"n": 2 ** 70}},
               {"kind": "tool_result", "id": "c0", "status": "ok", "content": "x"}]
    with pytest.raises(bl.ConfigError):
        runner.submit(model=model, history=history)
    assert model.calls == 0 and list(runner.journal.runs()) == []

    try:
        budget = bl.Budget(max_tool_calls=2 ** 70)
    except bl.ConfigError:
        pass  # refused when made: the most specific answer (SPEC 5)
    else:
        result = runner.submit(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                               budget=budget).result(timeout=10)
        assert result.status != "journal_unavailable", result.explanation
        check_finished(runner, result)
    still_serves(runner)


# -- 7. every attempt is recorded before it starts -----------------------------------------
def _dispatched(runner: bl.Runner, ctx: bl.ToolContext) -> bool:
    return any(isinstance(e, ev.CallDispatched) and e.execution_id == ctx.execution_id
               and e.attempt == ctx.attempt for e in events_of(runner, ctx.run_id))


def _dispatch_counts(runner: bl.Runner, run_id: str) -> dict[tuple[str, int], int]:
    """How often each (call id, attempt) has a CallDispatched."""
    events = events_of(runner, run_id)
    call_of = {e.execution_id: e.call_id for e in events if isinstance(e, ev.CallDecided)}
    counts: dict[tuple[str, int], int] = {}
    for e in events:
        if isinstance(e, ev.CallDispatched):
            key = (call_of[e.execution_id], e.attempt)
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.timeout(30)
def test_a_retry_attempt_is_recorded_before_it_starts(runner: bl.Runner) -> None:
    seen: list[tuple[int, bool]] = []

    @bl.tool(retry=bl.RetryPolicy(3, 0.0, (ValueError,)))
    def flaky(ctx: bl.ToolContext) -> str:
        seen.append((ctx.attempt, _dispatched(runner, ctx)))
        if ctx.attempt == 1:
            raise ValueError("first attempt fails")
        return "second works"

    result = runner.submit(model=one_call("flaky"), tools=[flaky], prompt="p",
                           run_id="retry").result(timeout=10)
    assert (result.status, result.tool_calls) == ("final", 2), result.explanation
    check_finished(runner, result)
    assert seen == [(1, True), (2, True)]
    assert _dispatch_counts(runner, "retry") == {("c1", 1): 1, ("c1", 2): 1}
    still_serves(runner)


@pytest.mark.timeout(30)
def test_calls_queued_behind_max_parallel_are_recorded_before_they_start(
        runner: bl.Runner) -> None:
    seen: list[tuple[str, bool]] = []

    @bl.tool
    def step(ctx: bl.ToolContext) -> str:
        seen.append((ctx.call_id, ctx.attempt == 1 and _dispatched(runner, ctx)))
        return ctx.call_id

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall(c, "step", {}) for c in "abc"]),
                              bl.Final("done")])
    result = runner.submit(model=model, tools=[step], prompt="p", run_id="queued",
                           budget=bl.Budget(max_parallel=1)).result(timeout=10)
    assert (result.status, result.tool_calls) == ("final", 3), result.explanation
    check_finished(runner, result)
    assert seen == [("a", True), ("b", True), ("c", True)]
    assert _dispatch_counts(runner, "queued") == {("a", 1): 1, ("b", 1): 1, ("c", 1): 1}
    still_serves(runner)
