"""Streaming in the provider adapters (``stream=True``): what the adapters share.

Nothing here imports a provider SDK. An adapter turns each provider event into a text delta
(or none) and its own bookkeeping; the drivers below do the rest, the same way for every
provider:

* each text delta goes to the application's ``on_text(delta, ctx)`` callback, in order;
* the output tokens are counted as they stream (the provider's running count where it gives
  one, else about 4 characters a token of streamed text, tool-argument JSON and thinking),
  and once the turn has said more than the run has left (``ctx.remaining``'s output tokens,
  or its total tokens less the step's input) the stream is closed: the HTTP request is cut;
* a cancelled run (``ctx.cancel``) cuts the stream too, and so does its deadline
  (``ctx.deadline``): a sync stream is checked after each event (and each read is bounded
  by the request's timeout), an async one is raced against both.

Contents:
    TextDelta       one piece of streamed text, with its run id and step
    TextStream      an ``on_text`` callback that is also an async iterator of TextDeltas
    StreamMeter     the output tokens a streamed turn has used, and the room it has
    Cut             why a stream was cut (the limit, or cancellation), for the adapter
    pump / apump    drive a sync / async event stream through the meter and the callback
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec

from boundloop.core.budget import Price, Usage, priced
from boundloop.messages import Malformed
from boundloop.models._common import DeadlinePassed

if TYPE_CHECKING:
    from boundloop.context import ModelContext

__all__ = ["TextDelta", "TextStream"]

E = TypeVar("E")

#: The characters of streamed text counted as one output token when the provider gives no
#: running count (the rule of thumb the runner's default reservation uses too).
CHARS_PER_TOKEN = 4

#: What ``on_text`` is: ``on_text(delta, ctx)``; an async model's callback may be async.
OnText = Callable[[str, "ModelContext"], Any]


class TextDelta(msgspec.Struct, frozen=True):
    """One piece of text a streaming model said (what a :class:`TextStream` yields).

    Attributes:
        text: the new text, to append to what came before in the same step.
        run_id: the run it belongs to.
        step: the model step (1-based): a new step is a new turn of the model (after its
            tool calls ran, or after a malformed turn).
    """

    text: str
    run_id: str
    step: int


class TextStream:
    """An ``on_text`` callback for the streaming adapters that is also an async iterator of
    the :class:`TextDelta` s it receives, for ``runner.arun`` users::

        text = bl.TextStream()
        model = AnthropicModel(anthropic.AsyncAnthropic(), "claude-sonnet-4-5",
                               stream=True, on_text=text)

        async def run() -> bl.RunResult:
            try:
                return await runner.arun(model=model, prompt="...")
            finally:
                text.close()            # ends the ``async for`` below

        task = asyncio.create_task(run())
        async for delta in text:
            print(delta.text, end="", flush=True)
        result = await task

    Calling it never blocks and is thread-safe (a sync model streams on a runner thread);
    deltas are buffered until they are read, in order. Iterate it once, on one event loop.
    ``close()`` ends the iteration once every buffered delta has been read; deltas given
    after ``close()`` are dropped.
    """

    def __init__(self) -> None:
        self._items: collections.deque[TextDelta] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    def __call__(self, delta: str, ctx: ModelContext) -> None:
        """Buffer ``delta`` of the step ``ctx`` (the ``on_text`` signature)."""
        with self._lock:
            if self._closed:
                return
            self._items.append(TextDelta(delta, ctx.run_id, ctx.step))
        self._wake()

    def close(self) -> None:
        """End the iteration once the buffered deltas have been read (idempotent)."""
        with self._lock:
            self._closed = True
        self._wake()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _wake(self) -> None:
        with self._lock:
            loop, waiter = self._loop, self._waiter
        if loop is None or waiter is None:
            return
        try:
            loop.call_soon_threadsafe(_settle, waiter)
        except RuntimeError:  # the consumer's loop is closed: nobody is waiting
            pass

    def __aiter__(self) -> AsyncIterator[TextDelta]:
        return self

    async def __anext__(self) -> TextDelta:
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise StopAsyncIteration
                self._loop = asyncio.get_running_loop()
                self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                with self._lock:
                    self._waiter = None


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TextCallbackError(RuntimeError):
    """The application's ``on_text`` callback raised: the step ends as a model error."""


