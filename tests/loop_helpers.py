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


def transcript(result: bl.RunResult) -> list[dict[str, Any]]:
    return msgspec.to_builtins(result.transcript)  # type: ignore[no-any-return]
