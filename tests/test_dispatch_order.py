"""SPEC 5.9 and 6: every dispatch follows its durably committed CallDecided.

Each handler asks another process to open the same journal directory and find the call's
CallDecided by execution id: only committed data is visible to another process, so this
proves the intent was durable before the handler ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec

import boundloop as bl

PROBE = """
import json, sys
from boundloop.journal.lmdb import LmdbJournal

path, run_id, eid = sys.argv[1:4]
journal = LmdbJournal(path, sync=False, create=False)
try:
    decided = [
        {"seq": seq, "decision": e.decision, "call_id": e.call_id, "tool": e.tool,
         "idempotency_key": e.idempotency_key}
        for seq, e in journal.read(run_id)
        if type(e).__name__ == "CallDecided" and e.execution_id == eid
    ]
finally:
    journal.close()
print(json.dumps(decided))
"""


def committed_intent(journal_dir: Path, run_id: str, execution_id: str) -> list[dict[str, Any]]:
    """The CallDecided events another process can read for ``execution_id``."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(journal_dir), run_id, execution_id],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_every_dispatch_follows_its_committed_decision(runner: bl.Runner,
                                                       journal_dir: Path) -> None:
    lock = threading.Lock()
    handled: list[dict[str, Any]] = []

    def observe(ctx: bl.ToolContext, tool: str) -> None:
        found = committed_intent(journal_dir, ctx.run_id, ctx.execution_id)
        with lock:
            handled.append({"tool": tool, "call_id": ctx.call_id,
                            "execution_id": ctx.execution_id, "attempt": ctx.attempt,
                            "idempotency_key": ctx.idempotency_key, "found": found})

    @bl.tool(timeout_s=30)
    def probe(label: str, ctx: bl.ToolContext) -> str:
        """Check that this call's intent is already durable."""
        observe(ctx, "probe")
        return label

    @bl.tool(timeout_s=30, idempotent=True, retry=bl.RetryPolicy(max_attempts=2))
    def flaky(ctx: bl.ToolContext) -> str:
        """Check the intent on every attempt; the first one fails."""
        observe(ctx, "flaky")
        if ctx.attempt == 1:
            raise ConnectionError("first attempt fails")
        return "second attempt worked"

    def permit(call: bl.ToolCall, tool: bl.Tool, ctx: bl.ModelContext) -> bool | str:
        return "not this one" if call.arguments.get("label") == "deny" else True

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "probe", {"label": "a"}),
                      bl.ToolCall("d", "probe", {"label": "deny"}),
                      bl.ToolCall("b", "probe", {"label": "b"})]),
        bl.CallTools([bl.ToolCall("f", "flaky", {})]),
        bl.Final("done"),
    ])
    result = runner.run(model=model, tools=[probe, flaky], prompt="go", permit=permit)

    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (3, 5)  # 3 calls + flaky's 2 attempts
    assert [(m["id"], m["status"]) for m in msgspec.to_builtins(result.transcript)
            if m["kind"] == "tool_result"] == [("a", "ok"), ("d", "denied"), ("b", "ok"),
                                               ("f", "ok")]

    # Inside every handler run, another process already saw the allowed intent.
    assert sorted((h["call_id"], h["attempt"]) for h in handled) == [
        ("a", 1), ("b", 1), ("f", 1), ("f", 2)]
    for h in handled:
        assert len(h["found"]) == 1, h
        intent = h["found"][0]
        assert intent["decision"] == "allow"
        assert (intent["call_id"], intent["tool"], intent["idempotency_key"]) == (
            h["call_id"], h["tool"], h["idempotency_key"])
    flaky_runs = [h for h in handled if h["tool"] == "flaky"]
    assert len({h["execution_id"] for h in flaky_runs}) == 1

    # And in the journal, each dispatch comes after its decision.
    records = list(runner.journal.read(result.run_id))
    seqs = [seq for seq, _ in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    decided = {e.execution_id: (seq, e) for seq, e in records
               if type(e).__name__ == "CallDecided"}
    dispatched = [(seq, e) for seq, e in records if type(e).__name__ == "CallDispatched"]
    assert len(dispatched) == 4
    for seq, e in dispatched:
        assert e.execution_id in decided
        decided_seq, intent = decided[e.execution_id]
        assert decided_seq < seq
        assert intent.decision == "allow"
    assert {e.execution_id for _, e in dispatched} == {h["execution_id"] for h in handled}
    denied = [e for _, e in decided.values() if e.call_id == "d"]
    assert len(denied) == 1 and denied[0].decision == "denied"
    assert denied[0].execution_id not in {e.execution_id for _, e in dispatched}
    for seq, e in records:
        if type(e).__name__ in ("CallSucceeded", "CallFailed"):
            assert decided[e.execution_id][0] < seq

    events = [e for _, e in records]
    assert type(events[-1]).__name__ == "RunFinished"
    state = bl.replay(events)
    assert (state.status, state.model_steps, state.tool_calls) == ("final", 3, 5)
    assert msgspec.to_builtins(state.transcript) == msgspec.to_builtins(result.transcript)