# --- counting --------------------------------------------------------------------------------

class StreamMeter:
    """The output tokens a streamed turn has used, and how many the run lets it use.

    ``room`` is the fewest of: the run's remaining output tokens; its remaining total tokens
    less the step's input (as the provider reported it when the stream started, else
    estimated from the request's size); and, with a ``price`` that charges output, the
    output tokens its remaining cost buys once the input is paid. ``spent`` is True once
    the output counted is above the room: the loop will then find that limit exceeded by
    the usage of the cut turn.
    """

    def __init__(self, ctx: ModelContext, request: Mapping[str, Any],
                 price: Price | str | None = None) -> None:
        # A catalogue price ("auto") is the runner's to apply: the cut is by tokens only.
        price = price if isinstance(price, Price) else None
        remaining = ctx.remaining
        self.output_left: int | None = remaining.output_tokens
        self.total_left: int | None = remaining.total_tokens
        self.cost_left: float | None = remaining.cost if price is not None and \
            price.output_per_mtok > 0 else None
        self.price = price
        self._request = request
        self._input_estimate: int | None = None
        #: All input the provider reported when the stream started (Anthropic), else None.
        self.input_reported: Usage | None = None
        #: The provider's own running count of output tokens, once it gave one.
        self.output_reported: int | None = None
        self.chars = self._chars_at_report = 0
        #: Whether a text delta reached the application (a retry would repeat it).
        self.delivered = False

    @property
    def bounded(self) -> bool:
        """Whether the run has any output, total token or (priced) cost limit at all."""
        return self.output_left is not None or self.total_left is not None or \
            self.cost_left is not None

    def input_estimate(self) -> int:
        """The step's input, estimated as ⌈bytes of the request as JSON / 4⌉."""
        if self._input_estimate is None:
            raw = json.dumps(self._request, default=str, ensure_ascii=False).encode()
            self._input_estimate = math.ceil(len(raw) / CHARS_PER_TOKEN)
        return self._input_estimate

    def input_tokens(self) -> int:
        """All input of the step: reported, else estimated."""
        if self.input_reported is not None:
            return self.input_reported.all_input_tokens
        return self.input_estimate()

    def reset(self) -> None:
        """Forget what an earlier attempt of the request streamed (before a retry)."""
        self.input_reported = None
        self.output_reported = None
        self.chars = self._chars_at_report = 0

    def count(self, text: str) -> None:
        """Count streamed output (text, tool-argument JSON, thinking)."""
        self.chars += len(text)

    def report(self, output_tokens: Any) -> None:
        """The provider's running count of output tokens (cumulative)."""
        if isinstance(output_tokens, int) and not isinstance(output_tokens, bool):
            self.output_reported = max(output_tokens, 0)
            self._chars_at_report = self.chars

    def output_tokens(self) -> int:
        """The output so far: the provider's last running count plus ⌈characters streamed
        since / 4⌉, else ⌈characters / 4⌉."""
        if self.output_reported is not None:
            return self.output_reported + math.ceil(
                (self.chars - self._chars_at_report) / CHARS_PER_TOKEN)
        return math.ceil(self.chars / CHARS_PER_TOKEN)

    def rooms(self) -> dict[str, int]:
        """The output tokens each bounded limit lets this turn use, by the limit's name
        (``output_tokens``, ``total_tokens``, ``cost``)."""
        rooms: dict[str, int] = {}
        if self.output_left is not None:
            rooms["output_tokens"] = self.output_left
        if self.total_left is not None:
            rooms["total_tokens"] = self.total_left - self.input_tokens()
        if self.cost_left is not None and self.price is not None:
            paid = self.price.cost(self._input_usage())
            per_token = self.price.output_per_mtok / 1_000_000
            rooms["cost"] = math.floor((self.cost_left - paid) / per_token)
        return rooms

    def room(self) -> int | None:
        """The output tokens the run lets this turn use; None when unbounded."""
        rooms = self.rooms()
        return min(rooms.values()) if rooms else None

    def spent(self) -> bool:
        """Whether the turn has said more than the run lets it."""
        if not self.bounded:
            return False
        room = self.room()
        return room is not None and self.output_tokens() > room

    def _input_usage(self) -> Usage:
        return self.input_reported if self.input_reported is not None else \
            Usage(input_tokens=self.input_estimate())

    def usage(self, price: Price | str | None) -> Usage:
        """The cut turn's usage: the input as reported (else estimated) and the output
        counted so far, priced by ``price`` (a table; the runner prices ``"auto"``)."""
        return priced(msgspec.structs.replace(self._input_usage(),
                                              output_tokens=self.output_tokens(),
                                              cost=None),
                      price if isinstance(price, Price) else None)

    def cut(self, price: Price | str | None) -> Malformed:
        """The turn cut at the run's limit: a ``bl.Malformed`` naming the limit, with the
        usage so far (see ``usage``), so the run ends ``limit_exceeded`` at that limit."""
        rooms = self.rooms()
        limit = min(rooms, key=lambda name: rooms[name]) if rooms else "output_tokens"
        return Malformed(self.cut_reason(), usage=self.usage(price), limit=limit)

    def cut_reason(self) -> str:
        """The malformed reason of a turn cut at the run's limit, naming the limit."""
        rooms = self.rooms()
        limit = min(rooms, key=lambda name: rooms[name]) if rooms else "output_tokens"
        room = max(rooms.get(limit, 0), 0)
        what = {"output_tokens": f"the run's remaining output tokens ({room})",
                "total_tokens": f"the {room} output tokens its total-token limit left",
                "cost": f"the {room} output tokens its cost limit left"}[limit]
        how = "as the provider counted them" if self.output_reported is not None else \
            f"estimated at {CHARS_PER_TOKEN} characters a token"
        return (f"the model's output was cut while it streamed: {what} were spent (about "
                f"{self.output_tokens()} tokens streamed, {how})")


