"""boundloop: LLM tool loops under hard budgets, as an event-sourced actor system.

A model proposes tool calls; the runner decides whether each happens, journals every
intent durably before its effect, and can rebuild any run by replaying its events.
"""

from boundloop import events
from boundloop.agent import Agent
from boundloop.cancel import CancelToken
from boundloop.clock import Clock, FakeClock
from boundloop.context import Model, ModelContext
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
from boundloop.models.scripted import ScriptedModel, ScriptExhausted
from boundloop.policy.budget import Budget, Price, Remaining, Usage
from boundloop.policy.replay import ReplayError, RunState, apply, replay
from boundloop.recovery import RecoveredRun
from boundloop.results import CompletedAction, RunResult, UnresolvedAction
from boundloop.runner import Runner
from boundloop.telemetry import Telemetry
from boundloop.tools import RetryPolicy, Tool, ToolContext, tool
from boundloop.worker import Worker

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
    "ToolResultMessage", "FinalMessage", "NoticeMessage",
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
