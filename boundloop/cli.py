"""The ``boundloop`` command: a thin layer over the library (SPEC 10).

Every command reads the journal from ``--journal DIR``, else ``$BOUNDLOOP_JOURNAL``, else
``./.boundloop``. The work is done by :mod:`boundloop.inspect` (and the Runner); this module
only parses arguments and prints. ``click`` and ``rich`` are imported here, never by
``import boundloop``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
import msgspec

from boundloop.errors import BoundloopError, JournalError, UnknownRun
from boundloop.policy.replay import ReplayError

EXIT_OK = 0
#: ``replay`` found the fold disagreeing with RunFinished, or ``--check`` found a divergence.
EXIT_MISMATCH = 1
#: Bad input: an unknown command or option, a bad duration or limit.
EXIT_USAGE = 2
#: No run with that id in the journal.
EXIT_UNKNOWN_RUN = 3
#: The journal is missing, locked, unreadable or damaged.
EXIT_JOURNAL = 4
#: A bug in boundloop (the message says how to see the traceback).
EXIT_INTERNAL = 70

EXIT_CODES = (
    "Exit codes: 0 ok; 1 replay found a mismatch, --check a divergence, or verify a damaged "
    "run; 2 bad input; "
    "3 unknown run id; 4 journal missing, locked or unreadable; 70 internal error."
)

F = TypeVar("F", bound=Callable[..., Any])


def journal_dir(value: str | None) -> str:
    """``--journal`` (the command's, else the group's), else ``$BOUNDLOOP_JOURNAL``, else
    ``./.boundloop``."""
    from boundloop.inspect import journal_dir as resolve

    if value is None:
        ctx = click.get_current_context(silent=True)
        root = ctx.find_root() if ctx is not None else None
        if root is not None and isinstance(root.obj, dict):
            value = root.obj.get("journal")
    return resolve(value)


journal_option = click.option(
    "--journal", "journal", default=None, metavar="DIR",
    help="Journal directory (default: $BOUNDLOOP_JOURNAL or ./.boundloop).")


def json_option(what: str) -> Callable[[F], F]:
    """``--json``: print ``what`` as JSON instead of a table."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} as JSON.")


if TYPE_CHECKING:
    _ParamType = click.ParamType[float]
else:  # click < 8.3: ParamType is not generic
    _ParamType = click.ParamType


