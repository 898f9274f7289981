"""A worker process for the ownership tests: one run of three ``mail`` calls, one at a time.

Usage: ``python fence_worker.py JOURNAL LEDGER MARKER [--lease S] [--hold S] [--tool KIND]``.
``mail`` appends ``<worker> <call> <attempt> <epoch>`` to LEDGER for every real side effect;
the first call writes MARKER (so the test knows a handler is running) and then waits
``--hold`` seconds (the test SIGSTOPs the process meanwhile). The run's result is printed
as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import boundloop as bl

RUN_ID = "fenced-run"


def mail_tool(ledger: Path, who: str, marker: Path | None = None, hold: float = 0.0,
              kind: str = "plain") -> bl.Tool:
    """The side effect under test: each real execution is one ledger line."""

    def mail(n: int, ctx: bl.ToolContext) -> str:
        with open(ledger, "a") as f:
            f.write(f"{who} {n} {ctx.attempt} {ctx.epoch}\n")
            f.flush()
            os.fsync(f.fileno())
        if marker is not None and n == 1:
            marker.write_text(str(os.getpid()))
            time.sleep(hold)
        return f"mail {n} sent"

    return bl.Tool("mail", mail, irreversible=kind == "irreversible",
                   idempotent=kind == "idempotent", timeout_s=None)


def script() -> bl.ScriptedModel:
    return bl.ScriptedModel([
        bl.CallTools([bl.ToolCall(f"c{n}", "mail", {"n": n}) for n in (1, 2, 3)]),
        bl.Final("all sent"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("journal")
    parser.add_argument("ledger")
    parser.add_argument("marker")
    parser.add_argument("--lease", type=float, default=1.5)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--tool", default="plain")
    args = parser.parse_args()
    tool = mail_tool(Path(args.ledger), "A", Path(args.marker), args.hold, args.tool)
    with bl.Runner(args.journal, lease_s=args.lease) as runner:
        result = runner.run(model=script(), tools=[tool], prompt="send three mails",
                            run_id=RUN_ID, budget=bl.Budget(max_parallel=1))
    print(json.dumps({"status": result.status, "explanation": result.explanation,
                      "tool_calls": result.tool_calls}), flush=True)


if __name__ == "__main__":
    main()
