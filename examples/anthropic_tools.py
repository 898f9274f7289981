"""A tool loop on Anthropic's Messages API under hard budgets.

Run it with a key (it uses the real API; a few thousand tokens at most):

    pip install 'boundloop[anthropic]'
    ANTHROPIC_API_KEY=sk-ant-... python examples/anthropic_tools.py          # sync client
    ANTHROPIC_API_KEY=sk-ant-... python examples/anthropic_tools.py async    # AsyncAnthropic

``ANTHROPIC_MODEL`` picks the model (default ``claude-sonnet-4-6``). The budget stops the
loop at 4 model steps, 4 tool calls, 60 seconds or 20,000 tokens, whichever comes first; the
last step is final-only (the API is sent ``tool_choice: none``). The system prompt and the
tools are marked for prompt caching. Without ``ANTHROPIC_API_KEY`` it prints this and exits.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from typing import Any

import boundloop as bl

#: Prices per million tokens (Claude Sonnet list prices; used for ``usage.cost``).
PRICE = bl.Price(input_per_mtok=3.0, output_per_mtok=15.0, cache_write_per_mtok=3.75,
                 cache_read_per_mtok=0.30)
PROMPT = "What is the weather and the local time in Paris and Tokyo?"


@bl.tool(read_only=True, idempotent=True, timeout_s=5.0)
def get_weather(city: str) -> dict[str, object]:
    """The current weather in a city (a canned answer: this is an example)."""
    return {"city": city, "temperature_c": 21, "sky": "clear"}


@bl.tool(read_only=True, idempotent=True, timeout_s=5.0)
def get_local_time(city: str) -> str:
    """The local time in a city, as HH:MM (a canned answer: this is an example)."""
    return {"paris": "14:05", "tokyo": "21:05"}.get(city.lower(), "12:00")


def report(result: bl.RunResult) -> int:
    print(f"status: {result.status} ({result.explanation})")
    print(f"model steps: {result.model_steps}, tool calls: {result.tool_calls}")
    usage = result.usage
    cost = f", cost {usage.cost:.5f}" if usage.cost is not None else ""
    print(f"tokens: {usage.input_tokens} input, {usage.cache_write_tokens} written to cache, "
          f"{usage.cache_read_tokens} read from cache, {usage.output_tokens} output{cost}")
    last = result.transcript[-1] if result.transcript else None
    if isinstance(last, bl.FinalMessage):
        print(f"answer: {last.text}")
    return 0 if result.status == "final" else 1


def main(argv: list[str]) -> int:
    if not os.environ.get("ANTHROPIC_API_KEY"):
        print(__doc__.strip())
        return 0
    try:
        import anthropic
    except ImportError:
        print("this example needs the Anthropic SDK: pip install 'boundloop[anthropic]'")
        return 0
    from boundloop.models.anthropic import AnthropicModel

    mode = argv[0] if argv else "sync"
    if mode not in ("sync", "async"):
        print(f"unknown mode {mode!r}: give `sync` or `async`")
        return 2
    options: dict[str, Any] = dict(
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"), max_tokens=1024,
        system="Answer in one short sentence. Call the tools you need in parallel.",
        price=PRICE, retry=bl.RetryPolicy(max_attempts=3, backoff_s=1.0), cache=True)
    budget = bl.Budget(max_model_steps=4, max_tool_calls=4, deadline_s=60,
                       max_total_tokens=20_000)
    tools = [get_weather, get_local_time]

    with tempfile.TemporaryDirectory() as tmp:
        journal = os.path.join(tmp, "journal")
        if mode == "sync":
            model = AnthropicModel(client=anthropic.Anthropic(), **options)
            with bl.Runner(journal) as runner:
                result = runner.run(model=model, tools=tools, budget=budget, prompt=PROMPT)
        else:
            async def run_async() -> bl.RunResult:
                # An AsyncAnthropic client makes an `async def` model; `arun` awaits it on
                # this event loop (where the client's connection pool lives).
                model = AnthropicModel(client=anthropic.AsyncAnthropic(), **options)
                async with bl.Runner(journal) as runner:
                    return await runner.arun(model=model, tools=tools, budget=budget,
                                             prompt=PROMPT)

            result = asyncio.run(run_async())
    return report(result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
