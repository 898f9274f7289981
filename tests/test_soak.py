"""The soak (issue 7): one Runner, thousands of mixed runs, nothing can wedge it.

Sync and async models and tools, nested runs from sync and async handlers, random Future
cancels and ``runner.cancel``, handlers stuck past their timeout, models that raise or have
the wrong signature. Afterwards: every Future settled, every run has a RunFinished and a
status, the thread count stayed under the cap, and ``replay`` of every run equals its
result. ``BOUNDLOOP_SOAK_RUNS`` sets the number of runs (default 5,000; the long variant,
marked ``soak``, runs 20,000).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.actors.workers import MAX_THREADS


def _tools(release: threading.Event) -> list[bl.Tool]:
    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        return text

    @bl.tool(read_only=True)
    async def aecho(text: str) -> str:
        await asyncio.sleep(0)
        return text

    @bl.tool(timeout_s=0.05)
    def stuck(text: str) -> str:
        release.wait(1.0)  # long past its timeout, but bounded
        return text

    @bl.tool(retry=bl.RetryPolicy(2, 0.0, (ValueError,)), idempotent=True)
    def flaky(text: str, ctx: bl.ToolContext) -> str:
        if ctx.attempt == 1:
            raise ValueError("first attempt fails")
        return text

    @bl.tool
    def delegate(text: str, ctx: bl.ToolContext) -> str:
        child = ctx.run_child(model=bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("k", "echo", {"text": text})]), bl.Final("child")]),
            tools=[echo], prompt=text, budget=bl.Budget(max_tool_calls=2))
        return child.status

    @bl.tool
    async def adelegate(text: str, ctx: bl.ToolContext) -> str:
        child = await ctx.arun_child(model=bl.ScriptedModel([bl.Final("child")]),
                                     prompt=text)
        return child.status

    return [echo, aecho, stuck, flaky, delegate, adelegate]


async def _async_model(history: list[Any], ctx: bl.ModelContext) -> Any:
    await asyncio.sleep(0)
    return bl.Final("async done")


async def _wrong_async(history: list[Any]) -> Any:  # one parameter too few
    return bl.Final("never")


def _wrong_sync() -> Any:
    return bl.Final("never")


def _model(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.05:
        return _wrong_async
    if kind < 0.08:
        return _wrong_sync
    if kind < 0.12:
        return bl.ScriptedModel([RuntimeError("the model broke")])
    if kind < 0.25:
        return _async_model
    name = rng.choice(["echo", "aecho", "echo", "aecho", "stuck", "flaky", "delegate",
                       "adelegate"])
    calls = [bl.ToolCall(f"c{i}", name, {"text": f"t{i}"}) for i in range(rng.randint(1, 2))]
    return bl.ScriptedModel([bl.CallTools(calls), bl.Final("done")])


def _soak(tmp_path: Path, runs: int) -> None:
    rng = random.Random(7)
    release = threading.Event()
    tools = _tools(release)
    peak = 0
    futures: list[tuple[str, Future[bl.RunResult], bool]] = []
    with bl.Runner(tmp_path / "j", sync=False, max_in_flight=100_000) as runner:
        try:
            for i in range(runs):
                run_id = f"soak-{i:05d}"
                f = runner.submit(model=_model(rng), tools=tools, prompt="go", run_id=run_id,
                                  budget=bl.Budget(max_tool_calls=6, deadline_s=5.0))
                fate = rng.random()
                cancelled = False
                if fate < 0.03:
                    cancelled = f.cancel()
                elif fate < 0.06:
                    runner.cancel(run_id, "soak")
                futures.append((run_id, f, cancelled))
                if i % 200 == 0:
                    peak = max(peak, threading.active_count())
                    # Keep a bounded window in flight so the soak measures churn, not a queue.
                    while sum(1 for _, g, _ in futures[-400:] if not g.done()) > 300:
                        time.sleep(0.005)
            results: dict[str, bl.RunResult] = {}
            for run_id, f, cancelled in futures:
                try:
                    results[run_id] = f.result(timeout=60)
                except CancelledError:
                    assert cancelled or f.cancelled()
                peak = max(peak, threading.active_count())
        finally:
            release.set()
        assert peak < 2 * MAX_THREADS + 40, peak
        journal = runner.journal
        top = [r for r in journal.runs() if r.startswith("soak-")]
        assert len(top) == runs
        statuses: dict[str, int] = {}
        for run_id in journal.runs():
            events = list(journal.events(run_id))
            finished = [e for e in events if isinstance(e, ev.RunFinished)]
            assert len(finished) == 1, (run_id, [type(e).__name__ for e in events])
            state = bl.replay(events)
            assert state.finished and state.status == finished[0].status
            statuses[state.status] = statuses.get(state.status, 0) + 1
            result = results.get(run_id)
            if result is not None:
                assert (state.status, state.model_steps, state.tool_calls,
                        state.transcript) == (result.status, result.model_steps,
                                              result.tool_calls, result.transcript), run_id
        for run_id, _, cancelled in futures:
            if cancelled:
                assert bl.replay(journal.events(run_id)).status in {"cancelled", "final",
                                                                    "model_error"}
        print("soak statuses", statuses, "peak threads", peak)
        # Every kind of ending the mix can produce showed up.
        assert {"final", "model_error", "cancelled"} <= set(statuses), statuses
        # The same Runner still serves.
        again = [runner.submit(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p")
                 for _ in range(100)]
        assert all(f.result(timeout=30).status == "final" for f in again)


def test_soak_bounded(tmp_path: Path) -> None:
    _soak(tmp_path, int(os.environ.get("BOUNDLOOP_SOAK_RUNS", "5000")))


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_soak_long(tmp_path: Path) -> None:
    _soak(tmp_path, 20_000)
