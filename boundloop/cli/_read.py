"""The commands that read runs: ``runs``, ``show``, ``replay``, ``export`` and ``stats``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from boundloop._text import money
from boundloop.cli._common import (
    _DAMAGE_HINT,
    DURATION,
    EXIT_JOURNAL,
    EXIT_MISMATCH,
    F,
    journal_dir,
    journal_option,
    json_option,
)
from boundloop.cli._output import Col, _age, _ago, _echo_json, _Out, _plural, _secs, _tokens, _when
from boundloop.core import kinds

if TYPE_CHECKING:
    from boundloop.stats import Stats


#: How many runs ``runs`` lists unless given -n N or --all.
RUNS_LIMIT = 50

REJECTED = ("rejected runs are not journaled: admission refuses them before anything is "
            "recorded, so no listing can show them (the caller's RunResult says "
            "`rejected`, and the telemetry counts them)")


@click.command()
@journal_option
@json_option("the runs")
@click.option("--status", "statuses", multiple=True, metavar="STATUS",
              help="Only runs with this status (repeatable): a SPEC status, or running / "
                   "interrupted for runs that have not finished (owner alive / gone). "
                   "Not rejected: admission refuses those before anything is journaled.")
@click.option("--limit-hit", "limits", multiple=True, metavar="LIMIT",
              help="Only runs stopped by this limit (repeatable; 'any' for every limit).")
@click.option("--since", type=DURATION, default=None, metavar="AGE",
              help="Only runs started within AGE (e.g. 2h, 7d).")
@click.option("--older-than", type=DURATION, default=None, metavar="AGE",
              help="Only runs started more than AGE ago.")
@click.option("-n", "--last", type=click.IntRange(min=1), default=None, metavar="N",
              help=f"At most N runs, the newest (default {RUNS_LIMIT}; with --tree, N "
                   "top-level runs and the runs under them).")
@click.option("--all", "every", is_flag=True, help="Every run that matches (no -n limit).")
@click.option("--tree", is_flag=True,
              help="List each child run under its parent (when the parent is listed too).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Only runs that carry this label (repeatable: every one must match).")
def runs(journal: str | None, as_json: bool, statuses: tuple[str, ...], limits: tuple[str, ...],
         since: float | None, older_than: float | None, last: int | None, every: bool,
         tree: bool, labels: tuple[str, ...]) -> None:
    """List runs, newest first: the newest 50 unless -n N or --all.

    Ids are never cut: at a narrow width other columns are cut or hidden first (--json has
    them all). "took" is the run's time; for a running run, its age (now minus its start).
    Costs are plain decimals ($0.000033)."""
    from boundloop.ops import DAMAGED, LIMITS, STATUSES, find_runs, open_journal

    wanted: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="'--label'")
        wanted[key] = value

    for s in statuses:
        if kinds.is_rejected(s):
            raise click.BadParameter(REJECTED, param_hint="'--status'")
        if s not in STATUSES:
            listed = ", ".join(x for x in STATUSES if not kinds.is_rejected(x))
            raise click.BadParameter(f"{s!r} is not a status ({listed})",
                                     param_hint="'--status'")
    for lim in limits:
        if lim not in (*LIMITS, "any"):
            raise click.BadParameter(f"{lim!r} is not a limit ({', '.join(LIMITS)}, any)",
                                     param_hint="'--limit-hit'")
    if every and last is not None:
        raise click.UsageError("-n and --all contradict each other")
    limit = None if every else (last or RUNS_LIMIT)
    now = time.time()
    with open_journal(journal_dir(journal), readonly=True) as j:
        found = find_runs(j, status=statuses, limit_hit=limits, since_s=since,
                          older_than_s=older_than, last=limit, tree=tree, now=now,
                          labels=wanted)
    more = f"-n N or --all for more than {limit}" if found.more else ""
    if as_json:
        _echo_json(found.runs)
        if more and last is None:  # the default limit cut the list short: say so
            click.echo(f"boundloop: listed the newest {_plural(limit or 0, 'run')}; {more}",
                       err=True)
    else:
        _runs_text(found, statuses, limits, since, older_than, now, limit, more, tree)
    damaged = [r.run_id for r in found.runs if r.status == DAMAGED]
    if damaged:
        # Listed with the others; the exit says the journal is damaged.
        click.echo(f"boundloop: {_plural(len(damaged), 'damaged run')} listed "
                   f"({', '.join(damaged)}); {_DAMAGE_HINT}", err=True)
        click.get_current_context().exit(EXIT_JOURNAL)


def _runs_text(found: Any, statuses: Sequence[str], limits: Sequence[str],
               since: float | None, older_than: float | None, now: float,
               limit: int | None, more: str, tree: bool) -> None:
    out = _Out()
    if not found.runs:
        out.line(_no_runs(found, statuses, limits, since, older_than, now))
        return
    filtered = bool(statuses or limits or since is not None or older_than is not None)
    what = "top-level runs" if tree else "runs"
    if found.more:
        title = f"the newest {limit} {'matching ' if filtered else ''}{what}"
        title += "" if filtered or tree else f" of {found.total}"
    elif filtered:
        title = f"{len(found.runs)} of {_plural(found.total, 'run')} match"
    else:
        title = _plural(len(found.runs), "run")
    title += ", newest first" + (", child runs under their parents" if tree else "")
    costs = any(r.usage.cost is not None for r in found.runs)
    rows = [(("  " * r.depth + "↳ " if r.depth else "") + r.run_id, r.status,
             r.exhausted_limit, r.model_steps, r.tool_calls, r.unresolved or "",
             _agent_cell(r), r.parent_run_id, _when(r.created_ts), _secs(r.elapsed_s))
            + ((None if r.usage.cost is None else money(r.usage.cost),) if costs else ())
            for r in found.runs]
    out.table([Col("run id"), Col("status"), Col("limit", shrink=8, drop=3),
               Col("steps", drop=6, right=True), Col("calls", drop=5, right=True),
               Col("unresolved", drop=2, right=True), Col("agent", shrink=8, drop=3),
               Col("parent", drop=4),
               Col("started", drop=8), Col("took", drop=7, right=True)]
              + ([Col("cost", drop=9, right=True)] if costs else []), rows,
              title=title, caption=f"({more})" if more else None)
    waiting = sorted({r.agent for r in found.runs
                      if r.status in ("queued", "interrupted") and r.agent})
    if waiting:
        out.line("queued and interrupted runs wait for a worker serving their agent: "
                 + ", ".join(waiting), style="dim")


def _agent_cell(r: Any) -> str | None:
    """An agent's name and version, then the run's labels, for one cell of ``runs``."""
    parts = [r.agent + (f"@{r.agent_version}" if r.agent_version else "")] if r.agent else []
    parts += [f"{k}={v}" for k, v in sorted(r.labels.items())]
    return " ".join(parts) or None


def _no_runs(found: Any, statuses: Sequence[str], limits: Sequence[str], since: float | None,
             older_than: float | None, now: float) -> str:
    """Why ``runs`` lists nothing, in a sentence."""
    if not found.total:
        return "no runs in this journal"
    newest = "" if found.newest_ts is None else \
        f", the newest started {_ago(now - found.newest_ts)} ago"
    held = f"this journal holds {_plural(found.total, 'run')}{newest}"
    others = [f"--status {s}" for s in statuses] + [f"--limit-hit {x}" for x in limits]
    if older_than is not None:
        others.append(f"--older-than {_age(older_than)}")
    if since is not None:
        also = f" matching {' '.join(others)}" if others else ""
        return f"no run started in the last {_age(since)}{also} ({held})"
    return f"no runs match {' '.join(others)} ({held})"


def _open_note(word: str) -> str:
    """What ``show`` and ``replay`` add to the state word of a run with no RunFinished."""
    if word == "queued":
        return "no RunFinished event yet; it waits for a worker"
    return "no RunFinished event yet; its runner is " + ("alive" if word == "running" else "gone")


def _run_rows(found: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [(r.run_id, r.status, r.exhausted_limit, r.model_steps, r.tool_calls,
             r.unresolved or "") for r in found]


_RUN_COLS = (Col("run id"), Col("status"), Col("limit", shrink=8, drop=3),
             Col("steps", drop=6, right=True), Col("calls", drop=5, right=True),
             Col("unresolved", drop=2, right=True))


@click.command()
@journal_option
@json_option("the timeline")
@click.argument("run_id")
def show(journal: str | None, as_json: bool, run_id: str) -> None:
    """Show a run's timeline: what it did, and why it stopped; then its child runs and its
    completed and unresolved actions. RUN_ID may be a unique prefix of the id. Events are
    named by their class (CallDecided), as `boundloop export` names them; costs are plain
    decimals ($0.000033); a running run's elapsed is its age."""
    from boundloop.ops import open_journal, run_timeline

    with open_journal(journal_dir(journal), readonly=True) as j:
        tl = run_timeline(j, run_id)
    if as_json:
        _echo_json(tl)
        return
    b = tl.budget
    rows = []
    for r in tl.rows:
        cost = "" if r.usage.cost is None else f" {money(r.usage.cost)}"
        after = f"{r.model_steps}/{b.max_model_steps} {r.tool_calls}/{b.max_tool_calls} " \
                f"{r.usage.total_tokens}{cost}"
        call = " ".join(x for x in (r.call_id, r.tool) if x)
        rows.append((r.seq, f"+{r.offset_s:.3f}s", r.step, r.event, call,
                     r.decision or r.outcome, _secs(r.latency_s) if r.latency_s else None,
                     r.detail, after))
    out = _Out()
    out.table([Col("seq", right=True), Col("time", drop=5), Col("step", drop=6, right=True),
               Col("event"), Col("call", shrink=8, wrap=True),
               Col("outcome", shrink=8), Col("latency", drop=5, right=True),
               Col("detail", shrink=8, drop=2, wrap=True), Col("budget after", drop=7)],
              rows, title=f"run {tl.run_id}",
              caption="budget after: model steps used/max, tool calls used/max, tokens",
              caption_of="budget after")
    limit = f" ({tl.exhausted_limit})" if tl.exhausted_limit else ""
    status = tl.status if tl.finished else f"{tl.status} ({_open_note(tl.status)})"
    out.line(f"status: {status}{limit}")
    out.line(f"explanation: {tl.explanation or '-'}")
    elapsed = tl.elapsed_s
    if tl.status == "running" and tl.started_ts:  # in flight: its age
        elapsed = max(time.time() - tl.started_ts, elapsed)
    out.line(f"model steps: {tl.model_steps}/{b.max_model_steps}, tool calls: "
             f"{tl.tool_calls}/{b.max_tool_calls}, usage: {_tokens(tl.usage)}, "
             f"elapsed: {_secs(elapsed)}")
    if tl.agent:
        out.line(f"agent: {tl.agent}" + (f" (version {tl.agent_version})"
                                         if tl.agent_version else ""))
    if tl.labels:
        out.line("labels: " + ", ".join(f"{k}={v}" for k, v in sorted(tl.labels.items())))
    if tl.tool_caps:
        # Accepted calls of each capped tool (nested runs' included) against its cap.
        out.line("tool caps: " + ", ".join(f"{name} {tl.tool_counts.get(name, 0)}/{cap}"
                                           for name, cap in sorted(tl.tool_caps.items())))
    if tl.parent_run_id:
        out.line(f"parent run: {tl.parent_run_id}")
    if tl.awaiting:
        out.table([Col("execution id"), Col("tool", shrink=8),
                   Col("arguments", shrink=10, wrap=True)],
                  [(a.execution_id, a.tool, json.dumps(a.arguments, ensure_ascii=False))
                   for a in tl.awaiting], title="calls awaiting approval")
        out.line(f"decide with: boundloop approve|deny {tl.run_id} EXECUTION_ID "
                 "[--by NAME] [--note TEXT]", style="dim")
    if tl.children:
        out.table(_RUN_COLS, _run_rows(tl.children),
                  title=f"child runs ({len(tl.children)}, oldest first)")
    else:
        out.line("child runs: none")
    if tl.completed:
        out.table([Col("call", shrink=8, wrap=True), Col("tool", shrink=8), Col("result", shrink=8),
                   Col("attempts", right=True, drop=1)],
                  [(c.call_id, c.tool, c.status, c.attempts) for c in tl.completed],
                  title="completed actions")
    else:
        out.line("completed actions: none")
    if tl.unresolved:
        out.table([Col("call", shrink=6, wrap=True), Col("tool", shrink=8), Col("execution id"),
                   Col("attempt", right=True, drop=2), Col("phase", drop=1)],
                  [(u.call_id, u.tool, u.execution_id, u.attempt,
                    u.phase + (" (abandoned)" if u.abandoned else "")) for u in tl.unresolved],
                  title="unresolved actions")
    else:
        out.line("unresolved actions: none")


