"""Helpers shared by the loop contract tests: the journal checks every run must pass."""

from __future__ import annotations

from typing import Any

import msgspec

import boundloop as bl

USER = {"kind": "user", "text": "go"}


def journal_of(runner: bl.Runner, result: bl.RunResult) -> tuple[list[str], list[Any]]:
    """The run's events; asserts they end in one RunFinished and replay to ``result``."""
    events = list(runner.journal.events(result.run_id))
    names = [type(e).__name__ for e in events]
    assert names[0] == "RunAdmitted"
    assert names[-1] == "RunFinished" and names.count("RunFinished") == 1
    fin = events[-1]
    assert (fin.status, fin.exhausted_limit, fin.explanation, fin.model_steps, fin.tool_calls) \
        == (result.status, result.exhausted_limit, result.explanation, result.model_steps,
            result.tool_calls)
    assert names.count("ModelStepStarted") == result.model_steps
    for e in events:
        if type(e).__name__.startswith("Call"):
            assert e.execution_id
    state = bl.replay(events)
    assert (state.status, state.exhausted_limit, state.model_steps, state.tool_calls) == (
        result.status, result.exhausted_limit, result.model_steps, result.tool_calls)
    assert msgspec.to_builtins(state.transcript) == msgspec.to_builtins(result.transcript)
    assert state.usage == result.usage
    assert state.unresolved == result.unresolved
    return names, events


def transcript(result: bl.RunResult, steps: bool = False) -> list[dict[str, Any]]:
    """The transcript's dict form; without ``steps``, call messages leave out their
    ``step`` (tests of turns check it: tests/test_turns.py)."""
    out: list[dict[str, Any]] = msgspec.to_builtins(result.transcript)
    if not steps:
        for m in out:
            if m["kind"] == "call":
                m.pop("step", None)
    return out


def plain(value: Any) -> Any:
    """``msgspec.to_builtins(value)``, with call messages' ``step`` left out."""
    out = msgspec.to_builtins(value)
    items = out if isinstance(out, list) else [out]
    for m in items:
        if isinstance(m, dict) and m.get("kind") == "call":
            m.pop("step", None)
    return out
