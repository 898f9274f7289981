"""Looking at the journal: list runs, show a run's timeline, rebuild and check it, prune, export.

These are the functions behind ``boundloop runs | show | replay | prune | export``; the command
line is a thin layer over them. Nothing here imports ``click`` or ``rich``.

The check (``check``) answers "would the *current* policy have decided what the recorded run
decided?", the way Temporal's Replayer reports non-determinism: it drives ``loop.drive`` with
a RunSpec rebuilt from the run's ``RunAdmitted`` event and answers every effect from the
recording (no model or tool is called), then compares the decisions the current policy makes
with the recorded ones and reports the first that differs.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, get_args

import msgspec

from boundloop import events as ev
from boundloop import owners as owners_mod
from boundloop._text import money, plain
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.context import ModelContext
from boundloop.errors import (
    AmbiguousId,
    ConfigError,
    JournalCorrupt,
    JournalUnavailable,
    UnknownRun,
)
from boundloop.journal import codec
from boundloop.journal.base import Journal, OwnerRecord, RunInfo
from boundloop.messages import CallTools, Final, Message, ToolCall
from boundloop.policy.budget import (
    TOKEN_LIMITS,
    Budget,
    LedgerReply,
    TreeLeft,
    Usage,
    default_reservation,
    exceeded,
)
from boundloop.policy.redact import PREFIX, digest, is_credential
from boundloop.policy.replay import ReplayError, RunState, apply, replay
from boundloop.recovery import RecoveredRun
from boundloop.results import CompletedAction, UnresolvedAction
from boundloop.tools import ArgumentError, Tool

__all__ = [
    "STATUSES", "LIMITS", "journal_dir", "open_journal", "parse_duration", "read_events",
    "load_events", "RunSummary", "list_runs", "TimelineRow", "Timeline", "timeline",
    "Rebuilt", "rebuild", "Divergence", "CheckReport", "check", "recorded_budget",
    "PruneReport", "prune", "export_lines", "event_name", "event_type", "describe",
    "owner_alive", "state_word", "RunList", "find_runs", "run_children", "run_timeline",
    "RecordedModelError", "recoverable", "ChainReport", "verify_chains",
    "key_file_warning", "CompactReport", "compact", "verify_journal", "AwaitingCall",
    "waiting_note",
]

#: Statuses a run can end with (SPEC 3), then the two states of a run with no RunFinished:
#: ``running`` (its runner is alive) and ``interrupted`` (its runner is gone: recover it).
STATUSES = ("final", "limit_exceeded", "repeated_call", "cancelled", "malformed_response",
            "model_error", "needs_review", "journal_unavailable", "rejected", "running",
            "interrupted", "queued", "awaiting_approval")
#: The limits a ``limit_exceeded`` run names (SPEC 1).
LIMITS = ("model_steps", "tool_calls", "deadline", "input_tokens", "output_tokens",
          "total_tokens", "cost")

_json = msgspec.json.Encoder()


# -- opening -----------------------------------------------------------------------------
def journal_dir(value: str | os.PathLike[str] | None = None) -> str:
    """``value``, else ``$BOUNDLOOP_JOURNAL``, else ``./.boundloop`` (SPEC 10)."""
    if value is not None and str(value):
        return os.fspath(value)
    return os.environ.get("BOUNDLOOP_JOURNAL") or ".boundloop"


def open_journal(path: str | os.PathLike[str] | None = None, *,
                 create: bool = False, readonly: bool = False, walk: bool = True) -> Journal:
    """Open the LMDB journal in ``path`` (see ``journal_dir``), or the PostgreSQL journal a
    ``postgresql://`` URL names, for inspection.

    With ``readonly`` nothing is written, created or chmodded, and no write lock is taken,
    so it never waits for a writer (SPEC 6: commands that only read). ``walk``: see
    ``LmdbJournal``.

    Raises:
        JournalUnavailable: there is no journal there (and ``create`` is False), or it cannot
            be opened (locked, unreadable, not an LMDB environment).
        JournalCorrupt: what is there is not a journal (an empty data.mdb, say).
    """
    from boundloop.journal.lmdb import LmdbJournal

    value = journal_dir(path)
    if "://" in value:
        from boundloop.journal import postgres  # psycopg is imported only for a URL

        if postgres.url_scheme(value):
            # postgresql:// (SPEC 12); any other scheme is a ConfigError naming those.
            return postgres.open_url(value, readonly=readonly, create=create and not readonly)
    where = Path(value)
    if not create:
        hint = "pass the right --journal or set $BOUNDLOOP_JOURNAL"
        if not where.exists():
            raise JournalUnavailable(f"no journal at {where}; {hint}")
        if not where.is_dir():
            raise JournalUnavailable(f"{where} is not a journal directory; {hint}")
        if not (where / "data.mdb").exists():
            raise JournalUnavailable(f"{where} holds no journal (no data.mdb); {hint}")
    try:
        return LmdbJournal(where, create=create and not readonly, readonly=readonly,
                           walk=walk)
    except OSError as exc:
        raise JournalUnavailable(f"cannot open the journal at {where}: "
                                 f"{exc.strerror or exc}") from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] == "lmdb":  # lmdb.Error: locked, invalid, ...
            raise JournalUnavailable(f"cannot open the journal at {where}: {exc}") from None
        raise


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> float:
    """Seconds in a duration like ``30d``, ``12h``, ``1h30m``, ``90s`` or ``2w``.

    Raises:
        ConfigError: ``text`` is not such a duration.
    """
    compact = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    for match in _DURATION.finditer(compact):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not compact or pos != len(compact):
        raise ConfigError(f"bad duration {text!r}: use a number and a unit (s, m, h, d, w), "
                          "e.g. 30d, 12h, 1h30m, 90s")
    return total


def read_events(journal: Journal, run_id: str) -> list[ev.Event]:
    """The run's events, oldest first (their sequence numbers are 1, 2, ...).

    Raises:
        UnknownRun: the journal holds no such run.
    """
    return list(journal.events(run_id))


#: How many candidates an ambiguous prefix names.
_CANDIDATES = 4


def _pick(given: str, ids: Iterable[str], what: str) -> str | None:
    """The one id of ``ids`` that starts with ``given`` (None: none does).

    Raises:
        AmbiguousId: several do (a few are named).
    """
    found: list[str] = []
    for candidate in ids:
        if candidate.startswith(given) and candidate not in found:
            found.append(candidate)
    if len(found) > 1:
        shown = ", ".join(sorted(found)[:_CANDIDATES])
        more = f" and {len(found) - _CANDIDATES} more" if len(found) > _CANDIDATES else ""
        raise AmbiguousId(f"{what} {given!r} is ambiguous: {len(found)} {what}s begin with "
                          f"it ({shown}{more}); give more of it")
    return found[0] if found else None


def resolve_run_id(journal: Journal, given: str) -> str:
    """The run id ``given`` names: itself when a run has that id (an exact id always wins),
    else the one run id it begins.

    Raises:
        UnknownRun: no run id is or begins with ``given``.
        AmbiguousId: ``given`` begins several run ids (and is none of them).
    """
    if given and journal.find(given) is not None:
        return given
    found = _pick(given, journal.runs(), "run id") if given else None
    if found is None:
        journal.info(given)  # raises UnknownRun, with the usual message
        raise UnknownRun(f"no run {given!r} in this journal")
    return found


def resolve_execution_id(journal: Journal, run_id: str, given: str) -> str:
    """The execution id of run ``run_id`` that ``given`` names: itself when one of the run's
    calls has that id, else the one it begins; when none does, ``given`` as it is (the
    caller says it is unknown).

    Raises:
        AmbiguousId: ``given`` begins several of the run's execution ids.
    """
    ids = list(dict.fromkeys(eid for e in journal.events(run_id)
                             if isinstance(eid := getattr(e, "execution_id", None), str)))
    if not given or given in ids:
        return given
    return _pick(given, ids, "execution id") or given


_json_events = msgspec.json.Decoder(ev.AnyEvent)
_raw_list = msgspec.msgpack.Decoder(list[bytes])


def load_events(path: str | os.PathLike[str]) -> list[ev.Event]:
    """Events from a file: JSON lines (``boundloop export``) or, for a ``.msgpack`` file, a
    msgpack array of the events' msgpack bytes (``codec.encode``, as a journal stores them
    uncompressed).

    Raises:
        JournalCorrupt: the file holds something that is not an event this version knows.
        OSError: the file cannot be read.
    """
    p = Path(path)
    data = p.read_bytes()
    if p.suffix == ".msgpack":
        try:
            raws = _raw_list.decode(data)
        except msgspec.DecodeError as exc:
            raise JournalCorrupt(f"{p}: not a msgpack array of events ({exc})") from None
        return [codec.decode(raw) for raw in raws]
    out: list[ev.Event] = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_json_events.decode(line))
        except msgspec.DecodeError as exc:
            named = _by_tag(line)  # "type" a class name (export), not a tag (older export)
            try:
                out.append(_json_events.decode(named if named is not None else line))
            except msgspec.DecodeError:
                raise JournalCorrupt(f"{p}, line {number}: not an event ({exc})") from None
    return out


#: Each event's stable tag, by its class name.
_TAGS = {cls.__name__: str(cls.__struct_config__.tag) for cls in get_args(ev.AnyEvent)}


def _by_tag(line: bytes) -> bytes | None:
    """A JSON line whose "type" names the event's class, with its tag there instead."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("type") not in _TAGS:
        return None
    obj["type"] = _TAGS[obj["type"]]
    return msgspec.json.encode(obj)


