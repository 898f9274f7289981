"""Agents of other frameworks, run under boundloop's budgets and journal.

``boundloop.integrations.pydantic_ai`` and ``boundloop.integrations.openai_agents`` (each an
optional extra) wrap an agent of that framework as a ``Guest``: boundloop drives the run, and
asks the framework for one model step at a time, starting it afresh from the run's recorded
history each step; the framework's function tools become boundloop tools. So every model
request and every tool call is decided, journaled and counted by boundloop, and a crashed
run is resumed from the journal alone. This package holds the framework-neutral part.
"""

from boundloop.integrations._guest import (
    Guest,
    GuestResult,
    GuestTool,
    OneRequest,
    current_call,
    render_output,
)

__all__ = ["Guest", "GuestResult", "GuestTool", "OneRequest", "current_call", "render_output"]
