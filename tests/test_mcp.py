"""``bl.mcp_tools``: an MCP server's tools under boundloop's rules.

The first tests start tests/mcp_server.py, a real stdio server of the official SDK, as a
subprocess and drive it through ``stdio_client`` + ``ClientSession``: permissions, argument
validation, the journal's flags and contents, ``isError`` results and a ``read_only`` Runner,
with the server's own ledger showing which calls reached it. The rest use a fake session
(no subprocess) for the listing, naming and result rules.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.mcp import McpToolError, mcp_tools

pytest.importorskip("jsonschema", reason="bl.mcp_tools needs jsonschema "
                                         "(pip install 'boundloop[mcp]')")
needs_sdk = pytest.mark.skipif(importlib.util.find_spec("mcp") is None,
                               reason="the official MCP SDK is not installed "
                                      "(pip install 'boundloop[mcp]')")

SERVER = Path(__file__).with_name("mcp_server.py")


@asynccontextmanager
async def server_session(tmp_path: Path) -> AsyncIterator[tuple[Any, Path]]:
    """A ClientSession on a fresh tests/mcp_server.py, and the ledger of its real calls."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    ledger = tmp_path / "ledger.jsonl"
    ledger.touch()
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)],
                                   env={**os.environ, "BOUNDLOOP_MCP_LEDGER": str(ledger)})
    with open(tmp_path / "server.log", "w", encoding="utf-8") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                ClientSession(read, write) as session:
            await asyncio.wait_for(session.initialize(), 20)
            yield session, ledger


def real_calls(ledger: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def by_name(tools: list[bl.Tool]) -> dict[str, bl.Tool]:
    return {t.name: t for t in tools}


def decided(runner: bl.Runner, run_id: str) -> dict[str, ev.CallDecided]:
    return {e.call_id: e for e in runner.journal.events(run_id)
            if isinstance(e, ev.CallDecided)}


def results(result: bl.RunResult) -> dict[str, bl.ToolResultMessage]:
    return {m.id: m for m in result.transcript if isinstance(m, bl.ToolResultMessage)}


def run_async(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))