def event_type(event: ev.Event) -> str:
    """The event's stable tag (``call.decided``), as stored."""
    return str(type(event).__struct_config__.tag)


def event_name(event: ev.Event) -> str:
    """The event's class name (``CallDecided``), as SPEC 6 names it."""
    return type(event).__name__


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
    infos = getattr(journal, "infos", None)
    if callable(infos):
        return list(infos())
    return [i for i in (journal.find(r) for r in journal.runs()) if i is not None]


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


# -- show --------------------------------------------------------------------------------
class TimelineRow(msgspec.Struct, kw_only=True):
    """One event of a run, with what was left of the budget after it."""

    seq: int
    offset_s: float
    #: The event's class name (``CallDecided``), as SPEC 6 names it and ``export`` too.
    event: str
    step: int | None = None
    call_id: str | None = None
    tool: str | None = None
    execution_id: str | None = None
    attempt: int | None = None
    decision: str | None = None
    outcome: str | None = None
    latency_s: float | None = None
    detail: str = ""
    model_steps: int = 0
    tool_calls: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)


class Timeline(msgspec.Struct, kw_only=True):
    """What a run did, event by event, and how it ended."""

    run_id: str
    status: str
    finished: bool
    exhausted_limit: str | None
    explanation: str
    model_steps: int
    tool_calls: int
    usage: Usage
    budget: Budget
    started_ts: float
    elapsed_s: float
    parent_run_id: str | None
    rows: list[TimelineRow]
    completed: list[CompletedAction]
    unresolved: list[UnresolvedAction]
    #: The runner that owns the run (its last OwnerClaimed, else its RunAdmitted).
    owner: str = ""
    #: The runs it started, oldest first (``run_timeline``; ``timeline`` leaves it empty).
    children: list[RunSummary] = msgspec.field(default_factory=list)
    #: The agent the run runs (name and version) and its labels (SPEC 14).
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    #: Calls that wait for a person: execution id, tool and arguments (as journaled).
    awaiting: list[AwaitingCall] = msgspec.field(default_factory=list)
    #: The run's per-tool caps (tool name -> max_calls) and its accepted calls by tool
    #: (nested runs' included), as the fold counts them.
    tool_caps: dict[str, int] = msgspec.field(default_factory=dict)
    tool_counts: dict[str, int] = msgspec.field(default_factory=dict)


