"""A worker process for the fleet tests: ``bl.Worker`` serving the agents of ``fleet_agents``.

Usage: ``python queue_worker.py JOURNAL LEDGER [--lease S] [--concurrency N] [--grace S]``
where JOURNAL is an LMDB directory or a ``postgresql://`` URL. Every real side effect of a
tool appends one line to LEDGER (fsync'd), so a test can count effects against the journal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import boundloop as bl


def effects(ledger: Path) -> list[dict[str, Any]]:
    """Every real side effect: its idempotency key, execution id, attempt, run and tool."""
    if not ledger.exists():
        return []
    out = []
    for line in ledger.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line a SIGKILL cut short: its effect is the next line's, if any
    return out


def fleet_agents(ledger: Path) -> list[bl.Agent]:
    """``fleet``: one model step calls ``act`` (not idempotent; reconciled through the
    ledger), the next answers. ``gated``: the same with ``act`` needing approval."""

    def effect(ctx: bl.ToolContext, tool: str) -> str:
        time.sleep(random.uniform(0, 0.02))
        line = json.dumps({"key": ctx.idempotency_key, "eid": ctx.execution_id,
                           "attempt": ctx.attempt, "run": ctx.run_id, "tool": tool,
                           "pid": os.getpid(), "epoch": ctx.epoch})
        with open(ledger, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        time.sleep(random.uniform(0, 0.02))
        return f"{tool} done"

    def acted(key: str) -> str | None:
        return "act done" if any(e["key"] == key for e in effects(ledger)) else None

    @bl.tool(reconcile=acted, timeout_s=10)
    def act(n: str, ctx: bl.ToolContext) -> str:
        """Act once on n."""
        return effect(ctx, "act")

    @bl.tool(reconcile=acted, timeout_s=10, needs_approval=True)
    def pay(n: str, ctx: bl.ToolContext) -> str:
        """Pay n (a person approves it first)."""
        return effect(ctx, "pay")

    def model_for(tool: str) -> Any:
        def model(history: list[Any], ctx: bl.ModelContext) -> Any:
            time.sleep(random.uniform(0.01, 0.06))
            if not any(m.kind == "tool_result" for m in history):
                return bl.CallTools([bl.ToolCall(f"c{ctx.step}", tool, {"n": ctx.run_id})])
            return bl.Final(f"done {ctx.run_id}")
        return model

    budget = bl.Budget(max_model_steps=30, max_tool_calls=30)
    return [bl.Agent("fleet", model=model_for("act"), tools=[act], budget=budget, version="1"),
            bl.Agent("gated", model=model_for("pay"), tools=[pay], budget=budget)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("journal")
    p.add_argument("ledger")
    p.add_argument("--lease", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--grace", type=float, default=5.0)
    args = p.parse_args()
    worker = bl.Worker(args.journal, fleet_agents(Path(args.ledger)),
                       concurrency=args.concurrency, grace_s=args.grace, poll_s=0.05,
                       lease_s=args.lease)
    import threading

    def ready() -> None:
        if worker.wait_ready(60):
            print("ready", flush=True)  # its signal handlers are in place

    threading.Thread(target=ready, daemon=True).start()
    worker.serve()
    print(f"bye {len(worker.finished)}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
