"""The tool executor: runs handlers with timeouts, ``max_parallel``, retries, reconcile."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pykka

from boundloop.actors.messages import DispatchBatch
from boundloop.actors.workers import Workers
from boundloop.loop import Attempt, Dispatch, Outcome, Planned, Reconcile
from boundloop.tools import ToolContext


class ExecutorActor(pykka.ThreadingActor):
    """Performs Dispatch effects; the calls run on the workers, never on this thread."""

    def __init__(self, workers: Workers) -> None:
        super().__init__()
        self.workers = workers

    def on_receive(self, message: Any) -> Any:
        future: Any
        match message:
            case DispatchBatch(dispatch=Reconcile(planned=planned), reply=reply):
                future = self.workers.spawn(_reconcile(self.workers, planned))
            case DispatchBatch(dispatch=Dispatch() as dispatch, reply=reply):
                future = self.workers.spawn(run_batch(self.workers, dispatch))
            case _:
                return None

        def done(f: Any) -> None:
            exc = f.exception()
            reply(None if exc else f.result(), exc)

        future.add_done_callback(done)
        return None


async def run_batch(workers: Workers, d: Dispatch) -> list[Outcome]:
    """Run a batch, at most ``max_parallel`` at once, and return outcomes in model order."""
    sem = asyncio.Semaphore(d.max_parallel or max(len(d.calls), 1))
    allowance = [d.retry_allowance]

    async def one(p: Planned) -> Outcome:
        async with sem:
            return await run_call(workers, d, p, allowance)

    return list(await asyncio.gather(*(one(p) for p in d.calls)))


def _why_not(d: Dispatch) -> str | None:
    if d.cancel.cancelled:
        return "cancelled"
    if d.deadline is not None and d.clock.monotonic() >= d.deadline:
        return "deadline"
    return None


async def _reconcile(workers: Workers, p: Planned) -> tuple[bool | None, Any]:
    if p.tool.reconcile is None:
        return None, None
    try:
        value = await asyncio.wait_for(
            workers.call(workers.tool_pool, p.tool.reconcile, p.idempotency_key),
            p.tool.timeout_s)
    except Exception:  # noqa: BLE001 - reconcile raising means it cannot tell
        return None, None
    return (False, None) if value is None else (True, value)


async def run_call(workers: Workers, d: Dispatch, p: Planned, allowance: list[int]) -> Outcome:
    """Every attempt of one call; the first is skipped when cancellation or the deadline
    came first."""
    outcome = Outcome(p.execution_id)
    tool, policy = p.tool, p.tool.retry
    attempt = p.first_attempt
    while True:
        why = _why_not(d)
        if why is not None:
            if not outcome.attempts:
                outcome.skipped = why
            return outcome
        timeout = tool.timeout_s
        if d.deadline is not None:
            left = max(d.deadline - d.clock.monotonic(), 0.001)
            timeout = left if timeout is None else min(timeout, left)
        child = None if d.run_child is None or d.parent is None else \
            functools.partial(d.run_child, d.parent, p.execution_id)
        ctx = ToolContext(p.run_id, p.call_id, p.execution_id, p.idempotency_key, attempt,
                          d.deadline, d.cancel, child)
        started = time.perf_counter()
        task = asyncio.ensure_future(
            workers.call(workers.tool_pool, tool.handler, **tool.bind(p.kwargs, ctx)))
        finished, _ = await asyncio.wait({task}, timeout=timeout)
        latency = time.perf_counter() - started
        retryable = False
        if not finished:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            att = Attempt(attempt, "timeout", latency_s=latency, timeout_s=timeout or 0.0,
                          error=f"the call timed out after {timeout:.3g}s; whether it took "
                                "effect is not known")
            att.reconciled, att.reconciled_value = await _reconcile(workers, p)
            outcome.attempts.append(att)
            if att.reconciled is True:
                return outcome
            retryable = policy is not None and issubclass(TimeoutError, policy.retry_on) and (
                att.reconciled is False or tool.idempotent)
        else:
            exc = task.exception()
            if exc is None:
                outcome.attempts.append(Attempt(attempt, "ok", task.result(), latency_s=latency))
                return outcome
            outcome.attempts.append(Attempt(attempt, "error", error=f"{type(exc).__name__}: {exc}",
                                            category=type(exc).__name__, latency_s=latency))
            retryable = policy is not None and isinstance(exc, policy.retry_on)
        if policy is None or not retryable or attempt - p.first_attempt + 1 >= policy.max_attempts \
                or allowance[0] <= 0:
            return outcome
        delay = policy.delay(attempt + 1)
        if d.deadline is not None and d.clock.monotonic() + delay >= d.deadline:
            return outcome
        if _why_not(d) is not None:
            return outcome
        allowance[0] -= 1
        if delay:
            await asyncio.sleep(delay)
        attempt += 1