class AwaitingCall(msgspec.Struct, frozen=True):
    """A call that waits for a person's approve or deny."""

    execution_id: str
    tool: str
    arguments: dict[str, Any]


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else _json.encode(value).decode()
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _row(seq: int, event: ev.Event, state: RunState, t0: float) -> TimelineRow:
    row = TimelineRow(seq=seq, offset_s=round(max(event.ts - t0, 0.0), 6),
                      event=event_name(event))
    eid = getattr(event, "execution_id", None)
    if isinstance(eid, str):
        row.execution_id = eid
        rec = state.calls.get(eid)
        if rec is not None:
            row.step, row.call_id, row.tool = rec.step, rec.call_id, rec.tool
    match event:
        case ev.RunAdmitted():
            names = ", ".join(t + (f" (max_calls={event.tool_caps[t]})"
                                   if t in event.tool_caps else "")
                              for t in event.tools) or "none"
            row.detail = f"tools: {names}"
        case ev.ModelStepStarted():
            row.step = event.step
            row.detail = f"tools {'allowed' if event.tools_allowed else 'not allowed'}"
        case ev.ModelStepCompleted(response=Final() as resp):
            row.step, row.outcome, row.latency_s = event.step, "final", event.latency_s
            row.detail = _short(resp.text)
        case ev.ModelStepCompleted(response=CallTools() as resp):
            row.step, row.latency_s = event.step, event.latency_s
            row.outcome = f"{len(resp.calls)} call{'s' if len(resp.calls) != 1 else ''}"
            row.detail = ", ".join(f"{c.id} {c.name}" for c in resp.calls)
        case ev.ModelStepFailed():
            row.step, row.outcome, row.latency_s = event.step, event.reason, event.latency_s
            row.detail = _short(event.detail)
        case ev.UsageCharged():
            row.step = event.step
            u = event.usage
            row.detail = (f"in {u.all_input_tokens} out {u.output_tokens}"
                          f"{'' if u.cost is None else f' cost {money(u.cost)}'}"
                          f" ({'estimated' if event.estimated else 'reported'})"
                          + (f"; unpriced: {_short(event.unpriced)}" if event.unpriced else ""))
        case ev.NoticeAdded():
            row.detail = _short(event.text)
        case ev.CallDecided():
            row.step, row.call_id, row.tool = event.step, event.call_id, event.tool
            row.decision = event.decision + (" (awaits approval)" if event.approval else "")
            row.detail = _short(event.reason) if event.reason else _short(event.arguments)
        case ev.CallDispatched():
            row.attempt, row.outcome = event.attempt, "dispatched"
        case ev.CallSucceeded():
            row.attempt, row.outcome, row.latency_s = event.attempt, event.status, event.latency_s
            row.detail = f"{event.size} bytes"
        case ev.CallFailed():
            row.attempt, row.latency_s = event.attempt, event.latency_s
            row.outcome = "error (retrying)" if event.retrying else "error"
            row.detail = _short(event.content)
        case ev.CallTimedOut():
            row.attempt, row.outcome, row.latency_s = event.attempt, "timed_out", event.latency_s
            row.detail = f"timeout {plain(event.timeout_s, 3)}s"
        case ev.CallOutcomeUnknown():
            row.attempt, row.outcome = event.attempt, "outcome_unknown"
            row.detail = _short(event.content)
        case ev.CallReconciled():
            row.attempt = event.attempt
            row.outcome = "reconciled: " + ("took effect" if event.took_effect else "did not")
        case ev.CallSkipped():
            row.outcome, row.detail = "skipped", event.reason
        case ev.CallResolved():
            row.outcome = f"resolved: {event.outcome}"
            row.detail = _short(" ".join(x for x in (event.note, f"by {event.by}" if event.by
                                                     else "") if x))
        case ev.RoundCompleted():
            row.step = event.step
        case ev.ChildCharged():
            row.detail = f"child {event.child_run_id}: {event.tool_calls} tool calls"
        case ev.OwnerClaimed() | ev.RunResumed():
            row.detail = f"owner {event.owner}" if event.owner else \
                ("released: nobody owns it" if isinstance(event, ev.OwnerClaimed) else "")
        case ev.ApprovalRequested():
            row.outcome = "awaiting approval"
        case ev.ApprovalDecided():
            row.outcome = "approved" if event.approved else "denied"
            row.detail = _short(" ".join(x for x in (event.note, f"by {event.by}" if event.by
                                                     else "") if x))
        case ev.RunRequeued():
            row.outcome = "queued again"
        case ev.RunFinished():
            row.outcome = event.status + (f" ({event.exhausted_limit})"
                                          if event.exhausted_limit else "")
            row.step = event.model_steps
        case _:
            pass
    row.model_steps, row.tool_calls, row.usage = state.model_steps, state.tool_calls, state.usage
    return row


def timeline(events: Iterable[ev.Event],
             owners: dict[str, OwnerRecord] | None = None) -> Timeline:
    """The run's timeline: each event with its time offset, step, call, decision, outcome,
    latency and the counters after it; then how the run ended.

    With ``owners`` (``journal.owners()``), a run with no RunFinished event is ``running``
    or ``interrupted`` as in ``list_runs`` (see ``state_word``); without, the fold's
    ``running``.

    Raises:
        ReplayError: the events do not make a run.
    """
    state = RunState()
    rows: list[TimelineRow] = []
    t0: float | None = None
    for seq, event in enumerate(events, 1):
        t0 = event.ts if t0 is None else t0
        apply(state, event)
        rows.append(_row(seq, event, state, t0))
    status, explanation = state.status, state.explanation
    if owners is not None and not state.finished:
        status = state_word(False, status, state.owner, owners)
        explanation = f"{OPEN_EXPLANATIONS[status]} {waiting_note(state, status)}".strip()
    return Timeline(agent=state.agent, agent_version=state.agent_version,
                    labels=state.labels, tool_caps=dict(state.tool_caps),
                    tool_counts=dict(state.tool_counts),
                    awaiting=[AwaitingCall(r.execution_id, r.tool, r.arguments)
                              for r in state.awaiting],
                    run_id=state.run_id, status=status, finished=state.finished,
                    exhausted_limit=state.exhausted_limit, explanation=explanation,
                    model_steps=state.model_steps, tool_calls=state.tool_calls,
                    usage=state.usage, budget=state.budget, started_ts=state.started_ts,
                    elapsed_s=state.elapsed_s, parent_run_id=state.parent_run_id, rows=rows,
                    completed=state.completed, unresolved=state.unresolved, owner=state.owner)


def run_timeline(journal: Journal, run_id: str) -> Timeline:
    """``timeline`` of the journal's run ``run_id``, with its state word (``running`` or
    ``interrupted`` while it has no RunFinished event) and the runs it started.

    Raises:
        UnknownRun: the journal holds no such run.
        AmbiguousId: ``run_id`` is no run's id and begins several.
        ReplayError: the events do not make a run.
    """
    run_id = resolve_run_id(journal, run_id)
    tl = timeline(read_events(journal, run_id), journal.owners())
    tl.children = run_children(journal, run_id)
    return tl


# -- replay ------------------------------------------------------------------------------
class Rebuilt(msgspec.Struct, kw_only=True):
    """A run's state rebuilt by the fold, and whether it agrees with its RunFinished event.

    ``finished_seq`` is the sequence number of the RunFinished event checked against (None
    when the run has not finished); ``mismatches`` says what disagrees (empty: consistent).
    """

    state: RunState
    finished_seq: int | None
    mismatches: list[str]

    @property
    def consistent(self) -> bool:
        """True when the fold agrees with the recorded RunFinished (or there is none)."""
        return not self.mismatches


def rebuild(events: Iterable[ev.Event]) -> Rebuilt:
    """Fold the events into the run's state and compare it with the last RunFinished event.

    Raises:
        ReplayError: the events do not make a run.
    """
    state = RunState()
    last: tuple[int, ev.RunFinished] | None = None
    for seq, event in enumerate(events, 1):
        apply(state, event)
        if isinstance(event, ev.RunFinished):
            last = (seq, event)
    if not state.finished or last is None:
        return Rebuilt(state=state, finished_seq=None, mismatches=[])
    seq, fin = last
    mismatches = [f"{name}: the fold gives {mine!r}, RunFinished (seq {seq}) says {theirs!r}"
                  for name, mine, theirs in (
                      ("status", state.status, fin.status),
                      ("exhausted_limit", state.exhausted_limit, fin.exhausted_limit),
                      ("model_steps", state.model_steps, fin.model_steps),
                      ("tool_calls", state.tool_calls, fin.tool_calls),
                      ("usage", state.usage, fin.usage))
                  # A RunFinished written before it carried usage decodes with an empty one.
                  if mine != theirs and not (name == "usage" and theirs == Usage())]
    return Rebuilt(state=state, finished_seq=seq, mismatches=mismatches)


