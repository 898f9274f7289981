"""The ``boundloop`` command: a thin layer over the library (SPEC 10)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from boundloop.errors import BoundloopError


def journal_dir(value: str | None) -> str:
    """``--journal``, else ``$BOUNDLOOP_JOURNAL``, else ``./.boundloop``."""
    return value or os.environ.get("BOUNDLOOP_JOURNAL") or ".boundloop"


journal_option = click.option("--journal", "journal", default=None, metavar="DIR",
                              help="Journal directory (default: $BOUNDLOOP_JOURNAL or ./.boundloop).")


@click.group()
def cli() -> None:
    """boundloop: LLM tool loops under hard budgets, on a durable event journal."""


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
        table.add_row(r["scenario"], r["status"], r["limit"] or "-", str(r["model_steps"]),
                      str(r["tool_calls"]))
    Console(width=max(Console().width, 100)).print(table)
    click.echo(f"journal: {os.path.abspath(journal_dir(journal))}")


def main(argv: list[str] | None = None) -> Any:
    """Entry point: bad input exits non-zero with a one-line message, never a traceback."""
    try:
        return cli.main(args=argv, prog_name="boundloop", standalone_mode=True)
    except BoundloopError as exc:
        click.echo(f"boundloop: {exc}", err=True)
        sys.exit(2)
