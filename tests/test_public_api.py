"""The public surface is pinned (DESIGN rule 8): exactly these names, each documented."""

from __future__ import annotations

import inspect
import types
import typing

import msgspec
import pytest

import boundloop as bl
from boundloop import events

EXPECTED = {
    # running
    "Runner", "RunResult", "CompletedAction", "UnresolvedAction", "CancelToken", "Telemetry",
    # recovery
    "RecoveredRun",
    # budgets and metering
    "Budget", "Remaining", "Usage", "Price",
    # models and messages
    "ModelContext", "ScriptedModel", "ScriptExhausted", "Final", "CallTools", "ToolCall",
    "Malformed", "ResponseInfo", "Message", "UserMessage", "AssistantMessage", "CallMessage",
    "ToolResultMessage", "FinalMessage", "NoticeMessage",
    # tools
    "tool", "Tool", "ToolContext", "RetryPolicy", "mcp_tools", "McpToolError",
    # replay and journal events
    "replay", "apply", "RunState", "ReplayError", "events", "Event", "RunAdmitted",
    "ModelStepStarted", "ModelStepCompleted", "ModelStepFailed", "NoticeAdded", "UsageCharged",
    "CallDecided", "CallDispatched", "CallSucceeded", "CallFailed", "CallTimedOut",
    "CallOutcomeUnknown", "CallReconciled", "CallSkipped", "CallResolved", "RoundCompleted",
    "ChildCharged", "OwnerClaimed", "RunResumed", "RunFinished",
    # time
    "Clock", "FakeClock",
    # errors
    "BoundloopError", "ConfigError", "JournalError", "JournalUnavailable", "JournalCorrupt",
    "SequenceConflict", "LeaseLost", "AdmissionError", "UnknownRun", "RecoveryError",
    "RunnerClosed",
}


def test_all_is_exactly_the_public_surface() -> None:
    assert len(bl.__all__) == len(set(bl.__all__)), "duplicate names in __all__"
    assert set(bl.__all__) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_public_name_exists_and_has_its_own_docstring(name: str) -> None:
    obj = getattr(bl, name)
    if isinstance(obj, types.UnionType) or typing.get_origin(obj) is typing.Union:
        # A union alias cannot carry a docstring of its own: each member must.
        members = typing.get_args(obj)
        assert members
        for member in members:
            assert "__doc__" in vars(member) and inspect.cleandoc(member.__doc__ or "")
        return
    own = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    assert isinstance(own, str) and own.strip(), f"bl.{name} has no docstring of its own"


def test_spec_section_1_names_are_public() -> None:
    for name in ("Runner", "RunResult", "Budget", "CancelToken", "ScriptedModel", "Final",
                 "CallTools", "ToolCall", "ModelContext", "ToolContext", "tool", "Tool",
                 "RetryPolicy", "replay", "RunState", "RecoveredRun", "CompletedAction",
                 "UnresolvedAction", "Usage", "ConfigError", "FakeClock"):
        assert hasattr(bl, name), f"SPEC names bl.{name}"


def test_spec_section_1_runner_methods() -> None:
    for name in ("run", "submit", "cancel", "recover", "journal", "close"):
        assert hasattr(bl.Runner, name), f"SPEC 1 uses Runner.{name}"


def fields(cls: type) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)}


def test_spec_field_names() -> None:
    assert fields(bl.RunResult) >= {
        "run_id", "status", "exhausted_limit", "explanation", "model_steps", "tool_calls",
        "transcript", "completed", "unresolved", "usage", "elapsed_s"}
    assert fields(bl.Budget) >= {
        "max_model_steps", "max_tool_calls", "max_parallel", "deadline_s", "max_input_tokens",
        "max_output_tokens", "max_total_tokens", "max_cost", "max_result_bytes",
        "reserve_final_step", "malformed_retries"}
    assert fields(bl.ModelContext) >= {
        "run_id", "step", "tools_allowed", "tools", "remaining", "deadline", "cancel"}
    assert fields(bl.UnresolvedAction) >= {
        "run_id", "call_id", "tool", "execution_id", "idempotency_key", "attempt", "phase"}
    assert fields(bl.Usage) >= {
        "input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens", "cost"}
    assert fields(bl.RunState) >= {
        "status", "model_steps", "tool_calls", "transcript", "usage"}
    for name in ("run_id", "call_id", "execution_id", "idempotency_key", "attempt", "deadline",
                 "cancel", "run_child"):
        assert hasattr(bl.ToolContext, name) or name in bl.ToolContext.__dataclass_fields__


def test_run_result_is_frozen() -> None:
    result = bl.RunResult("r", "final", None, "x", 1, 0, [], [], [], bl.Usage(), 0.0)
    with pytest.raises(AttributeError):
        result.status = "cancelled"  # type: ignore[misc]


def test_message_kinds() -> None:
    cases = [
        (bl.UserMessage("hi"), {"kind": "user", "text": "hi"}),
        (bl.CallMessage("c", "t", {"a": 1}),
         {"kind": "call", "id": "c", "name": "t", "arguments": {"a": 1}, "step": None}),
        (bl.CallMessage("c", "t", {"a": 1}, step=2),
         {"kind": "call", "id": "c", "name": "t", "arguments": {"a": 1}, "step": 2}),
        (bl.AssistantMessage(2, "let me look", [{"type": "thinking", "signature": "s"}]),
         {"kind": "assistant", "step": 2, "text": "let me look",
          "content": [{"type": "thinking", "signature": "s"}]}),
        (bl.ToolResultMessage("c", "ok", [1]),
         {"kind": "tool_result", "id": "c", "status": "ok", "content": [1]}),
        (bl.FinalMessage("done"), {"kind": "final", "text": "done"}),
        (bl.NoticeMessage("careful"), {"kind": "notice", "text": "careful"}),
    ]
    for message, form in cases:
        assert msgspec.to_builtins(message) == form
        assert message.kind == form["kind"]


def test_event_classes_named_in_spec() -> None:
    for name in ("RunAdmitted", "ModelStepStarted", "ModelStepCompleted", "ModelStepFailed",
                 "CallDecided", "CallDispatched", "CallSucceeded", "CallFailed", "CallTimedOut",
                 "CallOutcomeUnknown", "CallReconciled", "UsageCharged", "RunFinished"):
        cls = getattr(events, name)
        if name.startswith("Call"):
            assert "execution_id" in {f.name for f in msgspec.structs.fields(cls)}
    finished = {f.name for f in msgspec.structs.fields(events.RunFinished)}
    assert finished >= {"status", "exhausted_limit", "explanation", "model_steps", "tool_calls"}