# -- check -------------------------------------------------------------------------------
class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """The first decision of the current policy that differs from the recorded one.

    ``seq`` is the recorded event's sequence number (None when the recording has no
    decision there) and ``step`` its model step.
    """

    seq: int | None
    step: int
    recorded: str
    current: str

    def __str__(self) -> str:
        where = f"seq {self.seq}" if self.seq is not None else "after the last event"
        return (f"step {self.step}, {where}: recorded {self.recorded}; "
                f"the current policy: {self.current}")


class CheckReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``check`` found: ``ok`` when every recorded decision was made again.

    ``decisions`` counts the decisions compared and found equal; ``note`` says where the
    check stopped short of the end of the run, and why.
    """

    run_id: str
    ok: bool
    decisions: int
    divergence: Divergence | None
    budget: Budget
    note: str = ""


def recorded_budget(events: Sequence[ev.Event]) -> Budget:
    """The budget the run was admitted with.

    Raises:
        JournalCorrupt: the events do not start with RunAdmitted.
    """
    if not events or not isinstance(events[0], ev.RunAdmitted):
        raise JournalCorrupt("the run's events do not start with RunAdmitted")
    return events[0].budget


_DECISIONS = (ev.ModelStepStarted, ev.CallDecided, ev.RunFinished)
#: Where a check stops following the recording: after these, decisions depend on recovery,
#: a person, or child runs, none of which the check re-enacts.
_HORIZON = (ev.OwnerClaimed, ev.RunResumed, ev.CallResolved, ev.ChildCharged)
_STOP = object()
_MALFORMED = object()


class _ReplayClock(Clock):
    """Time as the recording saw it: ``now`` is seconds since the run started."""

    def __init__(self, wall0: float) -> None:
        self.now = 0.0
        self.wall0 = wall0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall0 + self.now


class RecordedModelError(Exception):
    """Stands for the exception the model raised in the recorded run."""


class _StandIn(Tool):
    """A tool known only by name: accepts any arguments unless the recording says otherwise."""

    def __init__(self, name: str, flags: ev.CallDecided | None, checker: _Checker) -> None:
        super().__init__(name, _no_handler, timeout_s=None,
                         read_only=bool(flags and flags.read_only),
                         idempotent=bool(flags and flags.idempotent),
                         irreversible=bool(flags and flags.irreversible and not flags.read_only))
        self._checker = checker

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # The loop validates each call in order right before its deadline check: set the
        # clock and cancellation as the recorded run saw them for this call.
        recorded = self._checker.recorded_for.pop(id(arguments), None)
        if recorded is not None:
            checker = self._checker
            checker.clock.now = max(checker.clock.now, checker.time_of(recorded))
            if recorded.decision == "skipped" and recorded.reason == "cancelled":
                checker.cancel.cancel("as recorded")
            if recorded.decision == "invalid_arguments":
                raise ArgumentError(recorded.reason or "invalid arguments (as recorded)")
        return dict(arguments)


def _no_handler() -> None:
    """Never called: the check answers dispatches from the recording."""


def _key(event: ev.Event) -> tuple[Any, ...]:
    match event:
        case ev.ModelStepStarted():
            return ("model", event.step, event.tools_allowed)
        case ev.CallDecided():
            return ("call", event.step, event.index, event.call_id, event.tool, event.decision)
        case ev.RunFinished():
            return ("finish", event.status, event.exhausted_limit, event.model_steps,
                    event.tool_calls)
        case _:
            return (event_type(event),)


def _step(event: ev.Event) -> int:
    match event:
        case ev.ModelStepStarted() | ev.CallDecided():
            return event.step
        case ev.RunFinished():
            return event.model_steps
        case _:
            return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def describe(event: ev.Event) -> str:
    """A decision event in a few words (what ``check`` reports)."""
    match event:
        case ev.ModelStepStarted():
            allowed = "tools allowed" if event.tools_allowed else "tools not allowed"
            return f"model step {event.step} starts ({allowed})"
        case ev.CallDecided():
            why = f" ({event.reason})" if event.reason and event.decision != "allow" else ""
            return (f"call {event.call_id} ({event.tool}) at step {event.step}: "
                    f"{event.decision}{why}")
        case ev.RunFinished():
            limit = f" ({event.exhausted_limit})" if event.exhausted_limit else ""
            return (f"the run finishes {event.status}{limit} after "
                    f"{_count(event.model_steps, 'model step')} and "
                    f"{_count(event.tool_calls, 'tool call')}")
        case _:
            return event_name(event)


def _tripping(budget: Budget, used: Usage, limit: str) -> Usage:
    """The smallest reservation that takes ``used`` over ``limit`` (and over no limit that is
    checked before it): stands for a reservation the recording did not keep."""
    def room(cap: float | None, spent: float) -> float:
        return math.inf if cap is None else max(cap - spent, 0)

    if limit == "input_tokens" and budget.max_input_tokens is not None:
        return Usage(input_tokens=int(room(budget.max_input_tokens, used.all_input_tokens)) + 1)
    if limit == "output_tokens" and budget.max_output_tokens is not None:
        return Usage(output_tokens=int(room(budget.max_output_tokens, used.output_tokens)) + 1)
    if limit == "total_tokens" and budget.max_total_tokens is not None:
        need = int(room(budget.max_total_tokens, used.total_tokens)) + 1
        take_in = int(min(need, room(budget.max_input_tokens, used.all_input_tokens)))
        return Usage(input_tokens=take_in, output_tokens=need - take_in)
    if limit == "cost" and budget.max_cost is not None:
        gap = room(budget.max_cost, used.cost or 0.0)
        return Usage(cost=gap + max(budget.max_cost, 1.0) * 1e-9)
    return Usage()


class _Checker:
    def __init__(self, events: Sequence[ev.Event], budget: Budget | None) -> None:
        admitted = events[0] if events else None
        if not isinstance(admitted, ev.RunAdmitted):
            raise JournalCorrupt("the run's events do not start with RunAdmitted")
        self.admitted = admitted
        self.note = ""
        cut = len(events)
        finished = False
        for i, event in enumerate(events):
            finished = finished or isinstance(event, ev.RunFinished)
            # After RunFinished, only a resume makes new decisions (a resolution makes none).
            if isinstance(event, ev.RunResumed) or (isinstance(event, _HORIZON) and not finished):
                cut = i
                self.note = (f"checked up to seq {i}: at seq {i + 1} ({event_name(event)}) the "
                             "run was taken over by recovery, a person or a child run, which "
                             "the check does not re-enact")
                break
        self.recording = list(events[:cut])
        self.finished = any(isinstance(e, ev.RunFinished) for e in self.recording)
        self.decisions = [(seq, e) for seq, e in enumerate(self.recording, 1)
                          if isinstance(e, _DECISIONS)]
        self.responses: dict[int, ev.ModelStepCompleted | ev.ModelStepFailed] = {}
        self.charged: dict[int, Usage] = {}
        self.decided: dict[tuple[int, str], ev.CallDecided] = {}
        self.outcomes: dict[str, list[ev.Event]] = {}
        self.results: dict[tuple[str, int], tuple[int, ev.CallSucceeded]] = {}
        flags: dict[str, ev.CallDecided] = {}
        for seq, e in enumerate(self.recording, 1):
            match e:
                case ev.ModelStepCompleted() | ev.ModelStepFailed():
                    self.responses[e.step] = e
                case ev.UsageCharged(estimated=False):
                    self.charged[e.step] = e.usage
                case ev.CallDecided():
                    self.decided[(e.step, e.call_id)] = e
                    flags.setdefault(e.tool, e)
                case ev.CallSucceeded():
                    self.results[(e.execution_id, e.attempt)] = (seq, e)
                    self.outcomes.setdefault(e.execution_id, []).append(e)
                case (ev.CallDispatched() | ev.CallFailed() | ev.CallTimedOut()
                      | ev.CallOutcomeUnknown() | ev.CallReconciled() | ev.CallSkipped()):
                    self.outcomes.setdefault(e.execution_id, []).append(e)
                case _:
                    pass
        self.recorded_budget = admitted.budget
        self.budget = budget if budget is not None else admitted.budget
        self.output_guess = next((e.reservation.output_tokens for _, e in self.decisions
                                  if isinstance(e, ev.ModelStepStarted)), 0)
        self.pos = 0
        self.matched = 0
        self.divergence: Divergence | None = None
        self.recorded_for: dict[int, ev.CallDecided] = {}
        self.cancel = CancelToken()
        self.clock = _ReplayClock(admitted.ts)
        self.tools = {name: _StandIn(name, flags.get(name), self) for name in admitted.tools}

    # -- the recording's cursor ----------------------------------------------------------
    def upcoming(self) -> tuple[int, ev.Event] | None:
        return self.decisions[self.pos] if self.pos < len(self.decisions) else None

    def time_of(self, event: ev.Event) -> float:
        """When the recorded run made its check for ``event``: its elapsed time, kept just
        under the recorded deadline unless the event says the deadline had passed."""
        t = event.elapsed_s
        deadline = self.recorded_budget.deadline_s
        passed = (isinstance(event, ev.RunFinished) and event.exhausted_limit == "deadline") \
            or (isinstance(event, ev.CallDecided) and event.decision == "skipped"
                and event.reason == "deadline")
        if deadline is not None and not passed:
            t = min(t, math.nextafter(deadline, -math.inf))
        return t

    def sync(self) -> None:
        """Set the clock and the cancel token as the recorded run saw them next."""
        nxt = self.upcoming()
        if nxt is None:
            return
        event = nxt[1]
        self.clock.now = max(self.clock.now, self.time_of(event))
        if isinstance(event, ev.RunFinished) and event.status == "cancelled":
            self.cancel.cancel("as recorded")

    def end(self, note: str) -> object:
        self.note = "; ".join(n for n in (self.note, note) if n)
        return _STOP

    def ends_here(self, where: str) -> object:
        """The recording has nothing more to answer with (a crash, or the horizon)."""
        if self.note:  # the horizon note already says where and why
            return _STOP
        return self.end(f"the recording ends {where} before the run finished; every recorded "
                        "decision matched")

    def expect(self, current: ev.Event) -> bool:
        """Compare one decision of the current policy with the next recorded one."""
        nxt = self.upcoming()
        if nxt is None:
            if self.finished:
                self.divergence = Divergence(seq=None, step=_step(current),
                                             recorded="nothing more (the run had finished)",
                                             current=describe(current))
            else:
                self.ends_here(f"at seq {len(self.recording)}")
            return False
        seq, recorded = nxt
        if isinstance(recorded, ev.RunFinished) and recorded.status == "journal_unavailable":
            self.end(f"the journal failed before seq {seq} and nothing after that was "
                     "recorded; every recorded decision before it matched")
            return False
        if _key(recorded) != _key(current):
            self.divergence = Divergence(seq=seq, step=_step(recorded),
                                         recorded=describe(recorded), current=describe(current))
            return False
        self.pos += 1
        self.matched += 1
        self.sync()
        return True

    # -- inputs the current policy asks for ----------------------------------------------
    def estimate(self, history: list[Message], model: Any) -> Usage:
        """The recorded reservation of the step about to start."""
        nxt = self.upcoming()
        if nxt is not None and isinstance(nxt[1], ev.ModelStepStarted):
            return nxt[1].reservation
        estimate = default_reservation(len(_json.encode(history)), self.output_guess)
        if nxt is not None and isinstance(nxt[1], ev.RunFinished) \
                and nxt[1].status == "limit_exceeded" and nxt[1].exhausted_limit in TOKEN_LIMITS:
            # The recorded run stopped before this step: its reservation went over the limit
            # but was not kept. Use the default estimate when it agrees, else the least that
            # does.
            limit = nxt[1].exhausted_limit or ""
            used = replay(self.recording[:nxt[0] - 1]).usage
            if exceeded(self.recorded_budget, used + estimate) != limit:
                return _tripping(self.recorded_budget, used, limit)
        return estimate

    def permit(self, call: ToolCall, tool: Tool, ctx: ModelContext) -> Any:
        """Feeds the recorded decision of this call: a denial here; invalid arguments, the
        clock and cancellation through the stand-in's ``validate`` (keyed by the call's
        arguments object, which the loop hands to both)."""
        recorded = self.decided.get((ctx.step, call.id))
        if recorded is None:
            return True
        self.recorded_for[id(call.arguments)] = recorded
        if recorded.decision == "denied":
            return recorded.reason or "denied (as recorded)"
        return True

    def model_reply(self, ctx: ModelContext) -> Any:
        from boundloop.loop import ModelReply

        started = ev.ModelStepStarted(run_id=self.admitted.run_id, step=ctx.step,
                                      tools_allowed=ctx.tools_allowed, reservation=Usage())
        if not self.expect(started):
            return _STOP
        recorded = self.responses.get(ctx.step)
        if recorded is None:
            return self.ends_here(f"at seq {len(self.recording)}, with no answer of the "
                                  f"model to step {ctx.step},")
        if isinstance(recorded, ev.ModelStepCompleted):
            response: Any = recorded.response
            if ctx.step in self.charged:
                response = msgspec.structs.replace(response, usage=self.charged[ctx.step])
            return ModelReply(response, None, recorded.latency_s)
        if recorded.reason == "error":
            return ModelReply(None, RecordedModelError(recorded.detail), recorded.latency_s)
        if recorded.reason == "cancelled":
            self.cancel.cancel("as recorded")
            return ModelReply(None, None, recorded.latency_s)
        return ModelReply(_MALFORMED, None, recorded.latency_s)

    def outcome(self, execution_id: str) -> Any:
        from boundloop.loop import Attempt, Outcome

        out = Outcome(execution_id)
        for e in self.outcomes.get(execution_id, []):
            last = out.attempts[-1] if out.attempts else None
            match e:
                case ev.CallSkipped():
                    out.skipped = e.reason
                case ev.CallSucceeded():
                    value: Any = e.content
                    if e.status == "too_large":
                        value = "x" * max(e.size - 2, 0)  # as many JSON bytes as the result
                    out.attempts.append(Attempt(e.attempt, "ok", value, latency_s=e.latency_s))
                case ev.CallFailed():
                    out.attempts.append(Attempt(e.attempt, "error", error=e.content,
                                                category=e.error_category,
                                                latency_s=e.latency_s))
                case ev.CallTimedOut():
                    out.attempts.append(Attempt(e.attempt, "timeout", latency_s=e.latency_s,
                                                timeout_s=e.timeout_s))
                case ev.CallReconciled() if last is not None:
                    last.reconciled = e.took_effect
                    last.reconciled_value = e.content
                case ev.CallOutcomeUnknown() if last is not None:
                    last.error = e.content
                case _:
                    pass
        return out

    def committed(self, events: Sequence[ev.Event]) -> object:
        for event in events:
            if isinstance(event, ev.CallDecided | ev.RunFinished):
                if not self.expect(event):
                    return _STOP
            elif isinstance(event, ev.CallSucceeded):
                found = self.results.get((event.execution_id, event.attempt))
                if found is not None and found[1].status != event.status:
                    seq, recorded = found
                    rec = self.decided_by_eid(event.execution_id)
                    what = f"call {rec.call_id} ({rec.tool}) result" if rec else "call result"
                    self.divergence = Divergence(
                        seq=seq, step=rec.step if rec else 0,
                        recorded=f"{what} {recorded.status} ({recorded.size} bytes)",
                        current=f"{what} {event.status}")
                    return _STOP
        return None

    def decided_by_eid(self, execution_id: str) -> ev.CallDecided | None:
        return next((d for d in self.decided.values() if d.execution_id == execution_id), None)

    # -- the drive -----------------------------------------------------------------------
    def run(self) -> CheckReport:
        from boundloop import loop

        spec = loop.RunSpec(
            run_id=self.admitted.run_id, model=_no_handler, tools=dict(self.tools),
            budget=self.budget, history=list(self.admitted.history), cancel=self.cancel,
            secret_key=b"boundloop-check", clock=self.clock, owner=self.admitted.owner,
            permit=self.permit, estimator=self.estimate,
            parent_run_id=self.admitted.parent_run_id, parent_step=self.admitted.parent_step,
            parent_execution_id=self.admitted.parent_execution_id)
        driver = loop.Driver(spec)
        gen = driver.run()
        self.sync()
        reply: Any = None
        try:
            while True:
                try:
                    effect = gen.send(reply)
                except StopIteration:
                    break
                if isinstance(effect, loop.Commit):
                    reply = self.committed(effect.events)
                elif isinstance(effect, loop.InvokeModel):
                    reply = self.model_reply(effect.ctx)
                elif isinstance(effect, loop.Dispatch):
                    reply = [self.outcome(p.execution_id) for p in effect.calls]
                    for p, out in zip(effect.calls, reply, strict=True):
                        # As the executor does: an attempt that did not ride its round's
                        # commit has its dispatch recorded before it starts.
                        done = p.first_attempt if p.recorded else p.first_attempt - 1
                        for i, att in enumerate(out.attempts):
                            if att.attempt > done:
                                driver.attempt_events(p.execution_id, att.attempt,
                                                      out.attempts[:i])
                                done = att.attempt
                elif isinstance(effect, loop.CallUser):
                    # The check's own estimator and permit stand-ins: call them in place.
                    try:
                        reply = loop.ModelReply(effect.fn(*effect.args))
                    except Exception as exc:  # noqa: BLE001 - delivered as the reply
                        reply = loop.ModelReply(None, exc)
                elif isinstance(effect, loop.Ledger):
                    # A child run settling with its tree: its own budget (already the smaller
                    # of what it asked and what was left) is what the check holds it to.
                    reply = LedgerReply(True, [], TreeLeft())
                else:
                    reply = self.end(f"the current loop asked for {type(effect).__name__}, "
                                     "which a recording cannot answer")
                if reply is _STOP:
                    break
        finally:
            gen.close()
        return CheckReport(run_id=self.admitted.run_id, ok=self.divergence is None,
                           decisions=self.matched, divergence=self.divergence,
                           budget=self.budget, note=self.note)


def check(events: Sequence[ev.Event], budget: Budget | None = None) -> CheckReport:
    """Re-run the current policy over a recorded run and report the first decision that
    differs (a Replayer): no model or tool is called.

    The run is driven by ``loop.drive`` with a RunSpec rebuilt from its RunAdmitted event.
    Model steps are answered with the recorded responses (and reported usage), dispatches
    with the recorded outcomes; time and cancellation follow the recording; recorded
    ``denied``, ``invalid_arguments`` and ``unknown_tool`` decisions are taken as given (the
    tools are stand-ins known by name). The decisions compared are each model step's start
    (and whether tools were allowed), each call's decision, and how the run finished
    (status, limit, counters), plus each result's status (``too_large``).

    Args:
        events: the run's events, oldest first.
        budget: the budget to check under (default: the recorded one), e.g. a lower
            ``max_tool_calls`` to ask whether it would have changed past decisions.

    Raises:
        JournalCorrupt: the events do not start with RunAdmitted.
    """
    return _Checker(list(events), budget).run()


# -- prune -------------------------------------------------------------------------------
class PruneReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``prune`` removed (or, with ``dry_run``, would remove) and what it kept."""

    cut_ts: float
    dry_run: bool
    pruned: list[str]
    kept: dict[str, str]