def capped_max_tokens(declared: int, ctx: ModelContext, *, floor: int = 1) -> int:
    """The output maximum to send: the declared one, at most one token past the run's
    remaining output tokens (so a turn that would overrun them is stopped by the provider
    just past the limit, and the loop ends the run ``limit_exceeded``), and at least
    ``floor`` (the smallest the API accepts)."""
    left = ctx.remaining.output_tokens
    if left is None or left + 1 >= declared:
        return declared
    return min(declared, max(left + 1, floor))


# --- driving a stream ------------------------------------------------------------------------

#: Why a stream was cut before its end.
Cut = Literal["limit", "cancelled"]


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _deadline_error() -> DeadlinePassed:
    return DeadlinePassed("the run's deadline passed while the model streamed its answer; "
                          "the stream was cut")


def _deliver(on_text: OnText | None, text: str, ctx: ModelContext, meter: StreamMeter) -> Any:
    if on_text is None or not text:
        return None
    meter.delivered = True
    try:
        return on_text(text, ctx)
    except Exception as exc:
        raise TextCallbackError(f"the on_text callback raised {type(exc).__name__}: "
                                f"{exc}") from exc


def pump(events: Iterable[E], read: Callable[[E], str | None], ctx: ModelContext,
         meter: StreamMeter, on_text: OnText | None) -> Cut | None:
    """Read ``events`` to their end (None), or until the stream must be cut: the run's
    token room is spent (``"limit"``) or the run was cancelled (``"cancelled"``). ``read``
    updates the adapter's bookkeeping and the meter, and returns the event's text delta.
    The caller closes the stream (leaving its ``with`` block cuts the HTTP request).

    Raises:
        DeadlinePassed: the deadline passed while the stream was read.
        TextCallbackError: ``on_text`` raised.
    """
    for event in events:
        before = meter.chars
        text = read(event)
        if ctx.cancel.cancelled:
            return "cancelled"
        if _passed(ctx.deadline):
            raise _deadline_error()
        if text:
            _deliver(on_text, text, ctx, meter)
        # Checked only after output (not on the provider's closing events: a turn that
        # ended is returned whole, and the loop charges its reported usage).
        if meter.chars != before and meter.spent():
            return "limit"
    return None


