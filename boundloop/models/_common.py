"""Helpers shared by the provider adapters (SPEC 13).

Nothing here imports a provider SDK: each adapter imports its own with :func:`require_sdk`,
and passes the SDK-specific parts (which errors are transient, how to read headers) to the
generic helpers below. Every function is small and stable: adapters in other modules import
them, so signatures are only ever extended (new keyword arguments with defaults), never
changed.

Contents:
    require_sdk          import an optional SDK, or ConfigError naming the extra
    request_timeout      the per-request timeout: the time left before the deadline
    retry_after_s        the delay a response asks for (``retry-after-ms``, ``Retry-After``)
    transient_status     whether an HTTP status is worth retrying (408, 409, 429, 5xx)
    call_with_retry      run a request, retrying transient errors before the deadline
    acall_with_retry     the same, for an ``async`` request
    provider_schema      a tool's JSON Schema with ``$ref`` inlined and an object root
    safe_tool_name       a tool name within ``^[a-zA-Z0-9_-]{1,64}$``
    ToolNames            the mapping between tool names and provider-safe names
    group_history        the history as provider turns (user text, final text, tool steps)
    result_text          a tool result as the text a provider is sent
    parse_arguments      tool arguments from JSON text (the raw string when not JSON)
    make_usage           a bl.Usage from provider counts, priced
    malformed            a bl.Malformed response (a turn without a usable answer)
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import email.utils
import hashlib
import importlib
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from boundloop.core.budget import Price, Usage, priced
from boundloop.errors import ConfigError
from boundloop.messages import Malformed, ResponseInfo

if TYPE_CHECKING:
    from boundloop.cancel import CancelToken
    from boundloop.tools import RetryPolicy

T = TypeVar("T")

#: The longest ``Retry-After`` honoured by default: a server asking for more is not retried.
MAX_RETRY_AFTER_S = 60.0
#: The shortest per-request timeout passed to an SDK (an HTTP client refuses 0).
MIN_TIMEOUT_S = 0.001


# --- the SDK -------------------------------------------------------------------------------

def require_sdk(module: str, extra: str, *, what: str = "this adapter") -> ModuleType:
    """Import the optional SDK ``module``.

    Raises:
        ConfigError: it is not installed; the message names ``boundloop[extra]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{what} needs the `{module}` package, which is not installed: "
            f"pip install 'boundloop[{extra}]'") from None


# --- time ----------------------------------------------------------------------------------

class DeadlinePassed(TimeoutError):
    """The run's deadline passed before a model request could be (re)sent."""


def request_timeout(deadline: float | None, default: float | None = None, *,
                    clock: Callable[[], float] = time.monotonic) -> float | None:
    """The timeout for one HTTP request: the seconds left before ``deadline`` (a
    ``time.monotonic()`` value), at most ``default``; ``default`` when there is no
    deadline (None: leave the SDK's own).

    Raises:
        DeadlinePassed: the deadline has passed (no request should be sent).
    """
    if deadline is None:
        return default
    left = deadline - clock()
    if left <= 0:
        raise DeadlinePassed("the run's deadline passed before the model request was sent")
    left = max(left, MIN_TIMEOUT_S)
    return left if default is None else min(left, default)


# --- retries -------------------------------------------------------------------------------

def headers_of(exc: BaseException) -> Mapping[str, str] | None:
    """The HTTP response headers an SDK error carries (``exc.response.headers``), if any."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    return headers if isinstance(headers, Mapping) or hasattr(headers, "get") else None


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an SDK error carries (``exc.status_code``), if any."""
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def retry_after_s(headers: Mapping[str, str] | None, *,
                  now: Callable[[], float] = time.time) -> float | None:
    """The delay, in seconds, that a response's headers ask for before a retry: the
    ``retry-after-ms`` header (milliseconds), else ``Retry-After`` (seconds, or an HTTP
    date); None when neither is given or parses as a finite delay (a past date is 0)."""
    if headers is None:
        return None
    get = headers.get
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = get(name)
        if raw is None:
            continue
        try:
            value = float(str(raw).strip()) * scale
        except ValueError:
            value = math.nan
            if scale == 1.0:
                try:
                    when = email.utils.parsedate_to_datetime(str(raw))
                    value = when.timestamp() - now()
                except (TypeError, ValueError, IndexError, OverflowError):
                    pass
        if math.isfinite(value):
            return max(value, 0.0)
    return None


