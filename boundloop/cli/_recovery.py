"""The recovery commands: ``recover`` (what a crash left unresolved) and ``resolve``."""

from __future__ import annotations

import json
from typing import Any

import click

from boundloop.cli._common import (
    _DAMAGE_HINT,
    EXIT_JOURNAL,
    _ids,
    _runner,
    journal_dir,
    journal_option,
    json_option,
)
from boundloop.cli._output import Col, _echo_json, _Out, _plural

OUTCOMES = ["succeeded", "failed", "abandoned"]


@click.command()
@journal_option
@json_option("the recovered runs")
@click.option("--claim", is_flag=True,
              help="Also take the runs over (append OwnerClaimed): their old runners are "
                   "fenced. Without it, nothing is written.")
@click.option("--dry-run", "dry_run", is_flag=True, help="Only report (the default).")
def recover(journal: str | None, as_json: bool, claim: bool, dry_run: bool) -> None:
    """List the runs whose runner is gone and what each left unresolved (read-only): for each
    action its execution id (never cut, whatever the width), call, tool, phase, attempt and
    arguments as the journal holds them (redacted), what to check before resolving it.

    Nothing is executed: resolve actions with `boundloop resolve`, then continue a run from
    your code with runner.resume(run_id, model=..., tools=...), which claims it.
    """
    if claim and dry_run:
        raise click.UsageError("--claim and --dry-run contradict each other")
    damaged: list[str] = []
    if claim:
        runner, j = _runner(journal)
        try:
            found = runner.recover(damaged=damaged)
        finally:
            runner.close()
            j.close()
    else:
        from boundloop.ops import open_journal, recoverable

        with open_journal(journal_dir(journal), readonly=True) as j:
            found = recoverable(j, damaged)
    _recover_report(found, claim, as_json, bool(damaged))
    if damaged:
        # The others are reported all the same, as `runs` does; the exit says the journal is
        # damaged.
        click.echo(f"boundloop: {_plural(len(damaged), 'damaged open run')} left out "
                   f"({', '.join(damaged)}); {_DAMAGE_HINT}", err=True)
        click.get_current_context().exit(EXIT_JOURNAL)


def _arguments(r: Any, u: Any) -> dict[str, Any]:
    """The arguments of ``r``'s unresolved action ``u``, as journaled (redacted)."""
    rec = r.state.calls.get(u.execution_id)
    return dict(rec.arguments) if rec is not None else {}


def _recover_report(found: list[Any], claim: bool, as_json: bool, left_out: bool) -> None:
    import msgspec

    if as_json:
        _echo_json([{"run_id": r.run_id, "model_steps": r.state.model_steps,
                     "tool_calls": r.state.tool_calls,
                     "unresolved": [{**msgspec.to_builtins(u),
                                     "arguments": _arguments(r, u)} for u in r.unresolved]}
                    for r in found])
        return
    out = _Out()
    if not found:
        out.line("no other runs to recover" if left_out else
                 "no runs to recover: every open run has a live runner")
        return
    out.line(f"claimed {_plural(len(found), 'run')}" if claim else
             f"{_plural(len(found), 'run')} to recover (read-only: --claim takes them over)",
             style="bold")
    for r in found:
        out.line()
        out.line(f"run {r.run_id}: {_plural(r.state.model_steps, 'model step')}, "
                 f"{_plural(r.state.tool_calls, 'tool call')}, "
                 f"{_plural(len(r.unresolved), 'unresolved action')}")
        if not r.unresolved:
            continue
        out.table([Col("execution id"), Col("call", shrink=6, drop=4, wrap=True),
                   Col("tool", shrink=8, drop=3), Col("phase", drop=5),
                   Col("attempt", drop=6, right=True),
                   Col("arguments (redacted)", shrink=12, wrap=True)],
                  [(u.execution_id, u.call_id, u.tool, u.phase, u.attempt,
                    json.dumps(_arguments(r, u), ensure_ascii=False, sort_keys=True))
                   for u in r.unresolved])
    if any(r.unresolved for r in found):
        out.line()
        out.line("check each action's effect (its arguments say what it was to do), then "
                 "record it: boundloop resolve RUN_ID EXECUTION_ID --outcome "
                 "succeeded|failed|abandoned --note TEXT (unique prefixes of the ids do)",
                 style="dim")


@click.command()
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
    is succeeded, failed or abandoned. RUN_ID and EXECUTION_ID may be unique prefixes
    (`boundloop recover` lists them, with each action's arguments). A run that a live
    runner still drives is refused unless --force."""
    if outcome_arg and outcome and outcome_arg != outcome:
        raise click.UsageError(f"two outcomes given: {outcome_arg} and --outcome {outcome}")
    outcome = outcome or outcome_arg
    if outcome is None:
        raise click.UsageError("give the outcome: succeeded, failed or abandoned")
    runner, j = _runner(journal)
    try:
        run_id, execution_id = _ids(j, run_id, execution_id)
        state = runner.resolve(run_id, execution_id, outcome, note, by=by, force=force)
    finally:
        runner.close()
        j.close()
    left = len(state.open_actions)
    flagged = sum(1 for u in state.unresolved if u.abandoned)
    click.echo(f"recorded: {execution_id} {outcome}; {left} unresolved action(s) left open in "
               f"{run_id}" + (f", {flagged} abandoned (closed, still flagged)" if flagged else ""))
