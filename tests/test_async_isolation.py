"""One run's blocking ``async def`` code cannot stretch another run's deadline (SPEC 1): the
async callables of runs started with ``run``/``submit`` run on a loop per run (workers.Loops),
and a loop still held by an abandoned call is handed to no other run."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import boundloop as bl
from boundloop.actors.workers import Loops, RunLoop


def test_a_blocking_async_model_does_not_starve_an_unrelated_async_run(tmp_path: Path) -> None:
    blocking, release = threading.Event(), threading.Event()

    async def blocker(history: list[Any], ctx: bl.ModelContext) -> Any:
        blocking.set()
        # Blocks whatever loop it runs on, as careless async code does: until the test has
        # seen the other run end (6 s at most), not a fixed 6 s the Runner's close waits out.
        release.wait(6)
        return bl.Final("late")

    async def quick(history: list[Any], ctx: bl.ModelContext) -> Any:
        await asyncio.sleep(0.01)  # suspended on its loop: a shared blocked loop keeps it
        if sum(m.kind == "tool_result" for m in history) >= 3:
            return bl.Final("done")
        return bl.CallTools([bl.ToolCall(f"c{len(history)}", "echo", {"text": "x"})])

    @bl.tool
    async def echo(text: str) -> str:
        """Echoes, after a wait on its loop."""
        await asyncio.sleep(0.01)
        return text

    with bl.Runner(tmp_path / "j") as runner:
        try:
            stuck = runner.submit(model=blocker, prompt="p",
                                  budget=bl.Budget(deadline_s=1.0))
            assert blocking.wait(5)
            started = time.monotonic()
            result = runner.run(model=quick, tools=[echo], prompt="p",
                                budget=bl.Budget(deadline_s=4.0, max_model_steps=6))
            took = time.monotonic() - started
            assert result.status == "final", result.explanation
            assert result.tool_calls == 3
            assert took < 2.0, took  # well within its deadline, while the other loop sleeps
            own = stuck.result(timeout=5)
            assert own.status == "limit_exceeded" and own.exhausted_limit == "deadline"
        finally:
            release.set()


def test_a_loop_held_by_an_abandoned_call_goes_to_no_other_run() -> None:
    loops = Loops(cap=2)
    release = threading.Event()

    async def hold() -> None:
        release.wait(10)  # a coroutine that blocks its loop

    async def where() -> threading.Thread:
        return threading.current_thread()

    try:
        first = RunLoop()
        blocked = loops.start(first, hold())
        loops.release(first)  # its run ended (abandoned at its deadline), the call goes on
        second = RunLoop()
        thread = loops.start(second, where()).result(timeout=5)
        assert first.held is not None and second.held is not None
        assert second.held is not first.held and thread is second.held.thread
        assert loops.threads == 2
        # Past the cap, a run shares the loop serving the fewest runs and calls: not the
        # blocked one.
        third = RunLoop()
        assert loops.start(third, where()).result(timeout=5) is thread
        release.set()
        blocked.result(timeout=5)
        loops.release(second)
        loops.release(third)
        ends = time.monotonic() + 5
        while first.held.calls and time.monotonic() < ends:  # its done callback may lag
            time.sleep(0.01)
        # Once its call ended, the first loop is idle again and is reused, not a new thread.
        fourth = RunLoop()
        loops.start(fourth, where()).result(timeout=5)
        assert fourth.held is first.held and loops.threads == 2
    finally:
        release.set()
        loops.close()


def test_past_the_cap_a_new_loop_starts_only_while_every_loop_is_stuck() -> None:
    loops = Loops(cap=1, limit=2)
    release = threading.Event()

    async def hold() -> None:
        release.wait(10)

    async def where() -> threading.Thread:
        return threading.current_thread()

    try:
        first = RunLoop()
        blocked = loops.start(first, hold())
        loops.release(first)
        second = RunLoop()
        loops.start(second, where()).result(timeout=5)
        assert second.held is not first.held and loops.threads == 2
        third = RunLoop()  # at the limit: shares the loop no ended run's call holds
        loops.start(third, where()).result(timeout=5)
        assert third.held is second.held and loops.threads == 2
        release.set()
        blocked.result(timeout=5)
        loops.release(second)
        loops.release(third)
        ends = time.monotonic() + 5
        while loops.threads > 1 and time.monotonic() < ends:
            time.sleep(0.01)
        assert loops.threads == 1  # the loop past the cap ended once idle
    finally:
        release.set()
        loops.close()


def test_a_run_started_with_arun_keeps_the_callers_loop() -> None:
    loops = Loops(cap=2)

    async def where() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def main() -> None:
        mine = asyncio.get_running_loop()
        run = RunLoop(mine)
        got = await asyncio.wrap_future(loops.start(run, where()))
        assert got is mine and run.held is None and loops.threads == 0

    try:
        asyncio.run(main())
    finally:
        loops.close()
