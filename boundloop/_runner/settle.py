"""Settling a run's Future, and awaiting it from asyncio."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, InvalidStateError

from boundloop.cancel import CancelToken
from boundloop.errors import RunnerClosed
from boundloop.results import RunResult


async def _await_run(future: Future[RunResult], token: CancelToken) -> RunResult:
    """Await a run's Future; a cancelled task cancels the run and waits for it to end."""
    waiting = asyncio.wrap_future(future)
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        token.cancel("the task awaiting the run was cancelled")
        while not waiting.done():
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                continue  # cancelled again: the run is ending already; keep waiting
            except Exception:  # noqa: BLE001 - the run ended; the task is cancelled anyway
                break
        raise


def _settle(future: Future[RunResult], result: RunResult) -> None:
    try:
        if not future.done():
            future.set_result(result)
    except InvalidStateError:
        pass  # the caller cancelled it meanwhile


def _fail(future: Future[RunResult], exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass  # the caller cancelled it meanwhile


def _chain(inner: Future[RunResult], out: Future[RunResult]) -> None:
    """Settle ``out`` as ``inner`` ended."""
    if inner.cancelled():
        _settle_closed(out)
    elif inner.exception() is not None:
        try:
            out.set_exception(inner.exception())
        except InvalidStateError:
            pass
    else:
        _settle(out, inner.result())


def _settle_closed(future: Future[RunResult]) -> None:
    try:
        if not future.done():
            future.set_exception(RunnerClosed(
                "the runner closed before the run ended; it stays open in the journal: "
                "recover() and resume() it from another runner"))
    except InvalidStateError:
        pass