class Duration(_ParamType):
    """A duration such as ``30d``, ``12h``, ``1h30m`` or ``90s`` (in seconds)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        from boundloop.inspect import parse_duration

        try:
            return parse_duration(str(value))
        except BoundloopError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()


# -- output helpers ------------------------------------------------------------------------
def _echo_json(value: Any) -> None:
    click.echo(json.dumps(msgspec.to_builtins(value), indent=2, ensure_ascii=False))


def _console() -> Any:
    from rich.console import Console

    # Pipes get a fixed, generous width so tables stay readable in logs and CI.
    return Console(width=max(Console().width, 140), highlight=False)


def _table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]],
           no_wrap: Sequence[int] = (0,)) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, overflow="fold", no_wrap=i in no_wrap)
    for row in rows:
        table.add_row(*(Text("-" if cell is None or cell == "" else str(cell)) for cell in row))
    return table


def _when(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


def _tokens(usage: Any) -> str:
    text = f"{usage.total_tokens} tok"
    return text if usage.cost is None else f"{text}, cost {usage.cost:.4g}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.option("--journal", "journal", default=None, metavar="DIR",
              help="Journal directory for every command (default: $BOUNDLOOP_JOURNAL or "
                   "./.boundloop); a command's own --journal wins.")
@click.pass_context
def cli(ctx: click.Context, journal: str | None) -> None:
    """boundloop: LLM tool loops under hard budgets, on a durable event journal."""
    ctx.obj = {"journal": journal}


@cli.command()
@journal_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def demo(journal: str | None, as_json: bool) -> None:
    """Run the built-in scripted scenarios end to end and print their reports."""
    from boundloop.demo import run_demo
    from boundloop.runner import Runner

    with Runner(journal_dir(journal)) as runner:
        scenarios = run_demo(runner)
    rows = [{"scenario": s.name, "run_id": s.result.run_id, "status": s.result.status,
             "limit": s.result.exhausted_limit, "model_steps": s.result.model_steps,
             "tool_calls": s.result.tool_calls, "explanation": s.result.explanation}
            for s in scenarios]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="boundloop demo")
    for col in ("scenario", "status", "limit", "model steps", "tool calls"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["scenario"]), str(r["status"]), str(r["limit"] or "-"),
                      str(r["model_steps"]), str(r["tool_calls"]))
    Console(width=max(Console().width, 100)).print(table)
    for r in rows:
        click.echo(f"- {r['scenario']} ({r['run_id']}): {r['explanation']}")
    click.echo(f"journal: {os.path.abspath(journal_dir(journal))}  "
               "(`boundloop show RUN_ID` prints a run's timeline)")


# -- runs ----------------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("the runs")
@click.option("--status", "statuses", multiple=True, metavar="STATUS",
              help="Only runs with this status (repeatable): a SPEC status, or running / "
                   "interrupted for runs that have not finished.")
@click.option("--limit-hit", "limits", multiple=True, metavar="LIMIT",
              help="Only runs stopped by this limit (repeatable; 'any' for every limit).")
@click.option("--since", type=DURATION, default=None, metavar="AGE",
              help="Only runs started within AGE (e.g. 2h, 7d).")
@click.option("--older-than", type=DURATION, default=None, metavar="AGE",
              help="Only runs started more than AGE ago.")
@click.option("-n", "--last", type=click.IntRange(min=1), default=None, metavar="N",
              help="At most N runs (the newest).")
def runs(journal: str | None, as_json: bool, statuses: tuple[str, ...], limits: tuple[str, ...],
         since: float | None, older_than: float | None, last: int | None) -> None:
    """List runs, newest first."""
    from boundloop.inspect import LIMITS, STATUSES, list_runs, open_journal

    for s in statuses:
        if s not in STATUSES:
            raise click.BadParameter(f"{s!r} is not a status ({', '.join(STATUSES)})",
                                     param_hint="'--status'")
    for lim in limits:
        if lim not in (*LIMITS, "any"):
            raise click.BadParameter(f"{lim!r} is not a limit ({', '.join(LIMITS)}, any)",
                                     param_hint="'--limit-hit'")
    with open_journal(journal_dir(journal), readonly=True) as j:
        found = list_runs(j, status=statuses, limit_hit=limits, since_s=since,
                          older_than_s=older_than, last=last)
    if as_json:
        _echo_json(found)
        return
    if not found:
        click.echo("no runs match" if (statuses or limits or since or older_than)
                   else "no runs in this journal")
        return
    rows = [(r.run_id, r.status, r.exhausted_limit, r.model_steps, r.tool_calls,
             r.unresolved or "", _when(r.created_ts), _secs(r.elapsed_s)) for r in found]
    _console().print(_table(f"{len(found)} run{'s' if len(found) != 1 else ''}, newest first",
                            ("run id", "status", "limit", "steps", "calls", "unresolved",
                             "started", "took"), rows))


# -- show ----------------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("the timeline")
@click.argument("run_id")
def show(journal: str | None, as_json: bool, run_id: str) -> None:
    """Show a run's timeline: what it did, and why it stopped."""
    from boundloop.inspect import open_journal, read_events, timeline

    with open_journal(journal_dir(journal), readonly=True) as j:
        tl = timeline(read_events(j, run_id))
    if as_json:
        _echo_json(tl)
        return
    b = tl.budget
    rows = []
    for r in tl.rows:
        cost = "" if r.usage.cost is None else f" ${r.usage.cost:.4g}"
        after = f"{r.model_steps}/{b.max_model_steps} {r.tool_calls}/{b.max_tool_calls} " \
                f"{r.usage.total_tokens}{cost}"
        rows.append((r.seq, f"+{r.offset_s:.3f}s", r.step, r.event, r.call_id, r.tool,
                     r.decision, r.outcome, _secs(r.latency_s) if r.latency_s else None,
                     r.detail, after))
    console = _console()
    table = _table(f"run {tl.run_id}",
                   ("seq", "time", "step", "event", "call", "tool", "decision", "outcome",
                    "latency", "detail", "budget after"), rows,
                   no_wrap=(0, 1, 3, 4, 5, 6, 7, 8, 10))
    table.caption = "budget after: model steps used/max, tool calls used/max, tokens"
    console.print(table)
    limit = f" ({tl.exhausted_limit})" if tl.exhausted_limit else ""
    status = tl.status if tl.finished else f"{tl.status} (no RunFinished event yet)"
    lines = [f"status: {status}{limit}",
             f"explanation: {tl.explanation or '-'}",
             f"model steps: {tl.model_steps}/{b.max_model_steps}, tool calls: "
             f"{tl.tool_calls}/{b.max_tool_calls}, usage: {_tokens(tl.usage)}, "
             f"elapsed: {_secs(tl.elapsed_s)}"]
    if tl.parent_run_id:
        lines.append(f"parent run: {tl.parent_run_id}")
    for line in lines:
        console.print(line, markup=False)
    if tl.completed:
        console.print(_table("completed actions", ("call", "tool", "result", "attempts"),
                             [(c.call_id, c.tool, c.status, c.attempts) for c in tl.completed]))
    else:
        console.print("completed actions: none", markup=False)
    if tl.unresolved:
        console.print(_table("unresolved actions", ("call", "tool", "execution id", "attempt",
                                                     "phase"),
                             [(u.call_id, u.tool, u.execution_id, u.attempt, u.phase)
                              for u in tl.unresolved]))
    else:
        console.print("unresolved actions: none", markup=False)