def prune(journal: Journal, older_than_s: float, *, dry_run: bool = False,
          now: float | None = None,
          progress: Callable[[int, int | None], None] | None = None) -> PruneReport:
    """Remove finished runs that finished more than ``older_than_s`` seconds ago.

    Open runs are never touched (they have no finish time), nor is what recovery needs:
    runs that finished ``needs_review`` (a person may still resolve and resume them) and
    finished runs whose child runs are still open. ``kept`` names those with the reason.
    ``progress``, if given, is told ``(runs removed, runs to remove)`` as it goes.

    Raises:
        ConfigError: ``older_than_s`` is negative.
    """
    if older_than_s < 0 or math.isnan(older_than_s):
        raise ConfigError(f"older_than_s must be at least 0, got {older_than_s!r}")
    now = time.time() if now is None else now
    cut = now - older_than_s
    open_parents = {i.parent_run_id for i in (journal.find(r) for r in journal.open_runs())
                    if i is not None and i.parent_run_id}
    kept: dict[str, str] = {}

    def keep(info: RunInfo) -> bool:
        if info.status == "needs_review":
            kept[info.run_id] = "needs review: a person may still resolve and resume it"
        elif info.status == "awaiting_approval":
            kept[info.run_id] = "awaiting approval: a person may still approve or deny"
        elif info.run_id in open_parents:
            kept[info.run_id] = "a child run of it is still open"
        return info.run_id in kept

    pruned = journal.prune(cut, dry_run=dry_run, keep=keep, progress=progress)
    return PruneReport(cut_ts=cut, dry_run=dry_run, pruned=pruned, kept=kept)


