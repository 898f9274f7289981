"""``boundloop stats``: the telemetry's figures computed from the journal alone (SPEC 11).

The figures come from the same projection that feeds the metrics
(``boundloop.telemetry.projection``), run over each run's events as the journal holds them,
so an operator reads the numbers the metrics report without any telemetry backend: runs by
status, limit hits by limit, outcome-unknown actions, retries, reconciliations, actions sent
to review, tokens by kind, cost per finished run, run duration and model and tool latency.
A run that finished twice (it was resumed) counts twice, as ``boundloop.runs`` counts it.

With ``since``, only what happened at or after that time counts (each event's ``ts``);
earlier events of the same runs are still read, to know which tool each action called.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Literal

import msgspec

from boundloop import events as ev
from boundloop._text import money, plain
from boundloop.core import kinds
from boundloop.errors import JournalCorrupt
from boundloop.journal.base import Journal
from boundloop.telemetry import names as n
from boundloop.telemetry.projection import Projection

By = Literal["tool", "status", "limit", "label", "agent"]
BY: tuple[str, ...] = ("tool", "status", "limit", "label", "agent")


class Distribution(msgspec.Struct, frozen=True):
    """How many values, their sum and mean, and their 50th and 95th percentiles (linear
    interpolation between the closest ranks); None where there are no values."""

    count: int = 0
    sum: float = 0.0
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None


def percentile(ordered: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of the sorted ``ordered``, interpolated; None if empty."""
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> Distribution:
    """The Distribution of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return Distribution()
    total = math.fsum(ordered)
    return Distribution(len(ordered), total, total / len(ordered), percentile(ordered, 0.5),
                        percentile(ordered, 0.95))


class Group(msgspec.Struct, frozen=True, omit_defaults=True):
    """The figures of one group of ``--by``: runs (by status or limit), or a tool's actions."""

    runs: int | None = None
    cost_total: float | None = None
    cost_per_run: float | None = None
    duration_s: Distribution | None = None
    attempts: int | None = None
    #: Of the attempts, those that failed (CallFailed: the tool raised or returned an error).
    errors: int | None = None
    retries: int | None = None
    outcome_unknown: int | None = None
    reconciliations: int | None = None
    reviews: int | None = None
    latency_s: Distribution | None = None


class Stats(msgspec.Struct, frozen=True):
    """The figures of ``boundloop stats`` (its ``--json`` form)."""

    #: Only events at or after this time (epoch seconds) count; None: everything.
    since: float | None
    #: Runs read (those with any event in the window).
    runs_seen: int
    #: Runs that finished (RunFinished events: a resumed run that ended again counts again).
    runs: int
    runs_by_status: dict[str, int]
    #: Runs that have not finished (no RunFinished since their last admission or resume).
    open_runs: int
    limit_hits: dict[str, int]
    outcome_unknown: int
    retries: int
    reconciliations: int
    #: Of the reconciliations, those that found the action took effect.
    reconciled_took_effect: int
    #: Actions sent to review: the unresolved actions of runs that ended needs_review.
    reviews: int
    tokens: dict[str, int]
    #: Runs that finished with a cost (a price table, or a model that reports it).
    cost_runs: int
    cost_total: float
    #: Mean cost of a finished run that has one (None when none has).
    cost_per_run: float | None
    cost: Distribution
    duration_s: Distribution
    model_calls: int
    model_latency_s: Distribution
    tool_attempts: int
    tool_latency_s: Distribution
    by: By | None = None
    #: Runs whose turn ended awaiting approval and that wait for a person now (SPEC 14).
    awaiting_approval: int = 0
    #: Per ``--by`` key: its figures.
    groups: dict[str, Group] | None = None
    #: Runs that could not be read (``boundloop verify`` tells more); they are left out.
    damaged: list[str] = msgspec.field(default_factory=list)


