"""Pydantic AI on the shared workload: tool rounds per second, with no journal at all.

An ``Agent`` over a ``FunctionModel`` (a deterministic script standing in for the LLM: one
``noop`` tool call per model step for ``--rounds`` steps, then the text answer ``done``) and
one no-op tool. Pydantic AI keeps a run's state in memory only: nothing is written to disk,
so this is an upper bound for an agent loop without durability, not a durable peer. Runs in
flight are asyncio tasks on one event loop (``agent.run``); ``--tool sync`` registers a plain
function instead of a coroutine (Pydantic AI then runs it on a worker thread).
"""

from __future__ import annotations

import asyncio
import sys
from argparse import ArgumentParser, Namespace
from importlib.metadata import version

import _common as c
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits

CALLS = c.Counter()


def make_agent(rounds: int, sync_tool: bool) -> Agent[None, str]:
    """The agent: a scripted model calling ``noop`` ``rounds`` times, then answering."""

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(p, ToolReturnPart)
                   for m in messages if isinstance(m, ModelRequest) for p in m.parts)
        if done < rounds:
            return ModelResponse(parts=[ToolCallPart("noop", {}, tool_call_id=f"c{done}")])
        return ModelResponse(parts=[TextPart(c.FINAL)])

    agent: Agent[None, str] = Agent(FunctionModel(script), output_type=str)
    if sync_tool:
        @agent.tool_plain(name="noop")
        def noop_sync() -> None:
            """Does nothing."""
            CALLS.hit()
    else:
        @agent.tool_plain(name="noop")
        async def noop() -> None:
            """Does nothing."""
            CALLS.hit()
    return agent


async def measure(args: Namespace) -> tuple[c.Timing, c.Timing]:
    agent = make_agent(args.rounds, args.tool == "sync")
    # the same step budget as boundloop's bench (max_model_steps=rounds + 2)
    limits = UsageLimits(request_limit=args.rounds + 2, tool_calls_limit=max(20, args.rounds))

    async def run_one(run_id: str) -> str:
        return (await agent.run("go", usage_limits=limits)).output

    warm = await c.drive_async(run_one, c.warmup_ids(args), args.inflight)
    return warm, await c.drive_async(run_one, c.timed_ids(args), args.inflight)


def main() -> None:
    def extra(p: ArgumentParser) -> None:
        p.add_argument("--tool", choices=("async", "sync"), default="async",
                       help="register the no-op tool as a coroutine (default) or a function")

    args = c.parse_args(__doc__.split("\n\n")[0], extra)
    warm, timing = asyncio.run(measure(args))
    c.check(args, timing, CALLS.value, warm)
    how = "sequential" if args.inflight == 1 else "asyncio tasks"
    c.report(args, peer="pydantic_ai", version=version("pydantic-ai-slim"),
             mode=f"no journal (in memory only); {how}, {args.tool} tool", timing=timing)


if __name__ == "__main__":
    sys.exit(main())
