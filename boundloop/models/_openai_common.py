"""What the OpenAI adapters share: the SDK, the adapter base class (requests, steps,
streaming), helpers, and the stream reader's interface."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from boundloop.core import kinds
from boundloop.errors import ConfigError
from boundloop.models._common import (
    ToolNames,
    acall_with_retry,
    call_with_retry,
    malformed,
    provider_schema,
    require_sdk,
    result_text,
    status_of,
    transient_status,
)
from boundloop.models._stream import (
    Cut,
    OnText,
    StreamMeter,
    apump,
    cancelled_reason,
    check_on_text,
    pump,
    stream_transient,
)
from boundloop.pricing import PriceOption, check_price
from boundloop.tools import RetryPolicy

EXTRA = "openai"
#: How much of a refusal's own text a malformed reason quotes.
_QUOTE = 200
#: Responses output item types that are sent back as input; others in ``content`` (e.g.
#: another provider's blocks in a history) are left out.
_ITEM_TYPES = frozenset({"reasoning", "message", "function_call", "compaction"})


def _sdk() -> Any:
    return require_sdk("openai", EXTRA, what="boundloop.models.openai")


def _is_async_client(client: Any) -> bool:
    try:
        import openai
    except ImportError:
        return False
    if isinstance(client, openai.AsyncOpenAI):
        return True
    for path in (("chat", "completions", "create"), ("responses", "create")):
        node = client
        try:
            for part in path:
                node = getattr(node, part)
        except Exception:  # noqa: BLE001 - a client without this resource
            continue
        if inspect.iscoroutinefunction(node):
            return True
    return False


def _flagged(status: str, content: Any) -> str:
    text = result_text(content)
    if kinds.is_ok(status):
        return text
    if kinds.is_error(status):
        return f"error: {text}"
    return f"error ({status}): {text}"


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _QUOTE else text[:_QUOTE - 1] + "…"


def _arguments_json(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False, default=str)


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _as_dict(item: Any) -> dict[str, Any]:
    """An SDK model (or a dict) as its JSON wire form, fields the API did not send left out."""
    if isinstance(item, dict):
        return item
    to_dict = getattr(item, "to_dict", None)
    if callable(to_dict):
        value = to_dict(mode="json", exclude_none=True)
        if isinstance(value, dict):
            return value
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        value = dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(value, dict):
            return value
    raise TypeError(f"cannot read a {type(item).__name__} from the provider's response")


def _transient(exc: BaseException) -> bool:
    """Provider errors worth retrying: timeouts, connection errors, 408/409/429, 5xx."""
    try:
        import openai
    except ImportError:  # pragma: no cover - the adapter was made, so the SDK is there
        return False
    if isinstance(exc, openai.APIConnectionError):  # APITimeoutError is one
        return True
    return isinstance(exc, openai.APIStatusError) and transient_status(status_of(exc))


class _OpenAIModel:
    """What the Chat and Responses adapters share: arguments, the client, retries."""

    #: ``gen_ai.provider.name`` of its ``chat`` spans (OpenTelemetry GenAI conventions).
    provider = "openai"
    #: create() arguments the adapter builds itself.
    _RESERVED: frozenset[str] = frozenset()
    _SYNC: type[_OpenAIModel] | None = None
    _ASYNC: type[_OpenAIModel] | None = None

    def __new__(cls, client: Any = None, *args: Any, **kwargs: Any) -> Any:
        # The public classes pick their sync or async variant from the client.
        if cls._ASYNC is not None and cls is not cls._ASYNC and _is_async_client(client):
            cls = cls._ASYNC
        return super().__new__(cls)

    def __init__(self, client: Any, model: str, max_tokens: int = 1024,
                 system: str | None = None, price: PriceOption = None,
                 retry: RetryPolicy | None = None, stream: bool = False,
                 on_text: OnText | None = None, **extra: Any) -> None:
        _sdk()
        name = type(self).__name__
        if client is None:
            raise ConfigError(f"{name} needs a client: openai.OpenAI() or openai.AsyncOpenAI()")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{name}: model must be a model name, got {model!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"{name}: max_tokens must be a whole number of at least 1, "
                              f"got {max_tokens!r}")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{name}: system must be text or None, got {system!r}")
        price = check_price(price, name)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"{name}: retry must be a bl.RetryPolicy or None, got {retry!r}")
        taken = sorted(set(extra) & self._RESERVED)
        if taken:
            raise ConfigError(f"{name}: {', '.join(taken)} cannot be given; the adapter builds "
                              "them from the history, ctx and its own arguments")
        is_async = _is_async_client(client)
        if is_async and not inspect.iscoroutinefunction(type(self).__call__):
            raise ConfigError(f"{name} is for openai.OpenAI; with openai.AsyncOpenAI use "
                              f"{self._ASYNC.__name__ if self._ASYNC else 'the async adapter'}")
        if not is_async and inspect.iscoroutinefunction(type(self).__call__):
            raise ConfigError(f"{name} is for openai.AsyncOpenAI; with openai.OpenAI use "
                              f"{self._SYNC.__name__ if self._SYNC else 'the sync adapter'}")
        if not isinstance(stream, bool):
            raise ConfigError(f"{name}: stream must be True or False, got {stream!r}")
        if on_text is not None and not stream:
            raise ConfigError(f"{name}: on_text needs stream=True")
        self.on_text = check_on_text(on_text, is_async=is_async, name=name)
        self.stream = stream
        self.client = client
        with_options = getattr(client, "with_options", None)
        # The SDK's own retries could outlive the run's deadline: `retry` replaces them.
        self._client = with_options(max_retries=0) if callable(with_options) else client
        self.model = model
        self.max_tokens = max_tokens
        #: The declared output maximum, used by the runner's default reservation.
        self.max_output_tokens = max_tokens
        self.system = system
        self.price = price
        self.retry = retry
        self.extra = dict(extra)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, max_tokens={self.max_tokens})"

    # -- subclass hooks --------------------------------------------------------------------

    def _request(self, history: list[Any], ctx: Any, names: ToolNames) -> dict[str, Any]:
        raise NotImplementedError

    def _create(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _parse(self, response: Any, names: ToolNames, max_tokens: int | None = None) -> Any:
        raise NotImplementedError

    def _stream_params(self, params: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _reader(self, meter: StreamMeter) -> _Reader:
        raise NotImplementedError

    def _sent_max(self, params: dict[str, Any]) -> int | None:
        raise NotImplementedError

    # -- one step ----------------------------------------------------------------------------

    def _prepare(self, history: list[Any], ctx: Any) -> tuple[dict[str, Any], ToolNames]:
        names = ToolNames([str(t.get("name", "")) for t in (ctx.tools or [])])
        return self._request(history, ctx, names), names

    def _step(self, history: list[Any], ctx: Any) -> Any:
        params, names = self._prepare(history, ctx)
        create = self._create()

        def send(timeout: float | None) -> Any:
            return create(**params) if timeout is None else create(**params, timeout=timeout)

        if self.stream:
            return self._streamed(params, names, ctx)
        response = call_with_retry(send, retry=self.retry, deadline=ctx.deadline,
                                   transient=_transient, cancel=ctx.cancel)
        return self._parse(response, names, self._sent_max(params))

    def _streamed(self, params: dict[str, Any], names: ToolNames, ctx: Any) -> Any:
        meter = StreamMeter(ctx, params, self.price)
        create = self._create()
        streaming = self._stream_params(params)

        def send(timeout: float | None) -> tuple[Cut | None, Any]:
            meter.reset()
            reader = self._reader(meter)
            options = streaming if timeout is None else {**streaming, "timeout": timeout}
            with create(**options) as stream:
                cut = pump(stream, reader.read, ctx, meter, self.on_text)
                return cut, (reader.result() if cut is None else None)

        cut, response = call_with_retry(
            send, retry=self.retry, deadline=ctx.deadline,
            transient=stream_transient(meter, _transient), cancel=ctx.cancel)
        return self._stream_result(cut, response, names, meter, params)

    async def _astreamed(self, params: dict[str, Any], names: ToolNames, ctx: Any) -> Any:
        meter = StreamMeter(ctx, params, self.price)
        create = self._create()
        streaming = self._stream_params(params)

        async def send(timeout: float | None) -> tuple[Cut | None, Any]:
            meter.reset()
            reader = self._reader(meter)
            options = streaming if timeout is None else {**streaming, "timeout": timeout}
            async with await create(**options) as stream:
                cut = await apump(stream, reader.read, ctx, meter, self.on_text)
                return cut, (reader.result() if cut is None else None)

        cut, response = await acall_with_retry(
            send, retry=self.retry, deadline=ctx.deadline,
            transient=stream_transient(meter, _transient), cancel=ctx.cancel)
        return self._stream_result(cut, response, names, meter, params)

    def _stream_result(self, cut: Cut | None, response: Any, names: ToolNames,
                       meter: StreamMeter, params: dict[str, Any]) -> Any:
        if cut == "cancelled":
            return malformed(cancelled_reason())
        if cut == "limit":
            return meter.cut(self.price)
        return self._parse(response, names, self._sent_max(params))

    async def _astep(self, history: list[Any], ctx: Any) -> Any:
        params, names = self._prepare(history, ctx)
        create: Callable[..., Awaitable[Any]] = self._create()

        def send(timeout: float | None) -> Awaitable[Any]:
            return create(**params) if timeout is None else create(**params, timeout=timeout)

        if self.stream:
            return await self._astreamed(params, names, ctx)
        response = await acall_with_retry(send, retry=self.retry, deadline=ctx.deadline,
                                          transient=_transient, cancel=ctx.cancel)
        return self._parse(response, names, self._sent_max(params))

    def _tools(self, ctx: Any, names: ToolNames) -> list[tuple[str, str, dict[str, Any]]]:
        tools = []
        for spec in ctx.tools or []:
            name = str(spec.get("name", ""))
            schema = provider_schema(spec.get("parameters"), tool=name)
            tools.append((names.to_provider(name), str(spec.get("description") or ""), schema))
        return tools


# --- Chat Completions ----------------------------------------------------------------------



# --- streaming ------------------------------------------------------------------------------

#: The smallest ``max_output_tokens`` the Responses API accepts.
_RESPONSES_MIN_OUTPUT = 16


def _limit(declared: int, sent: int | None) -> str:
    """The output maximum a length stop names: the one sent, saying when the run's
    remaining output tokens lowered it."""
    if sent is None or sent == declared:
        return f"{declared}"
    return f"{sent}, lowered to what the run had left of its output tokens"


class _Reader:
    """Reads one stream's events: counts their output on the meter, returns each text
    delta, and gives the response they add up to (what the non-streaming call returns)."""

    def __init__(self, meter: StreamMeter) -> None:
        self.meter = meter

    def read(self, event: Any) -> str | None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


# --- shared --------------------------------------------------------------------------------

def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _result_content(result: Any) -> str:
    if result is None:
        return "error (no_result): no result was recorded for this call"
    return _flagged(str(_field(result, "status") or "ok"), _field(result, "content"))


def _orphan_text(result: Any) -> str:
    return (f"(the result of tool call {_field(result, 'id')}, whose call is not in this "
            f"conversation) {_result_content(result)}")