class _Collect:
    """A metric sink that keeps every observation (``muted`` drops those before ``since``)."""

    def __init__(self) -> None:
        self.muted = False
        self.counts: dict[tuple[str, tuple[str, ...]], float] = {}
        self.values: dict[tuple[str, tuple[str, ...]], list[float]] = {}

    def record(self, metric: n.Metric, value: float, values: tuple[str, ...]) -> None:
        if self.muted:
            return
        key = (metric.name, values)
        if metric.kind == "counter":
            self.counts[key] = self.counts.get(key, 0) + value
        else:
            self.values.setdefault(key, []).append(value)

    def count(self, metric: n.Metric, at: int | None = None) -> dict[str, float]:
        """The metric's counts, summed by the attribute value at index ``at`` (all: "")."""
        out: dict[str, float] = {}
        for (name, values), v in self.counts.items():
            if name == metric.name:
                k = "" if at is None else values[at]
                out[k] = out.get(k, 0) + v
        return out

    def observed_where(self, metric: n.Metric, at: int, where: int,
                       value: str) -> dict[str, list[float]]:
        """The metric's observations whose attribute at ``where`` is ``value``, by the
        attribute value at ``at``."""
        out: dict[str, list[float]] = {}
        for (name, values), v in self.values.items():
            if name == metric.name and values[where] == value:
                out.setdefault(values[at], []).extend(v)
        return out

    def observed(self, metric: n.Metric, at: int | None = None) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for (name, values), v in self.values.items():
            if name == metric.name:
                out.setdefault("" if at is None else values[at], []).extend(v)
        return out


class _Finish(msgspec.Struct):
    status: str
    limit: str | None
    elapsed_s: float
    cost: float | None
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    agent: str = ""


class _Watch:
    """Sees each event before the projection: mutes the sink outside the window, notes
    whether the run finished, and keeps each RunFinished (for ``--by status|limit``)."""

    def __init__(self, sink: _Collect, since: float | None) -> None:
        self.sink = sink
        self.since = since
        self.finishes: list[_Finish] = []
        self.in_window = False
        self.finished = False
        self.admitted: ev.RunAdmitted | None = None
        self.awaiting = False

    def __call__(self, e: ev.Event) -> None:
        muted = self.sink.muted = self.since is not None and e.ts < self.since
        self.in_window = self.in_window or not muted
        if isinstance(e, ev.RunFinished) and kinds.awaits_approval(e.status):
            self.awaiting = True  # not a finished run: it waits for a person
        elif isinstance(e, ev.RunFinished):
            self.finished = True
            self.awaiting = False
            if not muted:
                first = self.admitted
                self.finishes.append(_Finish(e.status, e.exhausted_limit, e.elapsed_s,
                                             e.usage.cost,
                                             first.labels if first is not None else {},
                                             first.agent if first is not None else ""))
        elif isinstance(e, ev.RunAdmitted | ev.RunResumed | ev.RunRequeued):
            self.finished = self.awaiting = False
            if isinstance(e, ev.RunAdmitted):
                self.admitted = e


def compute(runs: Iterable[tuple[str, Iterable[ev.Event]]], *, since: float | None = None,
            by: By | None = None) -> Stats:
    """The figures of ``runs``, each ``(run_id, its events in order)``.

    Args:
        runs: the runs to count.
        since: only events with ``ts >= since`` count (None: all).
        by: also group the figures by ``tool``, ``status``, ``limit``, ``label`` (each
            ``key=value`` a run carries) or ``agent``.
    """
    if by is not None and by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, not {by!r}")
    sink = _Collect()
    watch = _Watch(sink, since)
    projection = Projection(sink, None, keep_finished=True, on_event=watch)
    seen = open_runs = awaiting = 0
    for run_id, events in runs:
        watch.in_window = watch.finished = watch.awaiting = False
        watch.admitted = None
        projection.project(run_id, events)
        projection.runs.pop(run_id, None)
        seen += watch.in_window
        awaiting += watch.awaiting
        open_runs += not watch.finished and not watch.awaiting
    stats = _figures(sink, watch.finishes, seen, open_runs, since, by)
    return msgspec.structs.replace(stats, awaiting_approval=awaiting) if awaiting else stats


