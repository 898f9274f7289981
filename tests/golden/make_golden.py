"""Record the golden journals: one real run per status a run can reach (and a few paths).

    python tests/golden/make_golden.py

runs each scenario on a real Runner with a fresh LMDB journal and writes, for each run,
``<name>.jsonl`` (``boundloop export``'s JSON lines, readable) and ``<name>.msgpack`` (a
msgpack array of the events' msgpack bytes, as a format 2 journal stored them).
``tests/test_inspect.py`` replays and checks them with the current code, so a change to the
events or the policy that would break old journals, or change past decisions, fails a test.

Re-record only on purpose (a deliberate change of a decision rule), never to make a failing
golden test pass: old journals must keep replaying. ``journal_unavailable`` cannot be
recorded (the journal is what failed), ``needs_review`` needs a crash and a resume, and
``rejected`` runs are never journaled.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

import boundloop as bl
from boundloop import ops as bi
from boundloop.journal import codec

HERE = Path(__file__).resolve().parent
SECRET = "s3cret-deploy-token"


def tools() -> list[bl.Tool]:
    @bl.tool(read_only=True, idempotent=True, timeout_s=5.0)
    def weather(city: str) -> dict[str, Any]:
        """Today's weather in a city."""
        return {"city": city, "sky": "sunny", "high_c": 21}

    @bl.tool(irreversible=True, timeout_s=5.0)
    def deploy(service: str, token: str) -> str:
        """Deploy a service (the token is redacted in the journal)."""
        return f"{service} deployed"

    attempts: list[int] = []

    @bl.tool(idempotent=True, retry=bl.RetryPolicy(max_attempts=2))
    def flaky(n: int) -> int:
        """Fails on its first attempt."""
        attempts.append(n)
        if len(attempts) == 1:
            raise ConnectionError("connection reset")
        return n * 2

    @bl.tool(timeout_s=0.05)
    def slow(name: str) -> str:
        """Takes longer than its timeout."""
        time.sleep(0.3)
        return name

    @bl.tool(timeout_s=5.0)
    def slower(name: str) -> str:
        """Takes longer than a short deadline."""
        time.sleep(0.4)
        return name

    @bl.tool(read_only=True)
    def dump(size: int) -> str:
        """A large result."""
        return "y" * size

    @bl.tool
    def halt(ctx: bl.ToolContext) -> str:
        """Cancels the run it serves."""
        ctx.cancel.cancel("an operator stopped the run")
        return "halted"

    return [weather, deploy, flaky, slow, slower, dump, halt]


def call(cid: str, tool_name: str, /, **arguments: Any) -> bl.ToolCall:
    return bl.ToolCall(cid, tool_name, arguments)


def calls(*items: bl.ToolCall, usage: bl.Usage | None = None) -> bl.CallTools:
    return bl.CallTools(list(items), usage=usage)


def no_prod(c: bl.ToolCall, tool: bl.Tool, ctx: bl.ModelContext) -> Any:
    return "deploys to prod need a person" if c.arguments.get("service") == "prod" else True


def cancel_from_model(history: Any, ctx: bl.ModelContext) -> Any:
    ctx.cancel.cancel("the user closed the tab")
    return calls(call("c1", "weather", city="Oslo"))


#: name -> (script, budget, permit)
SCENARIOS: dict[str, tuple[list[Any], bl.Budget, Callable[..., Any] | None]] = {
    # final, through every decision: allow, denied, unknown_tool, invalid_arguments; a
    # redacted argument; a malformed response retried with a notice.
    "final": ([
        calls(call("c1", "weather", city="Paris"),
              call("c2", "deploy", service="prod", token=SECRET),
              call("c3", "translate", text="bonjour"),
              call("c4", "weather", city=5)),
        calls(call("c5", "deploy", service="api", token=SECRET)),
        {"kind": "calls", "calls": []},
        bl.Final("Sunny in Paris; api deployed, prod needs a person."),
    ], bl.Budget(malformed_retries=1), no_prod),
    # final after a retried failure, a timeout (outcome unknown) and a too-large result.
    "final_retry_timeout": ([
        calls(call("c1", "flaky", n=21), call("c2", "slow", name="q3"),
              call("c3", "dump", size=500)),
        bl.Final("42; the report's outcome is unknown; the dump was too large."),
    ], bl.Budget(max_result_bytes=200), None),
    "limit_tool_calls": ([
        calls(call("c1", "weather", city="Rome")),
        calls(call("c2", "weather", city="Oslo"), call("c3", "weather", city="Bern")),
    ], bl.Budget(max_tool_calls=2), None),
    "limit_model_steps": ([
        calls(call("c1", "weather", city="Rome")),
        calls(call("c2", "weather", city="Oslo")),
    ], bl.Budget(max_model_steps=2), None),
    "limit_deadline": ([
        calls(call("c1", "slower", name="q4")),
        bl.Final("never reached"),
    ], bl.Budget(deadline_s=0.2), None),
    # usage reported by the model goes over the limit: nothing of that response runs.
    "limit_total_tokens": ([
        calls(call("c1", "weather", city="Rome"),
              usage=bl.Usage(input_tokens=300, output_tokens=150)),
    ], bl.Budget(max_total_tokens=400), None),
    # the next step's reservation would go over the limit: the model is not called.
    "limit_input_tokens": ([
        calls(call("c1", "weather", city="Rome"), usage=bl.Usage(input_tokens=330)),
        bl.Final("never reached"),
    ], bl.Budget(max_input_tokens=350), None),
    "repeated_call": ([
        calls(call("c1", "weather", city="Rome")),
        calls(call("c1", "weather", city="Rome")),
    ], bl.Budget(), None),
    "cancelled": ([cancel_from_model], bl.Budget(), None),
    "cancelled_dispatch": ([
        calls(call("c1", "halt"), call("c2", "weather", city="Rome")),
    ], bl.Budget(max_parallel=1), None),
    "malformed_response": ([{"kind": "calls", "calls": []}], bl.Budget(), None),
    "model_error": ([RuntimeError("provider returned 503")], bl.Budget(), None),
}


def record(out: Path) -> dict[str, str]:
    """Run every scenario and write its files into ``out``; returns name -> status."""
    statuses: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, bl.Runner(Path(tmp) / "journal") as runner:
        for name, (script, budget, permit) in SCENARIOS.items():
            result = runner.run(model=bl.ScriptedModel(script), tools=tools(),
                                prompt=f"golden scenario {name}", budget=budget,
                                permit=permit, run_id=f"golden-{name}")
            events = list(runner.journal.events(result.run_id))
            lines = bi.export_lines(events, runner.journal.secret_key)
            (out / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines))
            raw = msgspec.msgpack.encode([codec.encode(e) for e in events])
            (out / f"{name}.msgpack").write_bytes(raw)
            statuses[name] = f"{result.status} {result.exhausted_limit or ''}".strip()
    return statuses


if __name__ == "__main__":
    for scenario, status in record(HERE).items():
        print(f"{scenario:22} {status}")
    sys.exit(0)
