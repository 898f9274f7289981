"""What enters a run (issue #21): facts, frozen and plain, each the answer to an effect.

The interpreter (``boundloop.loop``) turns what user code and the journal did into these;
``decide`` reads nothing else. Whatever needs user code or secrets (a tool's ``validate``,
``permit``, a result's keyed digest, the price catalogue) is done before a fact is made.
"""

from __future__ import annotations

from typing import Any

import msgspec

from boundloop.core.budget import LedgerReply, Quote, Usage
from boundloop.core.rules import Attempt, SkipReason
from boundloop.core.rules import PermitRaised as PermitRaised


class Tick(msgspec.Struct, frozen=True):
    """Nothing new happened: go on from where the run stands (after a Step whose events had
    to be folded before the next decision, or to start)."""


class Committed(msgspec.Struct, frozen=True):
    """The last ``Commit`` is durable (``error`` None), or why not: ``conflict`` (another
    writer appended first), ``lease`` (this runner fenced itself)."""

    error: str | None = None
    conflict: bool = False
    lease: bool = False


class EffectFailed(msgspec.Struct, frozen=True):
    """The journal refused or ended an effect that was not a commit (a model call refused
    for a closed journal or a lost lease, a batch that failed on the journal)."""

    error: str
    lease: bool = False


class TreeReplied(msgspec.Struct, frozen=True):
    """The run tree's budget authority answered a ``ChargeTree``."""

    reply: LedgerReply


class Estimated(msgspec.Struct, frozen=True):
    """The step's reservation (priced), or why there is none: the estimator ``failed``
    (a sentence), or was ``abandoned`` (deadline or cancellation)."""

    usage: Usage | None = None
    failed: str | None = None
    abandoned: SkipReason | None = None


class ModelReplied(msgspec.Struct, frozen=True):
    """What the model returned, the journal-safe text of what it raised, how long it took,
    why the runner stopped waiting (``abandoned``), and the catalogue's price of it."""

    response: Any = None
    error: str | None = None
    latency_s: float = 0.0
    abandoned: SkipReason | None = None
    quote: Quote | None = None


#: ``permit``'s answer as a fact: True allows, a string is the reason to deny, False denies
#: without one, PermitRaised denies, None: it was not asked.
Verdict = bool | str | PermitRaised | None


class CallsChecked(msgspec.Struct, frozen=True):
    """Per call of the batch: the permission check's verdict, the validated arguments in
    journal form, and what is wrong with the arguments (None: valid, or no such tool)."""

    verdicts: list[Verdict]
    validated: list[Any]
    invalid: list[str | None]


class ApprovalsRuled(msgspec.Struct, frozen=True):
    """Each asked ``needs_approval`` rule's answer (True: a person must approve)."""

    answers: list[bool]


class Validated(msgspec.Struct, frozen=True):
    """Per asked call: what is wrong with its recorded arguments now, or None."""

    invalid: list[str | None]


class Reconciled(msgspec.Struct, frozen=True):
    """``reconcile`` said the action took effect (with the result's journal fields), did
    not, or cannot tell (None)."""

    took: bool | None
    fields: dict[str, Any] | None = None


class Ended(msgspec.Struct, frozen=True):
    """What became of one started call: its attempts (each result as its journal fields:
    content, size, digest, status), or why it never ran (``skipped``)."""

    execution_id: str
    attempts: list[Attempt] = msgspec.field(default_factory=list)
    skipped: str | None = None


class AttemptsEnded(msgspec.Struct, frozen=True):
    """Every call of the last ``StartCalls`` ended."""

    outcomes: list[Ended]


class AttemptStarting(msgspec.Struct, frozen=True):
    """An attempt that starts after its round (a retry, a call queued behind
    ``max_parallel``) needs its CallDispatched durable first, after the outcomes of the
    attempts ``before`` it."""

    execution_id: str
    attempt: int
    before: list[Attempt]


class AttemptFailed(msgspec.Struct, frozen=True):
    """An attempt raised or timed out (and reconcile did not say it took effect): may the
    call be tried again? ``retryable``: the failure is one the tool retries (its
    ``retry_on``; a timeout only when a retry cannot do the action twice); ``delay_s``:
    the tool's delay before the next attempt; ``gate``: why nothing may start now."""

    execution_id: str
    retryable: bool
    max_attempts: int
    attempts_made: int
    delay_s: float = 0.0
    gate: SkipReason | None = None


class RetryReserved(msgspec.Struct, frozen=True):
    """The run tree's budget authority answered the ``ChargeTree`` that reserves a retry
    of the call (SPEC 8): the retry runs only when granted and the run has a call left."""

    execution_id: str
    reply: LedgerReply


class Failed(msgspec.Struct, frozen=True):
    """Driving the run failed inside boundloop (a bug): end it in order."""

    detail: str


Input = (Tick | Committed | EffectFailed | TreeReplied | Estimated | ModelReplied
         | CallsChecked | ApprovalsRuled | Validated | Reconciled | AttemptsEnded
         | AttemptStarting | AttemptFailed | RetryReserved | Failed)