def _figures(sink: _Collect, finishes: list[_Finish], seen: int, open_runs: int,
             since: float | None, by: By | None) -> Stats:
    def ints(d: dict[str, float]) -> dict[str, int]:
        return {k: int(v) for k, v in sorted(d.items())}

    reconciled = sink.count(n.RECONCILIATIONS, 1)
    costs = sink.observed(n.RUN_COST).get("", [])
    cost_total = math.fsum(costs)
    tokens = ints(sink.count(n.TOKENS, 0))
    groups: dict[str, Group] | None = None
    if by == "tool":
        groups = _by_tool(sink)
    elif by is not None:
        groups = _by_run(finishes, by)
    return Stats(
        since=since, runs_seen=seen, runs=int(sum(sink.count(n.RUNS).values())),
        runs_by_status=ints(sink.count(n.RUNS, 0)), open_runs=open_runs,
        limit_hits=ints(sink.count(n.LIMIT_HITS, 0)),
        outcome_unknown=int(sum(sink.count(n.OUTCOME_UNKNOWN).values())),
        retries=int(sum(sink.count(n.RETRIES).values())),
        reconciliations=int(sum(reconciled.values())),
        reconciled_took_effect=int(reconciled.get("true", 0)),
        reviews=int(sum(sink.count(n.REVIEWS).values())),
        tokens={k: tokens.get(k, 0) for k in n.TOKEN_KINDS},
        cost_runs=len(costs), cost_total=cost_total,
        cost_per_run=cost_total / len(costs) if costs else None,
        cost=distribution(costs),
        duration_s=distribution(sink.observed(n.RUN_DURATION).get("", [])),
        model_calls=len(sink.observed(n.MODEL_LATENCY).get("", [])),
        model_latency_s=distribution(sink.observed(n.MODEL_LATENCY).get("", [])),
        tool_attempts=len(sink.observed(n.TOOL_LATENCY).get("", [])),
        tool_latency_s=distribution(sink.observed(n.TOOL_LATENCY).get("", [])),
        by=by, groups=groups)


def _by_tool(sink: _Collect) -> dict[str, Group]:
    latency = sink.observed(n.TOOL_LATENCY, 0)
    retries = sink.count(n.RETRIES, 0)
    unknown = sink.count(n.OUTCOME_UNKNOWN, 0)
    reconciled = sink.count(n.RECONCILIATIONS, 0)
    reviews = sink.count(n.REVIEWS, 0)
    errors = sink.observed_where(n.TOOL_LATENCY, 0, 1, "error")
    tools = sorted({*latency, *retries, *unknown, *reconciled, *reviews})
    return {t: Group(attempts=len(latency.get(t, [])), errors=len(errors.get(t, [])),
                     retries=int(retries.get(t, 0)),
                     outcome_unknown=int(unknown.get(t, 0)),
                     reconciliations=int(reconciled.get(t, 0)), reviews=int(reviews.get(t, 0)),
                     latency_s=distribution(latency.get(t, [])))
            for t in tools}


def _by_run(finishes: list[_Finish], by: By) -> dict[str, Group]:
    keyed: dict[str, list[_Finish]] = {}
    for f in finishes:
        if by == "label":
            # A run counts in the group of each of its labels.
            keys: list[str | None] = [f"{k}={v}" for k, v in sorted(f.labels.items())] \
                or ["(no labels)"]
        elif by == "agent":
            keys = [f.agent or "(no agent)"]
        else:
            keys = [f.status if by == "status" else f.limit]
        for key in keys:
            if key is not None:
                keyed.setdefault(key, []).append(f)
    out: dict[str, Group] = {}
    for key in sorted(keyed):
        group = keyed[key]
        costs = [f.cost for f in group if f.cost is not None]
        total = math.fsum(costs)
        out[key] = Group(runs=len(group), cost_total=total if costs else None,
                         cost_per_run=total / len(costs) if costs else None,
                         duration_s=distribution(f.elapsed_s for f in group))
    return out


