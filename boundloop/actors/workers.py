"""Where user code runs: bounded thread pools for sync callables, one asyncio loop for
``async def`` ones (so a thousand waiting async calls cost no threads)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Workers:
    """Thread pools for models and tools, and the event-loop thread that schedules them."""

    def __init__(self, model_threads: int = 32, tool_threads: int = 32) -> None:
        self.model_pool = ThreadPoolExecutor(model_threads, thread_name_prefix="boundloop-model")
        self.tool_pool = ThreadPoolExecutor(tool_threads, thread_name_prefix="boundloop-tool")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="boundloop-loop",
                                        daemon=True)
        self._thread.start()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the loop thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        """Await ``fn(*args, **kwargs)``: on the loop if it is async, else on ``pool``."""
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                getattr(fn, "__call__", None)):  # noqa: B004 - async callable objects
            return await fn(*args, **kwargs)
        result = await self.loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))
        if inspect.isawaitable(result):
            return await result
        return result

    async def _cancel_all(self) -> None:
        # Tasks of timed-out calls may still wait on their threads; cancel them so the
        # loop stops cleanly instead of destroying pending tasks.
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks(self.loop) if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop the loop and the pools (handlers still running are not waited for)."""
        if self.loop.is_running():
            try:
                self.spawn(self._cancel_all()).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing goes on regardless
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        self.model_pool.shutdown(wait=False, cancel_futures=True)
        self.tool_pool.shutdown(wait=False, cancel_futures=True)