_OVERRIDES: list[tuple[str, str, Any, str]] = [
    ("--max-model-steps", "max_model_steps", int, "model steps"),
    ("--max-tool-calls", "max_tool_calls", int, "tool calls"),
    ("--deadline-s", "deadline_s", float, "seconds of run time"),
    ("--max-input-tokens", "max_input_tokens", int, "input tokens"),
    ("--max-output-tokens", "max_output_tokens", int, "output tokens"),
    ("--max-total-tokens", "max_total_tokens", int, "input plus output tokens"),
    ("--max-cost", "max_cost", float, "cost"),
    ("--max-result-bytes", "max_result_bytes", int, "bytes per tool result"),
    ("--malformed-retries", "malformed_retries", int, "malformed responses retried"),
]


def _override_options(fn: F) -> F:
    for flag, field, kind, what in reversed(_OVERRIDES):
        fn = click.option(flag, field, type=kind, default=None, metavar="N",
                          help=f"With --check: check under this limit on {what}.")(fn)
    return fn


@click.command()
@journal_option
@json_option("the rebuilt state (and the check)")
@click.argument("run_id", required=False)
@click.option("--events", "events_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="Replay events from a file (`boundloop export` output or a "
                                   "golden .msgpack) instead of the journal.")
@click.option("--check", "do_check", is_flag=True,
              help="Re-run the current policy over the recorded responses and outcomes (no "
                   "model or tool is called) and report the first decision that differs.")
@_override_options
def replay(journal: str | None, as_json: bool, run_id: str | None, events_file: str | None,
           do_check: bool, **limits: Any) -> None:
    """Rebuild a run's state from its events and check it against how the run finished.
    RUN_ID may be a unique prefix of the id."""
    import msgspec

    from boundloop.ops import (
        OPEN_EXPLANATIONS,
        check,
        load_events,
        open_journal,
        read_events,
        rebuild,
        resolve_run_id,
        state_word,
    )

    changes = {k: v for k, v in limits.items() if v is not None}
    if changes and not do_check:
        raise click.UsageError("limit options such as --max-tool-calls need --check")
    if (run_id is None) == (events_file is None):
        raise click.UsageError("give a RUN_ID or --events FILE (one of them)")
    owners: dict[str, Any] = {}
    if events_file is not None:
        try:
            events = load_events(events_file)
        except OSError as exc:
            raise click.BadParameter(f"cannot read {events_file}: {exc.strerror or exc}",
                                     param_hint="'--events'") from None
    else:
        assert run_id is not None
        with open_journal(journal_dir(journal), readonly=True) as j:
            events = read_events(j, resolve_run_id(j, run_id))
            owners = j.owners()
    rebuilt = rebuild(events)
    st = rebuilt.state
    # The same word as `runs` and `show`; a file cannot tell whether its runner is alive.
    word, why = st.status, st.explanation
    if not st.finished:
        word = "unfinished" if events_file is not None else \
            state_word(False, st.status, st.owner, owners)
        why = OPEN_EXPLANATIONS.get(word, "The recording ends before the run finished.")
    report = None
    if do_check:
        budget = None
        if changes:
            budget = msgspec.structs.replace(rebuilt.state.budget, **changes)
        report = check(events, budget)
    failed = bool(rebuilt.mismatches) or (report is not None and not report.ok)
    if as_json:
        out: dict[str, Any] = {
            "run_id": st.run_id, "status": word, "finished": st.finished,
            "exhausted_limit": st.exhausted_limit, "explanation": why,
            "model_steps": st.model_steps, "tool_calls": st.tool_calls, "usage": st.usage,
            "elapsed_s": st.elapsed_s, "events": st.events, "budget": st.budget,
            "transcript": st.transcript, "completed": st.completed,
            "unresolved": st.unresolved, "consistent": rebuilt.consistent,
            "mismatches": rebuilt.mismatches}
        if report is not None:
            out["check"] = report
        _echo_json(out)
    else:
        _print_replay(rebuilt, report, word, why)
    if failed:
        click.get_current_context().exit(EXIT_MISMATCH)


def _print_replay(rebuilt: Any, report: Any, word: str, why: str) -> None:
    import msgspec

    st = rebuilt.state
    limit = f" ({st.exhausted_limit})" if st.exhausted_limit else ""
    note = "" if st.finished else " (" + (
        "not finished: the recording ends before RunFinished; from a file, whether its "
        "runner is alive is not known" if word == "unfinished" else _open_note(word)) + ")"
    lines = [f"run {st.run_id}: {st.events} events folded",
             f"status: {word}{limit}{note}",
             f"explanation: {why or '-'}",
             f"model steps: {st.model_steps}, tool calls: {st.tool_calls}, "
             f"usage: {_tokens(st.usage)}, elapsed: {_secs(st.elapsed_s)}",
             "transcript:"]
    for m in msgspec.to_builtins(st.transcript):
        body = {k: v for k, v in m.items() if k != "kind"}
        lines.append(f"  {m['kind']}: {json.dumps(body, ensure_ascii=False)}")
    lines.append("completed: " + (", ".join(f"{c.call_id} {c.tool} {c.status}"
                                            for c in st.completed) or "none"))
    lines.append("unresolved: " + (", ".join(f"{u.call_id} {u.tool} ({u.phase})"
                                             for u in st.unresolved) or "none"))
    if rebuilt.finished_seq is None:
        lines.append("consistency: the run has not finished; nothing to compare with")
    elif rebuilt.consistent:
        lines.append(f"consistency: ok, the fold agrees with RunFinished (seq "
                     f"{rebuilt.finished_seq})")
    else:
        lines.extend(f"consistency: MISMATCH {m}" for m in rebuilt.mismatches)
    if report is not None:
        if report.ok:
            lines.append(f"check: ok, the current policy makes the same {report.decisions} "
                         "decisions")
        else:
            lines.append(f"check: DIVERGES at {report.divergence}")
        if report.note:
            lines.append(f"check note: {report.note}")
    out = _Out()
    for line in lines:
        out.line(line)


@click.command()
@journal_option
@click.argument("run_id")
@click.option("--strip-content", is_flag=True,
              help="Also replace texts, arguments, results and error details with digests.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              metavar="FILE", help="Write to FILE instead of standard output.")
def export(journal: str | None, run_id: str, strip_content: bool, output: str | None) -> None:
    """Print a run's events as JSON lines, redacted, to attach to a bug report
    (`boundloop replay --events FILE` reads them back). RUN_ID may be a unique prefix of the
    id. Each line's "type" is the event's class name (CallDecided), as `show` names it."""
    from boundloop.ops import export_lines, open_journal, read_events, resolve_run_id

    with open_journal(journal_dir(journal), readonly=True) as j:
        lines = list(export_lines(read_events(j, resolve_run_id(j, run_id)), j.secret_key,
                                  strip_content=strip_content))
    text = "".join(line + "\n" for line in lines)
    if output is None:
        click.echo(text, nl=False)
        return
    _write_private(output, text)


def _write_private(output: str, text: str) -> None:
    """Write ``text`` to the file ``output``, made ``0600`` whatever the umask (SPEC 9); a
    symbolic link is not followed."""
    import errno
    import stat

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(output, flags, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, 0o600)  # an existing file too
            f.write(text)
    except OSError as exc:
        why = ("it is a symbolic link, which is not followed; give the file's own path"
               if exc.errno == errno.ELOOP else exc.strerror or str(exc))
        raise click.BadParameter(f"cannot write {output}: {why}",
                                 param_hint="'--output'") from None


@click.command()
@journal_option
@json_option("the figures")
@click.option("--since", type=DURATION, default=None, metavar="AGE",
              help="Only what happened within AGE (e.g. 24h, 7d); default: everything.")
@click.option("--by", "by", type=click.Choice(["tool", "status", "limit", "label", "agent"]),
              default=None, help="Also group the figures by tool, run status, limit hit, "
                                 "label (each key=value a run carries) or agent.")
def stats(journal: str | None, as_json: bool, since: float | None, by: str | None) -> None:
    """The telemetry's figures computed from the journal alone (SPEC 11): runs by status,
    limit hits, unknown outcomes, retries, reconciliations, reviews, tokens by kind, cost per
    finished run, run duration and model and tool latency."""
    from boundloop.ops import open_journal
    from boundloop.stats import from_journal

    with open_journal(journal_dir(journal), readonly=True) as j:
        figures = from_journal(j, since_s=since, by=by)  # type: ignore[arg-type]
    if as_json:
        _echo_json(figures)
    else:
        _stats_text(figures, by)
    if figures.damaged:
        # The figures leave those runs out: the journal is damaged, and the exit says so.
        click.get_current_context().exit(EXIT_JOURNAL)


def _stats_text(figures: Stats, by: str | None) -> None:
    from boundloop.stats import damage, group_table, summary

    out = _Out()
    for line in summary(figures):
        out.line(line)
    table = group_table(figures)
    if table is not None:
        header, rows = table
        out.line()
        # The group's name may be cut; the figures go last-first when even that does not
        # fit (--json has them all).
        out.table([Col(header[0], shrink=8)] + [
            Col(h, drop=i, right=True) for i, h in enumerate(header[1:], 1)],
            rows)
    elif figures.groups is not None:
        out.line()
        out.line(f"by {by}: nothing to show")
    for line in damage(figures):
        out.line(line)
