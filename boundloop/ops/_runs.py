"""The state of runs: the one word for it, ``runs`` (listing and filtering), a run's
children, and what ``recover`` would take over."""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec

from boundloop import owners as owners_mod
from boundloop.core.budget import (
    Usage,
)
from boundloop.core.replay import ReplayError, RunState, replay
from boundloop.errors import (
    JournalCorrupt,
)
from boundloop.journal.base import Journal, OwnerRecord, RunInfo
from boundloop.recovery import RecoveredRun

#: Statuses a run can end with (SPEC 3), then the two states of a run with no RunFinished:
#: ``running`` (its runner is alive) and ``interrupted`` (its runner is gone: recover it).
STATUSES = ("final", "limit_exceeded", "repeated_call", "cancelled", "malformed_response",
            "model_error", "needs_review", "journal_unavailable", "rejected", "running",
            "interrupted", "queued", "awaiting_approval")
#: The limits a ``limit_exceeded`` run names (SPEC 1).
LIMITS = ("model_steps", "tool_calls", "deadline", "input_tokens", "output_tokens",
          "total_tokens", "cost")


# -- runs --------------------------------------------------------------------------------
class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``boundloop runs``."""

    run_id: str
    status: str
    exhausted_limit: str | None
    model_steps: int
    tool_calls: int
    usage: Usage
    explanation: str
    created_ts: float
    finished_ts: float | None
    #: Seconds the run took; a running run's age (now minus its start).
    elapsed_s: float
    parent_run_id: str | None
    owner: str
    unresolved: int
    #: How deep the run sits under the listed runs (``list_runs(tree=True)``; else 0).
    depth: int = 0
    #: The agent the run runs (name and version) and its labels (SPEC 14).
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    #: Calls that wait for a person's approve or deny.
    awaiting: int = 0


class RunList(msgspec.Struct, frozen=True, kw_only=True):
    """What ``find_runs`` found: the runs, how many the journal holds, and whether more runs
    matched than ``last`` let through."""

    runs: list[RunSummary]
    total: int
    more: bool
    newest_ts: float | None


#: What ``show`` and ``replay`` say of a run with no RunFinished event, by its state word.
OPEN_EXPLANATIONS = {
    "running": "The run is in flight: its runner is alive.",
    "interrupted": "The run has no RunFinished event and its runner is gone; "
                   "`boundloop recover` lists what it left unresolved.",
    "queued": "The run waits in the queue for a worker.",
}


def waiting_note(state: RunState, word: str) -> str:
    """What an open run waits for, in a sentence: the agent a worker must serve."""
    if word not in ("queued", "interrupted") or not state.agent:
        return ""
    return (f"It waits for a worker serving agent {state.agent!r}"
            + (f" (version {state.agent_version!r} when it started)."
               if state.agent_version else "."))


def state_word(finished: bool, status: str, owner: str, owners: dict[str, OwnerRecord],
               now: float | None = None) -> str:
    """The one word for a run's state, the same in ``runs``, ``show`` and ``replay``: its
    status when it finished, else ``running`` (its owner is alive) or ``interrupted`` (its
    owner is gone)."""
    if finished:
        return status
    if status == "queued":
        return "queued"
    return "running" if owner_alive(owner, owners, now) else "interrupted"


def owner_alive(owner: str, owners: dict[str, OwnerRecord], now: float | None = None) -> bool:
    """Whether the runner ``owner`` still drives its runs (its process, or its lease)."""
    return owners_mod.owner_alive(owners.get(owner), now)


def recoverable(journal: Journal, damaged: list[str] | None = None) -> list[RecoveredRun]:
    """What ``runner.recover()`` would take over, read-only: every open run whose owner is
    gone, with the actions it left unresolved. Nothing is claimed or written.

    Raises:
        JournalCorrupt, ReplayError: an open run cannot be read, unless ``damaged`` is given:
            then its id is appended there and the other runs are reported all the same.
    """
    owners = journal.owners()
    out: list[RecoveredRun] = []
    for run_id in journal.open_runs():
        try:
            state = replay(e for _, e in journal.read(run_id))
        except (JournalCorrupt, ReplayError):
            if damaged is None:
                raise
            damaged.append(run_id)
            continue
        if not state.finished and not state.queued and not owner_alive(state.owner, owners):
            out.append(RecoveredRun(run_id, state, state.open_actions))
    return out


#: The state word of a run whose records cannot be read (``runs`` lists it, and exits 4).
DAMAGED = "damaged"
_DAMAGE_HINT = {False: "`boundloop verify` tells more",
                True: "its records are intact but do not make a run: `boundloop export` "
                      "shows them"}


def _summary(journal: Journal, info: RunInfo, owners: dict[str, OwnerRecord],
             now: float | None = None) -> RunSummary:
    try:
        state = replay(e for _, e in journal.read(info.run_id))
    except (JournalCorrupt, ReplayError) as exc:
        # Listed as damaged, the others as they are: one bad run hides no good one (records
        # that read but do not make a run, ReplayError, are as unusable as unreadable ones).
        return RunSummary(run_id=info.run_id, status=DAMAGED, exhausted_limit=None,
                          model_steps=0, tool_calls=0, usage=Usage(),
                          explanation=f"{exc} ({_DAMAGE_HINT[type(exc) is ReplayError]})",
                          created_ts=info.created_ts, finished_ts=info.finished_ts,
                          elapsed_s=0.0, parent_run_id=info.parent_run_id, owner=info.owner,
                          unresolved=0)
    status = state_word(state.finished, state.status, state.owner, owners)
    explanation = state.explanation if state.finished else OPEN_EXPLANATIONS[status]
    waits = waiting_note(state, status)
    elapsed = state.elapsed_s
    if status == "running":  # in flight: its age, not the time to its last event
        start = info.created_ts or state.started_ts
        elapsed = max((time.time() if now is None else now) - start, elapsed)
    return RunSummary(run_id=info.run_id, status=status, exhausted_limit=state.exhausted_limit,
                      model_steps=state.model_steps, tool_calls=state.tool_calls,
                      usage=state.usage, explanation=f"{explanation} {waits}".strip(),
                      created_ts=info.created_ts,
                      finished_ts=info.finished_ts, elapsed_s=elapsed,
                      parent_run_id=info.parent_run_id, owner=info.owner,
                      unresolved=len(state.unresolved), agent=state.agent,
                      agent_version=state.agent_version, labels=state.labels,
                      awaiting=len(state.awaiting))


def _infos(journal: Journal) -> list[RunInfo]:
    """Every run's index entry (no event is read)."""
    return journal.infos()


