"""A run's whole state as data (issue #21): what its events folded (``RunState``), its fixed
configuration, and where it stands in its round (``stage`` and the round's working data),
so that nothing of a run lives in a generator frame."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from boundloop import events as ev
from boundloop.core.budget import Budget, LedgerReply, Price, Usage
from boundloop.core.effects import CallStart
from boundloop.core.explain import Stop
from boundloop.core.kinds import Decision
from boundloop.core.replay import RunState
from boundloop.messages import CallTools, Message
from boundloop.results import RunResult

#: Where a run stands: each names the input it waits for (a Tick for the internal ones).
Stage = Literal[
    "start", "started", "round", "round_tree", "round_budget", "estimate", "invoke", "model",
    "batch", "batch_tree", "check", "check_next", "approve", "decided", "dispatch_tree",
    "dispatch_go", "dispatch", "round_end", "settle", "settle_reconcile", "settle_retry",
    "settle_validate", "settle_dispatch", "approved_validate", "approved_go",
    "approved_dispatch", "approved_end", "finish", "finish_tree", "finish_event",
    "finish_commit", "facts_commit", "journal_lost", "done"]


class Instant(msgspec.Struct, frozen=True):
    """What the world says at the moment of a decision (DESIGN rule 3: the clock and flags
    are inputs): wall and monotonic time, whether the run is cancelled (and why), whether
    a handler of it started a child run, whether this runner's lease still holds, and
    whether the journal can still record (it is not closed)."""

    ts: float
    mono: float
    cancelled: bool = False
    cancel_reason: str = ""
    children: bool = False
    leased: bool = True
    recordable: bool = True


class ToolFacts(msgspec.Struct, frozen=True):
    """What ``decide`` knows of a tool: its flags, never its code."""

    read_only: bool = False
    idempotent: bool = False
    irreversible: bool = False
    #: ``needs_approval``: never, always, or a rule the interpreter asks (``AskApproval``).
    approval: Literal["never", "always", "rule"] = "never"
    max_calls: int | None = None
    reconcile: bool = False


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """What does not change while the run runs."""

    run_id: str
    budget: Budget
    tools: dict[str, ToolFacts]
    history: list[Message]
    owner: str = ""
    read_only: bool = False
    permit: bool = False
    parent_run_id: str | None = None
    parent_step: int | None = None
    parent_execution_id: str | None = None
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    #: Priced by a table, or by the catalogue (the quote comes with the reply).
    table: Price | None = None
    catalogue: bool = False
    unpriced: str = "fail"


class Decided(msgspec.Struct):
    """One call of the batch as decided (SPEC 5.9)."""

    decision: Decision
    reason: str
    validated: Any = None
    approval: bool = False


class Machine(msgspec.Struct, kw_only=True):
    """One run, as data. ``decide`` updates it in place (as ``replay.apply`` updates its
    ``RunState``): no I/O, no clock reads."""

    config: Config
    state: RunState
    resumed: bool = False
    stage: Stage = "start"
    #: The run's deadline on the monotonic clock, when it (re)started, and its active time
    #: before that.
    deadline: float | None = None
    started: float = 0.0
    elapsed_before: float = 0.0
    #: Journal-form events folded and waiting for the next Commit; the batch in flight.
    pending: list[ev.Event] = msgspec.field(default_factory=list)
    committing: list[ev.Event] = msgspec.field(default_factory=list)
    #: For the report of a run the journal failed.
    unrecorded: set[str] = msgspec.field(default_factory=set)
    never_dispatched: set[str] = msgspec.field(default_factory=set)
    uninvoked: int = 0
    #: Tool calls folded whose commit failed (decided, or retried): the journal has none.
    uncounted: int = 0
    #: The run tree's ledger (SPEC 8): own spend charged, and own spend when the last
    #: batch started (the base of the ledger should a child start), with per-tool counts.
    ledger_open: bool = False
    charged: tuple[int, Usage] = (0, Usage())
    snapshot: tuple[int, Usage] = (0, Usage())
    charged_tools: dict[str, int] = msgspec.field(default_factory=dict)
    snapshot_tools: dict[str, int] = msgspec.field(default_factory=dict)
    caps: dict[str, int] = msgspec.field(default_factory=dict)
    tree_tools: tuple[dict[str, int], dict[str, int]] | None = None
    #: What the last ChargeTree reserved (calls, by tool) and the own spend it charged
    #: (calls, usage, by tool); the authority's last answer.
    asked_tree: tuple[int, dict[str, int], int, Usage, dict[str, int]] = (0, {}, 0, Usage(), {})
    tree_reply: LedgerReply | None = None
    current: Budget = msgspec.field(default_factory=Budget)
    #: Per call: attempts whose outcome is recorded; calls an attempt of which may have
    #: taken effect.
    attempts_recorded: dict[str, int] = msgspec.field(default_factory=dict)
    unknown: set[str] = msgspec.field(default_factory=set)
    #: True once the run's last commit gives up its ownership (awaiting approval).
    releasing: bool = False
    # -- the round in progress --
    stop: Stop | None = None
    reservation: Usage = msgspec.field(default_factory=Usage)
    step: int = 0
    allowed: bool = False
    was_final_only: bool = False
    batch: CallTools | None = None
    decided: list[Decided] = msgspec.field(default_factory=list)
    asked: list[int] = msgspec.field(default_factory=list)
    capped: list[str] = msgspec.field(default_factory=list)
    planned_calls: list[CallStart] = msgspec.field(default_factory=list)
    skipped: list[str] = msgspec.field(default_factory=list)
    review: list[str] = msgspec.field(default_factory=list)
    #: Resume: the open calls still to settle, and the one being settled.
    to_settle: list[str] = msgspec.field(default_factory=list)
    settling: str = ""
    settle_attempt: int = 0
    settle_retryable: bool = False
    #: Reconcile said the call being settled did not take effect (it is closed as such).
    settle_closed: bool = False
    approved_ids: list[str] = msgspec.field(default_factory=list)
    #: Retries the calls being run may still make (the call budget left when they
    #: started); decided here as each attempt fails (``AttemptFailed``).
    allowance: int = 0
    #: Retries asked of the run tree's authority (execution id -> their delay).
    retry_delays: dict[str, float] = msgspec.field(default_factory=dict)
    result: RunResult | None = None

    def elapsed(self, mono: float) -> float:
        """The run's active time at ``mono``."""
        return self.elapsed_before + (mono - self.started)

    def deadline_passed(self, mono: float) -> bool:
        """True once the run's deadline has passed at ``mono``."""
        return self.deadline is not None and mono >= self.deadline
