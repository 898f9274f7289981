"""OpenAI Agents SDK + SQLiteSession on the shared workload: durable tool rounds per second.

``Runner.run`` over an ``Agent`` whose model is a local ``Model`` implementation (a
deterministic script standing in for the LLM: one ``noop`` function call per model step for
``--rounds`` steps, then the assistant message ``done``), with one no-op ``function_tool``.
Each run has its own ``SQLiteSession`` (session id = run id) on one shared file: the SDK's
durable conversation store, which it opens in WAL mode; its synchronous level is SQLite's
compiled default, FULL here (checked). Tracing is disabled (``set_tracing_disabled(True)``)
and no OpenAI client is ever built: nothing touches the network. Runs in flight are asyncio
tasks on one event loop (the session does its SQLite work on ``asyncio.to_thread``).

What the session makes durable is the conversation (input, each function call and its
output, the final message), saved as the run goes; the SDK has no journal of the run itself
to resume a crashed run from, so a crash mid-run leaves the history so far, not a resumable run.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from argparse import Namespace
from collections.abc import AsyncIterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _common as c
from agents import (
    Agent,
    Model,
    ModelResponse,
    RunConfig,
    Runner,
    SQLiteSession,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

CALLS = c.Counter()


@function_tool
async def noop() -> str:
    """Does nothing."""
    CALLS.hit()
    return ""


def _kind(item: Any) -> Any:
    return item.get("type") if isinstance(item, dict) else getattr(item, "type", None)


class ScriptedModel(Model):
    """A fake LLM: a ``noop`` call while fewer than ``rounds`` tool results are in the input."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    async def get_response(self, system_instructions: str | None, input: Any,
                           model_settings: Any, tools: Any, output_schema: Any,
                           handoffs: Any, tracing: Any, *, previous_response_id: str | None,
                           conversation_id: str | None, prompt: Any) -> ModelResponse:
        items = input if isinstance(input, list) else []
        done = sum(_kind(i) == "function_call_output" for i in items)
        if done < self.rounds:
            out: Any = ResponseFunctionToolCall(id=f"fc{done}", call_id=f"c{done}",
                                                type="function_call", name="noop",
                                                arguments="{}")
        else:
            out = ResponseOutputMessage(
                id="m", type="message", role="assistant", status="completed",
                content=[ResponseOutputText(text=c.FINAL, type="output_text",
                                            annotations=[], logprobs=[])])
        return ModelResponse(output=[out], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the benchmark never streams")


async def measure(args: Namespace, db: Path) -> tuple[c.Timing, c.Timing]:
    agent = Agent(name="bench", instructions="", model=ScriptedModel(args.rounds),
                  tools=[noop])
    run_config = RunConfig(tracing_disabled=True)

    async def run_one(run_id: str) -> str:
        session = SQLiteSession(run_id, db)
        try:
            result = await Runner.run(agent, "go", session=session, run_config=run_config,
                                      max_turns=args.rounds + 2)
        finally:
            session.close()
        return str(result.final_output)

    warm = await c.drive_async(run_one, c.warmup_ids(args), args.inflight)
    return warm, await c.drive_async(run_one, c.timed_ids(args), args.inflight)


def verify_db(args: Namespace, db: Path) -> dict[str, Any]:
    """Fail unless the session file (WAL) holds every run with its calls and answer."""
    with sqlite3.connect(db) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = conn.execute("PRAGMA synchronous").fetchone()[0]
        sessions = conn.execute("SELECT COUNT(*) FROM agent_sessions").fetchone()[0]
        per = conn.execute("SELECT COUNT(*) FROM agent_messages").fetchone()[0]
    runs = args.runs + args.warmup
    if mode != "wal" or sync != 2:
        c.fail(f"session db is journal_mode={mode} synchronous={sync}, not wal/2 (FULL)")
    if sessions != runs:
        c.fail(f"session db holds {sessions} sessions, expected {runs}")
    # user input + (call + output) per round + final message
    if per != runs * (2 * args.rounds + 2):
        c.fail(f"session db holds {per} items, expected {runs * (2 * args.rounds + 2)}")
    return {"session_items": per}


def main() -> None:
    args = c.parse_args(__doc__.split("\n\n")[0])
    set_tracing_disabled(True)
    db = args.dir / "sessions.sqlite"
    warm, timing = asyncio.run(measure(args, db))
    c.check(args, timing, CALLS.value, warm)
    rows = verify_db(args, db)
    how = "sequential" if args.inflight == 1 else "asyncio tasks"
    c.report(args, peer="openai_agents", version=version("openai-agents"),
             mode=f"SQLiteSession WAL synchronous=FULL (conversation only); {how}",
             timing=timing, **rows)


if __name__ == "__main__":
    sys.exit(main())