def list_runs(journal: Journal, *, status: Iterable[str] = (), limit_hit: Iterable[str] = (),
              since_s: float | None = None, older_than_s: float | None = None,
              last: int | None = None, tree: bool = False,
              now: float | None = None) -> list[RunSummary]:
    """The journal's runs, newest first, filtered (``find_runs(...).runs``)."""
    return find_runs(journal, status=status, limit_hit=limit_hit, since_s=since_s,
                     older_than_s=older_than_s, last=last, tree=tree, now=now).runs


def find_runs(journal: Journal, *, status: Iterable[str] = (), limit_hit: Iterable[str] = (),
              since_s: float | None = None, older_than_s: float | None = None,
              last: int | None = None, tree: bool = False,
              now: float | None = None, labels: dict[str, str] | None = None) -> RunList:
    """The journal's runs, newest first, filtered; only the runs listed are replayed.

    Args:
        status: keep runs with one of these statuses (see ``STATUSES``); empty keeps all.
        limit_hit: keep ``limit_exceeded`` runs that hit one of these limits (``any`` for
            every limit); empty keeps all.
        since_s: keep runs started less than this many seconds ago.
        older_than_s: keep runs started more than this many seconds ago.
        last: at most this many runs (with ``tree``: this many top-level runs, each with
            the runs under it).
        tree: put each child run right under its parent (oldest child first) when the
            parent is listed too, with ``depth`` one more than the parent's.
        now: the current time (epoch seconds; default: the clock).
        labels: keep runs that carry every one of these labels.
    """
    now = time.time() if now is None else now
    wanted_labels = dict(labels or {})
    wanted, limits = set(status), set(limit_hit)
    owners = journal.owners()
    infos = sorted(_infos(journal), key=lambda i: i.order, reverse=True)
    newest = max((i.created_ts for i in infos), default=None)

    def listed(info: RunInfo) -> RunSummary | None:
        if since_s is not None and info.created_ts < now - since_s:
            return None
        if older_than_s is not None and info.created_ts >= now - older_than_s:
            return None
        if wanted and info.status is not None and info.status not in wanted:
            return None
        summary = _summary(journal, info, owners, now)
        if wanted and summary.status not in wanted:
            return None
        if limits and (summary.exhausted_limit is None or
                       not ({"any", summary.exhausted_limit} & limits)):
            return None
        if any(summary.labels.get(k) != v for k, v in wanted_labels.items()):
            return None
        return summary

    out: list[RunSummary] = []
    more = False
    if not tree:
        for info in infos:
            summary = listed(info)
            if summary is None:
                continue
            if last is not None and len(out) >= last:
                more = True
                break
            out.append(summary)
        return RunList(runs=out, total=len(infos), more=more, newest_ts=newest)
    by_id = {i.run_id: i for i in infos}
    kids: dict[str, list[RunInfo]] = {}
    for info in reversed(infos):  # oldest first
        parent = info.parent_run_id
        if parent is not None and parent in by_id and parent != info.run_id:
            kids.setdefault(parent, []).append(info)
    seen: set[str] = set()
    tops = 0
    for root in infos:
        parent = root.parent_run_id
        if parent is not None and parent in by_id and parent != root.run_id:
            continue  # listed under its parent
        family: list[RunSummary] = []
        stack = [(root, 0)]
        while stack:
            info, depth = stack.pop()
            if info.run_id in seen:
                continue
            seen.add(info.run_id)
            summary = listed(info)
            if summary is not None:
                family.append(msgspec.structs.replace(summary, depth=depth))
            below = depth + (summary is not None)
            stack.extend((k, below) for k in reversed(kids.get(info.run_id, [])))
        if not family:
            continue
        if last is not None and tops >= last:
            more = True
            break
        tops += 1
        out.extend(family)
    return RunList(runs=out, total=len(infos), more=more, newest_ts=newest)


def run_children(journal: Journal, run_id: str) -> list[RunSummary]:
    """The runs started by ``run_id`` (its direct children), oldest first."""
    owners = journal.owners()
    infos = sorted((i for i in _infos(journal) if i.parent_run_id == run_id
                    and i.run_id != run_id), key=lambda i: i.order)
    return [_summary(journal, i, owners) for i in infos]