def transient_status(status: int | None) -> bool:
    """Whether an HTTP status is worth retrying: 408 (request timeout), 409 (conflict),
    429 (rate limited), and every 5xx (including Anthropic's 529, overloaded)."""
    return status is not None and (status in (408, 409, 429) or status >= 500)


def _next_delay(retry: RetryPolicy | None, attempt: int, exc: BaseException,
                transient: Callable[[BaseException], bool], deadline: float | None,
                clock: Callable[[], float], max_wait_s: float) -> float | None:
    """The delay before attempt ``attempt + 1``, or None when ``exc`` must be raised: not
    retryable, attempts spent, a ``Retry-After`` above ``max_wait_s``, or a delay that would
    not end before the deadline."""
    if retry is None or attempt >= retry.max_attempts:
        return None
    if not isinstance(exc, retry.retry_on) or not transient(exc):
        return None
    asked = retry_after_s(headers_of(exc))
    if asked is not None and asked > max_wait_s:
        return None
    delay = retry.delay(attempt + 1) if asked is None else asked
    if deadline is not None and clock() + delay >= deadline:
        return None
    return delay


def call_with_retry(send: Callable[[float | None], T], *, retry: RetryPolicy | None,
                    deadline: float | None, transient: Callable[[BaseException], bool],
                    cancel: CancelToken | None = None, default_timeout: float | None = None,
                    max_wait_s: float = MAX_RETRY_AFTER_S,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """``send(timeout)`` (one HTTP request bounded by ``timeout`` seconds, see
    :func:`request_timeout`), retried while ``retry`` allows for errors that are in
    ``retry.retry_on`` and that ``transient`` accepts. The delay before a retry is what the
    error's ``Retry-After`` / ``retry-after-ms`` asks for, else ``retry.delay(attempt)``;
    every delay ends before ``deadline``, else the error is raised instead of waiting.
    A cancelled ``cancel`` ends a delay early and raises the last error.

    Raises:
        DeadlinePassed: the deadline passed before an attempt could start.
        BaseException: the last error, when it is not retried.
    """
    attempt = 1
    while True:
        timeout = request_timeout(deadline, default_timeout, clock=clock)
        try:
            return send(timeout)
        except Exception as exc:
            delay = _next_delay(retry, attempt, exc, transient, deadline, clock, max_wait_s)
            if delay is None:
                raise
            if cancel is not None:
                if cancel.wait(delay):
                    raise
            elif delay > 0:
                sleep(delay)
        attempt += 1


async def _sleep_unless_cancelled(delay: float, cancel: CancelToken | None) -> bool:
    """Sleep ``delay`` seconds on the running loop; True when ``cancel`` ended it early."""
    if cancel is None:
        await asyncio.sleep(delay)
        return False
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not woken.done():
            woken.set_result(None)

    def wake() -> None:
        loop.call_soon_threadsafe(settle)

    stop = cancel.on_cancel(wake)
    try:
        await asyncio.wait_for(asyncio.shield(woken), delay)
    except TimeoutError:
        pass
    finally:
        stop()
    return cancel.cancelled


async def acall_with_retry(send: Callable[[float | None], Awaitable[T]], *,
                           retry: RetryPolicy | None, deadline: float | None,
                           transient: Callable[[BaseException], bool],
                           cancel: CancelToken | None = None,
                           default_timeout: float | None = None,
                           max_wait_s: float = MAX_RETRY_AFTER_S,
                           clock: Callable[[], float] = time.monotonic) -> T:
    """:func:`call_with_retry` for an ``async`` ``send``; delays sleep on the running loop."""
    attempt = 1
    while True:
        timeout = request_timeout(deadline, default_timeout, clock=clock)
        try:
            return await send(timeout)
        except Exception as exc:
            delay = _next_delay(retry, attempt, exc, transient, deadline, clock, max_wait_s)
            if delay is None:
                raise
            if await _sleep_unless_cancelled(delay, cancel):
                raise
        attempt += 1


# --- tool schemas and names ----------------------------------------------------------------

def _resolve(ref: str, root: Mapping[str, Any]) -> Any:
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _inline(node: Any, root: Mapping[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(item, root, seen) for item in node]
    if not isinstance(node, Mapping):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is None or ref in seen:
            # An unresolvable or recursive reference: any value (the runner still validates
            # the arguments against the tool's own schema before any dispatch).
            rest = {k: _inline(v, root, seen) for k, v in node.items() if k != "$ref"}
            return rest
        merged = {**_inline(target, root, (*seen, ref)),
                  **{k: _inline(v, root, seen) for k, v in node.items() if k != "$ref"}}
        return merged
    return {k: _inline(v, root, seen) for k, v in node.items()
            if k not in ("$defs", "definitions")}


def provider_schema(parameters: Mapping[str, Any] | None, *, tool: str = "?") -> dict[str, Any]:
    """A tool's parameters as a self-contained JSON Schema whose root is an object: every
    ``$ref`` into ``$defs``/``definitions`` inlined (a recursive one becomes ``{}``, any
    value), the definitions dropped, ``"type": "object"`` added when the root has none.
    The input is not changed.

    Raises:
        ConfigError: the root is not an object schema (names ``tool``).
    """
    if not parameters:
        return {"type": "object", "properties": {}}
    schema = _inline(copy.deepcopy(dict(parameters)), parameters, ())
    if not isinstance(schema, dict):  # pragma: no cover - a Mapping stays a dict
        raise ConfigError(f"tool {tool!r}: its parameters are not a JSON Schema object")
    kind = schema.get("type")
    if kind is None:
        schema = {"type": "object", **schema}
        schema.setdefault("properties", {})
    elif kind != "object":
        raise ConfigError(f"tool {tool!r}: its parameters schema must describe an object, "
                          f"not {kind!r}")
    return schema


_SAFE_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")


def safe_tool_name(name: str, *, max_len: int = 64) -> str:
    """``name`` when it matches ``^[a-zA-Z0-9_-]{1,max_len}$`` (what Anthropic and OpenAI
    accept); else a stable stand-in: other characters become ``_``, and a short digest of
    the original keeps two names that differ only there apart, within ``max_len``."""
    if 0 < len(name) <= max_len and _SAFE_NAME.match(name):
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    base = re.sub(r"[^a-zA-Z0-9_-]", "_", name)[: max_len - len(digest) - 1]
    return f"{base}_{digest}"


class ToolNames:
    """The mapping between the runner's tool names and the names sent to a provider
    (:func:`safe_tool_name`): ``to_provider`` before a request, ``from_provider`` for the
    calls in its response (a name that maps to no tool comes back unchanged, so the runner
    reports it as an unknown tool)."""

    def __init__(self, names: list[str], *, max_len: int = 64) -> None:
        self._max_len = max_len
        self._back = {safe_tool_name(n, max_len=max_len): n for n in names}

    def to_provider(self, name: str) -> str:
        """The name sent to the provider for the tool ``name``."""
        return safe_tool_name(name, max_len=self._max_len)

    def from_provider(self, name: str) -> str:
        """The runner's tool name for the provider's ``name``."""
        return self._back.get(name, name)


# --- history -------------------------------------------------------------------------------

def _get(message: Any, name: str, default: Any = None) -> Any:
    if isinstance(message, Mapping):
        return message.get(name, default)
    return getattr(message, name, default)


@dataclasses.dataclass
class UserTurn:
    """Text for the model from the user side: a ``user`` message, or a runner ``notice``."""

    text: str
    notice: bool = False


@dataclasses.dataclass
class AssistantText:
    """A final answer accepted earlier (a ``final`` message): an assistant text turn."""

    text: str


@dataclasses.dataclass
class ToolStep:
    """One assistant turn with tool calls: the step's ``text`` and provider ``content``
    (from its ``assistant`` message, if any), its ``calls`` (``call`` messages) in order,
    and their ``results`` (``tool_result`` messages) by call id."""

    step: int | None
    text: str | None = None
    content: Any = None
    calls: list[Any] = dataclasses.field(default_factory=list)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)

    def paired(self) -> list[tuple[Any, Any]]:
        """Each call with its result (None when the history holds none), in call order."""
        return [(call, self.results.get(_get(call, "id"))) for call in self.calls]


@dataclasses.dataclass
class OrphanResult:
    """A ``tool_result`` whose call is not in the history (sent as user text)."""

    result: Any


Turn = UserTurn | AssistantText | ToolStep | OrphanResult


def group_history(history: list[Any]) -> list[Turn]:
    """The history (message Structs or their dicts) as provider turns, in order.

    An ``assistant`` message opens the ToolStep of its step; ``call`` messages of the same
    non-None ``step`` join one ToolStep (a call whose step is None is a ToolStep of its
    own); a ``tool_result`` joins the ToolStep that holds its call id, wherever it comes;
    ``user`` and ``notice`` messages are UserTurns, ``final`` ones AssistantTexts. Adjacent
    turns of one role are not merged: providers differ in what they require.
    """
    turns: list[Turn] = []
    by_call: dict[str, ToolStep] = {}
    open_step: ToolStep | None = None
    for message in history:
        kind = _get(message, "kind")
        if kind == "assistant":
            open_step = ToolStep(_get(message, "step"), _get(message, "text"),
                                 _get(message, "content"))
            turns.append(open_step)
        elif kind == "call":
            step = _get(message, "step")
            joins = open_step is not None and (
                open_step.step == step if step is not None else
                open_step.step is None and not open_step.calls)
            if open_step is None or not joins:
                open_step = ToolStep(step)
                turns.append(open_step)
            open_step.calls.append(message)
            by_call[str(_get(message, "id"))] = open_step
        elif kind == "tool_result":
            owner = by_call.get(str(_get(message, "id")))
            if owner is None:
                turns.append(OrphanResult(message))
            else:
                owner.results[str(_get(message, "id"))] = message
        elif kind in ("user", "notice"):
            open_step = None
            turns.append(UserTurn(str(_get(message, "text") or ""), notice=kind == "notice"))
        elif kind == "final":
            open_step = None
            turns.append(AssistantText(str(_get(message, "text") or "")))
    return turns


def result_text(content: Any) -> str:
    """A tool result's content as text: a string as it is, anything else as JSON."""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False, default=str)


