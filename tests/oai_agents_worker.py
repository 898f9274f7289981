"""A process for the OpenAI Agents SDK crash test: runs an unmodified ``agents.Agent`` under
boundloop until the test SIGKILLs it inside a tool call.

Usage: ``python oai_agents_worker.py JOURNAL LEDGER [--idempotent]``. The agent calls
``ship`` (marked irreversible, or with ``--idempotent`` idempotent) then answers; ``ship``
appends its idempotency key to LEDGER (the real side effect) and then waits, so the test
kills the process mid-call.
The same module gives the test the agent, to resume the run in its own process.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import agents
from agents.testing import assistant_message, function_call

import boundloop as bl
from boundloop.integrations import current_call
from boundloop.integrations.openai_agents import BoundloopAgent

RUN_ID = "oai-crash"


class HistoryModel(agents.Model):
    """A fake model that picks its reply from its input, so a resumed run goes on: ``ship``
    until a ``ship`` output is in the input, then a final answer."""

    def __init__(self) -> None:
        self.requests = 0

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any,
                           tools: Any, output_schema: Any, handoffs: Any, tracing: Any, *,
                           previous_response_id: Any = None, conversation_id: Any = None,
                           prompt: Any = None) -> agents.ModelResponse:
        self.requests += 1
        outputs = [i for i in input if isinstance(i, dict)
                   and i.get("type") == "function_call_output"]
        if outputs:
            out = [assistant_message(f"shipped: {outputs[-1]['output']}")]
        else:
            out = [function_call("ship", {"item": "box"}, call_id="call_ship")]
        return agents.ModelResponse(output=out, usage=agents.Usage(requests=1, input_tokens=5,
                                                                   output_tokens=2),
                                    response_id=f"resp_{self.requests}")

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def make_agent(ledger: Path, *, wait: bool, idempotent: bool = False) -> BoundloopAgent:
    @agents.function_tool
    async def ship(item: str) -> str:
        """Ship an item (a real, non-idempotent side effect)."""
        call = current_call()
        assert call is not None
        with open(ledger, "a") as f:
            f.write(f"{call.idempotency_key} ship {item}\n")
            f.flush()
            os.fsync(f.fileno())
        if wait:
            await asyncio.sleep(60)        # the test SIGKILLs the process here
        return f"{item} shipped"

    sdk_agent = agents.Agent(name="shipper", instructions="Ship what is asked.",
                             tools=[ship], model=HistoryModel())
    kind = "idempotent" if idempotent else "irreversible"
    return BoundloopAgent(sdk_agent, tool_options={"ship": {kind: True}},
                          budget=bl.Budget(max_tool_calls=3, max_model_steps=4))


def main() -> None:
    journal, ledger = sys.argv[1], Path(sys.argv[2])
    bound = make_agent(ledger, wait=True, idempotent="--idempotent" in sys.argv[3:])
    with bl.Runner(journal) as runner:
        out = bound.run(runner, "ship a box", run_id=RUN_ID)
    print(out.status)


if __name__ == "__main__":
    main()
