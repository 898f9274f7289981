"""A process for the Pydantic AI crash tests: runs one BoundloopAgent run and may die mid-call.

Usage: ``python guest_crash_worker.py JOURNAL EFFECTS KIND [--die]`` where KIND is ``plain``
(a tool that is neither idempotent nor irreversible), ``irreversible`` or ``idempotent``
(its ``tool_options``). The agent's model asks for ``ship`` once, then answers. With ``--die``
the tool SIGKILLs its own process right after its side effect (a line appended to EFFECTS),
before boundloop can record the outcome.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

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

import boundloop as bl
from boundloop.integrations import current_call
from boundloop.integrations.pydantic_ai import BoundloopAgent

RUN_ID = "pyd-crash"


def effect_lines(effects: Path) -> list[str]:
    """One line per real side effect: the call's idempotency key."""
    return effects.read_text().splitlines() if effects.exists() else []


def build(effects: Path, kind: str, die: bool = False) -> BoundloopAgent:
    """The shipping agent, as the crashed process and the recovering one both build it."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        results = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts
                   if isinstance(p, ToolReturnPart)]
        if not results:
            return ModelResponse(parts=[ToolCallPart("ship", {"item": "box"},
                                                     tool_call_id="ship-1")])
        return ModelResponse(parts=[TextPart(f"shipping: {results[0].outcome}")])

    agent = Agent(FunctionModel(model), name="shipper")

    @agent.tool_plain
    def ship(item: str) -> str:
        """Ship an item (a real, non-idempotent side effect)."""
        call = current_call()
        with open(effects, "a") as f:
            f.write(f"{call.idempotency_key if call else '?'}\n")
            f.flush()
            os.fsync(f.fileno())
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"{item} shipped"

    options: dict[str, Any] = {}
    if kind == "irreversible":
        options = {"ship": {"irreversible": True}}
    elif kind == "idempotent":
        options = {"ship": {"idempotent": True}}
    return BoundloopAgent(agent, tool_options=options)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("journal")
    p.add_argument("effects")
    p.add_argument("kind")
    p.add_argument("--die", action="store_true")
    a = p.parse_args()
    with bl.Runner(a.journal) as runner:
        out = build(Path(a.effects), a.kind, a.die).run(runner, "ship the box", run_id=RUN_ID)
    print(out.status)


if __name__ == "__main__":
    main()
