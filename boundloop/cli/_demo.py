"""``boundloop demo``: the built-in scripted scenarios, end to end."""

from __future__ import annotations

import json
import os

import click

from boundloop.cli._common import journal_dir, journal_option
from boundloop.cli._output import Col, _Out
from boundloop.core import kinds


@click.command()
@journal_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def demo(journal: str | None, as_json: bool) -> None:
    """Run the built-in scripted scenarios end to end and print their reports: status, the
    limit that stopped each run, its steps and calls, and its completed and unresolved
    actions."""
    from boundloop.demo import completed_text, run_demo
    from boundloop.runner import Runner

    where = journal_dir(journal)
    with Runner(where) as runner:
        scenarios = run_demo(runner)
    rows = [{"scenario": s.name, "run_id": s.result.run_id, "status": s.result.status,
             "limit": s.result.exhausted_limit, "budget_limit": s.limit,
             "model_steps": s.result.model_steps, "tool_calls": s.result.tool_calls,
             "completed": len(s.result.completed),
             "failed": sum(1 for c in s.result.completed if not kinds.is_ok(c.status)),
             "unresolved": len(s.result.unresolved), "parent_run_id": s.parent_run_id,
             "story": s.story, "explanation": s.result.explanation}
            for s in scenarios]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    out = _Out()
    out.table([Col("scenario", shrink=13), Col("status"), Col("limit", shrink=13, drop=2),
               Col("steps", drop=6, right=True), Col("calls", drop=5, right=True),
               Col("completed", shrink=9, drop=3), Col("unresolved", drop=1, right=True)],
              [(s.name, s.result.status, s.limit, s.result.model_steps, s.result.tool_calls,
                completed_text(s.result), len(s.result.unresolved)) for s in scenarios],
              title="boundloop demo")
    out.line()
    for s in scenarios:
        out.line(f"- {s.name} ({s.result.run_id}): {s.story}")
    out.line()
    default = os.environ.get("BOUNDLOOP_JOURNAL") or ".boundloop"
    if "://" in where:  # a database URL: never its password on the screen
        from boundloop.journal.postgres import _display

        shown = _display(where)
    else:
        shown = os.path.abspath(where)
    flag = "" if where == default else f" --journal {shown if '://' in where else where}"
    review = next((s.result.run_id for s in scenarios if kinds.needs_review(s.result.status)),
                  scenarios[0].result.run_id)
    out.line(f"journal: {shown}")
    out.line("what to run next:")
    for command, what in ((f"show {review}", "a run's timeline, event by event"),
                          ("runs --tree", "every run, child runs under their parents"),
                          ("stats", "the figures: statuses, limits, tokens, latency")):
        out.line(f"  boundloop{flag} {command}")
        out.line(f"      {what}", style="dim")