async def apump(events: AsyncIterator[E], read: Callable[[E], str | None],
                ctx: ModelContext, meter: StreamMeter, on_text: OnText | None) -> Cut | None:
    """:func:`pump` for an async stream: ``on_text`` may return an awaitable (it is
    awaited), and each wait for the next event is raced against the deadline and
    cancellation, so a stalled stream is cut when either comes."""
    loop = asyncio.get_running_loop()
    cancelled: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(_settle, cancelled)
        except RuntimeError:  # the loop closed: nobody waits any more
            pass

    stop = ctx.cancel.on_cancel(wake)
    try:
        while True:
            if ctx.cancel.cancelled:
                return "cancelled"
            timeout = None if ctx.deadline is None else ctx.deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise _deadline_error()
            step: asyncio.Future[Any] = asyncio.ensure_future(events.__anext__())
            racers: set[asyncio.Future[Any]] = {step, cancelled}
            done, _ = await asyncio.wait(racers, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                step.cancel()
                try:
                    await step
                except (asyncio.CancelledError, StopAsyncIteration, Exception):
                    pass
                if cancelled in done:
                    return "cancelled"
                raise _deadline_error()
            try:
                event = step.result()
            except StopAsyncIteration:
                return None
            before = meter.chars
            text = read(event)
            if ctx.cancel.cancelled:
                return "cancelled"
            if _passed(ctx.deadline):
                raise _deadline_error()
            if text:
                result = _deliver(on_text, text, ctx, meter)
                if inspect.isawaitable(result):
                    try:
                        await result
                    except Exception as exc:
                        raise TextCallbackError(
                            f"the on_text callback raised {type(exc).__name__}: "
                            f"{exc}") from exc
            if meter.chars != before and meter.spent():
                return "limit"
    finally:
        stop()
        if not cancelled.done():
            cancelled.cancel()


def stream_transient(meter: StreamMeter, transient: Callable[[BaseException], bool]
                     ) -> Callable[[BaseException], bool]:
    """``transient``, except that nothing is retried once text reached the application (a
    retry would send it the same text again)."""
    def check(exc: BaseException) -> bool:
        return not meter.delivered and not isinstance(exc, TextCallbackError) and \
            transient(exc)
    return check


def check_on_text(on_text: Any, *, is_async: bool, name: str) -> OnText | None:
    """``on_text`` when it is a usable callback for a sync (or ``is_async``) model."""
    from boundloop.errors import ConfigError

    if on_text is None:
        return None
    if not callable(on_text):
        raise ConfigError(f"{name}: on_text must be a callable (delta, ctx), got "
                          f"{type(on_text).__name__}")
    method = type(on_text).__dict__.get("__call__")
    if not is_async and (inspect.iscoroutinefunction(on_text) or
                         inspect.iscoroutinefunction(method)):
        raise ConfigError(f"{name}: an async on_text needs an async client (a sync model "
                          "cannot await it); give a plain function, or a bl.TextStream")
    checked: OnText = on_text
    return checked


def cancelled_reason() -> str:
    """The malformed reason of a stream cut because the run was cancelled (the loop
    discards the response and ends the run ``cancelled``)."""
    return "the run was cancelled while the model streamed its answer; the stream was cut"

