"""boundloop: LLM tool loops under hard budgets, as an event-sourced actor system.

A model proposes tool calls; the runner decides whether each happens, journals every
intent durably before its effect, and can rebuild any run by replaying its events.
"""

from typing import TYPE_CHECKING

from boundloop._version import __version__ as __version__

if TYPE_CHECKING:
    from boundloop import events
    from boundloop.agent import Agent
    from boundloop.cancel import CancelToken
    from boundloop.clock import Clock, FakeClock
    from boundloop.context import Model, ModelContext
    from boundloop.core.budget import Budget, Price, Remaining, Usage
    from boundloop.core.replay import ReplayError, RunState, apply, replay
    from boundloop.errors import (
        AdmissionError,
        ApprovalError,
        BoundloopError,
        ConfigError,
        JournalCorrupt,
        JournalError,
        JournalUnavailable,
        LeaseLost,
        RecoveryError,
        RunnerClosed,
        SequenceConflict,
        UnknownRun,
    )
    from boundloop.events import (
        ApprovalDecided,
        ApprovalRequested,
        CallDecided,
        CallDispatched,
        CallFailed,
        CallOutcomeUnknown,
        CallReconciled,
        CallResolved,
        CallSkipped,
        CallSucceeded,
        CallTimedOut,
        ChildCharged,
        Event,
        ModelStepCompleted,
        ModelStepFailed,
        ModelStepStarted,
        NoticeAdded,
        OwnerClaimed,
        RoundCompleted,
        RunAdmitted,
        RunFinished,
        RunRequeued,
        RunResumed,
        UsageCharged,
    )
    from boundloop.mcp import McpToolError, mcp_tools
    from boundloop.messages import (
        AssistantMessage,
        CallMessage,
        CallTools,
        Final,
        FinalMessage,
        Malformed,
        Message,
        NoticeMessage,
        ResponseInfo,
        ToolCall,
        ToolResultMessage,
        UserMessage,
    )
    from boundloop.models._stream import TextDelta, TextStream
    from boundloop.models.scripted import ScriptedModel, ScriptExhausted
    from boundloop.recovery import RecoveredRun
    from boundloop.results import CompletedAction, RunResult, UnresolvedAction
    from boundloop.runner import Runner
    from boundloop.telemetry import Telemetry
    from boundloop.tools import RetryPolicy, Tool, ToolContext, tool
    from boundloop.worker import Worker

# What each public name is imported from, on first use (PEP 562): `import boundloop` and the
# command line's small commands stay quick, loading only the modules they touch.
_WHERE: dict[str, str] = {
    "events": "boundloop.events",
    "ApprovalDecided": "boundloop.events",
    "ApprovalRequested": "boundloop.events",
    "CallDecided": "boundloop.events",
    "CallDispatched": "boundloop.events",
    "CallFailed": "boundloop.events",
    "CallOutcomeUnknown": "boundloop.events",
    "CallReconciled": "boundloop.events",
    "CallResolved": "boundloop.events",
    "CallSkipped": "boundloop.events",
    "CallSucceeded": "boundloop.events",
    "CallTimedOut": "boundloop.events",
    "ChildCharged": "boundloop.events",
    "Event": "boundloop.events",
    "ModelStepCompleted": "boundloop.events",
    "ModelStepFailed": "boundloop.events",
    "ModelStepStarted": "boundloop.events",
    "NoticeAdded": "boundloop.events",
    "OwnerClaimed": "boundloop.events",
    "RoundCompleted": "boundloop.events",
    "RunAdmitted": "boundloop.events",
    "RunFinished": "boundloop.events",
    "RunRequeued": "boundloop.events",
    "RunResumed": "boundloop.events",
    "UsageCharged": "boundloop.events",
    "Agent": "boundloop.agent",
    "CancelToken": "boundloop.cancel",
    "Clock": "boundloop.clock",
    "FakeClock": "boundloop.clock",
    "Model": "boundloop.context",
    "ModelContext": "boundloop.context",
    "AdmissionError": "boundloop.errors",
    "ApprovalError": "boundloop.errors",
    "BoundloopError": "boundloop.errors",
    "ConfigError": "boundloop.errors",
    "JournalCorrupt": "boundloop.errors",
    "JournalError": "boundloop.errors",
    "JournalUnavailable": "boundloop.errors",
    "LeaseLost": "boundloop.errors",
    "RecoveryError": "boundloop.errors",
    "RunnerClosed": "boundloop.errors",
    "SequenceConflict": "boundloop.errors",
    "UnknownRun": "boundloop.errors",
    "McpToolError": "boundloop.mcp",
    "mcp_tools": "boundloop.mcp",
    "AssistantMessage": "boundloop.messages",
    "CallMessage": "boundloop.messages",
    "CallTools": "boundloop.messages",
    "Final": "boundloop.messages",
    "FinalMessage": "boundloop.messages",
    "Malformed": "boundloop.messages",
    "Message": "boundloop.messages",
    "NoticeMessage": "boundloop.messages",
    "ResponseInfo": "boundloop.messages",
    "ToolCall": "boundloop.messages",
    "ToolResultMessage": "boundloop.messages",
    "UserMessage": "boundloop.messages",
    "ScriptedModel": "boundloop.models.scripted",
    "TextDelta": "boundloop.models._stream",
    "TextStream": "boundloop.models._stream",
    "ScriptExhausted": "boundloop.models.scripted",
    "Budget": "boundloop.core.budget",
    "Price": "boundloop.core.budget",
    "Remaining": "boundloop.core.budget",
    "Usage": "boundloop.core.budget",
    "ReplayError": "boundloop.core.replay",
    "RunState": "boundloop.core.replay",
    "apply": "boundloop.core.replay",
    "replay": "boundloop.core.replay",
    "RecoveredRun": "boundloop.recovery",
    "CompletedAction": "boundloop.results",
    "RunResult": "boundloop.results",
    "UnresolvedAction": "boundloop.results",
    "Runner": "boundloop.runner",
    "Telemetry": "boundloop.telemetry",
    "RetryPolicy": "boundloop.tools",
    "Tool": "boundloop.tools",
    "ToolContext": "boundloop.tools",
    "tool": "boundloop.tools",
    "Worker": "boundloop.worker",
}


def __getattr__(name: str) -> object:
    import importlib

    module = _WHERE.get(name)
    if module is None:
        # A subpackage such as ``bl.journal``, as when this module imported them all.
        import importlib.util

        if name.startswith("_") or importlib.util.find_spec(f"boundloop.{name}") is None:
            raise AttributeError(f"module 'boundloop' has no attribute {name!r}")
        module = f"boundloop.{name}"
    found = importlib.import_module(module)
    value = found if module == f"boundloop.{name}" else getattr(found, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
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
]