# -- replay --------------------------------------------------------------------------------
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


@cli.command()
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
    """Rebuild a run's state from its events and check it against how the run finished."""
    from boundloop.inspect import check, load_events, open_journal, read_events, rebuild

    changes = {k: v for k, v in limits.items() if v is not None}
    if changes and not do_check:
        raise click.UsageError("limit options such as --max-tool-calls need --check")
    if (run_id is None) == (events_file is None):
        raise click.UsageError("give a RUN_ID or --events FILE (one of them)")
    if events_file is not None:
        try:
            events = load_events(events_file)
        except OSError as exc:
            raise click.BadParameter(f"cannot read {events_file}: {exc.strerror or exc}",
                                     param_hint="'--events'") from None
    else:
        assert run_id is not None
        with open_journal(journal_dir(journal), readonly=True) as j:
            events = read_events(j, run_id)
    rebuilt = rebuild(events)
    report = None
    if do_check:
        budget = None
        if changes:
            budget = msgspec.structs.replace(rebuilt.state.budget, **changes)
        report = check(events, budget)
    st = rebuilt.state
    failed = bool(rebuilt.mismatches) or (report is not None and not report.ok)
    if as_json:
        out: dict[str, Any] = {
            "run_id": st.run_id, "status": st.status, "finished": st.finished,
            "exhausted_limit": st.exhausted_limit, "explanation": st.explanation,
            "model_steps": st.model_steps, "tool_calls": st.tool_calls, "usage": st.usage,
            "elapsed_s": st.elapsed_s, "events": st.events, "budget": st.budget,
            "transcript": st.transcript, "completed": st.completed,
            "unresolved": st.unresolved, "consistent": rebuilt.consistent,
            "mismatches": rebuilt.mismatches}
        if report is not None:
            out["check"] = report
        _echo_json(out)
    else:
        _print_replay(rebuilt, report)
    if failed:
        click.get_current_context().exit(EXIT_MISMATCH)


def _print_replay(rebuilt: Any, report: Any) -> None:
    st = rebuilt.state
    limit = f" ({st.exhausted_limit})" if st.exhausted_limit else ""
    lines = [f"run {st.run_id}: {st.events} events folded",
             f"status: {st.status}{limit}" + ("" if st.finished else " (not finished)"),
             f"explanation: {st.explanation or '-'}",
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
    for line in lines:
        click.echo(line)


# -- prune ---------------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("what was pruned")
@click.option("--older-than", type=DURATION, required=True, metavar="AGE",
              help="Remove runs that finished more than AGE ago (e.g. 30d).")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def prune(journal: str | None, as_json: bool, older_than: float, dry_run: bool) -> None:
    """Remove finished runs older than AGE (retention). Open runs and runs recovery still
    needs are kept."""
    from boundloop.inspect import open_journal
    from boundloop.inspect import prune as do_prune

    with open_journal(journal_dir(journal), readonly=dry_run) as j:
        report = do_prune(j, older_than, dry_run=dry_run)
    if as_json:
        _echo_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{verb} {len(report.pruned)} finished run{'s' if len(report.pruned) != 1 else ''}"
               f" that finished before {_when(report.cut_ts)}")
    for run_id in report.pruned:
        click.echo(f"  {run_id}")
    for run_id, why in report.kept.items():
        click.echo(f"kept {run_id}: {why}")


