"""SPEC 1 "Async use": `async with Runner`, `await runner.arun(...)`, `aresume`; async
callables run on the caller's loop; cancelling the awaiting task cancels the run."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev


def test_500_concurrent_runs_share_an_app_level_semaphore(tmp_path: Path) -> None:
    async def main() -> tuple[list[bl.RunResult], int, set[int]]:
        gate = asyncio.Semaphore(20)  # bound to this loop: a foreign loop could not use it
        loop_ids: set[int] = set()
        busy = peak = 0

        @bl.tool(read_only=True)
        async def fetch(n: int) -> int:
            nonlocal busy, peak
            loop_ids.add(id(asyncio.get_running_loop()))
            async with gate:
                busy += 1
                peak = max(peak, busy)
                await asyncio.sleep(0.01)
                busy -= 1
            return n * 2

        async def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
            loop_ids.add(id(asyncio.get_running_loop()))
            if ctx.step == 1:
                return bl.CallTools([bl.ToolCall("c1", "fetch", {"n": 1}),
                                     bl.ToolCall("c2", "fetch", {"n": 2})])
            return bl.Final("done")

        async with bl.Runner(tmp_path / "j", sync=False) as runner:
            results = await asyncio.gather(*[
                runner.arun(model=model, tools=[fetch], prompt=f"p{i}") for i in range(500)])
            # The same Runner serves sync callers too, meanwhile.
            sync = await asyncio.to_thread(
                runner.run, model=bl.ScriptedModel([bl.Final("sync")]), prompt="s")
            assert sync.status == "final"
            for r in results[:20]:
                assert bl.replay(runner.journal.events(r.run_id)).status == "final"
        return results, peak, loop_ids

    loop = asyncio.new_event_loop()
    try:
        results, peak, loop_ids = loop.run_until_complete(main())
        assert loop_ids == {id(loop)}  # every async callable ran on the caller's loop
    finally:
        loop.close()
    assert [r.status for r in results] == ["final"] * 500
    assert all((r.model_steps, r.tool_calls) == (2, 2) for r in results)
    assert all(r.transcript[2] == bl.ToolResultMessage("c1", "ok", 2) for r in results)
    assert 1 < peak <= 20


def test_cancelling_the_awaiting_task_cancels_the_run(tmp_path: Path) -> None:
    async def main() -> tuple[str, list[ev.Event]]:
        started = asyncio.Event()

        @bl.tool
        async def slow(ctx: bl.ToolContext) -> str:
            started.set()
            await asyncio.sleep(0.3)
            return "late"

        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("a", "slow", {})]),
                                  bl.Final("never")])
        async with bl.Runner(tmp_path / "j") as runner:
            task = asyncio.create_task(runner.arun(model=model, tools=[slow], prompt="p",
                                                   run_id="cancel-me"))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            events = list(runner.journal.events("cancel-me"))  # it has ended already
            again = await runner.arun(model=bl.ScriptedModel([bl.Final("ok")]), prompt="q")
            return again.status, events

    status, events = asyncio.run(main())
    assert status == "final"
    finished = [e for e in events if isinstance(e, ev.RunFinished)]
    assert [(e.status, "awaiting the run was cancelled" in e.explanation)
            for e in finished] == [("cancelled", True)]
    assert any(isinstance(e, ev.CallSucceeded) for e in events)  # the handler in flight ended


def test_aresume_runs_on_the_callers_loop(tmp_path: Path) -> None:
    where = tmp_path / "j"
    with bl.Runner(where) as first:
        blocked = threading.Event()

        @bl.tool(irreversible=True, timeout_s=0.05)
        def ship() -> str:
            blocked.wait(2)
            return "shipped"

        result = first.run(model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("s", "ship", {})]),
                                                   bl.Final("x")]),
                           tools=[ship], prompt="p", run_id="r")
        blocked.set()
        assert result.status == "needs_review"
        first.resolve("r", result.unresolved[0].execution_id, "succeeded", note="checked")

    async def main() -> bl.RunResult:
        seen: list[int] = []

        async def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
            seen.append(id(asyncio.get_running_loop()))
            return bl.Final("resumed")

        async with bl.Runner(where) as runner:
            out = await runner.aresume("r", model=model)
        assert seen == [id(asyncio.get_running_loop())]
        return out

    resumed = asyncio.run(main())
    assert (resumed.status, resumed.model_steps) == ("final", 2)


def test_a_closed_caller_loop_ends_the_run_instead_of_hanging(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()

    async def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
        return bl.Final("never")

    with bl.Runner(tmp_path / "j") as runner:
        spec = runner._spec(model, (), "p", None, None, None, "closed", None, loop=loop)
        loop.close()
        result = runner._start(spec, 0).result(timeout=10)
        assert result.status == "model_error" and "closed" in result.explanation
