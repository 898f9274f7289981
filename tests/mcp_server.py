"""A real MCP server (the official SDK's stdio server) for tests/test_mcp.py.

Every call that reaches a tool is appended, as one JSON line ``{"tool", "arguments"}``, to
the file named by ``$BOUNDLOOP_MCP_LEDGER``, so a test can prove what did (and did not)
reach the server. Runs on the SDK's 2.x ``MCPServer`` or its 1.x ``FastMCP``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mcp.types import ToolAnnotations
from pydantic import BaseModel

try:  # SDK 2.x
    from mcp.server.mcpserver import MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # SDK 1.x
    from mcp.server.fastmcp import FastMCP as Server  # type: ignore[no-redef]
    from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]

LEDGER = "BOUNDLOOP_MCP_LEDGER"

server = Server("boundloop-test", log_level="WARNING")


def _record(tool: str, arguments: dict[str, Any]) -> None:
    with open(os.environ[LEDGER], "a", encoding="utf-8") as ledger:
        ledger.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")


class Contact(BaseModel):
    name: str
    email: str
    phone: str | None = None


@server.tool(annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True),
             structured_output=False)
def lookup(key: str) -> str:
    """Look a key up in the directory."""
    _record("lookup", {"key": key})
    return f"value of {key}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True),
             structured_output=False)
def send_mail(to: str, body: str) -> str:
    """Send an e-mail (it cannot be unsent)."""
    _record("send_mail", {"to": to, "body": body})
    return f"sent to {to}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True), structured_output=False)
def fail(reason: str) -> str:
    """Always fails, saying why."""
    _record("fail", {"reason": reason})
    raise ToolError(f"cannot do it: {reason}")  # the result says isError: true


@server.tool(annotations=ToolAnnotations(destructiveHint=False, idempotentHint=False))
def create_ticket(title: str, contact: Contact, tags: list[str] | None = None) -> dict[str, Any]:
    """Open a support ticket for a contact."""
    _record("create_ticket", {"title": title, "contact": contact.model_dump(), "tags": tags})
    return {"id": 7, "title": title, "contact": contact.name, "tags": tags or []}


@server.tool(structured_output=False)
def touch(path: str) -> str:
    """No annotations at all: MCP's defaults apply (not read-only, destructive)."""
    _record("touch", {"path": path})
    return f"touched {path}"


if __name__ == "__main__":
    server.run()