# -- integrity -----------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("a list of {run_id, head, ok, error}")
@click.argument("run_ids", nargs=-1, metavar="[RUN_ID]...")
def verify(journal: str | None, as_json: bool, run_ids: tuple[str, ...]) -> None:
    """Check the hash chain of every run (or of RUN_IDs): one line per run with its id, its
    chain head in hex (keep it to prove the run unchanged later) and ok or what is damaged.
    Exits 1 if any run is damaged. Read-only."""
    from boundloop.inspect import key_file_warning, verify_journal

    where = journal_dir(journal)
    warning = key_file_warning(where)
    if warning:
        click.echo(f"boundloop: warning: {warning}", err=True)
    # In a child process: LMDB crashing on damaged pages of its own is reported as damage.
    reports = verify_journal(where, run_ids)
    if as_json:
        _echo_json(reports)
    else:
        if not reports:
            click.echo("boundloop: no runs in this journal", err=True)
        for r in reports:
            click.echo(f"{r.run_id}  {r.head or '-'}  "
                       + ("ok" if r.ok else f"DAMAGED {r.error}"))
    damaged = [r.run_id for r in reports if not r.ok]
    if damaged:
        click.echo(f"boundloop: {len(damaged)} of {len(reports)} runs damaged: "
                   f"{', '.join(damaged)}", err=True)
        click.get_current_context().exit(EXIT_MISMATCH)


@cli.command()
@journal_option
@json_option("the sizes")
def compact(journal: str | None, as_json: bool) -> None:
    """Rewrite the journal to reclaim the space of pruned runs (LMDB files never shrink by
    themselves). Crash-safe: the old journal stays whole until the new one replaces it.
    Refused while a runner or any other process has the journal open."""
    from boundloop.inspect import compact as do_compact

    report = do_compact(journal_dir(journal))
    if as_json:
        _echo_json(report)
        return
    click.echo(f"compacted {report.journal}: data.mdb {report.before} bytes before, "
               f"{report.after} bytes after ({_mb(report.before)} -> {_mb(report.after)})")


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


