"""A worker process for crash tests: runs one scripted run and may die mid-way.

Usage: ``python crash_worker.py JOURNAL LEDGER TOOLS [--die] [--fail-at N --mode MODE]``
where JOURNAL is an LMDB directory or a ``postgresql://`` URL and TOOLS is a comma-separated
list of tool names called one per step, in order. With ``--die`` the first handler to run
SIGKILLs the process right after its side effect.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import boundloop as bl
from boundloop.journal import LmdbJournal
from boundloop.journal.postgres import is_url
from boundloop.testing import FaultyJournal

RUN_ID = "crash-run"
ARGS = {"ship": {"item": "box"}, "charge": {"amount": 5}, "book": {"room": "b12"}}


def ledger_lines(ledger: Path) -> list[tuple[str, str]]:
    """(idempotency key, tool) for every real side effect, in order."""
    if not ledger.exists():
        return []
    return [tuple(line.split()) for line in ledger.read_text().splitlines()]  # type: ignore[misc]


def make_tools(ledger: Path, die: bool = False) -> list[bl.Tool]:
    """ship is irreversible, charge idempotent, book reconcilable; each appends one ledger
    line per real side effect, keyed by its idempotency key."""

    def act(name: str, ctx: bl.ToolContext) -> str:
        with open(ledger, "a") as f:
            f.write(f"{ctx.idempotency_key} {name}\n")
            f.flush()
            os.fsync(f.fileno())
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"{name} done"

    @bl.tool(irreversible=True)
    def ship(item: str, ctx: bl.ToolContext) -> str:
        return act("ship", ctx)

    @bl.tool(idempotent=True)
    def charge(amount: int, ctx: bl.ToolContext) -> str:
        return act("charge", ctx)

    def booked(key: str) -> str | None:
        return "book done" if any(k == key for k, _ in ledger_lines(ledger)) else None

    @bl.tool(reconcile=booked)
    def book(room: str, ctx: bl.ToolContext) -> str:
        return act("book", ctx)

    return [ship, charge, book]


def script(tools: list[str]) -> list[object]:
    """One call per step to each tool in turn, then a final answer."""
    steps: list[object] = [bl.CallTools([bl.ToolCall(f"c{i}", name, ARGS[name])])
                           for i, name in enumerate(tools, 1)]
    return [*steps, bl.Final("all done")]


def model_for(tools: list[str]) -> object:
    """A model that picks its next step from the history, so a resumed run continues."""

    def model(history: list[bl.Message], ctx: bl.ModelContext) -> object:
        done = sum(1 for m in history if m.kind == "tool_result")
        if done >= len(tools):
            return bl.Final("all done")
        name = tools[done]
        return bl.CallTools([bl.ToolCall(f"c{done + 1}", name, ARGS[name])])

    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("journal")
    p.add_argument("ledger")
    p.add_argument("tools")
    p.add_argument("--die", action="store_true")
    p.add_argument("--fail-at", type=int)
    p.add_argument("--mode", default="kill_before")
    a = p.parse_args()
    names = a.tools.split(",")
    journal: bl.journal.Journal  # type: ignore[attr-defined]
    if is_url(a.journal):
        from boundloop.journal.postgres import PostgresJournal

        journal = PostgresJournal(a.journal)
    else:
        journal = LmdbJournal(a.journal)
    if a.fail_at:
        journal = FaultyJournal(journal, a.fail_at, a.mode)
    with bl.Runner(journal) as runner:
        result = runner.run(model=model_for(names), tools=make_tools(Path(a.ledger), a.die),
                            prompt="go", run_id=RUN_ID)
    print(result.status)
    sys.exit(0)


if __name__ == "__main__":
    main()
