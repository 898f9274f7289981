"""The public surface is pinned (DESIGN rule 8): exactly these names, each documented."""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from pathlib import Path

import msgspec
import pytest

import boundloop as bl
from boundloop import events
from boundloop.core.kinds import RunStatus

EXPECTED = {
    # running
    "Runner", "RunResult", "CompletedAction", "UnresolvedAction", "CancelToken", "Telemetry",
    # recovery
    "RecoveredRun",
    # agents, workers, the queue and approvals
    "Agent", "Worker",
    # budgets and metering
    "Budget", "Remaining", "Usage", "Price",
    # models and messages
    "Model", "ModelContext", "ScriptedModel", "ScriptExhausted", "Final", "CallTools", "ToolCall",
    "Malformed", "ResponseInfo", "Message", "UserMessage", "AssistantMessage", "CallMessage",
    "ToolResultMessage", "FinalMessage", "NoticeMessage", "TextStream", "TextDelta",
    # tools
    "tool", "Tool", "ToolContext", "RetryPolicy", "mcp_tools", "McpToolError",
    # replay and journal events
    "replay", "apply", "RunState", "ReplayError", "events", "Event", "RunAdmitted",
    "ModelStepStarted", "ModelStepCompleted", "ModelStepFailed", "NoticeAdded", "UsageCharged",
    "CallDecided", "CallDispatched", "CallSucceeded", "CallFailed", "CallTimedOut",
    "CallOutcomeUnknown", "CallReconciled", "CallSkipped", "CallResolved", "RoundCompleted",
    "ChildCharged", "OwnerClaimed", "RunResumed", "RunFinished", "ApprovalRequested",
    "ApprovalDecided", "RunRequeued",
    # time
    "Clock", "FakeClock",
    # errors
    "BoundloopError", "ConfigError", "JournalError", "JournalUnavailable", "JournalCorrupt",
    "SequenceConflict", "LeaseLost", "AdmissionError", "UnknownRun", "RecoveryError",
    "RunnerClosed", "ApprovalError",
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


def test_every_exception_boundloop_exports_is_a_boundloop_error() -> None:
    """DESIGN rule 7: one exception tree (McpToolError was a bare RuntimeError)."""
    raised = [getattr(bl, n) for n in bl.__all__
              if inspect.isclass(getattr(bl, n)) and issubclass(getattr(bl, n), BaseException)]
    assert bl.McpToolError in raised
    assert [c.__name__ for c in raised if not issubclass(c, bl.BoundloopError)] == []
    assert issubclass(bl.McpToolError, RuntimeError)  # what it was before: still caught


# -- every public module's surface is pinned (trio's test_exports) ---------------------------
#: The ``__all__`` of every public module that has one. A module that grows an ``__all__``
#: (or changes it) changes this table in the same commit: the surface moves on purpose only.
MODULE_ALL: dict[str, set[str]] = {
    "boundloop": EXPECTED,
    "boundloop.cancel": {"CancelToken"},
    "boundloop.clock": {"Clock", "FakeClock"},
    "boundloop.context": {"Model", "ModelContext", "ModelResponse"},
    "boundloop.cli": {"cli", "main"},
    "boundloop.drill": {
        "Downstream", "DrillReport", "Effect", "QueueDrillReport", "StaleAttempt", "can_unshare",
        "command", "decision", "drill_agent", "drill_model", "drill_tools", "effects",
        "format_report", "fresh_database", "ledger", "ledger_size", "pg_restart_argv", "plan",
        "queue_plan", "run_drill", "run_queue_drill", "serve", "settle", "worker"},
    "boundloop.errors": {
        "AdmissionError", "BoundloopError", "ConfigError", "JournalCorrupt", "JournalError",
        "JournalUnavailable", "LeaseLost", "RecoveryError", "RunnerClosed", "SequenceConflict",
        "UnknownRun", "ApprovalError"},
    "boundloop.ops": {
        "ChainReport", "CheckReport", "CompactReport", "Divergence", "LIMITS", "PruneReport",
        "Rebuilt", "RecordedModelError", "RunList", "RunSummary", "STATUSES", "Timeline",
        "TimelineRow", "check", "compact", "describe", "event_name", "event_type",
        "export_lines", "find_runs", "journal_dir", "key_file_warning", "list_runs",
        "load_events", "open_journal", "owner_alive", "parse_duration", "prune",
        "read_events", "rebuild", "recorded_budget", "recoverable", "run_children",
        "run_timeline", "state_word", "timeline", "verify_chains", "verify_journal",
        "AwaitingCall", "waiting_note", "DAMAGED", "OPEN_EXPLANATIONS", "resolve_run_id",
        "resolve_execution_id"},
    "boundloop.journal": {"Journal", "LmdbJournal", "OwnerRecord", "RunInfo"},
    "boundloop.journal.base": {
        "Chained", "Done", "Fence", "Journal", "OwnerRecord", "RunInfo", "StoredIndex",
        "Submission", "about_to_sync", "answer", "batches", "check_run_id", "drain", "is_claim",
        "unforced_claim", "valid_run_id"},
    "boundloop.journal.memory": {"MemoryJournal"},
    "boundloop.journal.postgres": {
        "PostgresJournal", "SCHEMA_VERSION", "SCHEMES", "is_url", "open_url", "url_scheme"},
    "boundloop.mcp": {"McpToolError", "mcp_tools"},
    "boundloop.messages": {
        "AssistantMessage", "CallMessage", "CallTools", "Final", "FinalMessage", "Malformed",
        "Message", "NoticeMessage", "Response", "ToolCall", "ToolResultMessage", "UserMessage",
        "ResponseInfo", "copy_history", "to_history"},
    "boundloop.models": {"ScriptExhausted", "ScriptedModel"},
    "boundloop.models.anthropic": {"AnthropicModel", "AsyncAnthropicModel"},
    "boundloop.models.scripted": {"ScriptExhausted", "ScriptedModel"},
    "boundloop.models.openai": {
        "AsyncOpenAIChatModel", "AsyncOpenAIResponsesModel", "OpenAIChatModel",
        "OpenAIResponsesModel"},
    "boundloop.pricing": {"AUTO", "PriceOption", "Unpriced", "catalogue_cost",
                          "require_catalogue"},
    "boundloop.recovery": {"RecoveredRun"},
    "boundloop.results": {"CompletedAction", "RunResult", "UnresolvedAction"},
    "boundloop.telemetry": {"Fanout", "OtelMetrics", "Projection", "Sink", "Telemetry"},
    "boundloop.testing": {"FaultyJournal", "JournalContract", "MODES"},
    "boundloop.integrations": {"Guest", "GuestResult", "GuestTool", "OneRequest", "current_call",
                               "render_output"},
    "boundloop.integrations.pydantic_ai": {"BoundloopAgent"},
    "boundloop.integrations.openai_agents": {"BoundloopAgent", "to_input_items"},
    "boundloop.tools": {"ApprovalRule", "ArgumentError", "RetryPolicy", "Tool", "ToolContext",
                        "ToolLike", "tool"},
}

#: Modules a user imports by name (README, SPEC): each must say what it exports.
MUST_HAVE_ALL = {
    "boundloop", "boundloop.cancel", "boundloop.clock", "boundloop.context", "boundloop.errors",
    "boundloop.ops", "boundloop.journal", "boundloop.journal.base", "boundloop.mcp",
    "boundloop.messages", "boundloop.models", "boundloop.models.anthropic",
    "boundloop.models.openai", "boundloop.models.scripted", "boundloop.recovery",
    "boundloop.results", "boundloop.testing", "boundloop.tools"}


def public_modules() -> list[str]:
    """Every module of the package whose dotted name has no ``_``-prefixed part."""
    root = Path(bl.__file__).parent
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = ["boundloop", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if not any(p.startswith("_") for p in parts[1:]):
            out.append(".".join(parts))
    return out


def test_the_walk_finds_the_public_modules() -> None:
    found = public_modules()
    assert {"boundloop", "boundloop.runner", "boundloop.testing", "boundloop.journal.lmdb"} \
        <= set(found)
    assert not [m for m in found if "._" in m]


@pytest.mark.parametrize("name", public_modules())
def test_every_public_modules_all_is_pinned(name: str) -> None:
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None)
    if names is None:
        assert name not in MUST_HAVE_ALL, f"{name} is imported by users: give it an __all__"
        assert name not in MODULE_ALL, f"{name} lost its __all__"
        return
    assert len(names) == len(set(names)), f"duplicate names in {name}.__all__"
    assert name in MODULE_ALL, f"{name}.__all__ is not pinned in MODULE_ALL: {sorted(names)}"
    assert set(names) == MODULE_ALL[name]
    for attr in names:
        obj = getattr(module, attr)  # every exported name exists
        if inspect.isclass(obj) or inspect.isfunction(obj):
            own = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
            assert isinstance(own, str) and own.strip(), f"{name}.{attr} has no docstring"


def test_the_model_protocol_types_the_runner() -> None:
    """``bl.Model`` is what run/submit/arun/resume take, and ``RunResult.status`` is the
    RunStatus Literal (so a type checker sees a user's mistakes; see test_typing)."""
    for method in (bl.Runner.run, bl.Runner.submit, bl.Runner.arun, bl.Runner.resume,
                   bl.Runner.submit_resume, bl.Runner.aresume):
        assert typing.get_type_hints(method)["model"] == bl.Model | bl.Agent, method.__name__
    assert typing.get_type_hints(bl.RunResult)["status"] == RunStatus

