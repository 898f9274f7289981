"""The pools' own Future and the async test, as the loop relies on them (see workers.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from unittest import mock

import pytest

from boundloop.actors.workers import Pool, PoolFuture, is_async, outcome


@pytest.fixture
def pool() -> Any:
    p = Pool(2, "test-pool")
    yield p
    p.shutdown()


def test_a_pool_call_returns_through_its_future(pool: Pool) -> None:
    seen: list[tuple[Any, BaseException | None]] = []
    f = pool.submit(lambda a, b: a + b, 2, b=3)
    f.add_done_callback(lambda done: seen.append(outcome(done)))
    assert f.result(timeout=5) == 5
    assert f.done() and not f.cancelled() and not f.running() and f.exception() is None
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen == [(5, None)]
    # A callback added after the end runs at once, on the caller's thread.
    late: list[int] = []
    f.add_done_callback(lambda done: late.append(threading.get_ident()))
    assert late == [threading.get_ident()]


def test_a_pool_call_that_raises_gives_its_exception_and_a_bad_callback_stops_nothing(
        pool: Pool) -> None:
    def boom() -> None:
        raise KeyError("x")

    gate = threading.Event()
    f = pool.submit(lambda: (gate.wait(5), boom()))
    after: list[str] = []
    f.add_done_callback(lambda done: 1 / 0)  # type: ignore[arg-type,return-value]
    f.add_done_callback(lambda done: after.append("ran"))
    with pytest.raises(TimeoutError):
        f.result(timeout=0.01)  # not done yet: waiting is bounded
    gate.set()
    assert isinstance(f.exception(timeout=5), KeyError)
    with pytest.raises(KeyError):
        f.result()
    assert after == ["ran"]
    value, exc = outcome(f)
    assert value is None and isinstance(exc, KeyError)
    assert not f.cancel()  # a pool call is never cancelled
    # The pool goes on serving.
    assert pool.submit(lambda: "next").result(timeout=5) == "next"


def test_outcome_of_a_pending_pool_future_waits_for_it() -> None:
    f = PoolFuture()
    threading.Timer(0.05, lambda: f.set_result("late")).start()
    assert outcome(f) == ("late", None)


def test_is_async_finds_async_methods_and_objects_as_inspect_does() -> None:
    class Model:
        async def __call__(self, history: Any, ctx: Any) -> Any:
            return None

        async def step(self) -> None:
            return None

        def sync_step(self) -> None:
            return None

    m = Model()
    assert is_async(m) and is_async(m.step) and not is_async(m.sync_step)

    class Sync:
        def __call__(self) -> None:
            return None

    s = Sync()
    assert not is_async(s)

    async def coroutine_fn() -> None:
        return None

    # An __call__ set on the instance itself is not what Python calls, but inspect looks at
    # it: the answer stays inspect's.
    s.__dict__["__call__"] = coroutine_fn
    assert is_async(s) == asyncio.iscoroutinefunction(s.__call__)
    assert is_async(mock.AsyncMock()) and not is_async(mock.MagicMock())


def test_is_async_asks_inspect_of_proxies_subclasses_and_marked_functions() -> None:
    """Found by review: a proxy forwarding every attribute to an async callable was judged
    from its own class's sync __call__ (so an arun run's model left the caller's loop)."""
    import sys

    import boundloop as bl

    class Proxy:
        def __init__(self, target: Any) -> None:
            object.__setattr__(self, "_target", target)

        def __getattribute__(self, name: str) -> Any:
            return getattr(object.__getattribute__(self, "_target"), name)

        def __call__(self, *args: Any) -> Any:
            return object.__getattribute__(self, "_target")(*args)

    class AsyncModel:
        async def __call__(self, history: Any, ctx: Any) -> Any:
            return bl.Final("x")

    assert is_async(Proxy(AsyncModel()))
    assert not is_async(bl.ScriptedModel([bl.Final("x")]))  # boundloop's own: the fast path

    class AsyncScripted(bl.ScriptedModel):
        async def __call__(self, history: Any, ctx: Any) -> Any:  # type: ignore[override]
            return bl.Final("x")

    assert is_async(AsyncScripted([]))
    if sys.version_info >= (3, 12):
        import inspect

        def returns_a_coroutine() -> Any:
            return asyncio.sleep(0)

        assert is_async(inspect.markcoroutinefunction(returns_a_coroutine))  # type: ignore[attr-defined]


def test_a_pool_future_has_a_repr_and_one_outcome() -> None:
    from concurrent.futures import InvalidStateError

    f = PoolFuture()
    assert "PENDING" in repr(f)
    f.set_result(1)
    assert "FINISHED" in repr(f)
    with pytest.raises(InvalidStateError):
        f.set_result(2)
    with pytest.raises(InvalidStateError):
        f.set_exception(KeyError("x"))
    assert f.result() == 1


def test_a_thread_the_pool_starts_does_not_hold_up_calls_ending_on_its_other_threads(
        pool: Pool) -> None:
    """Thread.start() waits until the new thread runs, which takes milliseconds under load.
    The pool used to start compensating threads under its lock, which every thread ending a
    call takes: in the soak, the executor actor waited seconds in compensate() and retried
    calls were reported seconds late, past their runs' deadlines."""
    starting, go_on = threading.Event(), threading.Event()
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name.startswith("test-pool"):
            starting.set()
            go_on.wait(10)
        real_start(self)

    held = threading.Event()
    with mock.patch.object(threading.Thread, "start", slow_start):
        waiter = pool.submit(lambda: pool_blocking(pool, held))
        assert starting.wait(5), "the pool did not start a thread to compensate the waiter"
        # While that thread is being started, a call runs and ends on the pool's other
        # thread, which takes the pool's lock to do so.
        t0 = time.monotonic()
        assert pool.submit(lambda: 42).result(timeout=15) == 42
        took = time.monotonic() - t0
        go_on.set()
    held.set()
    assert waiter.result(timeout=5) is None
    assert took < 2, f"calls waited {took:.1f} s for a thread being started"
    assert pool.threads >= 2


def pool_blocking(pool: Pool, held: threading.Event) -> None:
    with pool.blocking():
        held.wait(10)