@needs_sdk
def test_permissions_validation_and_the_journal_with_a_real_server(tmp_path: Path) -> None:
    async def main() -> None:
        async with server_session(tmp_path) as (session, ledger):
            tools = await mcp_tools(session)
            named = by_name(tools)
            assert list(named) == ["lookup", "send_mail", "fail", "create_ticket", "touch"]
            flags = {n: (t.read_only, t.idempotent, t.irreversible) for n, t in named.items()}
            assert flags == {
                "lookup": (True, True, False),        # readOnlyHint + idempotentHint
                "send_mail": (False, False, True),    # destructiveHint
                "fail": (True, True, False),          # readOnlyHint
                "create_ticket": (False, False, False),  # destructiveHint: false
                "touch": (False, False, True),        # no annotations: MCP's defaults
            }
            listed = {t.name: t for t in (await session.list_tools()).tools}
            for name, tool in named.items():
                assert tool.schema["name"] == name
                assert tool.schema["description"] == listed[name].description
                assert tool.schema["parameters"] == json.loads(json.dumps(
                    listed[name].model_dump(by_alias=True, mode="json")["inputSchema"]))

            def permit(call: bl.ToolCall, tool: bl.Tool, ctx: Any) -> bool | str:
                return call.name != "send_mail" or "mail needs a person's approval"

            model = bl.ScriptedModel([
                bl.CallTools([
                    bl.ToolCall("c1", "lookup", {"key": "alpha"}),
                    bl.ToolCall("c2", "send_mail", {"to": "a@example.com", "body": "hi"}),
                    bl.ToolCall("c3", "lookup", {"key": 5}),
                    bl.ToolCall("c4", "create_ticket",
                                {"title": "t", "contact": {"name": "Ann"}}),
                    bl.ToolCall("c5", "lookup", {}),
                ]),
                bl.CallTools([bl.ToolCall("c6", "create_ticket", {
                    "title": "broken", "contact": {"name": "Ann", "email": "ann@example.com"},
                    "tags": ["urgent"]})]),
                bl.Final("done"),
            ])
            async with bl.Runner(tmp_path / "j") as runner:
                result = await runner.arun(model=model, tools=tools, prompt="p",
                                           permit=permit, run_id="mcp-1")
                got = results(result)
                assert result.status == "final"
                assert {i: m.status for i, m in got.items()} == {
                    "c1": "ok", "c2": "denied", "c3": "invalid_arguments",
                    "c4": "invalid_arguments", "c5": "invalid_arguments", "c6": "ok"}
                assert got["c1"].content == "value of alpha"
                assert got["c6"].content == {"id": 7, "title": "broken", "contact": "Ann",
                                             "tags": ["urgent"]}  # structuredContent
                calls = decided(runner, "mcp-1")
                assert "approval" in calls["c2"].reason
                assert calls["c3"].reason == "invalid arguments for 'lookup': " \
                    "Expected `string`, got `integer` - at `$.key`"
                assert calls["c4"].reason.endswith(
                    ": Object missing required field `email` - at `$.contact`")
                assert calls["c5"].reason.endswith(": Object missing required field `key`")
                for call_id, name in (("c1", "lookup"), ("c2", "send_mail"),
                                      ("c6", "create_ticket")):
                    e = calls[call_id]
                    assert e.tool == name
                    assert (e.read_only, e.idempotent, e.irreversible) == flags[name]
                events = list(runner.journal.events("mcp-1"))
                succeeded = {e.execution_id: e.content for e in events
                             if isinstance(e, ev.CallSucceeded)}
                assert succeeded == {calls["c1"].execution_id: "value of alpha",
                                     calls["c6"].execution_id: got["c6"].content}
                assert bl.replay(events).status == "final"
            # Only the allowed, valid calls reached the server.
            assert real_calls(ledger) == [
                {"tool": "lookup", "arguments": {"key": "alpha"}},
                {"tool": "create_ticket", "arguments": {
                    "title": "broken", "tags": ["urgent"],
                    "contact": {"name": "Ann", "email": "ann@example.com", "phone": None}}}]

    run_async(main)


@needs_sdk
def test_is_error_and_a_read_only_runner_with_a_real_server(tmp_path: Path) -> None:
    async def main() -> None:
        async with server_session(tmp_path) as (session, ledger):
            tools = await mcp_tools(session)
            model = bl.ScriptedModel([
                bl.CallTools([bl.ToolCall("c1", "fail", {"reason": "the disk is full"}),
                              bl.ToolCall("c2", "lookup", {"key": "k"}),
                              bl.ToolCall("c3", "send_mail", {"to": "b@example.com",
                                                              "body": "x"}),
                              bl.ToolCall("c4", "touch", {"path": "/tmp/x"}),
                              bl.ToolCall("c5", "create_ticket", {
                                  "title": "t", "contact": {"name": "A", "email": "e"}})]),
                bl.Final("done"),
            ])
            async with bl.Runner(tmp_path / "j", read_only=True) as runner:
                result = await runner.arun(model=model, tools=tools, prompt="p",
                                           run_id="mcp-ro")
                got = results(result)
                assert {i: m.status for i, m in got.items()} == {
                    "c1": "error", "c2": "ok", "c3": "denied", "c4": "denied",
                    "c5": "denied"}
                assert "cannot do it: the disk is full" in str(got["c1"].content)
                failed = [e for e in runner.journal.events("mcp-ro")
                          if isinstance(e, ev.CallFailed)]
                assert [e.error_category for e in failed] == ["McpToolError"]
                assert "the disk is full" in failed[0].content
            # The batch's calls run at once: each ran exactly once, in either order.
            assert sorted(c["tool"] for c in real_calls(ledger)) == ["fail", "lookup"]

    run_async(main)