def from_journal(journal: Journal, *, since_s: float | None = None, by: By | None = None,
                 now: float | None = None) -> Stats:
    """The figures of every run in ``journal`` (only what happened in the last ``since_s``
    seconds, when given). A run that cannot be read is left out and named in ``damaged``.
    """
    cutoff = None if since_s is None else (time.time() if now is None else now) - since_s
    damaged: list[str] = []

    def runs() -> Iterable[tuple[str, list[ev.Event]]]:
        for run_id in journal.runs():
            try:
                if cutoff is not None:
                    info = journal.find(run_id)
                    # Appended to last before the window: none of its events is in it.
                    if info is not None and info.updated_ts and info.updated_ts < cutoff:
                        continue
                events = list(journal.events(run_id))
            except JournalCorrupt:
                damaged.append(run_id)
                continue
            yield run_id, events

    stats = compute(runs(), since=cutoff, by=by)
    return msgspec.structs.replace(stats, damaged=damaged) if damaged else stats


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s":
        if v < 0.01:
            return f"{v * 1000:.2f}ms"
        return f"{v * 1000:.1f}ms" if v < 1 else f"{v:.2f}s"
    return money(v) if unit == "$" else plain(v)


def _dist(d: Distribution | None, unit: str = "") -> str:
    if d is None or not d.count:
        return "-"
    return f"p50 {_num(d.p50, unit)}, p95 {_num(d.p95, unit)} (n={d.count})"


def _pairs(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def _plural(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


def render(stats: Stats) -> str:
    """The figures as plain text lines (no colour, no box drawing), as they come: the CLI
    fits them to the terminal (``summary``, ``group_table``)."""
    lines = summary(stats)
    table = group_table(stats)
    if table is not None:
        header, rows = table
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines += [""] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                         for r in [header, *rows]]
    elif stats.groups is not None:
        lines += ["", f"by {stats.by}: nothing to show"]
    lines += damage(stats)
    return "\n".join(lines)


def damage(stats: Stats) -> list[str]:
    """A line on the runs left out as damaged, if any."""
    if not stats.damaged:
        return []
    return [f"left out {_plural(len(stats.damaged), 'damaged run')} "
            f"({', '.join(stats.damaged)}); `boundloop verify` tells more"]


def summary(stats: Stats) -> list[str]:
    """The figures over every run, a line each."""
    window = "everything in the journal" if stats.since is None else \
        "since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stats.since))
    lines = [
        f"window: {window} ({_plural(stats.runs_seen, 'run')} with events in it)",
        f"runs finished: {stats.runs} ({_pairs(stats.runs_by_status)}); still open: "
        f"{stats.open_runs}; awaiting approval: {stats.awaiting_approval}",
        f"limit hits: {_pairs(stats.limit_hits)}",
        f"unknown outcomes: {stats.outcome_unknown}",
        f"retries: {stats.retries}",
        f"reconciliations: {stats.reconciliations} ({stats.reconciled_took_effect} took "
        "effect)",
        f"sent to review: {stats.reviews}",
        f"tokens: {_pairs(stats.tokens)}",
        f"cost per finished run: {_num(stats.cost_per_run, '$')} (total "
        f"{_num(stats.cost_total, '$')} "
        f"over {_plural(stats.cost_runs, 'run')} with a cost)",
        f"run duration: {_dist(stats.duration_s, 's')}",
        f"model latency: {_dist(stats.model_latency_s, 's')}",
        f"tool latency: {_dist(stats.tool_latency_s, 's')}",
    ]
    return lines


def group_table(stats: Stats) -> tuple[list[str], list[list[str]]] | None:
    """(header, rows) of the figures by ``stats.by``; None without a grouping or groups."""
    groups = stats.groups or {}
    if stats.by == "tool":
        header = ["tool", "attempts", "errors", "retries", "unknown", "reconciled",
                  "reviews", "p50", "p95"]
        rows = [[k, str(g.attempts), str(g.errors), str(g.retries), str(g.outcome_unknown),
                 str(g.reconciliations), str(g.reviews),
                 _num(g.latency_s.p50 if g.latency_s else None, "s"),
                 _num(g.latency_s.p95 if g.latency_s else None, "s")]
                for k, g in groups.items()]
    else:
        header = [stats.by or "", "runs", "cost/run", "cost total", "p50", "p95"]
        rows = [[k, str(g.runs), _num(g.cost_per_run, "$"), _num(g.cost_total, "$"),
                 _num(g.duration_s.p50 if g.duration_s else None, "s"),
                 _num(g.duration_s.p95 if g.duration_s else None, "s")]
                for k, g in groups.items()]
    if not rows:
        return None
    return header, rows