# -- export ------------------------------------------------------------------------------
#: Fields whose values ``export_lines(strip_content=True)`` replaces with digests.
CONTENT_FIELDS = frozenset({"text", "content", "arguments", "detail", "note"})


def _scrub(value: Any, key: bytes, strip: bool) -> Any:
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            already = isinstance(v, str) and v.startswith(PREFIX)
            if not isinstance(k, str) or already:
                out[k] = _scrub(v, key, strip)
            elif strip and k in ("arguments", "validated") and isinstance(v, dict):
                # Arguments stay an object (the schema says so); each value is digested.
                out[k] = {name: arg if isinstance(arg, str) and arg.startswith(PREFIX)
                          else digest(key, arg) for name, arg in v.items()}
            elif is_credential(k) or (strip and k in CONTENT_FIELDS and v is not None):
                out[k] = digest(key, v)
            else:
                out[k] = _scrub(v, key, strip)
        return out
    if isinstance(value, list):
        return [_scrub(v, key, strip) for v in value]
    return value


def export_lines(events: Iterable[ev.Event], secret_key: bytes, *,
                 strip_content: bool = False) -> Iterator[str]:
    """The events as JSON lines (``{"seq": n, "type": "CallDecided", ...}``: the event's
    class name, as ``show`` names it), for a bug report.

    Values the journal redacted stay digests; any other value under a key that names a
    credential is digested too (HMAC under ``secret_key``). With ``strip_content``, texts,
    arguments, results and error details become digests as well, keeping the structure.
    ``load_events`` reads the lines back.
    """
    for seq, event in enumerate(events, 1):
        data = _scrub(msgspec.to_builtins(event), secret_key, strip_content)
        data["type"] = event_name(event)  # as `show` names it (load_events takes both)
        yield _json.encode({"seq": seq, **data}).decode()