@needs_sdk
def test_a_sync_run_in_a_thread_calls_the_session_on_its_own_loop(tmp_path: Path) -> None:
    async def main() -> None:
        async with server_session(tmp_path) as (session, ledger):
            tools = await mcp_tools(session, names=["lookup"], prefix="dir_")
            assert [t.name for t in tools] == ["dir_lookup"]
            model = bl.ScriptedModel([
                bl.CallTools([bl.ToolCall("c1", "dir_lookup", {"key": "beta"})]),
                bl.Final("done")])
            with bl.Runner(tmp_path / "j") as runner:
                # The blocking run waits in a thread; its async handler runs on the runner's
                # own loop and hands the call to the session's loop (this one).
                result = await asyncio.to_thread(runner.run, model=model, tools=tools,
                                                 prompt="p")
            assert results(result)["c1"] == bl.ToolResultMessage("c1", "ok", "value of beta")
            assert real_calls(ledger) == [{"tool": "lookup", "arguments": {"key": "beta"}}]

    run_async(main)


# --- a fake session: listing, naming and result rules --------------------------------------

class FakeSession:
    """Answers ``tools/list`` in pages of one tool and ``tools/call`` from ``answers``."""

    def __init__(self, tools: list[dict[str, Any]],
                 answers: dict[str, dict[str, Any]] | None = None) -> None:
        self.tools = tools
        self.answers = answers or {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.pages = 0

    async def list_tools(self, cursor: str | None = None) -> dict[str, Any]:
        self.pages += 1
        index = int(cursor or 0)
        page: dict[str, Any] = {"tools": self.tools[index:index + 1]}
        if index + 1 < len(self.tools):
            page["nextCursor"] = str(index + 1)
        return page

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((name, arguments))
        return self.answers[name]


def spec(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "inputSchema": {"type": "object", "properties": {}}, **extra}


def make_tools(session: FakeSession, **kwargs: Any) -> list[bl.Tool]:
    async def main() -> list[bl.Tool]:
        return await mcp_tools(session, **kwargs)
    return asyncio.run(main())


def calls_of(session: FakeSession, *names: str, prefix: str = "",
             arguments: dict[str, Any] | None = None) -> list[Any]:
    """Each named tool's handler called once, on the loop the tools were listed on (the
    session's): its value, or the exception it raised."""
    async def main() -> list[Any]:
        named = by_name(await mcp_tools(session, prefix=prefix))
        out: list[Any] = []
        for name in names:
            tool = named[prefix + name]
            try:
                out.append(await tool.handler(**tool.validate(arguments or {})))
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                out.append(exc)
        return out
    return asyncio.run(main())


def test_every_page_of_the_listing_is_read() -> None:
    session = FakeSession([spec("a"), spec("b"), spec("c")])
    assert [t.name for t in make_tools(session)] == ["a", "b", "c"]
    assert session.pages == 3


def test_annotations_are_hints_that_can_be_distrusted_or_overridden() -> None:
    hints = {"readOnlyHint": True, "idempotentHint": True}
    session = FakeSession([spec("read", annotations=hints),
                           spec("write", annotations={"destructiveHint": False}),
                           spec("odd", annotations={"readOnlyHint": "yes"})])
    trusted = by_name(make_tools(session))
    assert (trusted["read"].read_only, trusted["read"].irreversible) == (True, False)
    assert (trusted["write"].irreversible, trusted["write"].idempotent) == (False, False)
    assert trusted["odd"].read_only is False and trusted["odd"].irreversible  # not a bool
    distrusted = by_name(make_tools(session, trust_annotations=False))
    assert all((t.read_only, t.idempotent, t.irreversible) == (False, False, True)
               for t in distrusted.values())
    changed = by_name(make_tools(session, trust_annotations=False, overrides={
        "read": {"read_only": True}, "write": {"idempotent": True, "timeout_s": 5.0}}))
    assert (changed["read"].read_only, changed["read"].irreversible) == (True, False)
    assert (changed["write"].idempotent, changed["write"].timeout_s) == (True, 5.0)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"names": ["nope"]}, "offers no tool named 'nope'"),
    ({"overrides": {"nope": {}}}, "offers no tool named 'nope'"),
    ({"overrides": {"a": {"colour": "red"}}}, "not options of a tool"),
    ({"names": "a"}, "must be a list of tool names"),
])
def test_bad_selections_are_config_errors(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(bl.ConfigError, match=words):
        make_tools(FakeSession([spec("a")]), **kwargs)


def test_a_tool_boundloop_cannot_use_is_a_config_error_that_names_can_avoid() -> None:
    bad_schema = {"name": "weird", "inputSchema": {"type": "array"}}
    session = FakeSession([spec("a"), bad_schema, spec("")])
    with pytest.raises(bl.ConfigError, match="MCP tool 'weird'.*object schema.*names="):
        make_tools(session)
    with pytest.raises(bl.ConfigError, match="non-empty string name.*names="):
        make_tools(FakeSession([spec("")]))
    with pytest.raises(bl.ConfigError, match="two tools named 'a'"):
        make_tools(FakeSession([spec("a"), spec("a")]))
    assert [t.name for t in make_tools(session, names=["a"])] == ["a"]  # the others left out
    # A name outside provider rules is kept: the model adapters send a stable stand-in.
    assert [t.name for t in make_tools(FakeSession([spec("files.read")]))] == ["files.read"]


def test_results_become_json_like_data() -> None:
    image = {"type": "image", "data": "aGk=", "mimeType": "image/png"}
    session = FakeSession(
        [spec("text"), spec("structured"), spec("mixed"), spec("empty"), spec("bad")],
        answers={
            "text": {"content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                 "text": "b"}]},
            "structured": {"content": [{"type": "text", "text": "{}"}],
                           "structuredContent": {"n": 1}},
            "mixed": {"content": [{"type": "text", "text": "a", "annotations": None},
                                  image]},
            "empty": {"content": []},
            "bad": {"content": [{"type": "text", "text": "no such file"}], "isError": True},
        })
    text, structured, mixed, empty, bad = calls_of(
        session, "text", "structured", "mixed", "empty", "bad")
    assert text == "a\nb"
    assert structured == {"n": 1}
    assert mixed == [{"type": "text", "text": "a"}, image]
    assert empty == ""
    assert isinstance(bad, McpToolError) and str(bad) == "no such file"
    assert bad.tool == "bad" and bad.content == [{"type": "text", "text": "no such file"}]


def test_a_handler_off_the_sessions_loop_after_it_closed_raises() -> None:
    session = FakeSession([spec("a")], answers={"a": {"content": []}})
    (tool,) = make_tools(session)  # that loop has ended

    async def main() -> None:
        with pytest.raises(RuntimeError, match="session's event loop is not running"):
            await tool.handler()
    asyncio.run(main())
    assert session.calls == []


def test_the_server_is_called_by_its_own_name_with_the_validated_arguments() -> None:
    schema = {"type": "object", "properties": {"user-id": {"type": "integer"}},
              "required": ["user-id"], "additionalProperties": False}
    session = FakeSession([{"name": "get", "inputSchema": schema}],
                          answers={"get": {"content": [{"type": "text", "text": "ok"}]}})
    (tool,) = make_tools(session, prefix="crm_")
    assert tool.name == "crm_get"
    with pytest.raises(ValueError, match="unknown field `x`"):
        tool.validate({"user-id": 1, "x": 2})
    assert calls_of(session, "get", prefix="crm_", arguments={"user-id": 3}) == ["ok"]
    assert session.calls == [("get", {"user-id": 3})]
