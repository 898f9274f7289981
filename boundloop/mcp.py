"""An MCP server's tools as boundloop tools: ``tools = await bl.mcp_tools(session)``.

``session`` is an initialized ``mcp.ClientSession`` (the official SDK, 1.x or 2.x; anything
with ``async list_tools()`` and ``async call_tool(name, arguments)`` will do). This module
does not import the SDK: the session brings it. Each tool's ``inputSchema`` goes through
:meth:`boundloop.Tool.from_schema`, so arguments are checked against it (a cached JSON
Schema validator, ``jsonschema``: ``pip install 'boundloop[mcp]'``) before any call reaches
the server, and the runner's permissions, budgets and journal apply as to any tool.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import msgspec

from boundloop.errors import BoundloopError, ConfigError
from boundloop.tools import RetryPolicy, Tool

__all__ = ["McpToolError", "mcp_tools"]

#: The options ``overrides`` may set for a tool (those of ``Tool.from_schema``).
OVERRIDABLE = frozenset({"read_only", "idempotent", "irreversible", "timeout_s", "retry",
                         "reconcile", "sensitive", "description"})
#: The most pages of a tool listing followed (a server whose cursor never ends is refused).
MAX_PAGES = 1000
#: The most characters of an error result kept in the exception's message.
MAX_ERROR_TEXT = 2000


class McpToolError(BoundloopError, RuntimeError):
    """An MCP tool answered with ``isError: true``; the call's result is ``error``.

    A ``BoundloopError`` like every exception boundloop raises (DESIGN rule 7), and still
    a ``RuntimeError``, as it was before.

    Attributes:
        tool: the MCP tool's name (as the server knows it).
        content: the result's content blocks, as the server sent them (JSON data).
    """

    def __init__(self, tool: str, text: str, content: list[Any]) -> None:
        super().__init__(text)
        self.tool = tool
        self.content = content


async def mcp_tools(session: Any, *, names: Iterable[str] | None = None, prefix: str = "",
                    timeout_s: float | None = 60.0, retry: RetryPolicy | None = None,
                    sensitive: Collection[str] = (), trust_annotations: bool = True,
                    overrides: Mapping[str, Mapping[str, Any]] | None = None) -> list[Tool]:
    """The tools ``session``'s server offers, as boundloop Tools, in the server's order.

    Call it on the event loop the session lives on. Each tool's handler is an ``async def``
    that calls ``session.call_tool``; run them with ``await runner.arun(...)`` on that same
    loop. A handler running elsewhere (a sync ``runner.run`` in a worker thread) hands the
    call to the session's loop and waits for it; never call the blocking ``runner.run`` on
    the session's own loop thread: the call could not proceed and would time out.

    Flags come from the tool's annotations (MCP *hints*, with MCP's defaults):

    * ``readOnlyHint: true`` makes it ``read_only`` (and ``idempotent``: a read may be
      repeated; MCP says the other hints only matter for tools that are not read-only);
    * ``idempotentHint: true`` makes it ``idempotent`` (recovery may retry it);
    * a tool that is not read-only is ``irreversible`` unless it says
      ``destructiveHint: false``: MCP's default is destructive, so an unknown outcome of
      an unannotated tool goes to a person (``needs_review``), never retried blindly.

    MCP asks clients to treat annotations as untrusted unless the server is trusted: a
    lying ``readOnlyHint`` would get a tool past a ``read_only`` Runner. Pass
    ``trust_annotations=False`` for a server you do not trust (every tool is then neither
    read-only nor idempotent, and irreversible), and ``overrides`` to set a tool's flags
    yourself.

    Results: ``isError: true`` raises :class:`McpToolError` with the result's text (the
    call's status is ``error``). Otherwise the handler returns ``structuredContent`` when
    the result has it; else the text of its content blocks joined with newlines when all
    are text (``""`` for no content); else the list of content blocks as JSON data (as MCP
    sends them, ``{"type": "image", "data": ..., "mimeType": ...}``). A protocol error or
    a lost connection raises too (``error``): note that a call whose connection was lost
    may still have taken effect on the server.

    Args:
        session: an initialized MCP ``ClientSession``.
        names: keep only these tools (by the server's names); None keeps all.
        prefix: prepended to each name the model sees (``"github_"``), to keep the tools of
            several servers apart; the server is still called by its own name.
        timeout_s: for every tool, as in :class:`boundloop.Tool`.
        retry: for every tool, as in :class:`boundloop.Tool`.
        sensitive: for every tool, as in :class:`boundloop.Tool`.
        trust_annotations: honour the server's annotations (see above).
        overrides: per tool (by the server's name), ``Tool.from_schema`` options that
            replace what the annotations and the arguments above say: ``read_only``,
            ``idempotent``, ``irreversible``, ``timeout_s``, ``retry``, ``reconcile``,
            ``sensitive``, ``description``.

    Raises:
        ConfigError: a name in ``names`` or ``overrides`` that the server does not offer;
            an unknown override; a tool boundloop cannot accept (an empty or non-string
            name, two tools of one name, an input schema ``Tool.from_schema`` refuses):
            the message names it, and ``names=`` without it leaves it out; ``jsonschema``
            not installed.
    """
    loop = asyncio.get_running_loop()
    if not isinstance(prefix, str):
        raise ConfigError(f"prefix must be a string, got {prefix!r}")
    wanted = _names(names, "names")
    changes = _overrides(overrides)
    listed = await _listing(session)
    offered = [t.get("name") for t in listed]
    unknown = sorted({*(wanted or ()), *changes} - {n for n in offered if isinstance(n, str)})
    if unknown:
        raise ConfigError(f"the MCP server offers no tool named {', '.join(map(repr, unknown))}; "
                          f"it offers {_listed(offered)}")
    out: list[Tool] = []
    seen: set[str] = set()
    for entry in listed:
        name = entry.get("name")
        if wanted is not None and name not in wanted:
            continue
        if not isinstance(name, str) or not name:
            raise ConfigError(f"the MCP server offers a tool whose name boundloop cannot use "
                              f"({name!r}: a tool needs a non-empty string name); pass "
                              f"names=[...] to take only the others")
        if prefix + name in seen:
            raise ConfigError(f"the MCP server offers two tools named {name!r}; pass "
                              f"names=[...] to take only the others")
        seen.add(prefix + name)
        options: dict[str, Any] = {
            **_flags(entry.get("annotations"), trust_annotations), "timeout_s": timeout_s,
            "retry": retry, "sensitive": sensitive,
            "description": entry.get("description") or ""}
        options.update(changes.get(name, {}))
        if options["read_only"] and "irreversible" not in changes.get(name, {}):
            options["irreversible"] = False  # only a default said so: read-only wins
        schema = entry.get("inputSchema")
        if schema is None:
            schema = {"type": "object"}
        try:
            out.append(Tool.from_schema(prefix + name, schema, _caller(session, name, loop),
                                        **options))
        except ConfigError as exc:
            raise ConfigError(f"MCP tool {name!r}: {exc} (pass names=[...] without it to "
                              f"take only the others)") from None
    return out


def _names(names: Iterable[str] | None, what: str) -> frozenset[str] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ConfigError(f"{what} must be a list of tool names, got {names!r}")
    out = frozenset(names)
    if not all(isinstance(n, str) for n in out):
        raise ConfigError(f"{what} must be a list of tool names (strings), got {names!r}")
    return out


def _overrides(overrides: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ConfigError("overrides must map tool names to dicts of Tool options, got "
                          f"{overrides!r}")
    out = {}
    for name, options in overrides.items():
        if not isinstance(name, str) or not isinstance(options, Mapping):
            raise ConfigError("overrides must map tool names to dicts of Tool options, got "
                              f"{name!r}: {options!r}")
        bad = sorted(set(options) - OVERRIDABLE)
        if bad:
            raise ConfigError(f"overrides for {name!r}: {bad} are not options of a tool; "
                              f"use {sorted(OVERRIDABLE)}")
        out[name] = dict(options)
    return out


def _flags(annotations: Any, trusted: bool) -> dict[str, bool]:
    hints = annotations if trusted and isinstance(annotations, Mapping) else {}
    read_only = hints.get("readOnlyHint") is True
    return {"read_only": read_only,
            "idempotent": read_only or hints.get("idempotentHint") is True,
            "irreversible": not read_only and hints.get("destructiveHint") is not False}


def _listed(names: list[Any]) -> str:
    shown = ", ".join(repr(n) for n in names[:20])
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return f"{shown}{more}" if names else "no tools"


def _wire(value: Any, what: str) -> dict[str, Any]:
    """An SDK model (1.x camelCase or 2.x snake_case attributes) as MCP's JSON shape."""
    if isinstance(value, Mapping):
        return dict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        data = dump(by_alias=True, mode="json")
        if isinstance(data, dict):
            return data
    raise TypeError(f"expected an MCP {what}, got {type(value).__name__}")


async def _listing(session: Any) -> list[dict[str, Any]]:
    """Every page of ``tools/list``."""
    tools: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        result = await (session.list_tools() if cursor is None else _page(session, cursor))
        try:
            data = _wire(result, "tool listing")
        except TypeError as exc:
            raise ConfigError(f"session.list_tools() did not return a tool listing ({exc})"
                              ) from None
        page = data.get("tools") or []
        if not isinstance(page, list):
            raise ConfigError("the MCP server's tool listing has no list of tools")
        tools.extend(_wire(t, "tool") if not isinstance(t, dict) else t for t in page)
        cursor = data.get("nextCursor")
        if not cursor:
            return tools
    raise ConfigError(f"the MCP server's tool listing did not end after {MAX_PAGES} pages")


def _page(session: Any, cursor: str) -> Awaitable[Any]:
    try:
        params = inspect.signature(session.list_tools).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "params" in params:  # SDK 2.x, and later 1.x
        request = importlib.import_module("mcp.types").PaginatedRequestParams(cursor=cursor)
        return session.list_tools(params=request)  # type: ignore[no-any-return]
    return session.list_tools(cursor=cursor)  # type: ignore[no-any-return]


def _caller(session: Any, name: str, loop: asyncio.AbstractEventLoop
            ) -> Callable[..., Awaitable[Any]]:
    async def call_mcp_tool(**arguments: Any) -> Any:
        result = await _on_loop(loop, lambda: session.call_tool(name, arguments))
        return _content(name, result)

    call_mcp_tool.__qualname__ = call_mcp_tool.__name__ = f"mcp_{name}"
    return call_mcp_tool


async def _on_loop(loop: asyncio.AbstractEventLoop, start: Callable[[], Awaitable[Any]]) -> Any:
    """``await start()`` on ``loop``, the session's (its streams are bound to it)."""
    if asyncio.get_running_loop() is loop:
        return await start()
    if loop.is_closed() or not loop.is_running():
        raise RuntimeError("the MCP session's event loop is not running (was the session "
                           "closed?)")

    async def run() -> Any:
        return await start()

    # Cancelling this task (a timeout, a cancelled run) cancels the call on the session's loop.
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), loop))


def _content(name: str, result: Any) -> Any:
    data = _wire(result, "tool result")
    blocks = data.get("content") or []
    if not isinstance(blocks, list):
        blocks = [blocks]
    blocks = [{k: v for k, v in b.items() if v is not None} if isinstance(b, dict) else b
              for b in blocks]
    texts = [b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"
             and isinstance(b.get("text"), str)]
    all_text = len(texts) == len(blocks)
    if data.get("isError") is True:
        text = "\n".join(texts) if all_text and texts else _json(blocks)
        if len(text) > MAX_ERROR_TEXT:
            text = text[:MAX_ERROR_TEXT - 1] + "\u2026"
        raise McpToolError(name, text or f"the MCP tool {name!r} reported an error without "
                                         "saying what", blocks)
    if data.get("structuredContent") is not None:
        return data["structuredContent"]
    if all_text:
        return "\n".join(texts)
    return blocks


def _json(value: Any) -> str:
    if not value:
        return ""
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, ValueError, OverflowError, RecursionError):
        return repr(value)
