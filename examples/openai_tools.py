"""A tool loop on OpenAI under hard budgets.

Run it with a key (it uses the real API; a few hundred tokens):

    pip install 'boundloop[openai]'
    OPENAI_API_KEY=sk-... python examples/openai_tools.py             # Chat Completions
    OPENAI_API_KEY=sk-... python examples/openai_tools.py responses   # the Responses API

``OPENAI_MODEL`` picks the model (default ``gpt-4.1-mini``; for the Responses API with a
reasoning model, e.g. ``o4-mini``, the reasoning items are sent back on each step). Without
``OPENAI_API_KEY`` it prints this and exits.
"""

from __future__ import annotations

import os
import sys
import tempfile

import boundloop as bl


@bl.tool(read_only=True, idempotent=True, timeout_s=5.0)
def get_weather(city: str) -> dict[str, object]:
    """The current weather in a city (a canned answer: this is an example)."""
    return {"city": city, "temperature_c": 21, "sky": "clear"}


@bl.tool(read_only=True, idempotent=True, timeout_s=5.0)
def get_local_time(city: str) -> str:
    """The local time in a city, as HH:MM (a canned answer: this is an example)."""
    return {"paris": "14:05", "tokyo": "21:05"}.get(city.lower(), "12:00")


def main(argv: list[str]) -> int:
    if not os.environ.get("OPENAI_API_KEY"):
        print(__doc__.strip())
        return 0
    try:
        import openai
    except ImportError:
        print("this example needs the OpenAI SDK: pip install 'boundloop[openai]'")
        return 0
    from boundloop.models.openai import OpenAIChatModel, OpenAIResponsesModel

    api = argv[0] if argv else "chat"
    if api not in ("chat", "responses"):
        print(f"unknown API {api!r}: give `chat` or `responses`")
        return 2
    adapter = OpenAIResponsesModel if api == "responses" else OpenAIChatModel
    model = adapter(client=openai.OpenAI(), model=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"),
                    max_tokens=1024, system="Answer in one short sentence.",
                    retry=bl.RetryPolicy(max_attempts=3, backoff_s=1.0))
    budget = bl.Budget(max_model_steps=4, max_tool_calls=4, deadline_s=60,
                       max_total_tokens=20_000)

    with tempfile.TemporaryDirectory() as tmp, bl.Runner(os.path.join(tmp, "journal")) as runner:
        result = runner.run(model=model, tools=[get_weather, get_local_time], budget=budget,
                            prompt="What is the weather and the local time in Paris and Tokyo?")
    print(f"status: {result.status} ({result.explanation})")
    print(f"model steps: {result.model_steps}, tool calls: {result.tool_calls}")
    usage = result.usage
    print(f"tokens: {usage.input_tokens} input, {usage.cache_read_tokens} cached, "
          f"{usage.output_tokens} output")
    last = result.transcript[-1] if result.transcript else None
    if isinstance(last, bl.FinalMessage):
        print(f"answer: {last.text}")
    return 0 if result.status == "final" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