def parse_arguments(raw: Any) -> Any:
    """Tool arguments sent as JSON text, decoded: ``""``/None are ``{}``; text that is not
    valid JSON comes back as the raw string (the runner then reports the response malformed,
    naming the call and the parse error); anything not a string is returned as it is."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


# --- responses -----------------------------------------------------------------------------

def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def make_usage(input_tokens: Any, output_tokens: Any, cache_write_tokens: Any = 0,
               cache_read_tokens: Any = 0, *, price: Price | str | None = None) -> Usage:
    """A bl.Usage from provider counts (None or junk counts as 0), with its cost from
    ``price`` when it is a table. ``input_tokens`` must already exclude cached input
    (SPEC 7). With ``price="auto"`` the cost is left to the runner, which asks the
    catalogue for the model the response reports (``boundloop.pricing``)."""
    usage = Usage(_count(input_tokens), _count(output_tokens), _count(cache_write_tokens),
                  _count(cache_read_tokens))
    return priced(usage, price if isinstance(price, Price) else None)


def response_info(response_id: Any, model: Any, finish_reason: Any) -> ResponseInfo | None:
    """The provider's id, model and finish reason of a response (each kept only when it is
    a non-empty string, cut at 256 characters), None when it says none of them."""
    def text(value: Any) -> str | None:
        return value[:256] if isinstance(value, str) and value else None

    info = ResponseInfo(text(response_id), text(model), text(finish_reason))
    return info if info != _NO_INFO else None


_NO_INFO = ResponseInfo()


def malformed(reason: str, usage: Usage | None = None) -> Malformed:
    """A turn without a usable answer (a length stop, a refusal, ...): the runner treats it
    as a malformed response for ``reason`` (a plain sentence), charging ``usage``."""
    return Malformed(reason, usage=usage)