# -- integrity ---------------------------------------------------------------------------
class ChainReport(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``boundloop verify``: a run, its chain head in hex, and whether its
    records check out (``error`` says what is damaged, naming the sequence number)."""

    run_id: str
    head: str | None
    ok: bool
    error: str | None = None


def verify_chains(journal: Journal, run_ids: Sequence[str] = ()) -> list[ChainReport]:
    """Check the hash chain and sequence of every run (or of ``run_ids``), as stored: also
    runs whose index entries are damaged or missing, and the indexes of runs themselves.

    This runs in the calling process: LMDB keeps no checksums of its own pages, so a
    journal whose B-tree pages are damaged can crash it (SIGBUS, or an abort on one of its
    assertions). ``verify_journal`` runs the same check in a child process instead.

    Raises:
        UnknownRun: a run of ``run_ids`` is not in the journal.
        ConfigError: ``journal`` is not an LMDB journal (only it keeps a chain).
    """
    reports: dict[str, ChainReport] = {}
    for report in _chain_reports(journal, run_ids):
        _merge(reports, report)
    return list(reports.values())


def _merge(reports: dict[str, ChainReport], report: ChainReport) -> None:
    """Keep the first report of a run, unless a later one finds damage the first did not."""
    old = reports.get(report.run_id)
    if old is None:
        reports[report.run_id] = report
    elif old.ok and not report.ok:
        reports[report.run_id] = msgspec.structs.replace(report, head=report.head or old.head)


def _chain_reports(journal: Journal, run_ids: Sequence[str] = (), listed: Any = None,
                   indexes: bool | None = None, runs: bool = True) -> Iterator[ChainReport]:
    """Reports of ``run_ids`` (else of every run: those in the indexes, then any with records
    but no index entry), then (``indexes``, by default when no ids are given) of the
    indexes; ``listed`` is called with the ids first."""
    from boundloop.journal import chain
    from boundloop.journal.lmdb import LmdbJournal

    if not isinstance(journal, LmdbJournal) and not hasattr(journal, "chain_head"):
        raise ConfigError("this journal keeps no hash chain to verify")
    chained: Any = journal  # LMDB or PostgreSQL: both keep the chain
    # A unique prefix names a run; an unknown id is reported by _check_runs.
    run_ids = [_resolve_or_keep(chained, r) for r in run_ids]
    ids = list(run_ids) if run_ids or not runs else chained.indexed_run_ids()
    if listed is not None:
        listed(ids)
    yield from _check_runs(chained, ids, listed_by_user=bool(run_ids))
    if runs and not run_ids:
        known = set(ids)
        try:
            recorded = chained.recorded_run_ids()
        except JournalCorrupt as exc:
            recorded = []
            yield ChainReport(run_id="(records)", head=None, ok=False, error=str(exc))
        yield from _check_runs(chained, [r for r in recorded if r not in known],
                               listed_by_user=False)
    if not run_ids if indexes is None else indexes:
        for index in (chained.infos, chained.open_runs):
            try:
                list(index())
            except chain.ChainError as exc:
                yield ChainReport(run_id=exc.run_id, head=None, ok=False, error=exc.what)
            except JournalCorrupt as exc:
                yield ChainReport(run_id="(index)", head=None, ok=False, error=str(exc))


def _resolve_or_keep(journal: Any, given: str) -> str:
    from boundloop.errors import BoundloopError

    try:
        return resolve_run_id(journal, given)
    except AmbiguousId:
        raise
    except BoundloopError:  # unknown, or an index that cannot be read: reported per run
        return given


def _check_runs(journal: Any, ids: Sequence[str], listed_by_user: bool
                ) -> Iterator[ChainReport]:
    from boundloop.journal import chain

    for run_id in ids:
        try:
            head = journal.chain_head(run_id)
        except UnknownRun:
            if listed_by_user:
                raise
            yield ChainReport(run_id=run_id, head=None, ok=False,
                              error="the order index names it, but it has no index entry")
        except JournalCorrupt as exc:
            stored = journal.stored_head(run_id)
            if isinstance(exc, chain.ChainError):
                what = f"seq {exc.seq}: {exc.what}" if exc.seq else exc.what
            else:
                what = str(exc)
            yield ChainReport(run_id=run_id, head=stored.hex() if stored else None, ok=False,
                              error=what)
        else:
            yield ChainReport(run_id=run_id, head=head.hex(), ok=True)


_report_json = msgspec.json.Decoder(ChainReport)


def _verify_child() -> None:
    """The child process of ``verify_journal``: ``DIR all|some|indexes [RUN_ID...]`` in argv
    (all: the runs given, else every run, and the indexes; indexes: only those), one JSON
    line per finding on stdout (the ids first, then a report per run, then the indexes')."""
    import sys

    from boundloop.errors import BoundloopError

    out = sys.stdout

    def say(value: Any) -> None:
        out.write(_json.encode(value).decode() + "\n")
        out.flush()

    try:
        # Its pages are walked here, as a finding: the runs are read all the same (a crash
        # reading one is reported by the parent), so that each damaged run is named.
        with open_journal(sys.argv[1], readonly=True, walk=False) as j:
            if sys.argv[2] != "some" and hasattr(j, "walk_pages"):
                try:
                    j.walk_pages()
                except BoundloopError as exc:
                    say({"report": ChainReport(run_id="(pages)", head=None, ok=False,
                                               error=str(exc))})
            for report in _chain_reports(j, sys.argv[3:], listed=lambda ids: say({"ids": ids}),
                                         indexes=sys.argv[2] != "some",
                                         runs=sys.argv[2] != "indexes"):
                say({"report": report})
    except BoundloopError as exc:
        say({"error": str(exc), "kind": type(exc).__name__})


def verify_journal(path: str | os.PathLike[str] | None = None,
                   run_ids: Sequence[str] = (), *,
                   progress: Callable[[int, int | None], None] | None = None
                   ) -> list[ChainReport]:
    """``verify_chains`` on the journal in ``path``, in a child process, so that LMDB
    crashing on damaged B-tree pages is reported as damage instead of killing the caller:
    the run being read when the child died is reported damaged (naming the signal), and a
    new child goes on with the runs after it. ``progress``, if given, is told
    ``(runs checked, runs to check)`` as the child reports them.

    Raises:
        UnknownRun: a run of ``run_ids`` is not in the journal.
        JournalUnavailable, JournalCorrupt: the journal cannot be opened.
    """
    import signal
    import subprocess
    import sys
    import tempfile

    from boundloop import errors

    where = journal_dir(path)
    code = "from boundloop.inspection import _verify_child; _verify_child()"
    reports: dict[str, ChainReport] = {}
    todo = list(run_ids)
    mode = "some" if run_ids else "all"
    total: int | None = None  # runs to check in all, once the first child listed them
    while True:
        ids: list[str] | None = None
        done = 0
        # Read as the child writes, for the progress; its stderr goes to a file, so that
        # neither pipe can fill up while the other is read.
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
                [sys.executable, "-c", code, where, mode, *todo], stdout=subprocess.PIPE,
                stderr=err, text=True) as proc:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    item = msgspec.json.decode(line)
                    if "error" in item:
                        kind = getattr(errors, item["kind"], errors.JournalError)
                        raise kind(item["error"])
                    if "ids" in item:
                        ids = item["ids"]
                        if total is None:
                            total = len(ids)
                    else:
                        _merge(reports, _report_json.decode(_json.encode(item["report"])))
                        done += 1
                    if progress is not None:
                        progress(len(reports), total)
            except BaseException:
                proc.kill()
                raise
            proc.wait()
            err.seek(0)
            stderr = err.read()
        if proc.returncode >= 0:
            if proc.returncode != 0:
                raise errors.JournalError(f"verify failed: {stderr.strip()[-500:]}")
            return list(reports.values())
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        crashed = (f"LMDB crashed reading it ({name}): the journal's own B-tree pages are "
                   "damaged (LMDB keeps no checksums of them); restore the journal from a "
                   "backup")
        if ids is None or done >= len(ids):
            # While opening or listing the journal, or checking its indexes.
            _merge(reports, ChainReport(run_id="(journal)", head=None, ok=False, error=crashed))
            return list(reports.values())
        _merge(reports, ChainReport(run_id=ids[done], head=None, ok=False, error=crashed))
        todo = ids[done + 1:]
        if not todo:
            if mode != "all":
                return list(reports.values())
            mode = "indexes"


def key_file_warning(path: str | os.PathLike[str] | None = None) -> str | None:
    """A warning when a redaction key file from an older version lies inside the journal
    directory (SPEC 9: the key lives apart from the journal), else None."""
    key = Path(journal_dir(path)) / "redaction.key"
    if not key.exists():
        return None
    return (f"{key} is a redaction key inside the journal directory (from an older version): "
            "anyone with a copy of the journal can use it to confirm guessed secrets; move it "
            "out of the journal directory (keep it with $BOUNDLOOP_REDACTION_KEY_FILE or in "
            "the state directory) and remove it from there")


class CompactReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``compact`` did: the journal's ``data.mdb`` size before and after, in bytes."""

    journal: str
    before: int
    after: int


def compact(path: str | os.PathLike[str] | None = None, *,
            progress: Callable[[int, int | None], None] | None = None) -> CompactReport:
    """Rewrite the LMDB journal in ``path`` to reclaim the space of pruned runs (see
    ``boundloop.journal.lmdb.compact``: crash-safe, and only while nothing else uses it).
    ``progress``, if given, is told ``(records copied, records)`` as it goes.

    Raises:
        JournalUnavailable: there is no journal there, another process has it open, or a
            live runner owns it.
        JournalCorrupt: the journal is damaged.
    """
    from boundloop.journal.lmdb import compact as rewrite

    where = Path(journal_dir(path))
    if not where.is_dir():
        raise JournalUnavailable(f"no journal at {where}; pass the right --journal or set "
                                 "$BOUNDLOOP_JOURNAL")
    before, after = rewrite(where, lambda record: owners_mod.owner_alive(record),
                            progress=progress)
    return CompactReport(journal=str(where), before=before, after=after)