# -- export --------------------------------------------------------------------------------
@cli.command()
@journal_option
@click.argument("run_id")
@click.option("--strip-content", is_flag=True,
              help="Also replace texts, arguments, results and error details with digests.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              metavar="FILE", help="Write to FILE instead of standard output.")
def export(journal: str | None, run_id: str, strip_content: bool, output: str | None) -> None:
    """Print a run's events as JSON lines, redacted, to attach to a bug report
    (`boundloop replay --events FILE` reads them back)."""
    from boundloop.inspect import export_lines, open_journal, read_events

    with open_journal(journal_dir(journal), readonly=True) as j:
        lines = list(export_lines(read_events(j, run_id), j.secret_key,
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


# -- recovery ------------------------------------------------------------------------------
OUTCOMES = ["succeeded", "failed", "abandoned"]

def _runner(journal: str | None) -> Any:
    """A Runner on an existing journal (never creates one), and the journal to close."""
    from boundloop.inspect import open_journal
    from boundloop.runner import Runner

    j = open_journal(journal_dir(journal))
    return Runner(j, model_threads=1, tool_threads=1, supervisors=1), j


@cli.command()
@journal_option
@json_option("the recovered runs")
@click.option("--claim", is_flag=True,
              help="Also take the runs over (append OwnerClaimed): their old runners are "
                   "fenced. Without it, nothing is written.")
@click.option("--dry-run", "dry_run", is_flag=True, help="Only report (the default).")
def recover(journal: str | None, as_json: bool, claim: bool, dry_run: bool) -> None:
    """List the runs whose runner is gone and what each left unresolved (read-only).

    Nothing is executed: resolve actions with `boundloop resolve`, then continue a run from
    your code with runner.resume(run_id, model=..., tools=...), which claims it.
    """
    if claim and dry_run:
        raise click.UsageError("--claim and --dry-run contradict each other")
    if claim:
        runner, j = _runner(journal)
        try:
            found = runner.recover()
        finally:
            runner.close()
            j.close()
    else:
        from boundloop.inspect import open_journal, recoverable

        with open_journal(journal_dir(journal), readonly=True) as j:
            found = recoverable(j)
    if as_json:
        _echo_json([{"run_id": r.run_id, "model_steps": r.state.model_steps,
                     "tool_calls": r.state.tool_calls,
                     "unresolved": msgspec.to_builtins(r.unresolved)} for r in found])
        return
    if not found:
        click.echo("no runs to recover: every open run has a live runner")
        return
    rows: list[tuple[str, ...]] = []
    for r in found:
        if not r.unresolved:
            rows.append((r.run_id, str(r.state.model_steps), str(r.state.tool_calls),
                         "-", "-", "-", "-", "-"))
        for u in r.unresolved:
            rows.append((r.run_id, str(r.state.model_steps), str(r.state.tool_calls),
                         u.call_id, u.tool, u.execution_id, u.phase, str(u.attempt)))
    title = f"claimed {len(found)} run(s)" if claim else \
        f"{len(found)} run(s) to recover (read-only: --claim takes them over)"
    _console().print(_table(title,
                            ("run id", "steps", "calls", "call", "tool", "execution id",
                             "phase", "attempt"), rows))


@cli.command()
@journal_option
@click.argument("run_id")
@click.argument("execution_id")
@click.argument("outcome_arg", metavar="[OUTCOME]", required=False,
                type=click.Choice(OUTCOMES))
@click.option("--outcome", type=click.Choice(OUTCOMES),
              help="succeeded: it took effect; failed: it did not; abandoned: nobody can tell.")
@click.option("--note", default="", help="Why (kept in the journal).")
@click.option("--by", default=None, help="Who decided (default: user@host).")
@click.option("--force", is_flag=True,
              help="Resolve even though a live runner owns the run: it is fenced first (it "
                   "stops driving the run), and the journal records that it was forced.")
def resolve(journal: str | None, run_id: str, execution_id: str, outcome_arg: str | None,
            outcome: str | None, note: str, by: str | None, force: bool) -> None:
    """Record a person's decision on an unresolved action of RUN_ID: OUTCOME (or --outcome)
    is succeeded, failed or abandoned. A run that a live runner still drives is refused
    unless --force."""
    if outcome_arg and outcome and outcome_arg != outcome:
        raise click.UsageError(f"two outcomes given: {outcome_arg} and --outcome {outcome}")
    outcome = outcome or outcome_arg
    if outcome is None:
        raise click.UsageError("give the outcome: succeeded, failed or abandoned")
    runner, j = _runner(journal)
    try:
        state = runner.resolve(run_id, execution_id, outcome, note, by=by, force=force)
    finally:
        runner.close()
        j.close()
    left = len(state.open_actions)
    flagged = sum(1 for u in state.unresolved if u.abandoned)
    click.echo(f"recorded: {execution_id} {outcome}; {left} unresolved action(s) left open in "
               f"{run_id}" + (f", {flagged} abandoned (closed, still flagged)" if flagged else ""))


@cli.command()
@click.option("--runs", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--kills", type=click.IntRange(min=0), default=50, show_default=True,
              help="Faults to inject: SIGKILLs, and with --pause SIGSTOPs too.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--workers", type=click.IntRange(min=1, max=64), default=2, show_default=True,
              help="Worker processes sharing the journal.")
@click.option("--pause", is_flag=True, default=False,
              help="Also freeze workers past their lease (SIGSTOP), let the others take "
                   "their runs over, then wake them (SIGCONT) as zombies.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.1, max=86_400), default=1.0,
              show_default=True, help="The workers' lease_s, in seconds.")
@click.option("--pidns/--no-pidns", default=None,
              help="Run each worker in its own pid namespace (unshare, as root), so a "
                   "paused worker is judged by its lease (default: with --pause, when "
                   "available).")
@click.option("--dir", "where", type=click.Path(file_okay=False), default=None,
              help="Where to keep the drill's journal and ledger (default: a temp dir).")
@json_option("the report")
def drill(runs: int, kills: int, seed: int, workers: int, pause: bool, lease_s: float,
          pidns: bool | None, where: str | None, as_json: bool) -> None:
    """Crash-recovery and ownership drill: SIGKILL (and with --pause, SIGSTOP past the
    lease) workers at random moments while the others take their runs over; check the
    journal against a ledger of real side effects. Exits 1 if any invariant fails."""
    import tempfile
    from pathlib import Path

    from boundloop.drill import can_unshare, command, format_report, run_drill

    if pidns and not can_unshare():
        raise click.UsageError("--pidns needs root and a working unshare(1)")
    base = Path(where) if where else Path(tempfile.mkdtemp(prefix="boundloop-drill-"))
    report = run_drill(base, runs, kills, seed, workers,
                       out=(lambda s: None) if as_json else click.echo, pause=pause,
                       lease_s=lease_s, pidns=pidns)
    if as_json:
        _echo_json({**msgspec.to_builtins(report), "ok": report.ok, "dir": str(base)})
    else:
        click.echo(format_report(report, command(runs, kills, seed, workers, pause, lease_s,
                                                 pidns)))
    if not report.ok:
        click.get_current_context().exit(EXIT_MISMATCH)


# -- stats ---------------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("the figures")
@click.option("--since", type=DURATION, default=None, metavar="AGE",
              help="Only what happened within AGE (e.g. 24h, 7d); default: everything.")
@click.option("--by", "by", type=click.Choice(["tool", "status", "limit"]), default=None,
              help="Also group the figures by tool, run status or limit hit.")
def stats(journal: str | None, as_json: bool, since: float | None, by: str | None) -> None:
    """The telemetry's figures computed from the journal alone (SPEC 11): runs by status,
    limit hits, unknown outcomes, retries, reconciliations, reviews, tokens by kind, cost per
    finished run, run duration and model and tool latency."""
    from boundloop.inspect import open_journal
    from boundloop.stats import from_journal, render

    with open_journal(journal_dir(journal), readonly=True) as j:
        figures = from_journal(j, since_s=since, by=by)  # type: ignore[arg-type]
    if as_json:
        _echo_json(figures)
    else:
        click.echo(render(figures))


# -- entry point ---------------------------------------------------------------------------
def _fail(message: str, code: int) -> NoReturn:
    click.echo("boundloop: " + " ".join(str(message).split()), err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: bad input exits non-zero with a one-line message, never a traceback."""
    try:
        code = cli.main(args=argv, prog_name="boundloop", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        code = EXIT_OK
    except click.ClickException as exc:
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see `{exc.ctx.command_path} --help`)"
        _fail(exc.format_message() + hint, EXIT_USAGE if exc.exit_code == 2 else exc.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except UnknownRun as exc:
        _fail(str(exc), EXIT_UNKNOWN_RUN)
    except JournalError as exc:
        _fail(str(exc), EXIT_JOURNAL)
    except OSError as exc:  # permissions, a missing or odd file: the journal cannot be used
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"cannot use the journal{where}: {exc.strerror or exc}; check the path and "
              "its permissions", EXIT_JOURNAL)
    except ReplayError as exc:
        _fail(f"the journal does not replay: {exc}", EXIT_JOURNAL)
    except BoundloopError as exc:
        _fail(str(exc), EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 - the contract: never a traceback
        if os.environ.get("BOUNDLOOP_DEBUG"):
            raise
        journal_failure = type(exc).__module__.split(".")[0] == "lmdb"
        _fail(f"{'journal error' if journal_failure else 'internal error'}: "
              f"{type(exc).__name__}: {exc}" +
              ("" if journal_failure else " (set BOUNDLOOP_DEBUG=1 to see the traceback)"),
              EXIT_JOURNAL if journal_failure else EXIT_INTERNAL)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
